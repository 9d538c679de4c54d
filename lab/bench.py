"""``lab bench``: benchmarks that print figures and write them to ``evidence/bench/``.

Nothing here is a timed test: each subcommand measures, prints a table and
writes JSON, and a reader compares the figures with the goals.

- ``throughput``: N approved workflows drained by M ``lab worker`` OS processes
  through the real HTTP tool; workflows/s from the database's own clock,
  committed transactions per workflow from ``pg_stat_database``, HTTP calls per
  workflow and latency percentiles. ``--peer dbos`` runs the equivalent DBOS
  workflow (a queue, one step calling the same tool) on the same server,
  alternating with the lab when repeated so machine drift cancels.
- ``claim``: claim latency with 1k, 100k and 1M finished workflows in the table
  (bulk-inserted with one ``INSERT ... SELECT generate_series``), and the plan.
- ``suite``: the experiment suite's wall time serially and with ``-n 2``/``-n 4``,
  and how much of it is inherent waiting (real lease expiry, backoff).
- ``startup``: embedded PostgreSQL provisioning, and a worker's spawn-to-ready
  time against a bare interpreter.

Transactions are counted per database: the benchmark puts the workflow store,
the tool's ledger and DBOS's system tables in scratch databases of their own on
the same server, so each count is measured rather than estimated. Where the
server refuses ``CREATE DATABASE`` everything shares one database and the
tool's share is estimated as one transaction per call.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import importlib
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import conninfo, sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from rich.console import Console
from rich.table import Table

from lab import boundaries, cluster, errors, harness, plan, processes, protocol, store, tool

DEFAULT_HISTORY = (1_000, 100_000, 1_000_000)
CLAIM_SAMPLES = 300
CLAIM_WARMUP = 20
# Workers leave the loop after this much idleness; short, since idle polls are pure overhead.
IDLE_EXIT_SECONDS = 0.25
STARTUP_REPEAT = 7
PROVISION_REPEAT = 3
SUITE_TIMEOUT_SECONDS = 900.0
SUITE_VARIANTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("serial", ()),
    ("-n 2", ("-n", "2")),
    ("-n 4", ("-n", "4")),
)
GOALS = {
    "throughput_ratio_vs_dbos": 1.5,
    "xacts_per_workflow": 6.0,
    "claim_ratio_1m_over_1k": 1.3,
    "suite_n4_over_serial": 0.5,
}

# DBOS, when it is installed (the optional extra ``peers``).
DBOS_APP = "labbench"
DBOS_VERSION_TAG = "bench"
DBOS_QUEUE = "lab_bench"
DBOS_WORKFLOW = "lab_bench_credit"
DBOS_STEP = "lab_bench_credit_step"
# One workflow in flight per process, as a ``lab worker`` runs one item at a time. DBOS
# dequeues on a timer, not when a slot frees, so a short interval is its best setting here.
DBOS_WORKER_CONCURRENCY = 1
DBOS_POLL_SECONDS = 0.005
DBOS_URL_ENV = "LAB_BENCH_DBOS_URL"
DBOS_SCHEMA_ENV = "LAB_BENCH_DBOS_SCHEMA"
TOOL_ENV = "LAB_BENCH_TOOL"
_DBOS_CHILD = "import sys; from lab import bench; sys.exit(bench.dbos_worker_main(sys.argv[1:]))"

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
    delta: Mapping[str, int], *, system_db: str, tool_db: str, tool_calls: int
) -> dict[str, Any]:
    """Split a run's transactions into the orchestrator's and the tool ledger's.

    With separate databases both are measured. When they share one, the tool's
    share is estimated: its ledger write is one autocommit INSERT per call.
    """
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


def alternating_order(rounds: int, systems: Sequence[str]) -> list[list[str]]:
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
def _postgres(mode: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The server to measure, as ``lab.cluster`` provides it for ``mode``."""
    with cluster.start(mode=mode) as running:
        yield running.provisioned.dsn, dict(running.provisioned.describe())


def _server_facts(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        facts: dict[str, Any] = {}
        for name in ("server_version", "fsync", "synchronous_commit", "shared_buffers"):
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            facts[name] = row[0] if row else None
        return facts


def _environment(dsn: str | None, provision: Mapping[str, Any] | None) -> dict[str, Any]:
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
        facts["postgres"] = {**_server_facts(dsn), "provisioned": dict(provision or {})}
    return facts


@dataclass
class Scratch:
    """Scratch databases on the measured server: the workflow store, the tool ledger, DBOS."""

    admin_dsn: str
    store_db: str
    tool_db: str
    dbos_db: str
    separate: bool
    created: list[str] = field(default_factory=list)

    def dsn(self, dbname: str) -> str:
        """A DSN for ``dbname`` on the same server, with the admin DSN's credentials."""
        return boundaries.check_dsn(conninfo.make_conninfo(self.admin_dsn, dbname=dbname))

    def databases(self) -> list[str]:
        """The distinct databases whose transactions are counted."""
        return sorted({self.store_db, self.tool_db, self.dbos_db})

    def dbos_url(self) -> str:
        """The DBOS system database as a SQLAlchemy URL."""
        params = conninfo.conninfo_to_dict(self.dsn(self.dbos_db))
        user = quote(str(params.get("user") or os.environ.get("USER", "postgres")), safe="")
        password = params.get("password")
        auth = f"{user}:{quote(str(password), safe='')}" if password else user
        host = str(params.get("hostaddr") or params.get("host") or "127.0.0.1")
        port = str(params.get("port") or "5432")
        if host.startswith("/"):
            return f"postgresql://{auth}@/{self.dbos_db}?host={quote(host)}&port={port}"
        return f"postgresql://{auth}@{host}:{port}/{self.dbos_db}"

    @classmethod
    def create(cls, admin_dsn: str) -> Scratch:
        """Create the three scratch databases, or fall back to one shared database."""
        tag = uuid.uuid4().hex[:8]
        names = [f"lab_bench_{tag}_{role}" for role in ("store", "tool", "dbos")]
        created: list[str] = []
        try:
            with psycopg.connect(admin_dsn, autocommit=True) as conn:
                for name in names:
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                    created.append(name)
        except psycopg.errors.InsufficientPrivilege:
            own = str(conninfo.conninfo_to_dict(admin_dsn).get("dbname") or "postgres")
            _drop_databases(admin_dsn, created)
            return cls(admin_dsn, own, own, own, separate=False)
        return cls(admin_dsn, names[0], names[1], names[2], separate=True, created=created)

    def drop(self) -> None:
        """Drop the scratch databases this benchmark created."""
        _drop_databases(self.admin_dsn, self.created)
        self.created = []


def _drop_databases(admin_dsn: str, names: Sequence[str]) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def xact_snapshot(
    admin_dsn: str, databases: Sequence[str], timeout: float = 30.0
) -> dict[str, int]:
    """``xact_commit`` of each database once no other session is connected to it.

    A backend flushes its statistics when it exits, but an idle one may hold
    them for up to ten seconds; so every measured session must be closed first.
    """
    deadline = time.monotonic() + timeout
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = ANY(%s) AND pid <> pg_backend_pid()",
                (list(databases),),
            ).fetchone()
            if row is not None and row[0] == 0:
                break
            if time.monotonic() > deadline:
                raise errors.LabError(f"sessions still connected to {list(databases)}")
            time.sleep(0.05)
        rows = conn.execute(
            "SELECT datname, xact_commit FROM pg_stat_database WHERE datname = ANY(%s)",
            (list(databases),),
        ).fetchall()
    return {str(name): int(count) for name, count in rows}


