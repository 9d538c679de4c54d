"""One round of ``lab bench throughput``: a backlog drained by one system's configuration.

``lab_round`` drains N approved workflows with M ``lab worker`` processes through the real
HTTP tool; ``dbos_round`` the equivalent DBOS workflow (a queue, one step calling the same
tool; ``python -m lab.peers.dbos_peer worker``) on the same server; Temporal's round
(``lab.bench.temporal_round``) uses the helpers shared here. Each round is measured
over its honest window (``lab.bench.window``): from the release of its workers to its last
completion, the rate a user waits for and the CPU every process of the round used in it,
with the load average and the other processes' share of the machine sampled through it.
Committed transactions per workflow come from ``pg_stat_database``, WAL syncs from
``pg_stat_wal``, latencies from the systems' own timestamps.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from psycopg import sql

from lab import errors, protocol
from lab.bench import measure
from lab.bench.measure import ratio, rnd
from lab.bench.window import Window
from lab.peers import dbos_peer
from lab.pg import edge
from lab.runtime import plan, processes, store, tool

# Workers leave the loop after this much idleness; short, since idle polls are pure overhead.
# It falls outside the window (the last completion ends it) but inside the raw figures.
IDLE_EXIT_SECONDS = 0.25
# The lab's best configuration, as DBOS gets its own: a looping worker that fuses each
# completion with the next claim, and an idempotent claim with its start barrier, and
# reports no boundary lines (DBOS's workers print nothing per workflow either).
LAB_WORKER_FLAGS = ("--loop", "--fused", "--quiet")
DBOS_VERSION_TAG = "bench"
# One workflow in flight per process, as a ``lab worker`` runs one item at a time. DBOS
# dequeues on a timer, not when a slot frees, so a short interval is its best setting here.
DBOS_WORKER_CONCURRENCY = 1
DBOS_POLL_SECONDS = 0.005


@dataclass(frozen=True)
class Config:
    """One system's configuration: worker processes and, for DBOS, its queue settings; for
    Temporal, each worker's ``max_concurrent_activities`` (``concurrency``) and
    ``max_concurrent_workflow_tasks`` (``workflow_tasks``)."""

    system: str
    processes: int
    #: Workflows in flight per process, each with its own transactions: DBOS's
    #: ``worker_concurrency``, the lab's ``--concurrency``, Temporal's
    #: ``max_concurrent_activities``.
    concurrency: int | None = None
    poll: float | None = None
    #: The lab's ``--batch``: workflows per shared claim and completion transaction.
    batch: int = 1
    #: Temporal's ``max_concurrent_workflow_tasks``.
    workflow_tasks: int | None = None

    @property
    def in_flight(self) -> int:
        """Workflows in flight per process."""
        return (self.concurrency or 1) * self.batch

    @property
    def blast_radius(self) -> int:
        """Workflows one transaction carries (a refused or lost one touches them all)."""
        return self.batch

    @property
    def label(self) -> str:
        """A short name: ``lab p4``, ``lab p4 c8``, ``lab p4 b16``, ``dbos p4 c16 poll 5ms``
        or ``temporal p2 a8 wt2`` (activities, workflow tasks)."""
        if self.system == "lab":
            threads = self.concurrency or 1
            return (f"lab p{self.processes}" + (f" c{threads}" if threads > 1 else "")
                    + (f" b{self.batch}" if self.batch > 1 else ""))
        if self.system == "temporal":
            return (f"temporal p{self.processes} a{self.concurrency or 1} "
                    f"wt{self.workflow_tasks or 1}")
        return f"dbos p{self.processes} c{self.concurrency} poll {(self.poll or 0) * 1000:g}ms"

    def to_json(self) -> dict[str, Any]:
        """The configuration as a JSON object."""
        if self.system == "lab":
            return {"system": self.system, "processes": self.processes,
                    "concurrency": self.concurrency or 1, "batch": self.batch}
        if self.system == "temporal":
            return {"system": self.system, "processes": self.processes,
                    "max_concurrent_activities": self.concurrency or 1,
                    "max_concurrent_workflow_tasks": self.workflow_tasks or 1}
        return {"system": self.system, "processes": self.processes,
                "worker_concurrency": self.concurrency, "polling_interval_sec": self.poll}


@dataclass
class RunResult:
    """One drain of N workflows by one configuration."""

    config: Config
    workflows: int
    seconds: float | None
    succeeded: int
    http_calls: int
    xacts: dict[str, Any]
    latency_ready: dict[str, float | None]
    latency_claim: dict[str, float | None]
    cpu: dict[str, Any] = field(default_factory=dict)

    @property
    def system(self) -> str:
        """``lab``, ``dbos`` or ``temporal``."""
        return self.config.system

    @property
    def per_second(self) -> float | None:
        """Workflows per second over the window: from release to the last completion."""
        return ratio(float(self.succeeded), self.seconds) if self.succeeded else None

    def to_json(self) -> dict[str, Any]:
        """The run as a JSON object, with per-workflow figures."""
        n = self.workflows or 1
        wal, cpu = self.cpu.get("wal_syncs"), self.cpu.get("worker_cpu_seconds")

        def per_workflow_ms(key: str) -> float | None:
            value = self.cpu.get(key)
            return None if value is None else round(value * 1000 / n, 3)

        def per_workflow(key: str) -> float | None:
            # None: not in PostgreSQL (Temporal's dev server keeps its state in SQLite).
            value = self.xacts.get(key)
            return None if value is None else round(value / n, 3)

        return {
            "system": self.system,
            "config": self.config.to_json(),
            "label": self.config.label,
            "workflows": self.workflows,
            "workers": self.config.processes,
            "succeeded": self.succeeded,
            "seconds": rnd(self.seconds, 4),
            "workflows_per_second": rnd(self.per_second, 2),
            "http_calls": self.http_calls,
            "http_calls_per_workflow": round(self.http_calls / n, 3),
            "xacts": self.xacts,
            "xacts_per_workflow_raw": {
                key: per_workflow(key) for key in ("total", "system", "tool")
            },
            "wal_syncs_per_workflow_raw": None if wal is None else round(wal / n, 3),
            "worker_cpu_ms_per_workflow_raw": None if cpu is None else round(cpu * 1000 / n, 3),
            # The window alone (from release to the last completion), every process.
            "cpu_ms_per_workflow": {
                "workers": per_workflow_ms("window_workers_cpu_seconds"),
                "bench_and_tool": per_workflow_ms("window_bench_cpu_seconds"),
                "postgres": per_workflow_ms("window_server_cpu_seconds"),
                "peer_server": per_workflow_ms("window_peer_server_cpu_seconds"),
                "all": per_workflow_ms("window_all_cpu_seconds"),
            },
            # Beside every figure: what else the machine did through the window.
            "load_mean": self.cpu.get("load_mean"),
            "load_max": self.cpu.get("load_max"),
            "other_cores": self.cpu.get("other_cores"),
            "idle_cores": self.cpu.get("idle_cores"),
            "latency_ready_to_done": self.latency_ready,
            "latency_claim_to_done": self.latency_claim,
            "cpu": self.cpu,
        }


# -- one round of each system ---------------------------------------------------------------------


def release_together(
    children: list[processes.WorkerProcess], meter: measure.CpuMeter, window: Window
) -> float:
    """Start every system's workers the same way: all ready, the meters started, all go.
    Returns the release epoch, the window's start."""
    for child in children:
        child.wait_for(protocol.READY, timeout=60)
    pids = [child.pid for child in children]
    meter.released(pids)
    released = window.start(pids)
    for child in children:
        child.release()
    return released


