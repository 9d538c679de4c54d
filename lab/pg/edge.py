"""Short-lived PostgreSQL sessions for the benchmarks and the peer chapters: the psycopg edge.

``store`` owns the workflow tables; what remains (the benchmarks' statistics
queries, scratch databases, the peers' own status tables) connects here, so a
psycopg error is translated once into ``errors.StoreError`` naming the action and
the SQLSTATE, never the parameters. Callers above this module handle no driver
exception. A DSN is reshaped for another database in one place, ``on_database``, and
read or redirected to a proxy in one place, ``dsn_address`` and ``dsn_via``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, LiteralString
from urllib.parse import quote

import psycopg
from psycopg import conninfo, sql
from psycopg.rows import dict_row

from lab import errors, loopback, names
from lab.pg import sqlstates

Connection = psycopg.Connection[dict[str, Any]]


@contextlib.contextmanager
def translated(action: str) -> Iterator[None]:
    """Turn a psycopg error raised inside into ``StoreError`` naming ``action``."""
    try:
        yield
    except psycopg.Error as exc:
        raise errors.StoreError(f"PostgreSQL could not {action}: {explained(exc)}") from exc


def explained(exc: psycopg.Error) -> str:
    """The SQLSTATE of ``exc`` with its meaning, without echoing parameters (which may be
    sensitive): only a missing schema, table or database is named."""
    primary = exc.diag.message_primary if exc.sqlstate else None
    return sqlstates.explain(exc.sqlstate, primary, type(exc).__name__)


@contextlib.contextmanager
def session(dsn: str, action: str, *, schema: str | None = None,
            settings: str = "") -> Iterator[Connection]:
    """One autocommit session with dict rows (``search_path`` set to ``schema`` if given;
    ``settings``, server options such as ``-c lock_timeout=10s``, for this session only)."""
    options = f"-c search_path={names.check_schema_name(schema)}" if schema else ""
    with translated(action), psycopg.connect(
        dsn, autocommit=True, row_factory=dict_row, options=f"{options} {settings}".strip()
    ) as conn:
        yield conn


def rows(
    dsn: str, query: LiteralString | sql.Composed, params: Sequence[Any] | dict[str, Any] = (),
    *, action: str = "read statistics",
) -> list[dict[str, Any]]:
    """Run one statement in its own session; return its rows (none for a command)."""
    with session(dsn, action) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def on_database(dsn: str, dbname: str) -> str:
    """``dsn`` pointing at ``dbname`` on the same server with the same credentials."""
    return loopback.check_dsn(conninfo.make_conninfo(dsn, dbname=dbname))


def with_search_path(dsn: str, schema: str) -> str:
    """``dsn`` with ``search_path`` set to ``schema`` for every session it opens."""
    names.check_schema_name(schema)
    return conninfo.make_conninfo(dsn, options=f"-c search_path={schema}")


def dsn_address(dsn: str) -> tuple[str, int]:
    """The (host, port) a loopback DSN connects to (port 5432 when it names none)."""
    try:
        params = conninfo.conninfo_to_dict(loopback.check_dsn(dsn))
    except psycopg.Error as exc:
        raise errors.UsageError("the database DSN is malformed") from exc
    host = str(params.get("hostaddr") or params.get("host") or "127.0.0.1")
    return host, int(str(params.get("port") or 5432))


def dsn_via(dsn: str, host: str, port: int) -> str:
    """``dsn`` redirected to ``host:port`` (a proxy in front of the same server)."""
    params = {k: v for k, v in conninfo.conninfo_to_dict(dsn).items() if k != "hostaddr"}
    params.update(host=host, port=str(port))
    return conninfo.make_conninfo("", **params)


def database_of(dsn: str) -> str:
    """The database ``dsn`` names (PostgreSQL's default when it names none)."""
    params = conninfo.conninfo_to_dict(dsn)
    return str(params.get("dbname") or params.get("user") or "postgres")


def password_of(dsn: str) -> str | None:
    """The password ``dsn`` carries (or ``PGPASSWORD``), if any; None for a malformed DSN."""
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        return None
    return str(params.get("password") or os.environ.get("PGPASSWORD") or "") or None


def sqlalchemy_url(dsn: str) -> str:
    """``dsn`` as the SQLAlchemy URL DBOS takes for its system database."""
    params = conninfo.conninfo_to_dict(loopback.check_dsn(dsn))
    user = quote(str(params.get("user") or os.environ.get("USER", "postgres")), safe="")
    password = params.get("password")
    auth = f"{user}:{quote(str(password), safe='')}" if password else user
    host = str(params.get("hostaddr") or params.get("host") or "127.0.0.1")
    port = str(params.get("port") or "5432")
    dbname = quote(database_of(dsn), safe="")
    if host.startswith("/"):
        return f"postgresql://{auth}@/{dbname}?host={quote(host)}&port={port}"
    return f"postgresql://{auth}@{host}:{port}/{dbname}"


# Dropping a schema waits for no one: not for a lock an experiment's stuck session holds
# (lock_timeout), not past a deadline (statement_timeout), and not for a synchronous
# standby that an experiment cut off (synchronous_commit=local: the commit is on this
# server's disk, which is all a teardown needs; statement_timeout does not cover that
# wait, as PostgreSQL ends the statement's timer before the commit waits).
_DROP_SETTINGS = ("-c synchronous_commit=local -c lock_timeout=10s "
                  "-c statement_timeout=30s")


def drop_schema(dsn: str, schema: str) -> None:
    """Drop ``schema`` and everything in it, if it exists; a lock held elsewhere or a slow
    server ends it with ``errors.StoreError`` within seconds rather than waiting."""
    names.check_schema_name(schema)
    with session(dsn, "drop the schema", settings=_DROP_SETTINGS) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def create_databases(admin_dsn: str, names: Sequence[str]) -> bool:
    """Create every database of ``names``; False (and none left behind) when the role may not."""
    created: list[str] = []
    try:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            for name in names:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                created.append(name)
    except psycopg.errors.InsufficientPrivilege:
        drop_databases(admin_dsn, created)
        return False
    except psycopg.Error as exc:
        drop_databases(admin_dsn, created)
        raise errors.StoreError(
            f"PostgreSQL could not create a scratch database: {explained(exc)}"
        ) from exc
    return True


def drop_databases(admin_dsn: str, names: Sequence[str]) -> None:
    """Drop the databases of ``names`` (sessions still on them are ended)."""
    with session(admin_dsn, "drop a scratch database") as conn:
        for name in names:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def wal_syncs(dsn: str) -> int | None:
    """WAL flushes to disk so far, cluster-wide; None before PostgreSQL 14 (no pg_stat_wal)."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()
    except psycopg.errors.UndefinedTable:
        return None
    except psycopg.Error as exc:
        raise errors.StoreError(
            f"PostgreSQL could not read WAL statistics: {explained(exc)}"
        ) from exc
    return None if row is None else int(row[0])
