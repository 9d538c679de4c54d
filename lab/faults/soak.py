"""``lab soak``: a long run that mixes every fault, with memory and connections over time.

The soak runs chaos rounds (``lab.faults.chaos``) back to back on one embedded server,
until the asked number of workflows has run: each round with worker SIGKILLs, backend
terminations, lost replies, 429s, PostgreSQL SIGKILLs and restarts, network partitions,
disk-full faults and clock steps for at most ``--fault-phase`` seconds (then the drain
settles the rest without faults), its own seed (the soak's seed plus the round number)
and its own schemas, checked by the invariant checker and the independent SQL audit,
then dropped. A round's size bounds what one check holds in memory; the server, its
filesystem and its clock live for the whole soak, so what leaks across rounds shows.

A sampler thread reads, every ``sample_every`` seconds, the resident anonymous memory
(``Pss_Anon``: what a process allocated itself, not the shared buffers every backend
maps, with a page shared after a fork counted once over its sharers) of every process
of the run, grouped as the controller (this process), the
PostgreSQL server (postmaster and backends), the worker processes and the rest, and
the server's client connections. ``figure_svg`` draws both over time. The verdict is
the sum of every round's: no violation and the two checkers agreeing in each.

Faults meet work in flight: each round approves its workflows in waves through its
fault phase (``--release-over``, ``lab.faults.traffic``), and a database fault that
comes due waits briefly for work in flight. The report counts, per fault kind, the
strikes that met work in flight (``faults_in_flight``), and the samples that saw a
worker process alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg

from lab import errors, escape, files
from lab.faults import chaos, traffic
from lab.faults.chaos_settings import HostFlags, Settings, fault_option, release_option
from lab.options import option
from lab.pg import embedded, providers
from lab.runtime import processes

ROLES = ("controller", "postgres", "workers", "other")
# The share of the fault phase over which a round's approvals arrive by default: the
# last quarter lets the last waves meet faults too.
RELEASE_SHARE = 0.75
PROC_LIMIT = 64 * files.KIB


@dataclass(frozen=True)
class SoakSettings:
    """The soak: how many workflows in rounds of what size, sampled how often."""

    workflows: int = 100_000
    round_size: int = 2_000
    sample_every: float = 2.0
    chaos: Settings = field(default_factory=Settings)

    def validate(self) -> None:
        """Raise ``errors.UsageError`` for a soak that cannot run."""
        if not 1 <= self.workflows <= 1_000_000:
            raise errors.UsageError("workflows must be between 1 and 1000000")
        if not 10 <= self.round_size <= 100_000:
            raise errors.UsageError("round must be between 10 and 100000 workflows")
        if not 0.1 <= self.sample_every <= 60:
            raise errors.UsageError("sample-every must be between 0.1 and 60 seconds")
        self.chaos.validate()

    def rounds(self) -> list[int]:
        """The size of each round: full rounds, then what is left."""
        full, rest = divmod(self.workflows, self.round_size)
        return [self.round_size] * full + ([rest] if rest else [])


# -- sampling ---------------------------------------------------------------------------------


def _proc(pid: int, name: str) -> str:
    try:
        return files.read_bytes(Path(f"/proc/{pid}/{name}"), PROC_LIMIT,
                                "process status").decode("utf-8", errors="replace")
    except errors.InputError:
        return ""  # the process is gone: it has no memory to count


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc(int(entry), "stat")
        if not stat:
            continue
        # The command name may hold spaces and parentheses: fields follow the last ")".
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def anon_kib(pid: int) -> int:
    """The process's share of resident anonymous memory in KiB (0 when it is gone).

    ``Pss_Anon``: a page a forked process still shares with its parent (a PostgreSQL
    backend with the postmaster, a worker with the fork server) counts a share in each,
    so the sum over a role is what the role really holds. ``RssAnon``, which counts a
    shared page whole in every process, where the kernel has no ``smaps_rollup``.
    """
    for line in _proc(pid, "smaps_rollup").splitlines():
        if line.startswith("Pss_Anon:"):
            return int(line.split()[1])
    for line in _proc(pid, "status").splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def role(pid: int) -> str:
    """Which part of the run a process is (see ``ROLES``)."""
    # Backends retitle themselves ("postgres: ..."), but keep the executable's name.
    comm = _proc(pid, "comm").strip()
    if comm == "postgres":
        return "postgres"
    if comm == processes.command_name("lab.cli", ["worker"]):
        return "workers"  # forked from the fork server: named, its command line is the server's
    command = _proc(pid, "cmdline").split("\0")
    if "lab.cli" in command and "worker" in command:
        return "workers"
    return "other"


def connections(dsn: str) -> int | None:
    """Client connections the server holds now (None while it is away)."""
    try:
        with psycopg.connect(dsn, connect_timeout=3, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity "
                               "WHERE backend_type = 'client backend'").fetchone()
    except psycopg.Error:
        return None
    return int(row[0]) if row else None


def sample(dsn: str, began: float) -> dict[str, Any]:
    """One sample: seconds since ``began``, anonymous memory (MB) and processes per role,
    and the server's connections."""
    kib: Counter[str] = Counter({"controller": anon_kib(os.getpid())})
    count: Counter[str] = Counter({"controller": 1})
    for pid in descendants(os.getpid()):
        who = role(pid)
        kib[who] += anon_kib(pid)
        count[who] += 1
    return {
        "t": round(time.monotonic() - began, 1),
        "rss_mb": {r: round(kib[r] / 1024, 1) for r in ROLES},
        "processes": {r: count[r] for r in ROLES},
        "connections": connections(dsn),
    }