def wal_syncs(admin_dsn: str) -> int | None:
    """WAL flushes to disk so far, cluster-wide (``pg_stat_wal``, PostgreSQL 14+)."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        try:
            row = conn.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()
        except psycopg.errors.UndefinedTable:
            return None
    return None if row is None else int(row[0])


def _difference(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def _new_schema(prefix: str) -> str:
    return store.check_schema_name(f"{prefix}_{uuid.uuid4().hex[:10]}")


# -- throughput ------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One drain of N workflows by M worker processes."""

    system: str
    workflows: int
    workers: int
    seconds: float | None
    succeeded: int
    http_calls: int
    xacts: dict[str, Any]
    latency_ready: dict[str, float | None]
    latency_claim: dict[str, float | None]
    cpu: dict[str, float | None] = field(default_factory=dict)

    @property
    def per_second(self) -> float | None:
        """Workflows per second from first claim to last completion."""
        return ratio(float(self.succeeded), self.seconds) if self.succeeded else None

    def to_json(self) -> dict[str, Any]:
        """The run as a JSON object, with per-workflow figures."""
        n = self.workflows or 1
        return {
            "system": self.system,
            "workflows": self.workflows,
            "workers": self.workers,
            "succeeded": self.succeeded,
            "seconds": None if self.seconds is None else round(self.seconds, 4),
            "workflows_per_second": _round(self.per_second, 2),
            "http_calls": self.http_calls,
            "http_calls_per_workflow": round(self.http_calls / n, 3),
            "xacts": self.xacts,
            "xacts_per_workflow_raw": {
                key: round(self.xacts[key] / n, 3) for key in ("total", "system", "tool")
            },
            "latency_ready_to_done": self.latency_ready,
            "latency_claim_to_done": self.latency_claim,
            "cpu": self.cpu,
        }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _machine_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine from /proc/stat; None off Linux."""
    try:
        fields = Path("/proc/stat").read_text(encoding="ascii").splitlines()[0].split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class CpuMeter:
    """Machine busy share over a drain, and the CPU its worker processes used in all."""

    children: float = field(default_factory=_children_cpu)
    ticks: tuple[int, int] | None = None

    def released(self) -> None:
        """Mark the start of the drain (the workers were just released)."""
        self.ticks = _machine_ticks()

    def read(self) -> dict[str, float | None]:
        """Busy share of all cores since ``released``; reaped children's CPU seconds."""
        now = _machine_ticks()
        busy = None
        if self.ticks is not None and now is not None and now[1] > self.ticks[1]:
            busy = round((now[0] - self.ticks[0]) / (now[1] - self.ticks[1]), 3)
        return {"machine_busy_share": busy,
                "worker_cpu_seconds": round(_children_cpu() - self.children, 3)}


def _release_together(children: list[processes.WorkerProcess], meter: CpuMeter) -> None:
    """Start lab's and DBOS's workers the same way: all ready, the meter started, all go."""
    for child in children:
        child.wait_for(protocol.READY, timeout=60)
    meter.released()
    for child in children:
        child.release()


def _approved_backlog(dsn: str, schema: str, count: int) -> None:
    """Create and approve ``count`` sample workflows through the store's API."""
    sample = harness.sample_plan()
    with store.Store.open(dsn, schema, max_connections=4, application_name="lab-bench") as db:

        def one(index: int) -> None:
            created = db.create(harness.PROPOSER, f"bench-{index}", sample)
            db.approve(harness.APPROVER, created.id, created.fingerprint, timedelta(hours=1))

        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            for _ in pool.map(one, range(count)):
                pass


def _costs(
    scratch: Scratch,
    meter: CpuMeter,
    before: Mapping[str, int],
    wal_before: int | None,
    system_db: str,
    calls: int,
    own: Mapping[str, int] | None = None,
) -> tuple[dict[str, float | None], dict[str, Any]]:
    """CPU, WAL syncs and transactions one round cost, split between system and tool.

    ``own`` names the benchmark's own polling transactions to leave out.
    """
    cpu = meter.read()
    after = xact_snapshot(scratch.admin_dsn, scratch.databases())
    cpu["wal_syncs"] = _difference(wal_syncs(scratch.admin_dsn), wal_before)
    delta = xact_delta(before, after, own)
    xacts = split_transactions(
        delta, system_db=system_db, tool_db=scratch.tool_db, tool_calls=calls
    )
    return cpu, xacts


