"""The disk-full fault: ballast fills the data directory's filesystem, holds, then goes.

The embedded server's data directory (WAL included) sits on a size-limited filesystem
the run mounts itself (``lab.pg.embedded.Volume``: a tmpfs, or a loop-mounted ext4
image). A fault writes ballast beside the data directory until the filesystem refuses
another 512 bytes, holds it full for ``hold_s``, then deletes it. Faults alternate
between two targets (from a seeded start), which say what meets the full disk first:

- ``data``: the workers', recoverer's and tool's own writes. A write that needs a new
  page of a table or index fails with ``could not extend file ... No space left on
  device`` (an ERROR: that transaction rolls back, the server stays up); the workflow
  store's and the tool ledger's writes both run into it, whichever comes first.
- ``wal``: before filling, the fault leaves the server at the start of a WAL segment
  not yet written (``Server.prime_wal``: the segments kept ahead used up, as on a busy
  server), so the next WAL record anyone writes needs a new segment on a full disk:
  PostgreSQL PANICs in that backend (``could not write to file "pg_wal/xlogtemp..."``),
  every backend is cut off, and crash recovery cannot finish on a full disk either, so
  the postmaster gives up. Once the ballast is gone the lab starts it again
  (``revive``) on the same data directory, and it recovers from its WAL. A server that
  does not answer a query 30 s after the ballast went is restarted the same way: on a
  loaded machine PostgreSQL 18's postmaster was seen never acting on its failed startup
  process's exit, its ``postmaster.pid`` still saying "ready". Either restart is counted.

What the server did is read back from its log: every line of interest is counted.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from lab.runtime import processes

TARGETS = ("data", "wal")
MEET_PATIENCE = 3.0  # a hold lasts until a write met the disk, up to this many holds
PRIME_ROOM = 8 << 20  # room left for priming: three new 1 MB WAL segments, and then some
# What the server's log says under ENOSPC, and what each pattern is called in a report.
LOG_PATTERNS = (
    ("no_space_left", "No space left on device"),
    ("could_not_extend_file", "could not extend file"),
    ("could_not_write_wal", 'could not write to file "pg_wal/'),
    ("panic", "PANIC:"),
    ("error", "ERROR:"),
    ("crash_reinitialize", "all server processes terminated; reinitializing"),
    ("startup_failed", "aborting startup due to startup process failure"),
)


class Server(Protocol):
    """What the fault needs of the embedded server (``lab.pg.embedded.Server``)."""

    def fill_disk(self, leave: int = 0) -> int: ...
    def free_disk(self) -> None: ...
    def prime_wal(self, switches: int = 3) -> str: ...
    def revive(self) -> bool: ...
    def log_from(self, offset: int) -> tuple[str, int]: ...


def count_log(text: str) -> Counter[str]:
    """Lines of the server log that match each ``LOG_PATTERNS`` entry."""
    found: Counter[str] = Counter()
    for line in text.splitlines():
        for name, pattern in LOG_PATTERNS:
            if pattern in line:
                found[name] += 1
    return found


def _role(application: str) -> str:
    """Who an application name belongs to: a worker, the tool's ledger, the controller."""
    if application.startswith(processes.WORKER_APP_PREFIX):
        return "worker"
    return {"lab-tool": "tool ledger", "lab-chaos": "controller", "": "server process"}.get(
        application, application)