def _approved_backlog(dsn: str, schema: str, count: int) -> None:
    """Create and approve ``count`` sample workflows through the store's API."""
    sample = measure.sample_plan()
    with store.Store.open(dsn, schema, max_connections=8, application_name="lab-bench") as db:

        def one(index: int) -> None:
            created = db.create(measure.PROPOSER, f"bench-{index}", sample)
            db.approve(measure.APPROVER, created.id, created.fingerprint, timedelta(hours=1))

        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            for _ in pool.map(one, range(count)):
                pass


def round_costs(
    scratch: measure.Scratch,
    meter: measure.CpuMeter,
    window: Window,
    before: Mapping[str, int],
    wal_before: int | None,
    system_db: str | None,
    calls: int,
    own: Mapping[str, int] | None = None,
) -> tuple[dict[str, float | None], dict[str, Any]]:
    """CPU, WAL syncs and transactions one round cost, split between system and tool.

    ``own`` names the benchmark's own polling transactions to leave out; ``system_db`` is
    None for a system whose state is not in PostgreSQL.
    """
    window.stop()
    cpu: dict[str, Any] = dict(meter.read())
    after = measure.xact_snapshot(scratch.admin_dsn, scratch.databases())
    cpu["wal_syncs"] = measure.difference(measure.wal_syncs(scratch.admin_dsn), wal_before)
    delta = measure.xact_delta(before, after, own)
    xacts = measure.split_transactions(
        delta, system_db=system_db, tool_db=scratch.tool_db, tool_calls=calls
    )
    return cpu, xacts