def lab_round(scratch: Scratch, workflows: int, workers: int) -> RunResult:
    """Drain ``workflows`` approved workflows with ``workers`` ``lab worker`` processes."""
    schema = _new_schema("bench_lab")
    store_dsn, tool_dsn = scratch.dsn(scratch.store_db), scratch.dsn(scratch.tool_db)
    store.create_schema(store_dsn, schema)
    if tool_dsn != store_dsn:
        store.create_schema(tool_dsn, schema)
    _approved_backlog(store_dsn, schema, workflows)
    before = xact_snapshot(scratch.admin_dsn, scratch.databases())
    wal_before = wal_syncs(scratch.admin_dsn)
    service = tool.ToolService(tool_dsn, schema, idempotent=True).start()
    children: list[processes.WorkerProcess] = []
    meter = CpuMeter()
    try:
        for index in range(workers):
            children.append(
                processes.spawn_worker(
                    store_dsn, schema, service.endpoint, service.token, f"bench-{index}",
                    "--loop", "--idle-exit", str(IDLE_EXIT_SECONDS), "--start-gate",
                )
            )
        _release_together(children, meter)
        for child in children:
            child.finish(timeout=60 + workflows * 0.5)
        calls = service.calls + service.lookups
    finally:
        for child in children:
            child.cleanup()
        service.stop()
    cpu, xacts = _costs(scratch, meter, before, wal_before, scratch.store_db, calls)
    with store.Store.open(store_dsn, schema, max_connections=1) as db:
        rows = db.execute(
            """
            WITH claimed AS (
                SELECT workflow_id, max(created_at) AS at FROM events
                 WHERE kind = 'claimed' GROUP BY workflow_id
            ), start AS (SELECT min(at) AS t0 FROM claimed)
            SELECT extract(epoch FROM w.updated_at - greatest(w.ready_at, start.t0)) AS ready,
                   extract(epoch FROM w.updated_at - c.at) AS claim,
                   extract(epoch FROM w.updated_at - start.t0) AS since_start
              FROM workflows w JOIN claimed c ON c.workflow_id = w.id CROSS JOIN start
             WHERE w.state = 'succeeded'
            """
        )
    store.drop_schema(store_dsn, schema)
    if tool_dsn != store_dsn:
        store.drop_schema(tool_dsn, schema)
    return _result("lab", workflows, workers, rows, calls, xacts, cpu)


def _result(
    system: str,
    workflows: int,
    workers: int,
    rows: Sequence[Mapping[str, Any]],
    calls: int,
    xacts: dict[str, Any],
    cpu: dict[str, float | None],
) -> RunResult:
    ready = [float(row["ready"]) for row in rows]
    claim = [float(row["claim"]) for row in rows]
    span = max((float(row["since_start"]) for row in rows), default=None)
    return RunResult(
        system=system,
        workflows=workflows,
        workers=workers,
        seconds=span,
        succeeded=len(rows),
        http_calls=calls,
        xacts=xacts,
        latency_ready=latency_summary(ready),
        latency_claim=latency_summary(claim),
        cpu=cpu,
    )


def _dbos() -> Any:
    try:
        return importlib.import_module("dbos")
    except ImportError as exc:
        raise errors.LabError(
            "DBOS is not installed: pip install '.[peers]' to compare with it"
        ) from exc


def _dbos_env(scratch: Scratch, schema: str, endpoint: str, token: str) -> dict[str, str]:
    return {
        **os.environ,
        DBOS_URL_ENV: scratch.dbos_url(),
        DBOS_SCHEMA_ENV: schema,
        TOOL_ENV: endpoint,
        protocol.TOKEN_ENV: token,
        "PYTHONUNBUFFERED": "1",
    }


def _dbos_child(role: str, name: str, env: dict[str, str]) -> processes.WorkerProcess:
    argv = [sys.executable, "-c", _DBOS_CHILD, role, name]
    return processes.WorkerProcess(argv, env, name)


def dbos_prepare(scratch: Scratch, schema: str) -> None:
    """Create and migrate DBOS's system tables and register the queue, in a child process."""
    child = _dbos_child("prepare", "dbos-prepare", _dbos_env(scratch, schema, "", ""))
    try:
        child.finish(timeout=120)
    finally:
        child.cleanup()


