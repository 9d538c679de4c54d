"""A peer's packages, imported only when its experiment or bench round runs.

The peers are not needed to run the lab itself: each peer module asks for its package
here and gets it, or ``errors.MissingExtra`` with the one line that says how to install
it (the command maps it to its exit code).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from lab import errors


def imported(name: str, missing: str) -> Any:
    """The module ``name``, or ``MissingExtra(missing)`` when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise errors.MissingExtra(missing) from exc


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` (what a chapter pins and records)."""
    return str(importlib.metadata.version(distribution))
