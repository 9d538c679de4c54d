"""The store's tables: the schema file that creates them, and the one consistent read
of their history that the invariant checker judges."""

from __future__ import annotations

from importlib import resources
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from lab import loopback, names
from lab.pg import edge
from lab.runtime.store import queries


def schema_sql() -> str:
    """The text of ``schema.sql``: every table, index and constraint."""
    return resources.files("lab.runtime.store").joinpath("schema.sql").read_text(encoding="utf-8")


def create_schema(dsn: str, schema: str) -> None:
    """Create ``schema`` and every table of ``schema.sql`` inside it, atomically."""
    names.check_schema_name(schema)
    with (
        edge.translated("create the schema"),
        psycopg.connect(dsn, autocommit=True) as conn,
        conn.transaction(),
    ):
        conn.execute(sql.SQL(queries.CREATE_SCHEMA).format(sql.Identifier(schema)))
        conn.execute(sql.SQL(queries.SET_SEARCH_PATH).format(sql.Identifier(schema)))
        # schema.sql is a file of this package, not input: it is trusted SQL text.
        conn.execute(schema_sql().encode())


def history_rows(dsn: str, schema: str) -> dict[str, list[dict[str, Any]]]:
    """Everything the invariant checker reads, as plain rows, in one consistent snapshot.

    ``workflows``, ``events``, ``effects`` (the tool's ledger), ``barriers`` (start
    barriers: id, workflow, fence) and ``fences`` (the fenced lookup's tombstones: key,
    closed through) of one schema, read in a single REPEATABLE READ
    transaction, so the four see one moment even while something still writes. Only
    reads: the checker never goes through a transition.
    """
    names.check_schema_name(schema)
    with (
        edge.translated("read the history"),
        psycopg.connect(
            loopback.check_dsn(dsn), row_factory=dict_row, application_name="lab-invariants",
            connect_timeout=10,
        ) as conn,
    ):
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with conn.transaction():
            conn.execute(sql.SQL(queries.SET_SEARCH_PATH).format(sql.Identifier(schema)))
            return {
                "workflows": conn.execute(queries.HISTORY_WORKFLOWS).fetchall(),
                "events": conn.execute(queries.HISTORY_EVENTS).fetchall(),
                "effects": conn.execute(queries.HISTORY_EFFECTS).fetchall(),
                "barriers": conn.execute(queries.HISTORY_BARRIERS).fetchall(),
                "fences": conn.execute(queries.HISTORY_FENCES).fetchall(),
            }
