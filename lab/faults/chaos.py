"""The chaos run: real worker processes under random crashes and faults, then the invariants.

``lab chaos`` creates and approves N workflows, runs M ``lab worker`` OS processes in
loops, and while they work a supervisor (this process):

- SIGKILLs a random worker at exponential intervals (seeded) and restarts it; a target
  has finished at least one item: killing a process still importing its modules tests
  nothing and, at a 200 ms mean, would keep a loaded 2-core machine from any work;
- runs ``pg_terminate_backend`` on a random backend of this run's workers;
- serves the credit tool, which drops replies after committing the effect and answers
  429 at the given rates;
- recovers expired leases and reconciles unknown outcomes (lookup by the original key;
  a non-idempotent one goes to manual review), as an operator's recoverer would.

With ``restart_every_ms`` it also SIGKILLs the PostgreSQL postmaster and restarts it on
the same data directory (a durable server: fsync and synchronous commits on), and with
``partition_every_ms`` / ``latency_ms`` every link between processes runs through a
loopback fault proxy (``lab.faults.proxy``): workers to PostgreSQL, the tool to its
ledger, workers to the tool. A partition blackholes or resets one link for ``partition_for_ms``.
Every process rides these out (jittered backoff, fenced writes); the
controller itself tolerates an unreachable database and writes its report
before any cleanup.

With ``disk_full_every_ms`` the embedded server's data directory sits on a
size-limited filesystem and ``lab.faults.diskfull`` fills it with ballast, holds and
frees it (restarting a postmaster that gave up); with ``clock_step_every_ms`` the
server runs under libfaketime and ``lab.faults.clocksteps`` steps its clock forward
and back, counting the leases each step moves. Both need the server itself
(``server``), so a given DSN's server cannot take them.

Kills and terminations start once a first item is done (the warm-up; the tool's faults
are already on). The fault phase ends at ``duration`` or once every workflow is settled
and every fault asked for struck (``min_restarts`` restarts, a disk fault on each target,
a clock step each way, a partition healed); then the drain stops the faults, lets the
workers finish, waits for leases to expire and reconciles until nothing is left to do.
``lab.faults.invariants`` and ``lab.faults.audit`` (plain SQL) check the final database
and the whole event history; the report says whether both flag the same effect keys.

A worker process talks to one tool endpoint, and a tool service is either idempotent or
not, so the population is split into two schemas, each a complete, independent
deployment (state machine, ledger and invariants per schema): checking each and summing
loses nothing, and no worker can dispatch a plan to a tool of the wrong mode (which the
checker verifies anyway). The chaos workers use a 1 s lease and a 0.25 s heartbeat, so a
killed worker's claim is recovered within about a second.

Fault *times* and tool faults come from RNGs seeded with ``seed``; which process a timer
hits and what it was doing depend on OS scheduling: two runs with one seed are alike.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from lab import errors
from lab.faults import chaos_report, clocksteps, diagnostics, diskfull, proxy, traffic
from lab.faults.chaos_population import Population
from lab.faults.chaos_settings import (
    Counts,
    Settings,
    interval,
    require_server,
    split,
    spread,
)
from lab.pg import edge, embedded
from lab.runtime import processes, sealing

__all__ = ["Chaos", "Settings", "run", "split"]

RECOVER_EVERY_S = 0.1
WARM_UP_TIMEOUT_S = 60.0
# The links a network fault can cut (each through its own proxy).
WORKERS_POSTGRES = "workers-postgres"
TOOL_POSTGRES = "tool-postgres"
WORKERS_TOOL = "workers-tool"


class Chaos:
    """One chaos run against the PostgreSQL server at ``dsn``."""

    def __init__(
        self,
        dsn: str,
        settings: Settings,
        *,
        log: Callable[[str], None] | None = None,
        keep_schemas: bool = False,
        restart: Callable[[], float] | None = None,
        server: embedded.Server | None = None,
    ):
        settings.validate()
        require_server(settings, restart=restart is not None,
                       volume=server is not None and bool(server.volume),
                       steppable=server is not None and server.steppable)
        self.dsn, self._restart = dsn, restart
        self._restarting = threading.Event()  # the restarter has the server down on purpose
        self.settings = settings
        self.keep_schemas = keep_schemas
        self._log = log or (lambda message: None)
        # Names only need to be unique on a shared server, so they do not come from the seed.
        self.token = f"c{secrets.token_hex(4)}"
        root = random.Random(settings.seed)
        self._plans = random.Random(root.getrandbits(64))
        self._kill_rng = random.Random(root.getrandbits(64))
        self._term_rng = random.Random(root.getrandbits(64))
        self._tool_seeds = [root.getrandbits(32) for _ in range(2)]
        # Drawn after the older streams, so adding database faults kept their sequences.
        self._restart_rng = random.Random(root.getrandbits(64))
        self._partition_rng = random.Random(root.getrandbits(64))
        # Drawn after those, so adding disk and clock faults kept every older sequence.
        self._disk_rng = random.Random(root.getrandbits(64))
        self._clock_rng = random.Random(root.getrandbits(64))
        self.counts = Counts()
        # One key catalog for the run: every process seals results the checker can open.
        self.keys = sealing.load_catalog()
        self.check = chaos_report.Check(dsn, self.keys, server, self._restarting)  # the verdict
        # Network faults: one proxy per link, each its own fault target.
        self.proxies: dict[str, proxy.Proxy] = {}
        if settings.proxied:
            host, port = edge.dsn_address(dsn)
            for link in (WORKERS_POSTGRES, TOOL_POSTGRES):
                self.proxies[link] = proxy.Proxy(host, port, link).start()
        self.worker_dsn = self._via(WORKERS_POSTGRES)
        self.populations = [
            Population(dsn, self.token, self.keys, idempotent, size, slots,
                        ledger_dsn=self._via(TOOL_POSTGRES),
                        fenced_lookup=True if settings.non_idempotent_fenced else None)
            for idempotent, size, slots in split(settings)
        ]
        self._stop_recoverer = threading.Event()
        self._recoverer_failure: BaseException | None = None
        self._stop_restarts = threading.Event()
        self._restart_failure: BaseException | None = None
        self._items_done: dict[str, int] = {}
        self._began = time.monotonic()
        self.partitions = proxy.Partitions(
            self.proxies, self._partition_rng, settings.partition_for_ms / 1000.0, self._began
        )
        self.disk: diskfull.DiskFull | None = None
        self.clock: clocksteps.ClockSteps | None = None
        if server is not None and settings.disk_full_every_ms > 0:
            self.disk = diskfull.DiskFull(server, random.Random(self._disk_rng.getrandbits(64)),
                                          settings.disk_full_for_ms / 1000.0)
        if server is not None and settings.clock_step_every_ms > 0:
            self.clock = clocksteps.ClockSteps(
                server, dsn, [p.schema for p in self.populations],
                random.Random(self._clock_rng.getrandbits(64)), settings.clock_step_max_s)
        self._fault_threads: list[threading.Thread] = []
        self.strikes = traffic.Strikes()  # every strike, and whether work was in flight
        self.release: traffic.Release | None = None  # approvals in waves (release_over)

    def _via(self, link: str) -> str:
        """The DSN a client on ``link`` uses: its proxy when the run has one."""
        fault_proxy = self.proxies.get(link)
        if fault_proxy is None:
            return self.dsn
        return edge.dsn_via(self.dsn, "127.0.0.1", fault_proxy.port)

    # -- the whole run -----------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Set up, inject faults, drain, check; returns the report (JSON-ready).

        Cleanup is ``close()``'s, so a report is made even when cleanup fails after it.
        """
        began = self._began = self.partitions.origin = time.monotonic()
        recoverer = threading.Thread(target=self._recover_loop, name="chaos-recoverer",
                                     daemon=True)
        restarter = threading.Thread(target=self._restart_loop, name="chaos-restarter",
                                     daemon=True)
        try:
            self._start_populations()
            self._create_workflows()
            assert self.populations[0].db is not None
            durability = diagnostics.server_settings(self.populations[0].db)
            setup_s = time.monotonic() - began
            self._log(f"{self.settings.workflows} workflows approved in {setup_s:.1f}s; "
                      f"schemas {', '.join(p.schema for p in self.populations)}")
            self._arm_tool_faults()
            recoverer.start()
            warm_up_began = time.monotonic()
            self._warm_up()
            faults_began = time.monotonic()
            self._log(f"first item done after {faults_began - warm_up_began:.1f}s; "
                      "killing and terminating")
            restarter.start()
            self._start_database_faults()
            settled_in_faults = self._fault_phase()
            self._stop_restarts.set()
            restarter.join(timeout=120)
            for thread in self._fault_threads:
                thread.join(timeout=120)
            self._check_faults()
            open_after_faults = self._open_total()
            drain_began = time.monotonic()
            self._log(f"fault phase over after {drain_began - faults_began:.1f}s "
                      f"({open_after_faults} open); draining")
            self._heal()
            if self.release is not None:
                self.release.finish()
            self._drain(recoverer)
            check_began = time.monotonic()
            report = chaos_report.report(self.check, self, durability)
            ended = time.monotonic()
            report["timing"] = {
                "wall_s": round(ended - began, 2),
                "setup_s": round(setup_s, 2),
                "warm_up_s": round(faults_began - warm_up_began, 2),
                "fault_phase_s": round(drain_began - faults_began, 2),
                "drain_s": round(check_began - drain_began, 2),
                "check_s": round(ended - check_began, 2),
                "settled_during_faults": settled_in_faults,
                "open_when_faults_stopped": open_after_faults,
                "settled_before_drain": self.settings.workflows - open_after_faults,
            }
            return report
        finally:
            self._stop_recoverer.set()
            self._stop_restarts.set()
            for thread in [recoverer, restarter, *self._fault_threads]:
                if thread.is_alive():
                    thread.join(timeout=30 if thread is recoverer else 120)

    def _start_populations(self) -> None:
        """Start every population's tool and workers, behind a tool proxy (with the
        asked-for latency on every link) when the run has network faults."""
        for population in self.populations:
            population.start()
            assert population.service is not None
            if self.settings.proxied:
                population.tool_proxy = proxy.Proxy(
                    "127.0.0.1", int(population.service.endpoint.rsplit(":", 1)[1]),
                    f"{WORKERS_TOOL}:{population.code}",
                ).start()
                self.proxies[population.tool_proxy.name] = population.tool_proxy
        for fault_proxy in self.proxies.values():
            fault_proxy.set_latency(self.settings.latency_ms / 1000.0)

    def _arm_tool_faults(self) -> None:
        """Let each tool drop replies and answer 429 at the asked-for rates, seeded."""
        for population, seed in zip(self.populations, self._tool_seeds, strict=False):
            assert population.service is not None
            population.service.randomize_faults(
                drop_reply_rate=self.settings.drop_replies,
                reject_rate=self.settings.reject_429,
                seed=seed,
            )

    def _heal(self) -> None:
        """End every fault before the drain: tool faults off, partitions healed, no latency."""
        for population in self.populations:
            assert population.service is not None
            population.service.randomize_faults(drop_reply_rate=0.0, reject_rate=0.0, seed=0)
        self.partitions.heal(time.monotonic(), force=True)
        for fault_proxy in self.proxies.values():
            fault_proxy.set_latency(0.0)

    def close(self) -> list[str]:
        """Stop workers, tools and proxies; drop the schemas unless kept.

        Returns what could not be done (one line each): cleanup never hides a verdict.
        """
        problems: list[str] = []
        for population in self.populations:
            try:
                problems += population.close(drop=not self.keep_schemas)
            except errors.LabError as exc:
                problems.append(f"{population.label}: {exc}")
        for fault_proxy in self.proxies.values():
            fault_proxy.stop()
        return problems

    def _create_workflows(self) -> None:
        over = self.settings.release_over
        lists = [p.create_workflows(self._plans, approve=over <= 0) for p in self.populations]
        if over > 0:  # the populations' approvals interleaved in proportion, as traffic
            order = sorted((i / len(pending), n, item) for n, pending in enumerate(lists)
                           for i, item in enumerate(pending))
            self.release = traffic.Release([item for _, _, item in order], over)

    def _busy(self) -> bool:
        """Whether work is in flight: ready or running work (the last count) and a worker."""
        return not self._idle() and bool(self._live())

    def _idle(self) -> bool:
        """Whether no work is ready or running, by the last count."""
        return not any(p.open["ready"] + p.open["running"] for p in self.populations)

    def _strike(self, kind: str) -> bool:
        """Record a strike of ``kind`` about to happen, or withhold it (False: the phase
        ended first); with approvals in waves it first waits for work (``traffic``)."""
        return self.strikes.meet(kind, self._busy, self._idle, self._stop_restarts,
                                 self.release)

    # -- fault phase -------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Start the workers; return once one of them finished an item (or after a minute).

        The tool already drops replies and answers 429 here. Kills start only
        afterwards, so ``duration`` measures crashes of working processes, not
        the interpreter start-up of a loaded machine.
        """
        deadline = time.monotonic() + WARM_UP_TIMEOUT_S
        if self.release is not None:
            self.release.step(0.0)  # the first wave
        self._open_total(refresh=True)
        while time.monotonic() < deadline:
            self._check_faults()
            self._maintain()
            for population, _, child in self._live():
                population.read_lines(child, self.counts, self._items_done)
            if any(self._items_done.values()) or self._open_total(refresh=True) == 0:
                return
            time.sleep(0.05)

    def _fault_phase(self) -> bool:
        """Kill and terminate until ``duration`` or until all work is settled."""
        settings = self.settings
        now = time.monotonic()
        deadline = now + settings.duration
        next_kill = now + interval(self._kill_rng, settings.kill_every_ms)
        next_term = now + interval(self._term_rng, settings.terminate_every_ms)
        next_partition = now + spread(self._partition_rng, settings.partition_every_ms)
        next_count = began = now
        while True:
            self._check_faults()
            if self.release is not None:
                self.release.step(time.monotonic() - began)
            if self.disk is None:  # a disk fault's strike revives the server it kills
                self.check.require_server()
            now = time.monotonic()
            if now >= next_count:
                # Work may settle before the database was ever killed: with restarts
                # asked for, the phase lasts until ``min_restarts`` happened too.
                restarted = (len(self.counts.restarts) >= settings.min_restarts
                             and (self.disk is None or self.disk.struck_every_target())
                             and (self.clock is None or self.clock.stepped_both_ways())
                             and self._partitioned()
                             and not self._more_faults_needed())
                released = self.release is None or self.release.complete
                if self._open_total(refresh=True) == 0 and restarted and released:
                    return True
                next_count = now + 0.25
            if now >= deadline:
                return False
            self._maintain()
            if now >= next_kill:
                self._kill_one()
                next_kill += interval(self._kill_rng, settings.kill_every_ms)
                next_kill = max(next_kill, now)
            if now >= next_term:
                self._terminate_one()
                next_term += interval(self._term_rng, settings.terminate_every_ms)
                next_term = max(next_term, now)
            self.partitions.heal(now)
            if now >= next_partition:
                busy = self._busy()  # a strike is a cut made, not one already in force
                if self.partitions.cut(now):
                    self.strikes.record("partition", busy)
                next_partition = now + spread(self._partition_rng,
                                                    settings.partition_every_ms)
            wake = min(next_kill, next_term, next_partition, next_count, deadline,
                       self.partitions.heals_at)
            time.sleep(min(max(wake - time.monotonic(), 0.0), 0.05))

    def _partitioned(self) -> bool:
        """Whether partitions, if asked for, struck and healed once: work settled before
        the first (a fast machine) must not end a round that was to show one."""
        wanted = self.settings.partition_every_ms > 0 and bool(self.partitions.links)
        return not wanted or (bool(self.partitions.log) and not self.partitions.cut_now)

    def _more_faults_needed(self) -> bool:
        """Whether faults a minimum asks for are still due (``chaos_hosts``: failovers)."""
        return False

    # -- database faults ---------------------------------------------------------------

    def _restart_loop(self) -> None:
        """SIGKILL and restart the postmaster every ``restart_every_ms`` (give or take half)."""
        if self._restart is None or self.settings.restart_every_ms <= 0:
            return
        try:
            while not self._stop_restarts.wait(
                spread(self._restart_rng, self.settings.restart_every_ms)
            ):
                if not self._strike("postgres_restart"):
                    break
                at = time.monotonic() - self._began
                self._restarting.set()
                try:
                    down = self._restart()
                finally:
                    self._restarting.clear()
                self.counts.restarts.append({"at_s": round(at, 2), "down_s": round(down, 3)})
                self._log(f"PostgreSQL SIGKILLed and restarted ({down:.2f}s down)")
        except BaseException as exc:  # surfaced by the supervisor, never swallowed
            self._restart_failure = exc

    def _start_database_faults(self) -> None:
        """Start the disk-full and clock-step threads, each on its own seeded timer."""
        s = self.settings
        if self.disk is not None:
            disk = self.disk
            disk.start()
            self._fault_threads.append(threading.Thread(
                target=self._fault_loop, name="chaos-disk-full", daemon=True,
                args=(s.disk_full_every_ms, self._disk_rng,
                      lambda at: disk.strike(at, self._stop_restarts), "disk full")))
        if self.clock is not None:
            clock = self.clock
            self._fault_threads.append(threading.Thread(
                target=self._fault_loop, name="chaos-clock-steps", daemon=True,
                args=(s.clock_step_every_ms, self._clock_rng, clock.step, "clock step")))
        for thread in self._fault_threads:
            thread.start()

    def _fault_loop(self, every_ms: float, rng: random.Random,
                    strike: Callable[[float], dict[str, Any]], what: str) -> None:
        """Strike every ``every_ms`` (give or take half) until the fault phase ends."""
        try:
            while not self._stop_restarts.wait(spread(rng, every_ms)):
                if not self._strike(what.replace(" ", "_")):
                    break
                record = strike(time.monotonic() - self._began)
                self._log(f"{what}: {record}")
        except BaseException as exc:  # surfaced by the supervisor, never swallowed
            self._restart_failure = exc

    def _live(self) -> list[tuple[Population, int, processes.WorkerProcess]]:
        return [
            (population, slot, child)
            for population in self.populations
            for slot, child in enumerate(population.slots)
            if child is not None and child.alive()
        ]

    def _kill_one(self) -> None:
        """SIGKILL a random worker among those that have finished at least one item.

        A process still starting (importing modules, connecting) holds no claim,
        so killing it would only test the interpreter's start-up time, and on a
        loaded machine no incarnation would ever do any work. Once a worker has
        finished one item it is always in the middle of the next one (or idle),
        so the kill lands anywhere in the claim/dispatch/complete window. A
        timer that finds no such worker is counted as a miss.
        """
        live = []
        for entry in self._live():
            entry[0].read_lines(entry[2], self.counts, self._items_done)
            if self._items_done.get(entry[2].name, 0) > 0:
                live.append(entry)
        if not live:
            self.counts.kill_misses += 1
            return
        population, slot, _ = self._kill_rng.choice(live)
        self.counts.kills += 1
        self.strikes.record("worker_sigkill", self._busy())
        self._reap(population, slot)

    def _terminate_one(self) -> None:
        """``pg_terminate_backend`` on a random backend of a live worker of this run."""
        assert self.populations[0].db is not None
        # A reaped worker's backend may linger for a moment: it is not a target.
        live = {child.name for _, _, child in self._live()}
        done = diagnostics.terminate_one(self.populations[0].db, self.token, live,
                                         self._term_rng)
        if done is None:  # the database is away: nothing to terminate now
            self.counts.unreachable_reads += 1
        if done:
            self.counts.backend_terminations += 1
            self.strikes.record("backend_termination", self._busy())
        else:
            self.counts.termination_misses += 1

    def _maintain(self) -> None:
        """Reap workers that exited; start one in each empty slot while ready work is left."""
        for population in self.populations:
            for slot, child in enumerate(population.slots):
                if child is not None and not child.alive():
                    self._reap(population, slot)
                if population.slots[slot] is None and population.open["ready"] > 0:
                    self._spawn(population, slot)

    def _spawn(self, population: Population, slot: int) -> None:
        population.spawn(slot, self.worker_dsn, self.token, self.settings, self.keys)
        self.counts.worker_starts += 1

    def _reap(self, population: Population, slot: int) -> None:
        population.reap(slot, self.counts, self._items_done)

    # -- recovery ----------------------------------------------------------------------

    def _recover_loop(self) -> None:
        try:
            while not self._stop_recoverer.wait(RECOVER_EVERY_S):
                for population in self.populations:
                    population.recover(self.counts)
        except BaseException as exc:  # surfaced by the supervisor, never swallowed
            self._recoverer_failure = exc

    def _check_faults(self) -> None:
        """Surface a failure of the recoverer or restarter thread as the run's failure."""
        for what, failure in (("recoverer", self._recoverer_failure),
                              ("PostgreSQL restarter", self._restart_failure)):
            if failure is None:
                continue
            if isinstance(failure, errors.LabError):
                raise failure
            raise errors.CheckFailed(f"the chaos {what} failed: {failure!r}") from failure

    # -- drain -------------------------------------------------------------------------

    def _open_total(self, refresh: bool = False) -> int:
        """Open work in all populations; a database that is away leaves the last counts."""
        total = 0
        for population in self.populations:
            counts = population.open
            if refresh:
                try:
                    counts = population.refresh()
                except errors.StoreError:
                    self.counts.unreachable_reads += 1
            total += sum(counts.values())
        return total

    def _drain(self, recoverer: threading.Thread) -> None:
        """No more faults: let workers and the recoverer settle everything they can.

        The recoverer's passes move here, into this thread, so that each count of
        open work comes right after a pass: work a pass just took out of review
        (proven undispatched, queued again) is counted, and gets a worker.
        """
        self._stop_recoverer.set()
        recoverer.join(timeout=30)
        self._check_faults()
        deadline = time.monotonic() + self.settings.drain_timeout
        while True:
            while time.monotonic() < deadline:
                self.check.require_server()
                for population in self.populations:
                    population.recover(self.counts)
                if self._open_total(refresh=True) == 0:
                    break
                self._maintain()
                time.sleep(RECOVER_EVERY_S)
            # Workers leave by themselves once idle; whatever is left after that is stuck.
            wait_until = time.monotonic() + self.settings.idle_exit + 15.0
            while self._live() and time.monotonic() < wait_until:
                time.sleep(0.1)
            for population in self.populations:
                for slot, child in enumerate(population.slots):
                    if child is None:
                        continue
                    if child.alive():
                        self.counts.drain_kills += 1
                    self._reap(population, slot)
            # A last pass with no worker alive: leases of anything still running run out.
            for _ in range(3):
                if self._open_total(refresh=True) == 0:
                    break
                time.sleep(self.settings.lease + 0.2)
                for population in self.populations:
                    population.recover(self.counts)
            ready = sum(p.open["ready"] for p in self.populations)
            if ready == 0 or time.monotonic() >= deadline:
                return
            # Recovery queued work again after the workers left: drain once more.

    # -- the check and the report ----------------------------------------------------------

def run(
    dsn: str,
    settings: Settings,
    *,
    log: Callable[[str], None] | None = None,
    keep_schemas: bool = False,
    restart: Callable[[], float] | None = None,
    server: embedded.Server | None = None,
) -> dict[str, Any]:
    """Run one bounded chaos round against ``dsn`` and return its report.

    The round creates its own schemas (``chaos_<token>_i`` / ``_n``) and drops
    them at the end unless ``keep_schemas``; what cleanup could not do is in the
    report's ``cleanup`` list. ``restart`` crash-restarts the server (needed for
    ``restart_every_ms``).
    """
    chaos = Chaos(dsn, settings, log=log, keep_schemas=keep_schemas, restart=restart,
                  server=server)
    try:
        report = chaos.run()
    finally:
        problems = chaos.close()
    report["cleanup"] = problems
    return report