def round_result(
    config: Config,
    workflows: int,
    rows: Sequence[Mapping[str, Any]],
    calls: int,
    xacts: dict[str, Any],
    cpu: dict[str, Any],
    window: Window,
) -> RunResult:
    """The round's figures over its window: from release to the last completion."""
    ready = [float(row["ready"]) for row in rows]
    # A round may read the claim of a sample of its workflows only (Temporal's histories).
    claim = [float(row["claim"]) for row in rows if row.get("claim") is not None]
    last = max((float(row["done"]) for row in rows), default=None)
    cpu.update(window.figures(last))
    return RunResult(
        config=config, workflows=workflows, seconds=cpu["window_seconds"],
        succeeded=len(rows), http_calls=calls,
        xacts=xacts, latency_ready=measure.latency_summary(ready),
        latency_claim=measure.latency_summary(claim), cpu=cpu,
    )


# Latencies from the release (the parameter, an epoch): ready (or released) to done,
# and the last claim to done; ``done`` is the completion's epoch, the window's end.
_LAB_TIMES = """
    WITH claimed AS (
        SELECT workflow_id, max(created_at) AS at FROM events
         WHERE kind = 'claimed' GROUP BY workflow_id
    )
    SELECT extract(epoch FROM w.updated_at - greatest(w.ready_at, to_timestamp(%s)))
               AS ready,
           extract(epoch FROM w.updated_at - c.at) AS claim,
           extract(epoch FROM w.updated_at) AS done
      FROM workflows w JOIN claimed c ON c.workflow_id = w.id
     WHERE w.state = 'succeeded'
"""


def _concurrency_flags(config: Config) -> tuple[str, ...]:
    """``--concurrency N`` when the configuration keeps more than one slot per process."""
    slots = config.concurrency or 1
    return ("--concurrency", str(slots)) if slots > 1 else ()