def dbos_round(scratch: Scratch, dbos_schema: str, workflows: int, workers: int) -> RunResult:
    """Drain ``workflows`` DBOS workflows (one step calling the tool) with ``workers`` processes."""
    dbos = _dbos()
    schema = _new_schema("bench_dbos")
    tool_dsn = scratch.dsn(scratch.tool_db)
    store.create_schema(tool_dsn, schema)
    tag = uuid.uuid4().hex[:8]
    sample = harness.sample_plan()
    client = dbos.DBOSClient(
        system_database_url=scratch.dbos_url(),
        dbos_system_schema=dbos_schema,
        application_name=DBOS_APP,
    )
    try:
        for index in range(workflows):
            operation = f"bench-{tag}-{index}"
            body = {
                "effect_key": plan.effect_key(harness.PROPOSER.tenant, operation),
                "fingerprint": sample.fingerprint(),
                "plan": sample.to_json(),
            }
            client.enqueue(
                {
                    "workflow_name": DBOS_WORKFLOW,
                    "queue_name": DBOS_QUEUE,
                    "workflow_id": f"{tag}-{index}",
                    "app_version": DBOS_VERSION_TAG,
                },
                body,
            )
    finally:
        client.destroy()
    status = sql.Identifier(dbos_schema, "workflow_status")
    before = xact_snapshot(scratch.admin_dsn, scratch.databases())
    wal_before = wal_syncs(scratch.admin_dsn)
    service = tool.ToolService(tool_dsn, schema, idempotent=True).start()
    env = _dbos_env(scratch, dbos_schema, service.endpoint, service.token)
    children: list[processes.WorkerProcess] = []
    meter = CpuMeter()
    polls = 0
    try:
        for index in range(workers):
            children.append(_dbos_child("worker", f"dbos-{tag}-{index}", env))
        _release_together(children, meter)
        for child in children:
            child.wait_for(protocol.LAUNCHED, timeout=60)
        deadline = time.monotonic() + 60 + workflows * 0.5
        with psycopg.connect(scratch.dsn(scratch.dbos_db), autocommit=True) as conn:
            while True:
                polls += 1
                row = conn.execute(
                    sql.SQL(
                        "SELECT count(*) FROM {} WHERE workflow_uuid LIKE %s "
                        "AND status IN ('ENQUEUED', 'PENDING')"
                    ).format(status),
                    (f"{tag}-%",),
                ).fetchone()
                if row is not None and row[0] == 0:
                    break
                if time.monotonic() > deadline:
                    raise errors.LabError("DBOS workers did not drain the queue in time")
                time.sleep(0.05)
        for child in children:
            child.release()
        for child in children:
            child.finish(timeout=60)
        calls = service.calls + service.lookups
    finally:
        for child in children:
            child.cleanup()
        service.stop()
    cpu, xacts = _costs(
        scratch, meter, before, wal_before, scratch.dbos_db, calls, own={scratch.dbos_db: polls}
    )
    with psycopg.connect(scratch.dsn(scratch.dbos_db), autocommit=True) as conn:
        cur = conn.cursor(row_factory=dict_row)
        rows = cur.execute(
            sql.SQL(
                """
                WITH runs AS (
                    SELECT created_at, started_at_epoch_ms AS started,
                           coalesce(completed_at, updated_at) AS done
                      FROM {} WHERE workflow_uuid LIKE %s AND status = 'SUCCESS'
                ), start AS (SELECT min(started) AS t0 FROM runs)
                SELECT (done - greatest(created_at, t0)) / 1000.0 AS ready,
                       (done - started) / 1000.0 AS claim,
                       (done - t0) / 1000.0 AS since_start
                  FROM runs CROSS JOIN start
                """
            ).format(status),
            (f"{tag}-%",),
        ).fetchall()
    store.drop_schema(tool_dsn, schema)
    return _result("dbos", workflows, workers, rows, calls, xacts, cpu)


@dataclass(frozen=True)
class _Work:
    effect_key: str
    fingerprint: str
    plan: dict[str, Any]


def dbos_worker_main(argv: Sequence[str]) -> int:
    """Body of a DBOS child process: ``prepare`` the system tables, or be a ``worker``.

    A worker speaks the lab's line protocol: ``BOOK_READY`` before launching DBOS
    (a newline releases it), ``BOOK_LAUNCHED`` once its queue runner is up, and
    ``BOOK_DONE`` after a second newline has shut DBOS down.
    """
    role, name = argv[0], argv[1]
    dbos = _dbos()
    endpoint = os.environ.get(TOOL_ENV, "")
    token = os.environ.get(protocol.TOKEN_ENV, "")
    clients: list[tool.ToolClient] = []

    def credit_step(body: dict[str, Any]) -> dict[str, str]:
        if not clients:
            clients.append(tool.ToolClient(endpoint, token))
        work = _Work(body["effect_key"], body["fingerprint"], body["plan"])
        return clients[0].call(work).to_json()

    step = dbos.DBOS.step(name=DBOS_STEP)(credit_step)

    def credit(body: dict[str, Any]) -> dict[str, str]:
        result: dict[str, str] = step(body)
        return result

    dbos.DBOS.workflow(name=DBOS_WORKFLOW)(credit)
    dbos.DBOS(
        config={
            "name": DBOS_APP,
            "system_database_url": os.environ[DBOS_URL_ENV],
            "dbos_system_schema": os.environ[DBOS_SCHEMA_ENV],
            "executor_id": name,
            "application_version": DBOS_VERSION_TAG,
            "run_admin_server": False,
            "log_level": "WARNING",
        }
    )
    if role == "prepare":
        dbos.DBOS.launch()
        dbos.DBOS.register_queue(
            DBOS_QUEUE,
            worker_concurrency=DBOS_WORKER_CONCURRENCY,
            polling_interval_sec=DBOS_POLL_SECONDS,
        )
        dbos.DBOS.destroy()
        return 0
    print(protocol.READY, flush=True)
    sys.stdin.readline()
    dbos.DBOS.launch()
    print(protocol.LAUNCHED, flush=True)
    sys.stdin.readline()
    dbos.DBOS.destroy(workflow_completion_timeout_sec=10)
    for client in clients:
        client.close()
    print(protocol.DONE, flush=True)
    return 0


