"""SQLSTATEs named with their meaning, for one-line errors a person can act on.

Pure: ``explain`` takes the code and, for the few classes where the server's message
names only an object (a schema, a table, a database, a role), that object's name; a
message that could echo a parameter (a value, a row) is never used.
"""

from __future__ import annotations

import re

# The SQLSTATEs the lab meets, by meaning (PostgreSQL's Appendix A names in brackets).
MEANINGS = {
    "08000": "the connection failed (connection_exception)",
    "08001": "the server could not be reached (sqlclient_unable_to_establish_sqlconnection)",
    "08003": "the connection is closed (connection_does_not_exist)",
    "08006": "the connection was lost (connection_failure)",
    "08P01": "the server and client disagree on the protocol (protocol_violation)",
    "23505": "a row with this key exists already (unique_violation)",
    "25P02": "the transaction was aborted earlier (in_failed_sql_transaction)",
    "28000": "the server refused this role (invalid_authorization_specification)",
    "28P01": "the password was refused (invalid_password)",
    "3D000": "no such database (invalid_catalog_name)",
    "3F000": "no such schema (invalid_schema_name)",
    "40001": "a concurrent transaction conflicted; retry (serialization_failure)",
    "40P01": "a deadlock was broken by aborting this transaction (deadlock_detected)",
    "42501": "the role may not do this (insufficient_privilege)",
    "42P01": "no such table: is the schema there? (undefined_table)",
    "42703": "no such column: the schema is older or newer than the code (undefined_column)",
    "42883": "no such function (undefined_function)",
    "53100": "the server's disk is full (disk_full)",
    "53200": "the server is out of memory (out_of_memory)",
    "53300": "the server has no free connection slot (too_many_connections)",
    "55P03": "a lock could not be taken (lock_not_available)",
    "57014": "the statement was cancelled (query_canceled)",
    "57P01": "the server ended the session: shutting down or terminated (admin_shutdown)",
    "57P02": "the server crashed and ended the session (crash_shutdown)",
    "57P03": "the server is starting up or shutting down (cannot_connect_now)",
    "58030": "the server's file I/O failed (io_error)",
    "XX000": "the server failed internally (internal_error)",
}
# Classes (the code's first two characters) for codes not listed one by one.
CLASSES = {
    "08": "the connection failed",
    "22": "a value was out of range or malformed (data exception)",
    "23": "a constraint refused the row (integrity constraint violation)",
    "40": "the transaction was rolled back (transaction rollback)",
    "42": "the statement is wrong for this schema (syntax error or access rule violation)",
    "53": "the server ran out of a resource (insufficient resources)",
    "57": "an operator intervened (operator intervention)",
    "58": "the server's system failed (system error)",
    "XX": "the server failed internally",
}
# Codes whose primary message names one object and nothing else, and the pattern for it.
_NAMED = {
    "3F000": ("schema", re.compile(r'schema "([^"]{1,63})" does not exist')),
    "42P01": ("relation", re.compile(r'relation "([^"]{1,127})" does not exist')),
    "3D000": ("database", re.compile(r'database "([^"]{1,63})" does not exist')),
}
# Driver failures with no SQLSTATE, by the psycopg exception's class name.
_NO_STATE = {
    "PoolTimeout": "no connection within the pool's timeout: is the server up and reachable?",
    "OperationalError": "the server could not be reached or dropped the connection",
    "InterfaceError": "the connection is unusable (closed or broken)",
}


def explain(sqlstate: str | None, primary: str | None = None, kind: str = "") -> str:
    """``SQLSTATE 42P01: no such table ... (undefined_table), relation "x.y"``, one line.

    ``primary`` is the server's primary message, used only to name a missing schema,
    relation or database; ``kind`` is the driver exception's class name, for failures
    that carry no SQLSTATE (a pool timeout, a refused connection).
    """
    if not sqlstate:
        return _NO_STATE.get(kind, f"{kind or 'the driver'} failed (no SQLSTATE)")
    meaning = MEANINGS.get(sqlstate) or CLASSES.get(sqlstate[:2], "see PostgreSQL's Appendix A")
    text = f"SQLSTATE {sqlstate}: {meaning}"
    named = _NAMED.get(sqlstate)
    if named is not None and primary:
        found = named[1].search(primary)
        if found:
            text += f", {named[0]} {found.group(1)!r}"
    return text
