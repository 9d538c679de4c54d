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
- ``wal``: the fault also makes the server cross WAL segment boundaries (a WAL message
  and a segment switch, as a busy server does by itself), so a new segment must be
  written: PostgreSQL PANICs (``could not write to file "pg_wal/xlogtemp..."``), every
  backend is cut off, and crash recovery cannot finish on a full disk either, so the
  postmaster gives up. Once the ballast is gone the lab starts it again (``revive``),
  on the same data directory: it recovers from its WAL.

What the server did is read back from its log: every line of interest is counted.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

TARGETS = ("data", "wal")
# What the server's log says under ENOSPC, and what each pattern is called in a report.
LOG_PATTERNS = (
    ("no_space_left", "No space left on device"),
    ("could_not_extend_file", "could not extend file"),
    ("could_not_write_wal", 'could not write to file "pg_wal/'),
    ("panic", "PANIC:"),
    ("crash_reinitialize", "all server processes terminated; reinitializing"),
    ("startup_failed", "aborting startup due to startup process failure"),
)


class Server(Protocol):
    """What the fault needs of the embedded server (``lab.pg.embedded.Server``)."""

    def fill_disk(self) -> int: ...
    def free_disk(self) -> None: ...
    def push_wal(self, switches: int = 8) -> str: ...
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
    _offset: int = 0
    _first: int = 0

    def start(self) -> None:
        """Remember where the server log stands: only what faults caused is counted."""
        while True:
            text, self._offset = self.server.log_from(self._offset)
            if not text:
                break

    def strike(self, at_s: float, stop: Any = None) -> dict[str, Any]:
        """One fault: fill, (for ``wal``) push WAL, hold, free, revive; returns its record.

        ``stop`` (a ``threading.Event``) cuts the hold short when the run ends.
        """
        # Alternating from a seeded start, so a run with two faults has met both.
        if not self.log:
            self._first = self.rng.randrange(len(TARGETS))
        target = TARGETS[(self._first + len(self.log)) % len(TARGETS)]
        began = time.monotonic()
        ballast = self.server.fill_disk()
        wal_error = self.server.push_wal() if target == "wal" else ""
        remaining = self.hold_s - (time.monotonic() - began)
        if remaining > 0:
            if stop is not None:
                stop.wait(remaining)
            else:
                time.sleep(remaining)
        self.server.free_disk()
        held = time.monotonic() - began
        revived = self.server.revive()
        self.revivals += int(revived)
        seen = self._read_log()
        record = {
            "at_s": round(at_s, 2),
            "target": target,
            "ballast_mb": round(ballast / (1 << 20), 1),
            "held_s": round(held, 2),
            "wal_switch_error": wal_error,
            "postmaster_restarted_by_lab": revived,
            "server_log": dict(sorted(seen.items())),
        }
        self.log.append(record)
        return record

    def _read_log(self) -> Counter[str]:
        seen: Counter[str] = Counter()
        while True:
            text, self._offset = self.server.log_from(self._offset)
            if not text:
                break
            seen += count_log(text)
            for line in text.splitlines():
                for name, pattern in LOG_PATTERNS:
                    if pattern in line and name not in self.examples:
                        self.examples[name] = line[line.find(pattern.split()[0]):][:200]
        self.server_log += seen
        return seen

    def report(self) -> dict[str, Any]:
        """The faults, the server's log lines by kind, an example of each, restarts."""
        return {
            "count": len(self.log),
            "by_target": dict(sorted(Counter(r["target"] for r in self.log).items())),
            "held_s": round(sum(r["held_s"] for r in self.log), 2),
            "postmaster_restarted_by_lab": self.revivals,
            "server_log": dict(sorted(self.server_log.items())),
            "server_log_examples": dict(sorted(self.examples.items())),
            "log": self.log,
        }
