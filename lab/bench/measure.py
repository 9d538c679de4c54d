"""Measurement for ``lab bench``: arithmetic, the server's counters, CPU, scratch databases.

The benchmarks (``bench_throughput``, ``bench_claim``, ``bench_suite``,
``bench_startup``) measure with these helpers and nothing else, so a figure in one
is computed as it is in another. Statistics queries go through ``lab.pg.edge``, the
psycopg edge; what is pure here is tested without a database.

Transactions are counted per database: the throughput benchmark puts the workflow
store, the tool's ledger and DBOS's system tables in scratch databases of their own
on the same server, so each count is measured rather than estimated. Where the
server refuses ``CREATE DATABASE`` everything shares one database and the tool's
share is estimated as one transaction per call.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import os
import platform
import re
import resource
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from psycopg import sql

from lab import errors, load, names
from lab.pg import cluster, edge
from lab.runtime import plan, store

T = TypeVar("T")

# The lab's sample plan and actors, for the benchmarks' own backlogs (the experiments'
# harness has its own; a benchmark does not import the experiment harness).
PROPOSER = store.Actor(tenant="tenant-a", subject="bench-proposer", role="proposer")
APPROVER = store.Actor(tenant="tenant-a", subject="bench-approver", role="approver")
# The experiments' lease (``harness.SEED_LEASE``; tests/bench/test_bench.py checks they agree).
SEED_LEASE_SECONDS = 3.0


def sample_plan() -> plan.Plan:
    """The plan every benchmark workflow carries: 500 minor units of CNY to account-a."""
    return plan.Plan(version=1, action="issue_credit", account="account-a", amount_minor=500,
                     currency="CNY", idempotent=True)


# -- pure arithmetic and parsing ---------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolating linearly between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError("percentile must lie between 0 and 100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the divisor is zero."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def latency_summary(seconds: Sequence[float]) -> dict[str, float | None]:
    """p50, p99 and max of ``seconds``, in milliseconds (None for no samples)."""
    if not seconds:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "p50_ms": round(percentile(seconds, 50) * 1000, 3),
        "p99_ms": round(percentile(seconds, 99) * 1000, 3),
        "max_ms": round(max(seconds) * 1000, 3),
    }


def xact_delta(
    before: Mapping[str, int], after: Mapping[str, int], own: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Committed transactions per database between two snapshots, less the benchmark's own."""
    own = own or {}
    missing = set(before) ^ set(after)
    if missing:
        raise ValueError(f"snapshots disagree on databases: {sorted(missing)}")
    return {name: after[name] - before[name] - own.get(name, 0) for name in before}


def split_transactions(
    delta: Mapping[str, int], *, system_db: str | None, tool_db: str, tool_calls: int
) -> dict[str, Any]:
    """Split a run's transactions into the orchestrator's and the tool ledger's.

    With separate databases both are measured. When they share one, the tool's
    share is estimated: its ledger write is one autocommit INSERT per call. A
    ``system_db`` of None is an orchestrator whose state is not in PostgreSQL
    (Temporal's dev server keeps it in SQLite): the tool's database holds the tool's
    transactions alone, measured, and the orchestrator's (and so the total) are unknown.
    """
    if system_db is None:
        return {"total": None, "system": None, "tool": delta[tool_db], "tool_measured": True,
                "system_measured": False}
    if system_db != tool_db:
        system, ledger = delta[system_db], delta[tool_db]
        return {"total": system + ledger, "system": system, "tool": ledger, "tool_measured": True}
    total = delta[system_db]
    return {"total": total, "system": total - tool_calls, "tool": tool_calls,
            "tool_measured": False}


def marginal_per_workflow(
    run: Mapping[str, Any], empty: Mapping[str, Any], workflows: int
) -> dict[str, float]:
    """Transactions per workflow beyond an empty run's fixed cost (start, idle polls, exit)."""
    if workflows <= 0:
        raise ValueError("marginal cost needs at least one workflow")
    return {
        key: round((run[key] - empty[key]) / workflows, 3) for key in ("total", "system", "tool")
    }


def alternating_order(rounds: int, systems: Sequence[T]) -> list[list[T]]:
    """The systems' order in each round, reversed every other round so drift cancels."""
    return [list(systems) if r % 2 == 0 else list(reversed(systems)) for r in range(rounds)]


_DURATION_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+(\S+)")


def parse_durations(output: str) -> list[tuple[str, str, float]]:
    """``(nodeid, phase, seconds)`` from pytest's ``--durations`` section."""
    found: list[tuple[str, str, float]] = []
    for line in output.splitlines():
        match = _DURATION_LINE.match(line)
        if match:
            found.append((match.group(3), match.group(2), float(match.group(1))))
    return found


