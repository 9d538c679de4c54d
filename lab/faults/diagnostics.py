"""What the fault tools ask the server behind a store: its durability settings, the
backends of a run's workers, and ending one of them (``pg_terminate_backend``)."""

from __future__ import annotations

import random
from collections.abc import Set

from lab import errors
from lab.runtime import processes
from lab.runtime.store import Store, queries

# What decides whether a committed transaction survives a crash of the server or machine.
DURABILITY_SETTINGS = ("fsync", "synchronous_commit", "full_page_writes", "wal_sync_method")


def server_settings(db: Store) -> dict[str, str]:
    """The server's durability settings, as it reports them (``SHOW``)."""
    rows = db.execute(queries.SERVER_SETTINGS, (list(DURABILITY_SETTINGS),),
                      action="read the server's settings")
    return {str(row["name"]): str(row["setting"]) for row in rows}


def backends(db: Store, application_prefix: str) -> list[tuple[int, str]]:
    """(pid, application name) of every server backend whose name has this prefix."""
    rows = db.execute(queries.BACKENDS, (len(application_prefix), application_prefix),
                      action="list backends")
    return [(int(row["pid"]), str(row["application_name"])) for row in rows]


def terminate_backend(db: Store, pid: int) -> bool:
    """``pg_terminate_backend(pid)``: True when the server signalled it."""
    rows = db.execute(queries.TERMINATE_BACKEND, (pid,), action="terminate a backend")
    return bool(rows and rows[0]["done"])


def terminate_one(db: Store, token: str, live: Set[str], rng: random.Random) -> bool | None:
    """End one backend, drawn with ``rng``, of the live workers (named ``live``) of the
    chaos round ``token``: True when signalled, False when there was none to end, None
    when the database is away."""
    prefix = f"{processes.WORKER_APP_PREFIX}{token}"
    try:
        pids = [pid for pid, name in backends(db, prefix)
                if name[len(processes.WORKER_APP_PREFIX):] in live]
        return bool(pids) and terminate_backend(db, rng.choice(pids))
    except errors.StoreError:
        return None