class Sampler:
    """Samples every ``every`` seconds on a thread until ``stop``."""

    def __init__(self, dsn: str, every: float, began: float,
                 log: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.dsn, self.every, self.began = dsn, every, began
        self.samples: list[dict[str, Any]] = []
        self._log = log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)

    def start(self) -> Sampler:
        """Take a first sample now, then keep sampling on the thread."""
        self.samples.append(sample(self.dsn, self.began))
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            taken = sample(self.dsn, self.began)
            self.samples.append(taken)
            if self._log is not None:
                self._log(taken)

    def stop(self) -> None:
        """Stop sampling and take a last sample."""
        self._stop.set()
        self._thread.join(timeout=30)
        self.samples.append(sample(self.dsn, self.began))


# -- the run ----------------------------------------------------------------------------------


def run(
    dsn: str, settings: SoakSettings, *, server: embedded.Server | None,
    restart: Callable[[], float] | None, log: Callable[[str], None] = lambda m: None,
) -> dict[str, Any]:
    """Run the soak's rounds; the report (JSON-ready): totals, rounds, samples, verdict."""
    settings.validate()
    began = time.monotonic()
    sizes = settings.rounds()
    last_progress = [0.0]

    def progress(taken: dict[str, Any]) -> None:
        if taken["t"] - last_progress[0] >= 30:
            last_progress[0] = taken["t"]
            log(f"t={taken['t']:.0f}s rss MB {taken['rss_mb']} "
                f"connections {taken['connections']}")

    sampler = Sampler(dsn, settings.sample_every, began, progress).start()
    rounds: list[dict[str, Any]] = []
    done = 0
    try:
        for index, size in enumerate(sizes):
            round_settings = replace(settings.chaos, workflows=size,
                                     seed=settings.chaos.seed + index)
            report = chaos.run(dsn, round_settings, server=server, restart=restart)
            rounds.append(_round_summary(index, report, release_free_heap()))
            done += size
            elapsed = time.monotonic() - began
            rate = done / elapsed
            eta = (settings.workflows - done) / rate if rate > 0 else math.inf
            log(f"round {index + 1}/{len(sizes)}: {done}/{settings.workflows} workflows, "
                f"{rate:.1f}/s, {report['violation_count']} violations, checkers "
                f"{'agree' if report['checkers_agree'] else 'DISAGREE'}; elapsed "
                f"{elapsed:.0f}s, ETA {eta:.0f}s")
    finally:
        sampler.stop()
        if server is not None and server.steppable:
            server.set_clock(0)
    wall = time.monotonic() - began
    return _report(settings, rounds, sampler.samples, wall, done)