def known_waits(source: str, lease_seconds: float) -> dict[str, float]:
    """Seconds each test function of ``source`` must wait by design.

    Counted: each ``recover_by_elapsed_lease(...)`` call (a real lease running
    out on the database clock), each ``backoff = timedelta(...)`` assignment (a
    persisted retry delay) and the literal ``duration=`` of a chaos
    ``Settings(...)`` (its fault phase, an upper bound). Polling for other
    processes is not inherent.
    """
    waits: dict[str, float] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
            continue
        total = 0.0
        for inner in ast.walk(node):
            if isinstance(inner, ast.Call) and _called(inner) == "recover_by_elapsed_lease":
                total += lease_seconds
            if isinstance(inner, ast.Call) and _called(inner) == "Settings":
                total += sum(_literal_seconds(kw.value) for kw in inner.keywords
                             if kw.arg == "duration")
            if isinstance(inner, ast.Assign) and any(
                isinstance(target, ast.Attribute) and target.attr == "backoff"
                for target in inner.targets
            ):
                total += _literal_timedelta(inner.value)
        if total:
            waits[node.name] = total
    return waits


def _called(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return call.func.id if isinstance(call.func, ast.Name) else None


def _literal_seconds(node: ast.expr) -> float:
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return 0.0
    return float(value) if isinstance(value, int | float) else 0.0


def _literal_timedelta(node: ast.expr) -> float:
    if not (isinstance(node, ast.Call) and _called(node) == "timedelta"):
        return 0.0
    try:
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        args = [ast.literal_eval(arg) for arg in node.args]
        return float(timedelta(*args, **kwargs).total_seconds())
    except (ValueError, TypeError):
        return 0.0



# -- PostgreSQL plumbing ------------------------------------------------------------------------


@contextlib.contextmanager
def postgres(mode: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The server to measure, as ``lab.pg.cluster`` provides it for ``mode``: durable (fsync and
    synchronous commits on) where the lab starts it, since a commit's cost is what is measured."""
    with cluster.start(mode=mode, durable=True) as running:
        yield running.provisioned.dsn, dict(running.provisioned.describe())


def server_facts(dsn: str) -> dict[str, Any]:
    """The settings that decide what a commit costs, as the server reports them."""
    facts: dict[str, Any] = {}
    with edge.session(dsn, "read the server's settings") as conn:
        for name in ("server_version", "fsync", "synchronous_commit", "shared_buffers"):
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            facts[name] = row[name] if row else None
    return facts


def environment(dsn: str | None, provision: Mapping[str, Any] | None) -> dict[str, Any]:
    """Where and when the figures were measured: commit, interpreter, machine, load, server."""
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    facts: dict[str, Any] = {
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit or None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        # Other work on the machine skews every figure; the load says how much there was.
        "load_average_1_5_15": [round(v, 2) for v in os.getloadavg()],
    }
    if dsn is not None:
        facts["postgres"] = {**server_facts(dsn), "provisioned": dict(provision or {})}
    return facts


@dataclass(frozen=True)
class Scratch:
    """Scratch databases on the measured server: the workflow store, the tool ledger, DBOS.

    Each database's DSN is derived once from the admin DSN, here.
    """

    admin_dsn: str = field(repr=False)
    store_db: str
    tool_db: str
    dbos_db: str
    separate: bool
    created: tuple[str, ...] = ()
    store_dsn: str = field(init=False, repr=False)
    tool_dsn: str = field(init=False, repr=False)
    dbos_dsn: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for role in ("store", "tool", "dbos"):
            dsn = edge.on_database(self.admin_dsn, getattr(self, f"{role}_db"))
            object.__setattr__(self, f"{role}_dsn", dsn)

    def databases(self) -> list[str]:
        """The distinct databases whose transactions are counted."""
        return sorted({self.store_db, self.tool_db, self.dbos_db})

    def dbos_url(self) -> str:
        """The DBOS system database as a SQLAlchemy URL."""
        return edge.sqlalchemy_url(self.dbos_dsn)

    @classmethod
    def create(cls, admin_dsn: str) -> Scratch:
        """Create the three scratch databases, or fall back to one shared database."""
        tag = uuid.uuid4().hex[:8]
        names = [f"lab_bench_{tag}_{role}" for role in ("store", "tool", "dbos")]
        if not edge.create_databases(admin_dsn, names):
            own = edge.database_of(admin_dsn)
            return cls(admin_dsn, own, own, own, separate=False)
        return cls(admin_dsn, names[0], names[1], names[2], separate=True, created=tuple(names))

    def drop(self) -> None:
        """Drop the scratch databases this benchmark created."""
        edge.drop_databases(self.admin_dsn, self.created)


def xact_snapshot(
    admin_dsn: str, databases: Sequence[str], timeout: float = 30.0
) -> dict[str, int]:
    """``xact_commit`` of each database once no other session is connected to it.

    A backend flushes its statistics when it exits, but an idle one may hold
    them for up to ten seconds; so every measured session must be closed first.
    """
    deadline = time.monotonic() + timeout
    with edge.session(admin_dsn, "read transaction counts") as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) AS n FROM pg_stat_activity "
                "WHERE datname = ANY(%s) AND pid <> pg_backend_pid()",
                (list(databases),),
            ).fetchone()
            if row is not None and row["n"] == 0:
                break
            if time.monotonic() > deadline:
                raise errors.StoreError(f"sessions still connected to {list(databases)}")
            time.sleep(0.05)
        rows = conn.execute(
            "SELECT datname, xact_commit FROM pg_stat_database WHERE datname = ANY(%s)",
            (list(databases),),
        ).fetchall()
    return {str(row["datname"]): int(row["xact_commit"]) for row in rows}