def throughput(
    admin_dsn: str, workflows: int, workers: int, peer: str | None, repeat: int
) -> dict[str, Any]:
    """Drain backlogs with the lab (and the peer), alternating; return every figure."""
    if workflows < 1 or workers < 1 or repeat < 1:
        raise errors.Rejected("workflows, workers and repeat must be positive")
    systems = ["lab", peer] if peer else ["lab"]
    scratch = Scratch.create(admin_dsn)
    dbos_schema = "dbos"
    try:
        if peer == "dbos":
            _dbos()
            dbos_schema = "dbos" if scratch.separate else _new_schema("lab_bench_dbos")
            dbos_prepare(scratch, dbos_schema)

        def run(system: str, count: int) -> RunResult:
            if system == "lab":
                return lab_round(scratch, count, workers)
            return dbos_round(scratch, dbos_schema, count, workers)

        # An empty run of each system measures its fixed cost: start, idle polls, exit.
        empty = {system: run(system, 0) for system in systems}
        rounds: list[list[RunResult]] = []
        for order in alternating_order(repeat, systems):
            rounds.append([run(system, workflows) for system in order])
    finally:
        if scratch.separate:
            scratch.drop()
        elif dbos_schema != "dbos":  # only the scratch schema made for this run
            store.drop_schema(admin_dsn, dbos_schema)
    by_system: dict[str, list[RunResult]] = {s: [] for s in systems}
    for round_results in rounds:
        for result in round_results:
            by_system[result.system].append(result)
    summary: dict[str, Any] = {}
    for system, results in by_system.items():
        rates = [r.per_second for r in results if r.per_second is not None]
        marginal = [marginal_per_workflow(r.xacts, empty[system].xacts, workflows) for r in results]
        summary[system] = {
            "workflows_per_second_median": _round(statistics.median(rates), 2) if rates else None,
            "xacts_per_workflow_marginal_median": {
                key: round(statistics.median(m[key] for m in marginal), 3)
                for key in ("total", "system", "tool")
            },
            "http_calls_per_workflow_median": round(
                statistics.median(r.http_calls / workflows for r in results), 3
            ),
            "worker_cpu_ms_per_workflow_marginal_median": _median_marginal(
                results, empty[system], "worker_cpu_seconds", workflows, scale=1000.0
            ),
            "wal_syncs_per_workflow_marginal_median": _median_marginal(
                results, empty[system], "wal_syncs", workflows
            ),
            "machine_busy_share_median": _median_present(
                r.cpu.get("machine_busy_share") for r in results
            ),
            "all_succeeded": all(r.succeeded == workflows for r in results),
        }
    pair_ratios: list[float] = []
    if peer:
        for round_results in rounds:
            pair = {r.system: r.per_second for r in round_results}
            value = ratio(pair.get("lab"), pair.get(peer))
            if value is not None:
                pair_ratios.append(value)
    return {
        "workflows": workflows,
        "workers": workers,
        "repeat": repeat,
        "peer": peer,
        "databases": "separate" if scratch.separate else "shared (tool share estimated)",
        "idle_exit_seconds": IDLE_EXIT_SECONDS,
        "dbos_settings": {
            "worker_concurrency": DBOS_WORKER_CONCURRENCY,
            "polling_interval_sec": DBOS_POLL_SECONDS,
        } if peer == "dbos" else None,
        "empty_runs": {system: result.to_json() for system, result in empty.items()},
        "rounds": [[result.to_json() for result in r] for r in rounds],
        "summary": summary,
        "ratio_vs_peer_per_round": [round(v, 3) for v in pair_ratios],
        "ratio_vs_peer_median": round(statistics.median(pair_ratios), 3) if pair_ratios else None,
        "goals": {
            "throughput_ratio_vs_dbos": GOALS["throughput_ratio_vs_dbos"],
            "xacts_per_workflow": GOALS["xacts_per_workflow"],
        },
    }


def _median_marginal(
    results: Sequence[RunResult], empty: RunResult, key: str, workflows: int, scale: float = 1.0
) -> float | None:
    base = empty.cpu.get(key)
    values = [
        (value - base) * scale / workflows
        for value in (r.cpu.get(key) for r in results)
        if value is not None and base is not None
    ]
    return round(statistics.median(values), 3) if values else None


def _median_present(values: Iterator[float | None] | Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def _throughput_table(report: Mapping[str, Any]) -> Table:
    table = Table(title=f"throughput: {report['workflows']} workflows, {report['workers']} workers"
                  " (xacts: raw per workflow, system = workflow store or DBOS tables)")
    for column in ("round", "system", "wf/s", "xacts/wf", "system", "tool", "HTTP/wf",
                   "ready→done p50 / p99 ms", "claim→done p50 / p99 ms", "busy"):
        table.add_column(column, justify="right")
    for number, round_results in enumerate(report["rounds"], start=1):
        for run in round_results:
            raw = run["xacts_per_workflow_raw"]
            ready, claim = run["latency_ready_to_done"], run["latency_claim_to_done"]
            table.add_row(
                str(number), run["system"], _fmt(run["workflows_per_second"]),
                _fmt(raw["total"]), _fmt(raw["system"]), _fmt(raw["tool"]),
                _fmt(run["http_calls_per_workflow"]),
                f"{_fmt(ready['p50_ms'])} / {_fmt(ready['p99_ms'])}",
                f"{_fmt(claim['p50_ms'])} / {_fmt(claim['p99_ms'])}",
                _fmt(run["cpu"].get("machine_busy_share")),
            )
    return table


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


# -- claim latency --------------------------------------------------------------------------------

# Rows are cloned from one workflow made through the API, so columns the schema gains later
# are copied as the store filled them; only identity, state and times are overridden.
_CLONE_OVERRIDES: dict[str, sql.Composable] = {
    "id": sql.SQL("%(prefix)s::text || g"),
    "operation": sql.SQL("%(prefix)s::text || g"),
    "state": sql.SQL("%(state)s::text"),
    "result": sql.SQL("%(result)s::jsonb"),
    "fence": sql.SQL("%(fence)s::bigint"),
    "attempt": sql.SQL("%(fence)s::integer"),
    "ready_at": sql.SQL("now() - %(age)s::interval + g * interval '1 ms'"),
    "created_at": sql.SQL("now() - %(age)s::interval + g * interval '1 ms'"),
    "updated_at": sql.SQL("now() - %(age)s::interval + g * interval '1 ms' + interval '50 ms'"),
}


def clone_query(columns: Sequence[str]) -> sql.Composed:
    """One ``INSERT ... SELECT ... generate_series`` cloning the template row ``count`` times."""
    return sql.SQL(
        "INSERT INTO workflows ({columns}) SELECT {values} FROM workflows AS t "
        "CROSS JOIN generate_series(1, %(count)s) AS g WHERE t.id = %(template)s"
    ).format(
        columns=sql.SQL(", ").join(sql.Identifier(name) for name in columns),
        values=sql.SQL(", ").join(
            _CLONE_OVERRIDES.get(name, sql.SQL("t.{}").format(sql.Identifier(name)))
            for name in columns
        ),
    )


def _fill(dsn: str, schema: str, history: int, ready: int) -> float:
    """Bulk-insert ``history`` succeeded and ``ready`` due workflows; return the seconds taken."""
    with store.Store.open(dsn, schema, max_connections=1, application_name="lab-bench") as db:
        created = db.create(harness.PROPOSER, "template", harness.sample_plan())
        db.approve(harness.APPROVER, created.id, created.fingerprint, timedelta(hours=1))
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True, options=f"-c search_path={schema}") as conn:
        columns = [str(row[0]) for row in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'workflows'::regclass "
            "AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum"
        ).fetchall()]
        query = clone_query(columns)
        conn.execute(query, {"prefix": "hist_", "state": "succeeded", "fence": 1,
                             "result": Jsonb({"receipt": "history"}), "age": "1 day",
                             "count": history, "template": created.id})
        conn.execute(query, {"prefix": "ready_", "state": "ready", "fence": 0,
                             "result": None, "age": "1 minute",
                             "count": ready, "template": created.id})
        # As autovacuum would have by then: visibility map set, statistics current.
        conn.execute("VACUUM (ANALYZE) workflows")
    return time.perf_counter() - started