# glibc's mallopt(3) parameter: how many malloc arenas threads may spread over.
M_ARENA_MAX = -8


def one_malloc_arena() -> bool:
    """Make every thread of this process allocate from one glibc arena; True when set.

    Called before the soak starts a thread. A round starts and ends dozens of threads
    (the tool's request handlers, the proxies, the pools, the faults), and glibc gives
    threads up to eight arenas per core; each keeps the pages it once grew to, partly
    used, so the controller's resident memory crept up round after round with nothing
    alive to explain it (measured: 30.6 to 33.1 MB over 20 rounds of 300 workflows and
    still rising, against 29.4 to 30.8 MB and flat from the twelfth round with one
    arena). The controller is no hot path: one arena costs it nothing measurable.
    """
    try:
        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):
        return False  # no glibc


def release_free_heap() -> dict[str, float]:
    """Hand the C heap's free pages back to the kernel; this process's anonymous memory
    (MB) before and after.

    A round frees what it held (its checker reads tens of thousands of rows through
    libpq), but glibc keeps freed pages mapped until asked. ``malloc_trim(0)`` returns
    every free page: what stays resident after it is memory the controller still holds,
    which is what the soak's figure must show. Both numbers go into the round's summary.
    """
    before = anon_kib(os.getpid()) / 1024
    # Without glibc there is nothing to trim, and the samples show the untrimmed size.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    return {"before_mb": round(before, 1),
            "after_mb": round(anon_kib(os.getpid()) / 1024, 1)}


def _round_summary(index: int, report: dict[str, Any],
                   controller_heap: dict[str, float]) -> dict[str, Any]:
    f = report["faults"]
    return {
        "round": index + 1,
        "controller_rss_mb": controller_heap,
        "seed": report["run"]["seed"],
        "workflows": report["run"]["workflows"],
        "wall_s": report["timing"]["wall_s"],
        "states": report["states"],
        "effects": report["effects"],
        "violations": report["violation_count"],
        "violations_by_kind": report["violations_by_kind"],
        "audit_findings": report["audit"]["audit_findings"],
        "checkers_agree": report["checkers_agree"],
        "cleanup": report["cleanup"],
        "faults": {
            "worker_sigkills": f["kills"],
            "backend_terminations": f["backend_terminations"],
            "dropped_replies": f["dropped_replies"],
            "rejected_429": f["rejected_429"],
            "postgres_restarts": f["postgres_restarts"],
            "partitions": f["partitions"],
            "disk_full": f["disk_full"]["count"],
            "disk_full_server_log": f["disk_full"].get("server_log", {}),
            "postmaster_restarted_after_full_disk":
                f["disk_full"].get("postmaster_restarted_by_lab", 0),
            "clock_steps": f["clock_steps"]["count"],
            "leases_expired_early_by_step": f["clock_steps"].get("leases_expired_early", 0),
            "leases_expired_late_by_step": f["clock_steps"].get("leases_expired_late", 0),
        },
        "manual_reviews": report["manual_reviews"],
        "in_flight": f["in_flight"],
        "release": f["release"],
    }