def lab_round(
    scratch: measure.Scratch, workflows: int, config: Config, postmaster: int | None = None
) -> RunResult:
    """Drain ``workflows`` approved workflows with ``config.processes`` ``lab worker``s."""
    schema = measure.new_schema("bench_lab")
    store.create_schema(scratch.store_dsn, schema)
    if scratch.tool_dsn != scratch.store_dsn:
        store.create_schema(scratch.tool_dsn, schema)
    _approved_backlog(scratch.store_dsn, schema, workflows)
    before = measure.xact_snapshot(scratch.admin_dsn, scratch.databases())
    wal_before = measure.wal_syncs(scratch.admin_dsn)
    service = tool.ToolService(scratch.tool_dsn, schema, idempotent=True).start()
    children: list[processes.WorkerProcess] = []
    meter = measure.CpuMeter(postmaster)
    window = Window(postmaster)
    try:
        for index in range(config.processes):
            children.append(
                processes.spawn_worker(
                    scratch.store_dsn, schema, service.endpoint, service.token, f"bench-{index}",
                    *LAB_WORKER_FLAGS, "--batch", str(config.batch),
                    *_concurrency_flags(config),
                    "--idle-exit", str(IDLE_EXIT_SECONDS), "--start-gate",
                    # Exec'd, as DBOS's are: the meter counts this process's reaped
                    # children, and a forked worker is the fork server's child.
                    fork=False,
                )
            )
        released = release_together(children, meter, window)
        for child in children:
            child.finish(timeout=60 + workflows * 0.5)
        calls = service.calls + service.lookups
    finally:
        window.stop()
        for child in children:
            child.cleanup()
        service.stop()
    cpu, xacts = round_costs(scratch, meter, window, before, wal_before, scratch.store_db, calls)
    with store.Store.open(scratch.store_dsn, schema, max_connections=1) as db:
        rows = db.execute(_LAB_TIMES, (released,))
    edge.drop_schema(scratch.store_dsn, schema)
    if scratch.tool_dsn != scratch.store_dsn:
        edge.drop_schema(scratch.tool_dsn, schema)
    return round_result(config, workflows, rows, calls, xacts, cpu, window)


def _dbos_child(
    scratch: measure.Scratch, dbos_schema: str, role: str, name: str, config: Config,
    service: tool.ToolService | None = None,
) -> processes.WorkerProcess:
    env = dbos_peer.child_env(scratch.dbos_dsn, dbos_schema,
                              service.endpoint if service else "", service.token if service else "")
    argv = dbos_peer.argv(role, "--name", name, "--app-version", DBOS_VERSION_TAG,
                          "--concurrency", str(config.concurrency or DBOS_WORKER_CONCURRENCY),
                          "--poll", str(config.poll or DBOS_POLL_SECONDS))
    return processes.WorkerProcess(argv, env, name)


def dbos_prepare(scratch: measure.Scratch, dbos_schema: str, config: Config) -> None:
    """Create and migrate DBOS's system tables and (re)register the queue for ``config``."""
    child = _dbos_child(scratch, dbos_schema, "prepare", "dbos-prepare", config)
    try:
        child.finish(timeout=120)
    finally:
        child.cleanup()


def _enqueue(scratch: measure.Scratch, dbos_schema: str, tag: str, workflows: int) -> None:
    dbos = dbos_peer.module()
    sample = measure.sample_plan()
    client = dbos.DBOSClient(system_database_url=scratch.dbos_url(),
                             dbos_system_schema=dbos_schema, application_name=dbos_peer.APP)
    try:
        for index in range(workflows):
            work = dbos_peer.Work(
                effect_key=plan.effect_key(measure.PROPOSER.tenant, f"bench-{tag}-{index}"),
                fingerprint=sample.fingerprint(), plan=sample.to_json(),
            )
            client.enqueue({"workflow_name": dbos_peer.WORKFLOW, "queue_name": dbos_peer.QUEUE,
                            "workflow_id": f"{tag}-{index}", "app_version": DBOS_VERSION_TAG},
                           work.to_json())
    finally:
        client.destroy()