def _explain(dsn: str, schema: str) -> str:
    with psycopg.connect(dsn, options=f"-c search_path={schema}") as conn:
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + store.CLAIM_QUERY).fetchall()
        conn.rollback()
    return "\n".join(str(row[0]) for row in rows)


def claim_latency(dsn: str, sizes: Sequence[int], samples: int = CLAIM_SAMPLES) -> dict[str, Any]:
    """Claim latency with each history size, interleaving sizes so drift cancels."""
    if not sizes or any(size < 0 for size in sizes):
        raise errors.Rejected("history sizes must be non-negative")
    schemas = {size: _new_schema("bench_claim") for size in sizes}
    stores: dict[int, store.Store] = {}
    report: dict[str, Any] = {"samples": samples, "warmup": CLAIM_WARMUP, "sizes": {}}
    try:
        for size, schema in schemas.items():
            store.create_schema(dsn, schema)
            fill_seconds = _fill(dsn, schema, size, samples + CLAIM_WARMUP)
            report["sizes"][size] = {"fill_seconds": round(fill_seconds, 2),
                                     "plan": _explain(dsn, schema)}
            stores[size] = store.Store.open(dsn, schema, max_connections=1)
        timings: dict[int, list[float]] = {size: [] for size in sizes}
        for index in range(samples + CLAIM_WARMUP):
            for size in sizes:
                started = time.perf_counter()
                claimed = stores[size].claim("bench-claimer", timedelta(minutes=5))
                elapsed = time.perf_counter() - started
                if claimed is None:
                    raise errors.LabError(f"no ready work left in the {size} history")
                if index >= CLAIM_WARMUP:
                    timings[size].append(elapsed)
        for size in sizes:
            report["sizes"][size].update(latency_summary(timings[size]))
            report["sizes"][size]["execution_ms"] = _execution_ms(report["sizes"][size]["plan"])
    finally:
        for db in stores.values():
            db.close()
        for schema in schemas.values():
            store.drop_schema(dsn, schema)
    smallest, largest = min(sizes), max(sizes)
    low, high = report["sizes"][smallest], report["sizes"][largest]
    report["ratio_p50_largest_over_smallest"] = _round(ratio(high["p50_ms"], low["p50_ms"]), 3)
    report["ratio_p99_largest_over_smallest"] = _round(ratio(high["p99_ms"], low["p99_ms"]), 3)
    report["smallest"], report["largest"] = smallest, largest
    report["goal_ratio"] = GOALS["claim_ratio_1m_over_1k"]
    return report


def _execution_ms(plan_text: str) -> float | None:
    match = re.search(r"Execution Time: ([\d.]+) ms", plan_text)
    return float(match.group(1)) if match else None


def _claim_table(report: Mapping[str, Any]) -> Table:
    table = Table(title=f"claim latency ({report['samples']} claims per history size)")
    for column in ("finished history", "p50 ms", "p99 ms", "max ms", "plan exec ms", "fill s"):
        table.add_column(column, justify="right")
    for size, figures in report["sizes"].items():
        table.add_row(f"{size:,}", _fmt(figures["p50_ms"]), _fmt(figures["p99_ms"]),
                      _fmt(figures["max_ms"]), _fmt(figures["execution_ms"]),
                      _fmt(figures["fill_seconds"]))
    return table


# -- the experiment suite ------------------------------------------------------------------------


def suite_command(extra: Sequence[str]) -> list[str]:
    """The pytest command the suite benchmark times, with ``extra`` (``-n 4``) appended."""
    return [sys.executable, "-m", "pytest", "experiments", "-q", "-p", "no:cacheprovider",
            "-p", "no:hypothesispytest", "--lab-no-evidence", "--durations=0",
            "--durations-min=0", *extra]


def suite_waits(experiments: Path) -> dict[str, float]:
    """Known inherent waits of every experiment, by test function name."""
    waits: dict[str, float] = {}
    lease = harness.SEED_LEASE.total_seconds()
    for path in sorted(experiments.rglob("test_*.py")):
        waits.update(known_waits(path.read_text(encoding="utf-8"), lease))
    return waits