def _report(settings: SoakSettings, rounds: list[dict[str, Any]],
            samples: list[dict[str, Any]], wall: float, done: int) -> dict[str, Any]:
    faults: Counter[str] = Counter()
    server_log: Counter[str] = Counter()
    states: Counter[str] = Counter()
    for r in rounds:
        for key, value in r["faults"].items():
            if isinstance(value, int):
                faults[key] += value
        server_log.update(r["faults"]["disk_full_server_log"])
        states.update(r["states"])
    violations = sum(r["violations"] for r in rounds)
    agree = all(r["checkers_agree"] for r in rounds)
    conns = [s["connections"] for s in samples if s["connections"] is not None]
    working = sum(1 for s in samples if s["processes"]["workers"] > 0)
    return {
        "settings": {"workflows": settings.workflows, "round_size": settings.round_size,
                     "sample_every_s": settings.sample_every,
                     "chaos": settings.chaos.describe(max_attempts=0, proxied_links=[])},
        "workflows_run": done,
        "wall_s": round(wall, 1),
        "workflows_per_s": round(done / wall, 2) if wall > 0 else 0.0,
        "rounds": rounds,
        "states": dict(sorted(states.items())),
        "faults": dict(sorted(faults.items())),
        # Per fault kind, how many strikes met work in flight, over every round.
        "faults_in_flight": traffic.merge([r["in_flight"] for r in rounds]),
        "samples_with_workers": {"alive": working, "samples": len(samples)},
        "disk_full_server_log": dict(sorted(server_log.items())),
        "memory_mb": {
            role_: {"first": samples[0]["rss_mb"][role_], "last": samples[-1]["rss_mb"][role_],
                    "peak": max(s["rss_mb"][role_] for s in samples)}
            for role_ in ROLES
        } if samples else {},
        "connections": {"baseline": conns[0] if conns else None,
                        "peak": max(conns) if conns else None,
                        "final": conns[-1] if conns else None},
        "samples": samples,
        "violations": violations,
        "checkers_agree": agree,
        "verdict": "pass" if violations == 0 and agree else "fail",
    }


# -- the figure -------------------------------------------------------------------------------

_COLOURS = {"controller": "#1f77b4", "postgres": "#2ca02c", "workers": "#d62728",
            "other": "#9467bd", "connections": "#ff7f0e"}


