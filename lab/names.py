"""Identifiers: schema names checked before they reach PostgreSQL, and random ids.

Pure and dependency-free, so the store, the tool, the plugin and the benchmarks
share one rule for a schema name without importing each other.
"""

from __future__ import annotations

import re
import uuid

from lab import errors

SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def check_schema_name(schema: str) -> str:
    """Return ``schema`` if it is a plain lower-case identifier, else raise ``Rejected``."""
    if not isinstance(schema, str) or not SCHEMA_NAME.fullmatch(schema):
        raise errors.Rejected("schema name must match ^[a-z_][a-z0-9_]{0,62}$")
    return schema


def new_id(prefix: str = "wf") -> str:
    """A random identifier with a readable prefix."""
    return f"{prefix}_{uuid.uuid4().hex}"