def suite_breakdown(
    wall: float,
    durations: Sequence[tuple[str, str, float]],
    waits: Mapping[str, float],
    serial: bool = True,
) -> dict[str, Any]:
    """Split one run's wall time: inherent waits, test work, and harness overhead around tests.

    Time outside tests (start-up, provisioning, collection) is only defined for a
    serial run; under xdist the tests' times overlap.
    """
    phases = {"setup": 0.0, "call": 0.0, "teardown": 0.0}
    tests: dict[str, float] = {}
    for nodeid, phase, seconds in durations:
        phases[phase] += seconds
        tests[nodeid] = tests.get(nodeid, 0.0) + seconds
    # Per test id, so each parametrized instance waits its own time; a known wait is an upper
    # bound (a chaos fault phase ends early once all work settles), so cap it at the test's time.
    inherent = sum(
        min(waits.get(nodeid.split("::")[-1].split("[")[0], 0.0), seconds)
        for nodeid, seconds in tests.items()
    )
    in_tests = sum(phases.values())
    return {
        "wall_seconds": round(wall, 3),
        "tests": len(tests),
        "test_seconds": {k: round(v, 3) for k, v in phases.items()},
        "inherent_wait_seconds": round(inherent, 3),
        "inherent_share_of_wall": _round(ratio(inherent, wall), 3) if serial else None,
        "overhead_seconds": round(wall - inherent, 3) if serial else None,
        "outside_tests_seconds": round(wall - in_tests, 3) if serial else None,
        "longest_test_seconds": round(max(tests.values(), default=0.0), 3),
    }


def suite(experiments: Path = Path("experiments")) -> dict[str, Any]:
    """Time the experiment suite serially and with 2 and 4 xdist workers."""
    waits = suite_waits(experiments)
    runs: dict[str, Any] = {}
    for label, extra in SUITE_VARIANTS:
        command = suite_command(extra)
        cpu_before = _children_cpu()
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False,
                              timeout=SUITE_TIMEOUT_SECONDS)
        wall = time.perf_counter() - started
        # pytest, its xdist workers and worker processes; not the daemonized PostgreSQL.
        cpu = _children_cpu() - cpu_before
        summary = [line for line in done.stdout.splitlines() if " in " in line and "passed" in line]
        runs[label] = {
            "command": " ".join(command[1:]),
            "exit_code": done.returncode,
            "summary": summary[-1].strip("= ") if summary else done.stdout[-300:],
            **suite_breakdown(wall, parse_durations(done.stdout), waits, serial=not extra),
            "cpu_seconds": round(cpu, 2),
            # Two cores cannot finish this CPU work sooner than this, however many workers.
            "cpu_floor_seconds": round(cpu / (os.cpu_count() or 1), 2),
        }
    serial = runs["serial"]
    for label in runs:
        runs[label]["fraction_of_serial"] = _round(
            ratio(runs[label]["wall_seconds"], serial["wall_seconds"]), 3
        )
    # No worker count beats the longest test plus the session's own start-up.
    floor = serial["outside_tests_seconds"] + serial["longest_test_seconds"]
    return {
        "known_waits": waits,
        "runs": runs,
        "parallel_floor_fraction": _round(ratio(floor, serial["wall_seconds"]), 3),
        "goal_n4_fraction": GOALS["suite_n4_over_serial"],
        "database": protocol.DSN_ENV if os.environ.get(protocol.DSN_ENV) else "plugin auto",
    }


def _suite_table(report: Mapping[str, Any]) -> Table:
    table = Table(title="experiment suite wall time")
    for column in ("run", "exit", "wall s", "x serial", "inherent waits s", "inherent share",
                   "outside tests s", "longest test s", "CPU s", "CPU floor s"):
        table.add_column(column, justify="right")
    for label, run in report["runs"].items():
        table.add_row(label, str(run["exit_code"]), _fmt(run["wall_seconds"]),
                      _fmt(run["fraction_of_serial"]), _fmt(run["inherent_wait_seconds"]),
                      _fmt(run["inherent_share_of_wall"]), _fmt(run["outside_tests_seconds"]),
                      _fmt(run["longest_test_seconds"]), _fmt(run["cpu_seconds"]),
                      _fmt(run["cpu_floor_seconds"]))
    return table


# -- startup ---------------------------------------------------------------------------------------


def _time_exit(argv: Sequence[str]) -> float:
    started = time.perf_counter()
    subprocess.run(list(argv), check=True, capture_output=True)
    return time.perf_counter() - started


def _samples(measure: Callable[[], float], count: int) -> dict[str, Any]:
    values = [measure() for _ in range(count)]
    return {"median_ms": round(statistics.median(values) * 1000, 2),
            "min_ms": round(min(values) * 1000, 2),
            "max_ms": round(max(values) * 1000, 2), "count": count}


def startup(dsn: str, repeat: int = STARTUP_REPEAT) -> dict[str, Any]:
    """Provisioning time of the embedded cluster and a worker's spawn-to-ready time."""
    report: dict[str, Any] = {}
    ups: list[float] = []
    downs: list[float] = []
    methods: list[str] = []
    for _ in range(PROVISION_REPEAT):
        started = time.perf_counter()
        running = cluster.start(mode="embedded")
        ups.append(time.perf_counter() - started)
        methods.append(running.provisioned.details.get("method", "?"))
        started = time.perf_counter()
        running.stop()
        downs.append(time.perf_counter() - started)
    report["provisioning"] = {
        "start_median_ms": round(statistics.median(ups) * 1000, 1),
        "start_all_ms": [round(u * 1000, 1) for u in ups],
        "stop_median_ms": round(statistics.median(downs) * 1000, 1),
        "methods": methods,
    }
    report["bare_python"] = _samples(lambda: _time_exit([sys.executable, "-c", "pass"]), repeat)
    report["import_worker_modules"] = _samples(
        lambda: _time_exit([sys.executable, "-c", "import lab.cli, lab.processes"]), repeat
    )
    schema = _new_schema("bench_start")
    store.create_schema(dsn, schema)
    service = tool.ToolService(dsn, schema, idempotent=True).start()

    def spawn_to_ready() -> float:
        started = time.perf_counter()
        child = processes.spawn_worker(dsn, schema, service.endpoint, service.token,
                                       "bench-startup", "--start-gate")
        try:
            child.wait_for(protocol.READY, timeout=60)
            elapsed = time.perf_counter() - started
            child.release()
            child.finish(timeout=60)
        finally:
            child.cleanup()
        return elapsed

    try:
        report["worker_spawn_to_ready"] = _samples(spawn_to_ready, repeat)
    finally:
        service.stop()
        store.drop_schema(dsn, schema)
    report["ratio_worker_over_bare"] = _round(ratio(
        report["worker_spawn_to_ready"]["median_ms"], report["bare_python"]["median_ms"]), 2)
    return report