def dbos_round(
    scratch: measure.Scratch, dbos_schema: str, workflows: int, config: Config,
    postmaster: int | None = None,
) -> RunResult:
    """Drain ``workflows`` DBOS workflows (one step calling the tool) with ``config``."""
    schema = measure.new_schema("bench_dbos")
    store.create_schema(scratch.tool_dsn, schema)
    dbos_prepare(scratch, dbos_schema, config)
    tag = uuid.uuid4().hex[:8]
    _enqueue(scratch, dbos_schema, tag, workflows)
    status = sql.Identifier(dbos_schema, "workflow_status")
    before = measure.xact_snapshot(scratch.admin_dsn, scratch.databases())
    wal_before = measure.wal_syncs(scratch.admin_dsn)
    service = tool.ToolService(scratch.tool_dsn, schema, idempotent=True).start()
    children: list[processes.WorkerProcess] = []
    meter = measure.CpuMeter(postmaster)
    window = Window(postmaster)
    polls = 0
    remaining = sql.SQL(
        "SELECT count(*) AS n FROM {} WHERE workflow_uuid LIKE %s "
        "AND status IN ('ENQUEUED', 'PENDING')"
    ).format(status)
    try:
        for index in range(config.processes):
            children.append(
                _dbos_child(scratch, dbos_schema, "worker", f"dbos-{tag}-{index}", config, service)
            )
        released = release_together(children, meter, window)
        for child in children:
            child.wait_for(protocol.LAUNCHED, timeout=60)
        deadline = time.monotonic() + 60 + workflows * 0.5
        with edge.session(scratch.dbos_dsn, "watch DBOS drain its queue") as conn:
            while True:
                polls += 1
                row = conn.execute(remaining, (f"{tag}-%",)).fetchone()
                if row is not None and row["n"] == 0:
                    break
                if time.monotonic() > deadline:
                    raise errors.CheckFailed("DBOS workers did not drain the queue in time")
                time.sleep(0.05)
        for child in children:
            child.release()
        for child in children:
            child.finish(timeout=60)
        calls = service.calls + service.lookups
    finally:
        window.stop()
        for child in children:
            child.cleanup()
        service.stop()
    cpu, xacts = round_costs(
        scratch, meter, window, before, wal_before, scratch.dbos_db, calls,
        own={scratch.dbos_db: polls},
    )
    rows = edge.rows(
        scratch.dbos_dsn,
        sql.SQL(
            """
            WITH runs AS (
                SELECT created_at, started_at_epoch_ms AS started,
                       coalesce(completed_at, updated_at) AS done
                  FROM {} WHERE workflow_uuid LIKE %s AND status = 'SUCCESS'
            )
            SELECT (done - greatest(created_at, %s * 1000.0)) / 1000.0 AS ready,
                   (done - started) / 1000.0 AS claim,
                   done / 1000.0 AS done
              FROM runs
            """
        ).format(status),
        (f"{tag}-%", released),
        action="read DBOS's workflow times",
    )
    edge.drop_schema(scratch.tool_dsn, schema)
    return round_result(config, workflows, rows, calls, xacts, cpu, window)


# -- the benchmark's setting -------------------------------------------------------------------


Run = Callable[[Config, int], RunResult]


@contextlib.contextmanager
def scratch_databases(admin_dsn: str, peer: bool) -> Iterator[tuple[measure.Scratch, str]]:
    """Scratch databases (and DBOS's schema) for one benchmark, removed afterwards."""
    scratch = measure.Scratch.create(admin_dsn)
    dbos_schema = "dbos" if scratch.separate else measure.new_schema("lab_bench_dbos")
    try:
        if peer:
            dbos_peer.module()
        yield scratch, dbos_schema
    finally:
        if scratch.separate:
            scratch.drop()
        elif peer:
            edge.drop_schema(admin_dsn, dbos_schema)


def runner(scratch: measure.Scratch, dbos_schema: str) -> Run:
    """A function that runs one round of a configuration on these scratch databases."""
    postmaster = measure.server_pid(scratch.admin_dsn)

    def run(config: Config, workflows: int) -> RunResult:
        if config.system == "lab":
            return lab_round(scratch, workflows, config, postmaster)
        return dbos_round(scratch, dbos_schema, workflows, config, postmaster)

    return run


def round_size(probe: RunResult, min_workflows: int, min_seconds: float) -> int:
    """Workflows for a round of at least ``min_seconds`` at the rate of a short ``probe``
    round (a fifth more, since the rate drifts), and never fewer than ``min_workflows``."""
    rate = probe.per_second
    if rate is None or min_seconds <= 0:
        return min_workflows
    return max(min_workflows, math.ceil(rate * min_seconds * 1.2))
