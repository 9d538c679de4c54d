"""The durable workflow store: fenced SQL transitions on PostgreSQL.

``Store`` (in ``face``) is what callers hold: it owns the connection pool and the
transactions. Inside them, ``lifecycle``, ``claims``, ``settlement`` and ``review`` are
the transitions as functions over a connection, built from ``transitions``' fenced steps;
``decisions`` holds what is decided without I/O (refusals, what a due row becomes instead
of running, why work waits for a person); ``queries`` names every SQL statement once;
``records`` holds the snapshots and names;
``tables`` creates the schema (``schema.sql``) and reads the invariant checker's history.
"""

from lab.runtime.store.face import Store
from lab.runtime.store.queries import CLAIM_QUERY
from lab.runtime.store.records import (
    DEFAULT_MAX_ATTEMPTS,
    NON_EFFECT_OUTCOMES,
    STATES,
    TERMINAL_STATES,
    UNDISPATCHED_REVIEW,
    Actor,
    Claimed,
    Finished,
    Step,
    Workflow,
)
from lab.runtime.store.tables import create_schema, history_rows, schema_sql

__all__ = [
    "CLAIM_QUERY",
    "DEFAULT_MAX_ATTEMPTS",
    "NON_EFFECT_OUTCOMES",
    "STATES",
    "TERMINAL_STATES",
    "UNDISPATCHED_REVIEW",
    "Actor",
    "Claimed",
    "Finished",
    "Step",
    "Store",
    "Workflow",
    "create_schema",
    "history_rows",
    "schema_sql",
]