def wal_syncs(admin_dsn: str) -> int | None:
    """WAL flushes to disk so far, cluster-wide (``pg_stat_wal``, PostgreSQL 14+)."""
    return edge.wal_syncs(admin_dsn)


def difference(after: float | None, before: float | None) -> float | None:
    """``after - before``, or None when either is unknown."""
    return None if after is None or before is None else after - before


def new_schema(prefix: str) -> str:
    """A fresh schema name for one benchmark round."""
    return names.check_schema_name(f"{prefix}_{uuid.uuid4().hex[:10]}")


def ceiling(dsn: str, seconds: float = 2.0, schema_prefix: str = "bench_ceiling") -> dict[str, Any]:
    """The machine's ceiling: one-row INSERT transactions per second, one session, ``seconds``.

    Every workflow costs at least a few commits, each waiting for its WAL flush on an
    fsync-on server; this is how many such commits the server and disk do alone.
    """
    schema = new_schema(schema_prefix)
    with edge.session(dsn, "measure the commit ceiling") as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        try:
            table = sql.Identifier(schema, "ceiling")
            conn.execute(sql.SQL("CREATE TABLE {} (n bigint)").format(table))
            insert = sql.SQL("INSERT INTO {} VALUES (%s)").format(table)
            count = 0
            started = time.perf_counter()
            while (elapsed := time.perf_counter() - started) < seconds:
                conn.execute(insert, (count,))
                count += 1
        finally:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    return {"inserts": count, "seconds": round(elapsed, 3),
            "commits_per_second": round(count / elapsed, 1)}


# Steps of the fixed loop ``cpu_speed`` times: about half a second of CPU on this lab's
# machines.
SPEED_LOOP_STEPS = 20_000_000


def cpu_speed(runs: int = 3) -> dict[str, Any]:
    """How fast this machine runs Python now: the CPU seconds a fixed loop of additions
    took, fastest and slowest of ``runs``.

    On a shared VM the same loop's time moved by half between hours of one day, and
    every CPU-per-workflow figure with it; this is what lets two sittings be read side
    by side. A measurement, never a verdict.
    """
    taken = []
    for _ in range(runs):
        started = time.process_time()
        total = 0
        for step in range(SPEED_LOOP_STEPS):
            total += step
        taken.append(time.process_time() - started)
    return {"loop_steps": SPEED_LOOP_STEPS, "runs": runs,
            "cpu_seconds_min": round(min(taken), 3), "cpu_seconds_max": round(max(taken), 3)}


def rnd(value: float | None, digits: int) -> float | None:
    """``value`` rounded, None kept."""
    return None if value is None else round(value, digits)


def machine_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine from /proc/stat; None off Linux."""
    try:
        fields = Path("/proc/stat").read_text(encoding="ascii").splitlines()[0].split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def children_cpu() -> float:
    """CPU seconds of every reaped child process so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int) -> tuple[float, float, int] | None:
    """(own CPU seconds, reaped children's CPU seconds, parent pid) of a live process.

    From ``/proc/<pid>/stat`` (a kernel table, not a file on disk); None when the
    process is gone or this is not Linux.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = text[text.rfind(")") + 2:].split()
    if len(fields) < 15:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return (utime + stime) / tick, (cutime + cstime) / tick, int(fields[1])


def child_pids(parent: int) -> list[int]:
    """The live children of ``parent``, from /proc (empty off Linux)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            facts = process_cpu(int(entry.name))
            if facts is not None and facts[2] == parent:
                found.append(int(entry.name))
    return found