def _startup_table(report: Mapping[str, Any]) -> Table:
    table = Table(title="startup")
    table.add_column("what")
    table.add_column("median ms", justify="right")
    table.add_column("min / max ms", justify="right")
    provisioning = report["provisioning"]
    table.add_row("embedded PostgreSQL start", _fmt(provisioning["start_median_ms"]),
                  " / ".join(_fmt(v) for v in provisioning["start_all_ms"]))
    table.add_row("embedded PostgreSQL stop", _fmt(provisioning["stop_median_ms"]), "")
    for key, label in (("bare_python", "python -c pass"),
                       ("import_worker_modules", "python -c 'import lab.cli, lab.processes'"),
                       ("worker_spawn_to_ready", f"lab worker --start-gate → {protocol.READY}")):
        figures = report[key]
        table.add_row(label, _fmt(figures["median_ms"]),
                      f"{_fmt(figures['min_ms'])} / {_fmt(figures['max_ms'])}")
    return table


# -- command line ---------------------------------------------------------------------------------


def _write(output_dir: str, name: str, report: Mapping[str, Any]) -> Path:
    path = Path(output_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n",
                    encoding="utf-8")
    return path


def cli_main(args: argparse.Namespace, console: Console | None = None) -> int:
    """Run one ``lab bench`` subcommand; print its table and write its JSON."""
    out = console or Console()
    if console is None and not out.is_terminal:
        out.width = 140  # piped output keeps whole table rows
    command: str = args.bench_command
    try:
        if command == "suite":
            report = {"environment": _environment(None, None), **suite()}
            out.print(_suite_table(report))
            n4 = report["runs"]["-n 4"]["fraction_of_serial"]
            goal = GOALS["suite_n4_over_serial"]
            out.print(f"-n 4 wall time / serial: {_fmt(n4)} (goal <= {goal}); floor set by the "
                      f"longest test and start-up: {_fmt(report['parallel_floor_fraction'])}")
        else:
            mode = getattr(args, "lab_postgres", "auto")
            with _postgres(mode) as (dsn, provision):
                environment = _environment(dsn, provision)
                report = {"environment": environment, **_measure(command, args, dsn)}
            out.print(f"PostgreSQL {environment['postgres']['server_version']} "
                      f"({environment['postgres']['provisioned'].get('provider')}), "
                      f"fsync={environment['postgres']['fsync']}")
            _print(command, report, out)
    except errors.LabError as exc:
        out.print(f"{type(exc).__name__}: {exc}", style="red", markup=False)
        return 1
    except psycopg.Error as exc:
        # The SQLSTATE names the cause without echoing parameters.
        out.print(f"[red]PostgreSQL error {exc.sqlstate or type(exc).__name__}[/red]")
        return 1
    path = _write(args.output_dir, command, report)
    out.print(f"wrote {path}")
    return 0


def _measure(command: str, args: argparse.Namespace, dsn: str) -> dict[str, Any]:
    if command == "throughput":
        return throughput(dsn, args.workflows, args.workers, args.peer, args.repeat)
    if command == "claim":
        return claim_latency(dsn, list(args.history) or list(DEFAULT_HISTORY))
    if command == "startup":
        return startup(dsn)
    raise errors.Rejected(f"unknown bench command {command!r}")


def _print(command: str, report: Mapping[str, Any], out: Console) -> None:
    if command == "throughput":
        out.print(_throughput_table(report))
        for system, figures in report["summary"].items():
            marginal = figures["xacts_per_workflow_marginal_median"]
            cpu_ms = figures["worker_cpu_ms_per_workflow_marginal_median"]
            out.print(f"{system}: {_fmt(figures['workflows_per_second_median'])} workflows/s; "
                      f"{_fmt(marginal['total'])} xacts/workflow beyond fixed cost "
                      f"({_fmt(marginal['system'])} orchestrator + {_fmt(marginal['tool'])} tool); "
                      f"{_fmt(figures['http_calls_per_workflow_median'])} HTTP calls/workflow; "
                      f"{_fmt(figures['wal_syncs_per_workflow_marginal_median'])} WAL "
                      f"syncs/workflow; {_fmt(cpu_ms)} worker CPU ms/workflow")
        if report["peer"]:
            out.print(f"lab / {report['peer']} throughput: {_fmt(report['ratio_vs_peer_median'])} "
                      f"(per round {report['ratio_vs_peer_per_round']}; goal >= "
                      f"{GOALS['throughput_ratio_vs_dbos']})")
    elif command == "claim":
        out.print(_claim_table(report))
        out.print(f"p50 {report['largest']:,} / {report['smallest']:,}: "
                  f"{_fmt(report['ratio_p50_largest_over_smallest'])}; p99: "
                  f"{_fmt(report['ratio_p99_largest_over_smallest'])} "
                  f"(goal <= {GOALS['claim_ratio_1m_over_1k']})")
        out.print(f"plan with {report['largest']:,} finished workflows:")
        out.print(report["sizes"][report["largest"]]["plan"], markup=False, highlight=False)
    elif command == "startup":
        out.print(_startup_table(report))
        out.print(f"worker spawn-to-ready / bare python: {_fmt(report['ratio_worker_over_bare'])}")
