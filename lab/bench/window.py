"""The window of one throughput round, and what the machine did through it.

A round's window runs from the release of its workers to its last completion: what a
user waiting for the backlog waits for. A ``Window`` samples, from release on and every
``interval`` seconds, the load average, the machine's busy and total CPU ticks and the
cumulative CPU of every process of the round (the workers, PostgreSQL's processes, a
peer's own server such as Temporal's dev server, this process: the tool service and the
output readers, less the sampler's own thread).
``figures`` then reads each quantity at the window's end by interpolating between the
samples around it, so a worker's idle polls and exit after the last completion are not
counted, and reports the CPU the round's processes did not use: the other processes'
share of the machine and the idle share, in cores.

Times are wall-clock epochs (``time.time()``), as the server's timestamps are: the
server is a local process (``measure.server_pid``) reading the same clock.
"""

from __future__ import annotations

import bisect
import os
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lab.bench import measure

SAMPLE_SECONDS = 0.2
# Finding the server's processes scans every process of the machine: the sampler does it
# this often, not at every sample (py-spy: a scan per sample was a quarter of this process's
# CPU through a round, on a machine whose two cores the round needs). A backend started
# between scans is counted from the next one; one that exits moves to the postmaster's
# reaped children, never counted twice.
RESCAN_SECONDS = 1.0


@dataclass(frozen=True)
class Sample:
    """One reading: cumulative CPU seconds per share, machine ticks, the 1-minute load."""

    at: float
    load: float
    busy_ticks: int | None
    total_ticks: int | None
    workers: float
    server: float | None
    own: float
    #: A peer's own server process (Temporal's dev server), when the round has one.
    peer_server: float | None = None


@dataclass
class Window:
    """Samples through one round, from ``start`` (the release) until ``stop``."""

    postmaster: int | None
    interval: float = SAMPLE_SECONDS
    #: The pid of a peer's own server (Temporal's dev server), counted as a share of its own.
    peer_server: int | None = None
    samples: list[Sample] = field(default_factory=list)
    _pids: tuple[int, ...] = ()
    _last: dict[int, float] = field(default_factory=dict)
    _server_pids: list[int] = field(default_factory=list)
    _scanned: float = float("-inf")
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, pids: Sequence[int]) -> float:
        """Take the release's sample (call just before releasing ``pids``) and start
        sampling; returns the release epoch."""
        self._pids = tuple(pids)
        first = self._sample(sampler_cpu=0.0)
        self.samples.append(first)
        self._thread = threading.Thread(target=self._run, name="bench-window", daemon=True)
        self._thread.start()
        return first.at

    def stop(self) -> None:
        """Stop sampling (once the workers exited, or the round failed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self._sample(sampler_cpu=time.thread_time()))

    def _sample(self, *, sampler_cpu: float) -> Sample:
        for pid in self._pids:
            facts = measure.process_cpu(pid)
            if facts is not None:
                # A pid that exited keeps its last reading: CPU only grows.
                self._last[pid] = facts[0] + facts[1]
        now = time.monotonic()
        if self.postmaster is not None and now - self._scanned >= RESCAN_SECONDS:
            self._server_pids = measure.child_pids(self.postmaster)
            self._scanned = now
        ticks = measure.machine_ticks()
        return Sample(
            at=time.time(), load=os.getloadavg()[0],
            busy_ticks=None if ticks is None else ticks[0],
            total_ticks=None if ticks is None else ticks[1],
            workers=sum(self._last.values()),
            server=measure.server_cpu(self.postmaster, self._server_pids),
            own=measure.own_cpu() - sampler_cpu,
            peer_server=measure.pid_cpu(self.peer_server),
        )

    def figures(self, end: float | None) -> dict[str, Any]:
        """The window from the release to ``end`` (the last completion's epoch): its
        length, every share's CPU seconds, load, and the others' and idle cores."""
        if end is None or not self.samples:
            return {"window_seconds": None}
        start = self.samples[0]
        seconds = end - start.at
        if seconds <= 0:
            return {"window_seconds": None}
        workers = self._at(end, "workers") - start.workers
        own = self._at(end, "own") - start.own
        server = (None if start.server is None
                  else self._at(end, "server") - start.server)
        peer = (None if start.peer_server is None
                else self._at(end, "peer_server") - start.peer_server)
        ours = None if server is None else workers + own + server + (peer or 0.0)
        inside = [s for s in self.samples if s.at <= end] or [start]
        figures: dict[str, Any] = {
            "window_seconds": round(seconds, 3),
            "window_samples": len(inside),
            "window_workers_cpu_seconds": round(workers, 3),
            "window_bench_cpu_seconds": round(own, 3),
            "window_server_cpu_seconds": measure.rnd(server, 3),
            "window_peer_server_cpu_seconds": measure.rnd(peer, 3),
            "window_all_cpu_seconds": measure.rnd(ours, 3),
            "load_mean": round(statistics.fmean(s.load for s in inside), 2),
            "load_max": round(max(s.load for s in inside), 2),
        }
        busy, total = self._at(end, "busy_ticks"), self._at(end, "total_ticks")
        if start.busy_ticks is not None and start.total_ticks is not None:
            tick = os.sysconf("SC_CLK_TCK")
            busy_s = (busy - start.busy_ticks) / tick
            total_s = (total - start.total_ticks) / tick
            figures["idle_cores"] = round(max(total_s - busy_s, 0.0) / seconds, 2)
            # The CPU the round's processes did not use: the rest of the machine's load.
            figures["other_cores"] = (None if ours is None
                                      else round(max(busy_s - ours, 0.0) / seconds, 2))
        return figures

    def _at(self, when: float, name: str) -> float:
        """The cumulative quantity ``name`` at ``when``, interpolated between samples."""
        times = [s.at for s in self.samples]
        index = bisect.bisect_left(times, when)
        if index >= len(self.samples):
            return float(getattr(self.samples[-1], name) or 0.0)
        after = self.samples[index]
        if index == 0 or after.at == when:
            return float(getattr(after, name) or 0.0)
        before = self.samples[index - 1]
        low, high = float(getattr(before, name) or 0.0), float(getattr(after, name) or 0.0)
        share = (when - before.at) / (after.at - before.at)
        return low + (high - low) * share