def server_pid(admin_dsn: str) -> int | None:
    """The postmaster's pid of a server on this machine (the parent of our backend), or None.

    None when the backend is not a process here (a server elsewhere or in a container).
    """
    with edge.session(admin_dsn, "find the server's process") as conn:
        row = conn.execute("SELECT pg_backend_pid() AS pid").fetchone()
        facts = None if row is None else process_cpu(int(row["pid"]))
    return None if facts is None or facts[2] <= 1 else facts[2]


def server_cpu(postmaster: int | None, children: Sequence[int] | None = None) -> float | None:
    """CPU seconds a local PostgreSQL server has used so far, all its processes counted.

    The postmaster, every live child (backends, WAL writer, checkpointer, autovacuum)
    and every child it already reaped (a closed session's backend). ``children``: the
    live children found earlier (``child_pids``), to spare a scan of every process.
    """
    if postmaster is None:
        return None
    own = process_cpu(postmaster)
    if own is None:
        return None
    total = own[0] + own[1]
    for pid in child_pids(postmaster) if children is None else children:
        facts = process_cpu(pid)
        if facts is not None:
            total += facts[0] + facts[1]
    return total


def pid_cpu(pid: int | None) -> float | None:
    """CPU seconds a process and its reaped children used so far; None for no pid or a
    process gone (a peer's own server, such as Temporal's dev server)."""
    facts = None if pid is None else process_cpu(pid)
    return None if facts is None else facts[0] + facts[1]


def own_cpu() -> float:
    """CPU seconds of this process so far, all its threads (the tool service runs here)."""
    times = os.times()
    return times.user + times.system


@dataclass
class CpuMeter:
    """Machine busy share over a drain, and the CPU every process of the run used.

    ``worker_cpu_seconds``: the worker processes in all, start-up included (reaped
    children). From ``released`` on, the drain itself: ``drain_worker_cpu_seconds``
    (workers, less what they used before release), ``bench_cpu_seconds`` (this process:
    the tool service's threads, the output readers, a drain poll), ``server_cpu_seconds``
    (every PostgreSQL process; None for a server that is not a local process) and
    ``all_cpu_seconds``, their sum, with ``peer_server_cpu_seconds`` (a peer's own server,
    such as Temporal's dev server, when ``peer_server`` names its pid).
    """

    postmaster: int | None = None
    peer_server: int | None = None
    children: float = field(default_factory=children_cpu)
    ticks: tuple[int, int] | None = None
    before_release: float = 0.0
    own: float = 0.0
    server: float | None = None
    peer: float | None = None

    def released(self, pids: Sequence[int] = ()) -> None:
        """Mark the start of the drain: the worker processes ``pids`` were just released."""
        self.ticks = machine_ticks()
        self.before_release = sum(
            facts[0] for facts in (process_cpu(pid) for pid in pids) if facts is not None
        )
        self.own = own_cpu()
        self.server = server_cpu(self.postmaster)
        self.peer = pid_cpu(self.peer_server)

    def read(self) -> dict[str, float | None]:
        """Busy share since ``released``; CPU seconds per share (call once workers exited)."""
        now = machine_ticks()
        busy = None
        if self.ticks is not None and now is not None and now[1] > self.ticks[1]:
            busy = round((now[0] - self.ticks[0]) / (now[1] - self.ticks[1]), 3)
        workers = children_cpu() - self.children
        drain = workers - self.before_release
        bench = own_cpu() - self.own
        server = difference(server_cpu(self.postmaster), self.server)
        peer = difference(pid_cpu(self.peer_server), self.peer)
        everything = None if server is None else drain + bench + server + (peer or 0.0)
        return {"machine_busy_share": busy,
                "worker_cpu_seconds": round(workers, 3),
                "drain_worker_cpu_seconds": round(drain, 3),
                "bench_cpu_seconds": round(bench, 3),
                "server_cpu_seconds": rnd(server, 3),
                "peer_server_cpu_seconds": rnd(peer, 3),
                "all_cpu_seconds": rnd(everything, 3)}


@contextlib.contextmanager
def noise(count: int) -> Iterator[list[int]]:
    """``count`` busy neighbours for the whole measurement: processes spinning on a core.

    Both systems' rounds run beside the same load. They are not children the meters reap
    before they end, so their CPU is never counted as a system's (a round's window counts
    it among the other processes' cores). Yields their pids.
    """
    with load.busy(max(int(count), 0)) as pids:  # the same spinners as --beside-load
        yield pids


def fmt(value: Any) -> str:
    """A figure for a table cell: ``-`` for none, 3 decimals below 10, else 1."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def write(output_dir: str, name: str, report: Mapping[str, Any]) -> Path:
    """Write ``report`` as ``<output_dir>/<name>.json``; return the path."""
    path = Path(output_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n",
                    encoding="utf-8")
    return path