def figure_svg(samples: list[dict[str, Any]], title: str) -> str:
    """Resident memory per role and the server's connections over time, as one SVG.

    Deterministic: the same samples give the same bytes.
    """
    width, height, left, right = 760, 480, 64, 130
    panels = [("resident anonymous memory (MB)", 40, 230), ("client connections", 300, 440)]
    t_max = max((s["t"] for s in samples), default=1.0) or 1.0
    rss_max = max((v for s in samples for v in s["rss_mb"].values()), default=1.0) or 1.0
    conn_max = max((s["connections"] or 0 for s in samples), default=1) or 1
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, sans-serif" '
           f'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="20" font-size="14" font-weight="bold">{escape.xml(title)}</text>']

    def x(t: float) -> float:
        return left + (width - left - right) * t / t_max

    for label, top, bottom in panels:
        out.append(f'<text x="{left}" y="{top - 6}">{escape.xml(label)}</text>')
        out.append(f'<line x1="{left}" y1="{bottom}" x2="{width - right}" y2="{bottom}" '
                   f'stroke="#444"/>')
        out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#444"/>')
        top_value = rss_max if top == panels[0][1] else conn_max
        out.append(f'<text x="{left - 6}" y="{top + 4}" text-anchor="end">'
                   f'{top_value:.0f}</text>')
        out.append(f'<text x="{left - 6}" y="{bottom + 4}" text-anchor="end">0</text>')
    out.append(f'<text x="{width - right}" y="{panels[1][2] + 18}" text-anchor="end">'
               f'{t_max:.0f} s</text>')
    out.append(f'<text x="{left}" y="{panels[1][2] + 18}">0 s</text>')

    def line(points: list[tuple[float, float]], colour: str) -> None:
        if points:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
                       f'points="{path}"/>')

    top, bottom = panels[0][1], panels[0][2]
    for index, role_ in enumerate(ROLES):
        line([(x(s["t"]), bottom - (bottom - top) * s["rss_mb"][role_] / rss_max)
              for s in samples], _COLOURS[role_])
        out.append(f'<text x="{width - right + 8}" y="{top + 14 + 16 * index}" '
                   f'fill="{_COLOURS[role_]}">{role_}</text>')
    top, bottom = panels[1][1], panels[1][2]
    line([(x(s["t"]), bottom - (bottom - top) * s["connections"] / conn_max)
          for s in samples if s["connections"] is not None], _COLOURS["connections"])
    out.append(f'<text x="{width - right + 8}" y="{top + 14}" '
               f'fill="{_COLOURS["connections"]}">connections</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# -- the command ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakOptions:
    """What ``lab soak`` is asked to do: its flags, declared here or, for those it shares
    with ``lab chaos``, in ``chaos_settings.FAULT_FLAGS`` (every fault on unless set to 0)."""

    workflows: int = option(100_000, help="workflows in all")
    round: int = option(2_000, metavar="N",
                        help="workflows per chaos round (each checked, then dropped)")
    workers: int = fault_option("workers")
    batch: int = fault_option("batch")
    concurrency: int = fault_option("concurrency")
    kill_every: float = option(1000.0, metavar="MS", help="mean ms between SIGKILLs of a worker")
    drop_replies: float = fault_option("drop_replies", 0.05)
    reject_429: float = fault_option("reject_429", 0.05)
    terminate_backends: float = option(
        3000.0, metavar="MS", help="mean ms between pg_terminate_backend of a worker (0: never)")
    non_idempotent_share: float = fault_option("non_idempotent_share")
    seed: int = option(42, help="seed of the fault schedules")
    restart_postgres_every: float = option(
        30_000.0, metavar="MS", help="SIGKILL and restart PostgreSQL about every MS (0: never)")
    partition_every: float = option(
        15_000.0, metavar="MS", help="cut one link (blackhole or reset) about every MS (0: never)")
    partition_for: float = fault_option("partition_for", 800.0)
    disk_full_every: float = fault_option("disk_full_every", 30_000.0)
    disk_full_for: float = fault_option("disk_full_for")
    disk_full_mb: int = fault_option("disk_full_mb", 256)
    disk_full_fs: str = fault_option("disk_full_fs")
    clock_step_every: float = fault_option("clock_step_every", 20_000.0)
    clock_step_max: int = fault_option("clock_step_max", 10)
    hosts: int = fault_option("hosts")
    replication: str = fault_option("replication")
    failover_every: float = fault_option("failover_every")
    min_failovers: int = fault_option("min_failovers")
    net_fault_every: float = fault_option("net_fault_every")
    net_fault_for: float = fault_option("net_fault_for")
    min_net_faults: int = fault_option("min_net_faults")
    skew_max: int = fault_option("skew_max")
    fault_phase: float = option(
        60.0, metavar="S", help="seconds of faults per round at most; the drain settles the rest")
    # None: three quarters of the fault phase.
    release_over: float | None = release_option(
        None, "three quarters of --fault-phase; 0: all at once")
    sample_every: float = option(
        2.0, metavar="S", help="seconds between memory and connection samples")
    output: str = option("evidence/soak.json", help="the report (JSON)")
    figure: str = option("evidence/soak.svg", help="the memory figure (SVG)")
    lab_postgres: str = providers.mode_option()


def settings_from(options: SoakOptions) -> SoakSettings:
    """``lab soak`` options as soak settings (every fault on unless set to 0). With
    ``--hosts`` the one-machine faults (restarts, proxy partitions, disk full, server
    clock steps) are off: failovers and faults between hosts take their place."""
    hosts = HostFlags.from_options(options)
    if hosts.enabled:
        options = replace(options, restart_postgres_every=0.0, partition_every=0.0,
                          disk_full_every=0.0, clock_step_every=0.0)
    chaos_settings = Settings(hosts=hosts,
        workflows=min(options.round, options.workflows), workers=options.workers,
        duration=options.fault_phase,
        kill_every_ms=options.kill_every, drop_replies=options.drop_replies,
        reject_429=options.reject_429, terminate_every_ms=options.terminate_backends,
        non_idempotent_share=options.non_idempotent_share, seed=options.seed,
        restart_every_ms=options.restart_postgres_every,
        partition_every_ms=options.partition_every,
        partition_for_ms=options.partition_for, durable=True,
        disk_full_every_ms=options.disk_full_every, disk_full_for_ms=options.disk_full_for,
        disk_full_mb=options.disk_full_mb, disk_full_fs=options.disk_full_fs,
        clock_step_every_ms=options.clock_step_every,
        clock_step_max_s=options.clock_step_max,
        drain_timeout=600.0, batch=options.batch, concurrency=options.concurrency,
        # Approvals arrive through the fault phase, so its faults meet work in flight.
        release_over=(options.fault_phase * RELEASE_SHARE if options.release_over is None
                      else options.release_over),
    )
    return SoakSettings(workflows=options.workflows, round_size=options.round,
                        sample_every=options.sample_every, chaos=chaos_settings)


def cli_main(options: SoakOptions) -> int:
    """Body of ``lab soak``: start the server, run the rounds, write the JSON and the SVG.

    Returns 0 when every round kept every invariant and the checkers agreed, else 1.
    """
    import json
    import logging
    import sys

    from lab.pg import cluster

    one_arena = one_malloc_arena()  # before any thread of the soak starts
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    settings = settings_from(options)
    settings.validate()
    c = settings.chaos
    if c.hosts.enabled:
        from lab.faults import chaos_hosts_command

        return chaos_hosts_command.soak_main(settings.rounds(), c, options.output)

    def say(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    volume = embedded.Volume(c.disk_full_mb, c.disk_full_fs) if c.disk_full_every_ms else None
    with cluster.start(mode=options.lab_postgres, durable=True, volume=volume,
                       faketime=c.clock_step_every_ms > 0) as running:
        if c.restart_every_ms > 0 and not running.can_crash_restart:
            raise errors.ProvisioningError(
                "--restart-postgres-every needs a server this run starts (the embedded "
                "provider)")
        described = running.provisioned.describe()
        say(f"PostgreSQL {described['server_version']} via {described['provider']} "
            f"{described['details']}; {settings.workflows} workflows in "
            f"{len(settings.rounds())} rounds")
        report = run(running.provisioned.dsn, settings, server=running.server,
                     restart=running.crash_restart if c.restart_every_ms > 0 else None,
                     log=say)
        report["postgres"] = described
        report["controller_malloc"] = ("one glibc arena, trimmed after each round"
                                       if one_arena else "the C library's default")
    output = Path(options.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    figure = Path(options.figure)
    figure.parent.mkdir(parents=True, exist_ok=True)
    figure.write_text(figure_svg(report["samples"], f"lab soak: {report['workflows_run']} "
                                 f"workflows, {report['wall_s']:.0f} s"), encoding="utf-8")
    memory = report["memory_mb"]
    print(f"soak: {report['workflows_run']} workflows in {report['wall_s']} s "
          f"({report['workflows_per_s']}/s); faults {report['faults']}")
    print(f"server under a full disk: {report['disk_full_server_log']}")
    print("memory MB (first/peak/last): " + ", ".join(
        f"{r} {m['first']}/{m['peak']}/{m['last']}" for r, m in memory.items()))
    trimmed = [r["controller_rss_mb"]["after_mb"] for r in report["rounds"]]
    if trimmed:
        print(f"controller after each round's trim, MB: first {trimmed[0]}, "
              f"peak {max(trimmed)}, last {trimmed[-1]}")
    print(f"connections: {report['connections']}")
    print("faults that met work in flight: " + ", ".join(
        f"{kind} {t['busy']}/{t['strikes']}" + (f" ({t['after_work']} after the work)"
                                                 if t.get("after_work") else "")
        for kind, t in report["faults_in_flight"].items())
        + f"; samples with workers alive: {report['samples_with_workers']['alive']}/"
        f"{report['samples_with_workers']['samples']}")
    print(f"violations: {report['violations']}; checkers agree: {report['checkers_agree']}; "
          f"verdict: {report['verdict']}")
    print(f"report written to {output}, figure to {figure}")
    return 0 if report["verdict"] == "pass" else 1