@dataclass
class DiskFull:
    """Runs disk-full faults on one server and keeps what happened."""

    server: Server
    rng: random.Random
    hold_s: float
    log: list[dict[str, Any]] = field(default_factory=list)
    server_log: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    revivals: int = 0
    met_count: int = 0
    panicked_in: Counter[str] = field(default_factory=Counter)
    _offset: int = 0
    _first: int = 0
    _began: float = 0.0
    _pending: dict[str, Any] = field(default_factory=dict)

    def start(self) -> None:
        """Remember where the server log stands: only what faults caused is counted."""
        while True:
            text, self._offset = self.server.log_from(self._offset)
            if not text:
                break

    def strike(self, at_s: float, stop: Any = None) -> dict[str, Any]:
        """One fault: fill (for ``wal``, primed), hold, free, revive; returns its record.

        ``stop`` (a ``threading.Event``) cuts the hold short when the run ends.
        """
        target = TARGETS[(self._first + len(self.log)) % len(TARGETS)]
        self.fill(target)
        # A quiet server may write nothing in the hold: wait a little longer for a write
        # to meet the full disk, so the fault is one a write felt, where one comes.
        self.met(within=self.hold_s * MEET_PATIENCE)
        remaining = self.hold_s - (time.monotonic() - self._began)
        if remaining > 0:
            if stop is not None:
                stop.wait(remaining)
            else:
                time.sleep(remaining)
        return self.free(at_s)

    def fill(self, target: str) -> None:
        """Fill the disk for ``target`` (``data`` or ``wal``); ``free`` ends the fault."""
        if target not in TARGETS:
            raise ValueError(f"unknown disk-full target {target!r}")
        if not self.log and not self._pending:
            # Alternating from a seeded start, so a run with two faults has met both.
            self._first = self.rng.randrange(len(TARGETS))
        self._began = time.monotonic()
        self._pending = {"target": target, "ballast": 0, "wal_prime_error": ""}
        if target == "wal":
            # Nearly full first, so the top-up after priming is too short for anyone to
            # write the next segment while there is still room for it.
            self._pending["ballast"] = self.server.fill_disk(leave=PRIME_ROOM)
            self._pending["wal_prime_error"] = self.server.prime_wal()
        self._pending["ballast"] += self.server.fill_disk()

    def met(self, within: float) -> bool:
        """Wait (at most ``within`` seconds) until the server's log says a write met the
        full disk; whether it did."""
        deadline = time.monotonic() + within
        while True:
            seen, panicked_by = self._read_log()
            self._pending.setdefault("seen", Counter()).update(seen)
            self._pending.setdefault("panicked", []).extend(panicked_by)
            if self._pending["seen"].get("no_space_left", 0) or time.monotonic() >= deadline:
                return bool(self._pending["seen"].get("no_space_left", 0))
            time.sleep(0.05)

    def free(self, at_s: float) -> dict[str, Any]:
        """Delete the ballast, start the postmaster again if it gave up; the record."""
        pending, self._pending = self._pending, {}
        self.server.free_disk()
        held = time.monotonic() - self._began
        revived = self.server.revive()
        self.revivals += int(revived)
        seen, panicked_by = self._read_log()
        seen = pending.get("seen", Counter()) + seen
        self.met_count += int(seen.get("no_space_left", 0) > 0)
        panicked_by = pending.get("panicked", []) + panicked_by
        record = {
            "at_s": round(at_s, 2),
            "target": pending.get("target", "?"),
            "ballast_mb": round(pending.get("ballast", 0) / (1 << 20), 1),
            "held_s": round(held, 2),
            "wal_prime_error": pending.get("wal_prime_error", ""),
            "postmaster_restarted_by_lab": revived,
            "server_log": dict(sorted(seen.items())),
            "refused": panicked_by,
        }
        self.log.append(record)
        return record

    def _read_log(self) -> tuple[Counter[str], list[str]]:
        """Count the new log lines; for each refused write, in order, its severity and
        who made it (the log prefix names the application: ``%m [%p] %a: ``)."""
        seen: Counter[str] = Counter()
        panicked: list[str] = []
        while True:
            text, self._offset = self.server.log_from(self._offset)
            if not text:
                break
            seen += count_log(text)
            for line in text.splitlines():
                if "No space left on device" in line:
                    severity = "PANIC" if "PANIC:" in line else (
                        "ERROR" if "ERROR:" in line else "FATAL" if "FATAL:" in line else "LOG")
                    head = line.split(f"{severity}:")[0]
                    panicked.append(
                        f"{severity} in {_role(head.split('] ', 1)[-1].rstrip(': '))}")
                for name, pattern in LOG_PATTERNS:
                    if pattern in line and name not in self.examples:
                        self.examples[name] = line[line.find(pattern.split()[0]):][:200]
        self.server_log += seen
        self.panicked_in += Counter(panicked)
        return seen, panicked

    def struck_every_target(self) -> bool:
        """Whether a fault filled the disk for each target (``data`` and ``wal``): a round
        whose work settled after one fill has shown only half of what the fault does."""
        return {record["target"] for record in self.log} >= set(TARGETS)

    def report(self) -> dict[str, Any]:
        """The faults, the server's log lines by kind, an example of each, restarts."""
        return {
            "count": len(self.log),
            "met_by_a_write": self.met_count,
            "by_target": dict(sorted(Counter(r["target"] for r in self.log).items())),
            "held_s": round(sum(r["held_s"] for r in self.log), 2),
            "postmaster_restarted_by_lab": self.revivals,
            "server_log": dict(sorted(self.server_log.items())),
            "server_log_examples": dict(sorted(self.examples.items())),
            "refused": dict(sorted(self.panicked_in.items())),
            "log": self.log,
        }
