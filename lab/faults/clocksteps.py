"""The clock-step fault: the server's wall clock jumps forward or back while workers run.

The lab's only clock is PostgreSQL's ``clock_timestamp()``: leases, expiry and retry
timers all read it. The embedded server runs under libfaketime
(``lab.pg.embedded``), its offset from real time read from a file every second, so a
step reaches each backend within about a second of being written (not all at the
same instant: for a moment the server's processes disagree, as after an NTP step).

Each step moves the clock to a new offset, drawn (seeded) between ``-max_s`` and
``+max_s`` seconds of real time and at least one second from the current one. Just
before a step, the running leases it will move are counted in every population's
schema: a forward step of ``d`` expires early every lease due within ``d`` seconds;
a backward step of ``d`` makes late every lease due within ``d`` seconds, and brings
back to life every lease that ran out less than ``d`` seconds ago and was not
recovered yet. The count is the fault's own prediction from the rows; which of those
leases were then recovered is in the run's lease-expiry count.

psycopg errors are translated here, at this edge, into ``lab.errors.StoreError``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
from psycopg import sql

from lab import errors


class Server(Protocol):
    """What the fault needs of the embedded server (``lab.pg.embedded.Server``)."""

    def set_clock(self, offset_s: int) -> None: ...


def moved_leases(dsn: str, schemas: Sequence[str], step_s: int) -> int:
    """Running leases a step of ``step_s`` seconds moves (see the module)."""
    if step_s == 0 or not schemas:
        return 0
    span = f"{abs(step_s)} seconds"
    # Forward: due within the step. Backward: due within it, or ran out less than it ago.
    back = "0 seconds" if step_s > 0 else span
    total = 0
    try:
        with psycopg.connect(dsn, connect_timeout=5, autocommit=True) as conn:
            for schema in schemas:
                query = sql.SQL(
                    "SELECT count(*) FROM {}.workflows WHERE state = 'running' AND "
                    "lease_until >= clock_timestamp() - %(back)s::interval AND "
                    "lease_until < clock_timestamp() + %(span)s::interval"
                ).format(sql.Identifier(schema))
                row = conn.execute(query, {"span": span, "back": back}).fetchone()
                total += int(row[0]) if row else 0
    except psycopg.Error as exc:
        raise errors.StoreError(f"could not count leases before a clock step: "
                                f"{type(exc).__name__}") from None
    return total


@dataclass
class ClockSteps:
    """Steps one server's clock and keeps what happened."""

    server: Server
    dsn: str = field(repr=False)
    schemas: Sequence[str]
    rng: random.Random
    max_s: int
    offset_s: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)

    def next_offset(self) -> int:
        """A new offset within ``±max_s``, at least one second from the current one."""
        while True:
            offset = self.rng.randint(-self.max_s, self.max_s)
            if offset != self.offset_s:
                return offset

    def step(self, at_s: float) -> dict[str, Any]:
        """Count the leases the step moves, then step to a new seeded offset; its record."""
        return self.step_to(at_s, self.next_offset())

    def step_to(self, at_s: float, offset: int) -> dict[str, Any]:
        """Count the leases a step to ``offset`` moves, then step; returns its record."""
        step = offset - self.offset_s
        try:
            moved: int | None = moved_leases(self.dsn, self.schemas, step)
        except errors.StoreError:
            moved = None  # the database is away (a restart, a full disk): not counted
        self.server.set_clock(offset)
        record = {
            "at_s": round(at_s, 2),
            "from_s": self.offset_s,
            "to_s": offset,
            "step_s": step,
            "leases_early" if step > 0 else "leases_late": moved,
        }
        self.offset_s = offset
        self.log.append(record)
        return record

    def stepped_both_ways(self) -> bool:
        """Whether the clock was stepped forward once and back once: early expiry and
        late expiry (with resurrection) are different faults, and a round shows both."""
        return (any(r["step_s"] > 0 for r in self.log)
                and any(r["step_s"] < 0 for r in self.log))

    def report(self) -> dict[str, Any]:
        """Steps, their sizes, and the leases they moved early or late."""
        early = sum(r.get("leases_early") or 0 for r in self.log)
        late = sum(r.get("leases_late") or 0 for r in self.log)
        return {
            "count": len(self.log),
            "forward": sum(1 for r in self.log if r["step_s"] > 0),
            "backward": sum(1 for r in self.log if r["step_s"] < 0),
            "largest_step_s": max((abs(r["step_s"]) for r in self.log), default=0),
            "leases_expired_early": early,
            "leases_expired_late": late,
            "steps_not_counted": sum(
                1 for r in self.log if r.get("leases_early", r.get("leases_late")) is None),
            "final_offset_s": self.offset_s,
            "log": self.log,
        }
