"""Work in flight while faults strike: approvals in waves, and a record of every strike.

A chaos round approves all its workflows at once, so a round's work can be settled long
before a fault on a 20- or 30-second timer comes due: an audit of a 10,000-workflow soak
found worker processes alive in 30 of 107 samples, and no write ever met a full disk.
With ``Settings.release_over`` the round creates its workflows up front but approves
them in waves (``WAVE_S`` apart) through that many seconds of its fault phase, as
traffic arrives, and a database fault whose time has come waits until work is in
flight before it strikes (``wait_for_work``). That wait has no timer of its own, since
a loaded machine can keep work out of flight for any number of seconds; it ends when
the fault phase does (the fault is then withheld) or when the round's work is all
approved and done, as nothing more will come (a fault a minimum still asks for then
strikes an idle system, counted apart as ``after_work``). Every strike is recorded with
whether work was in flight then (``Strikes``), so the share of each fault that hit a
busy system is a figure of the report, not a hope.

``due`` is pure; ``Release`` does the approving.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lab import errors

WAVE_S = 0.5  # approvals come this often, like arriving traffic
BUSY_POLL_S = 0.05
FINISH_PATIENCE_S = 60.0  # the drain approves what is left; a database away this long fails


def due(total: int, elapsed: float, over: float) -> int:
    """How many of ``total`` workflows are approved ``elapsed`` seconds into a release
    spread over ``over`` seconds: a first wave at once, then one wave every ``WAVE_S``,
    the last at ``over`` (all of them when ``over`` is 0)."""
    if over <= 0 or total <= 0:
        return max(total, 0)
    waves = max(1, math.ceil(over / WAVE_S))
    if elapsed >= over:
        return total
    done = min(waves, 1 + int(max(elapsed, 0.0) / WAVE_S))
    return math.ceil(total * done / waves)


@dataclass(frozen=True)
class Pending:
    """A created workflow waiting for its approval: approve it with ``approve``."""

    workflow_id: str
    approve: Callable[[], None]


class Release:
    """Approves a round's created workflows in waves over ``over`` seconds.

    A step that meets a database that is away (restarted, partitioned, its disk full)
    approves nothing more now; the next step tries again, so no workflow is lost and
    none is approved twice (an approval is idempotent: see ``Population.approve``).
    """

    def __init__(self, pending: list[Pending], over: float) -> None:
        self.pending, self.over = pending, over
        self.approved = 0
        self.refusals = 0  # steps that met a database that was away

    @property
    def complete(self) -> bool:
        """Whether every workflow of the round is approved."""
        return self.approved >= len(self.pending)

    def step(self, elapsed: float) -> int:
        """Approve what is due ``elapsed`` seconds in; returns how many this step did."""
        target = due(len(self.pending), elapsed, self.over)
        before = self.approved
        while self.approved < target:
            try:
                self.pending[self.approved].approve()
            except errors.StoreError:
                self.refusals += 1
                break
            self.approved += 1
        return self.approved - before

    def finish(self) -> None:
        """Approve everything left (the drain's first act), waiting out a database that is
        still coming back; ``errors.CheckFailed`` names how many were never approved."""
        deadline = time.monotonic() + FINISH_PATIENCE_S
        while not self.complete:
            self.step(math.inf)
            if self.complete:
                return
            if time.monotonic() >= deadline:
                raise errors.CheckFailed(
                    f"{len(self.pending) - self.approved} workflows of the round could not "
                    f"be approved within {FINISH_PATIENCE_S:.0f} s: the database stayed away")
            time.sleep(0.2)

    def describe(self) -> dict[str, Any]:
        """The report's ``release`` section."""
        return {"over_s": self.over, "wave_s": WAVE_S, "workflows": len(self.pending),
                "approved": self.approved, "steps_refused_by_database": self.refusals}


class Strikes:
    """Every fault that struck, by kind, and how many struck while work was in flight.

    Written by the supervisor and the fault threads, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}

    def record(self, kind: str, busy: bool, *, after_work: bool = False) -> None:
        """Count one strike of ``kind``: ``busy`` when work was in flight as it struck,
        ``after_work`` when the round's work was all approved and done already."""
        with self._lock:
            tally = self._counts.setdefault(kind, [0, 0, 0])
            tally[0] += 1
            tally[1] += int(busy)
            tally[2] += int(after_work and not busy)

    def meet(self, kind: str, busy: Callable[[], bool], idle: Callable[[], bool],
             stop: threading.Event, release: Release | None) -> bool:
        """Record a strike of ``kind`` about to happen, or withhold it (False: ``stop``
        came first). With a ``release`` (approvals in waves) it first waits for work in
        flight, or for the round's work to be done: all approved and ``idle``
        (``wait_for_work``)."""
        if release is None:
            met: str | None = "busy" if busy() else "idle"
        else:
            met = wait_for_work(busy, lambda: release.complete and idle(), stop)
        if met is not None:
            self.record(kind, met == "busy", after_work=met == "after_work")
        return met is not None

    def report(self) -> dict[str, dict[str, float]]:
        """Per kind: strikes, those that hit work in flight, those that came after the
        round's work was done, and the share that hit work in flight."""
        with self._lock:
            return {kind: _tally(*counts) for kind, counts in sorted(self._counts.items())}


def _tally(strikes: int, busy: int, after_work: int) -> dict[str, float]:
    return {"strikes": strikes, "busy": busy, "after_work": after_work,
            "busy_share": round(busy / strikes, 3) if strikes else 0.0}


def wait_for_work(busy: Callable[[], bool], done: Callable[[], bool],
                  stop: threading.Event) -> str | None:
    """Wait until work is in flight (``"busy"``) or the round's work is all approved and
    done (``"after_work"``); ``None`` when ``stop`` (the fault phase's end) came first.

    Bounded by the fault phase's own deadline, which sets ``stop``.
    """
    while True:
        if busy():
            return "busy"
        if done():
            return "after_work"
        if stop.wait(BUSY_POLL_S):
            return None


def merge(reports: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Several rounds' ``Strikes.report()`` summed, shares recomputed (the soak's)."""
    totals: dict[str, list[int]] = {}
    for report in reports:
        for kind, tally in report.items():
            total = totals.setdefault(kind, [0, 0, 0])
            for i, key in enumerate(("strikes", "busy", "after_work")):
                total[i] += int(tally.get(key, 0))
    return {kind: _tally(*counts) for kind, counts in sorted(totals.items())}
