"""Provision PostgreSQL as a run would, report it, and hold it until stdin closes.

A test helper run as its own process, so that testcontainers (whose settings are read once per
process) and its Ryuk session start fresh, and so that a test can SIGKILL the owner of a
server. Usage: ``python tests/support/hold_postgres.py MODE``. Prints one JSON line on stdout, then
waits; on end of input it stops the server and exits 0. A provisioning error prints
``{"error": ...}`` and exits 3.
"""

from __future__ import annotations

import json
import logging
import sys

from lab import errors
from lab.pg import cluster


def _session_id() -> str | None:
    try:
        from testcontainers.core.labels import SESSION_ID
    except ImportError:
        return None
    return SESSION_ID


def main(mode: str) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    try:
        running = cluster.start(mode=mode)
    except errors.LabError as exc:
        print(json.dumps({"error": str(exc), "session_id": _session_id()}), flush=True)
        return 3
    report = {
        "dsn": running.provisioned.dsn,
        "describe": running.provisioned.describe(),
        "session_id": _session_id(),
    }
    print(json.dumps(report), flush=True)
    sys.stdin.read()
    running.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
