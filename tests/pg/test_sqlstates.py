"""A PostgreSQL failure is named by its SQLSTATE and what it means, in one line.

``lab.pg.sqlstates`` is pure; the edge (``lab.pg.edge.translated``) uses it for every
driver error it turns into ``StoreError``. A missing schema, table or database is named;
a server message that could carry a parameter never is.
"""

from __future__ import annotations

import psycopg
import pytest

from lab import errors
from lab.pg import edge, sqlstates


def test_a_known_code_is_named_with_its_meaning() -> None:
    """The code, a sentence, and PostgreSQL's condition name."""
    assert sqlstates.explain("53100") == "SQLSTATE 53100: the server's disk is full (disk_full)"
    assert sqlstates.explain("57P01").startswith("SQLSTATE 57P01: the server ended the session")


def test_an_unlisted_code_falls_back_to_its_class() -> None:
    """A code not listed one by one still says what kind of failure it is."""
    assert sqlstates.explain("22P02") == ("SQLSTATE 22P02: a value was out of range or "
                                          "malformed (data exception)")
    assert sqlstates.explain("ZZ999") == "SQLSTATE ZZ999: see PostgreSQL's Appendix A"


def test_only_a_missing_object_is_named_from_the_message() -> None:
    """A missing schema or table is named; another code's message is never echoed."""
    assert sqlstates.explain("3F000", 'schema "nosuch" does not exist') == (
        "SQLSTATE 3F000: no such schema (invalid_schema_name), schema 'nosuch'")
    assert sqlstates.explain("42P01", 'relation "nosuch.workflows" does not exist').endswith(
        "relation 'nosuch.workflows'")
    leaked = sqlstates.explain("22P02", 'invalid input syntax for type uuid: "secret-value"')
    assert "secret-value" not in leaked


def test_a_failure_without_a_code_is_named_by_what_happened() -> None:
    """A pool timeout carries no SQLSTATE: it says what to check instead."""
    assert "pool's timeout" in sqlstates.explain(None, kind="PoolTimeout")
    assert sqlstates.explain(None, kind="Weird") == "Weird failed (no SQLSTATE)"


def test_the_edge_names_a_missing_table_on_a_real_server(lab_dsn: str) -> None:
    """Through the edge, against PostgreSQL: one line naming the code, meaning and table."""
    with pytest.raises(errors.StoreError) as caught, edge.session(lab_dsn, "read it") as conn:
        conn.execute("SELECT * FROM nosuch_schema_x.workflows")
    message = str(caught.value)
    assert message == ("PostgreSQL could not read it: SQLSTATE 42P01: no such table: is the "
                       "schema there? (undefined_table), relation 'nosuch_schema_x.workflows'")
    assert isinstance(caught.value.__cause__, psycopg.errors.UndefinedTable)
