"""``lab bench throughput``: workflows/s through worker OS processes, the lab against DBOS.

N approved workflows are drained by M ``lab worker`` processes through the real HTTP
tool; workflows/s from the database's own clock, committed transactions per workflow
from ``pg_stat_database``, WAL syncs from ``pg_stat_wal``, worker CPU, HTTP calls per
workflow and latency percentiles. ``--peer dbos`` drains the equivalent DBOS workflow
(a queue, one step calling the same tool; ``python -m lab.peers.dbos_peer worker``) on the
same server, alternating with the lab so machine drift cancels.

``--sweep`` measures each system over its own configuration space (the lab: worker
processes; DBOS: processes x ``worker_concurrency`` x queue polling interval) in one
run, alternating configurations, and reports best against best, the ratio at equal
process counts, and the machine's ceiling (one-row INSERT commits/s on the same server,
measured before and after) with each system's share of it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import statistics
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from psycopg import sql
from rich.table import Table

from lab import errors, protocol
from lab.bench import measure
from lab.bench.measure import fmt, ratio, rnd
from lab.peers import dbos_peer
from lab.pg import edge
from lab.runtime import plan, processes, store, tool

# Workers leave the loop after this much idleness; short, since idle polls are pure overhead.
IDLE_EXIT_SECONDS = 0.25
GOAL_RATIO_VS_DBOS = 2.0
GOAL_RATIO_VS_DBOS_NOISE = 1.5  # beside the fixed busy neighbour of ``--noise``
GOAL_XACTS_PER_WORKFLOW = 6.0
GOAL_WAL_SYNCS_PER_WORKFLOW = 2.5
GOAL_ALL_CPU_MS_PER_WORKFLOW = 3.0
# The lab's best configuration, as DBOS gets its own: a looping worker that fuses each
# completion with the next claim, and an idempotent claim with its start barrier, and
# reports no boundary lines (DBOS's workers print nothing per workflow either).
LAB_WORKER_FLAGS = ("--loop", "--fused")
DBOS_VERSION_TAG = "bench"
# One workflow in flight per process, as a ``lab worker`` runs one item at a time. DBOS
# dequeues on a timer, not when a slot frees, so a short interval is its best setting here.
DBOS_WORKER_CONCURRENCY = 1
DBOS_POLL_SECONDS = 0.005
SWEEP_LAB_PROCESSES = (2, 4)
SWEEP_LAB_BATCH = (1, 32)
SWEEP_DBOS_PROCESSES = (2, 4)
SWEEP_DBOS_CONCURRENCY = (1, 8, 16)
SWEEP_DBOS_POLL = (0.005, 0.05)
CEILING_SECONDS = 2.0


@dataclass(frozen=True)
class Config:
    """One system's configuration: worker processes and, for DBOS, its queue settings."""

    system: str
    processes: int
    #: Workflows in flight per process: DBOS's ``worker_concurrency``, the lab's ``--batch``.
    concurrency: int | None = None
    poll: float | None = None

    @property
    def label(self) -> str:
        """A short name: ``lab p4``, ``lab p4 b16`` or ``dbos p4 c16 poll 5ms``."""
        if self.system == "lab":
            batch = self.concurrency or 1
            return f"lab p{self.processes}" + (f" b{batch}" if batch > 1 else "")
        return f"dbos p{self.processes} c{self.concurrency} poll {(self.poll or 0) * 1000:g}ms"

    def to_json(self) -> dict[str, Any]:
        """The configuration as a JSON object."""
        if self.system == "lab":
            return {"system": self.system, "processes": self.processes,
                    "batch": self.concurrency or 1}
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
    cpu: dict[str, float | None] = field(default_factory=dict)

    @property
    def system(self) -> str:
        """``lab`` or ``dbos``."""
        return self.config.system

    @property
    def per_second(self) -> float | None:
        """Workflows per second from first claim to last completion."""
        return ratio(float(self.succeeded), self.seconds) if self.succeeded else None

    def to_json(self) -> dict[str, Any]:
        """The run as a JSON object, with per-workflow figures."""
        n = self.workflows or 1
        wal, cpu = self.cpu.get("wal_syncs"), self.cpu.get("worker_cpu_seconds")

        def per_workflow_ms(key: str) -> float | None:
            value = self.cpu.get(key)
            return None if value is None else round(value * 1000 / n, 3)

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
                key: round(self.xacts[key] / n, 3) for key in ("total", "system", "tool")
            },
            "wal_syncs_per_workflow_raw": None if wal is None else round(wal / n, 3),
            "worker_cpu_ms_per_workflow_raw": None if cpu is None else round(cpu * 1000 / n, 3),
            # The drain alone (from release to the last exit), every process of the run.
            "cpu_ms_per_workflow": {
                "workers": per_workflow_ms("drain_worker_cpu_seconds"),
                "bench_and_tool": per_workflow_ms("bench_cpu_seconds"),
                "postgres": per_workflow_ms("server_cpu_seconds"),
                "all": per_workflow_ms("all_cpu_seconds"),
            },
            "latency_ready_to_done": self.latency_ready,
            "latency_claim_to_done": self.latency_claim,
            "cpu": self.cpu,
        }


# -- one round of each system ---------------------------------------------------------------------


def _release_together(children: list[processes.WorkerProcess], meter: measure.CpuMeter) -> None:
    """Start lab's and DBOS's workers the same way: all ready, the meter started, all go."""
    for child in children:
        child.wait_for(protocol.READY, timeout=60)
    meter.released([child.pid for child in children])
    for child in children:
        child.release()


def _approved_backlog(dsn: str, schema: str, count: int) -> None:
    """Create and approve ``count`` sample workflows through the store's API."""
    sample = measure.sample_plan()
    with store.Store.open(dsn, schema, max_connections=4, application_name="lab-bench") as db:

        def one(index: int) -> None:
            created = db.create(measure.PROPOSER, f"bench-{index}", sample)
            db.approve(measure.APPROVER, created.id, created.fingerprint, timedelta(hours=1))

        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            for _ in pool.map(one, range(count)):
                pass


def _costs(
    scratch: measure.Scratch,
    meter: measure.CpuMeter,
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
    after = measure.xact_snapshot(scratch.admin_dsn, scratch.databases())
    cpu["wal_syncs"] = measure.difference(measure.wal_syncs(scratch.admin_dsn), wal_before)
    delta = measure.xact_delta(before, after, own)
    xacts = measure.split_transactions(
        delta, system_db=system_db, tool_db=scratch.tool_db, tool_calls=calls
    )
    return cpu, xacts


def _result(
    config: Config,
    workflows: int,
    rows: Sequence[Mapping[str, Any]],
    calls: int,
    xacts: dict[str, Any],
    cpu: dict[str, float | None],
) -> RunResult:
    ready = [float(row["ready"]) for row in rows]
    claim = [float(row["claim"]) for row in rows]
    span = max((float(row["since_start"]) for row in rows), default=None)
    return RunResult(
        config=config, workflows=workflows, seconds=span, succeeded=len(rows), http_calls=calls,
        xacts=xacts, latency_ready=measure.latency_summary(ready),
        latency_claim=measure.latency_summary(claim), cpu=cpu,
    )


_LAB_TIMES = """
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
    try:
        for index in range(config.processes):
            children.append(
                processes.spawn_worker(
                    scratch.store_dsn, schema, service.endpoint, service.token, f"bench-{index}",
                    *LAB_WORKER_FLAGS, "--batch", str(config.concurrency or 1),
                    "--idle-exit", str(IDLE_EXIT_SECONDS), "--start-gate",
                    # Exec'd, as DBOS's are: the meter counts this process's reaped
                    # children, and a forked worker is the fork server's child.
                    fork=False,
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
    with store.Store.open(scratch.store_dsn, schema, max_connections=1) as db:
        rows = db.execute(_LAB_TIMES)
    edge.drop_schema(scratch.store_dsn, schema)
    if scratch.tool_dsn != scratch.store_dsn:
        edge.drop_schema(scratch.tool_dsn, schema)
    return _result(config, workflows, rows, calls, xacts, cpu)


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
        _release_together(children, meter)
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
        for child in children:
            child.cleanup()
        service.stop()
    cpu, xacts = _costs(
        scratch, meter, before, wal_before, scratch.dbos_db, calls, own={scratch.dbos_db: polls}
    )
    rows = edge.rows(
        scratch.dbos_dsn,
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
        action="read DBOS's workflow times",
    )
    edge.drop_schema(scratch.tool_dsn, schema)
    return _result(config, workflows, rows, calls, xacts, cpu)


# -- the benchmark --------------------------------------------------------------------------------


@contextlib.contextmanager
def _scratch(admin_dsn: str, peer: bool) -> Iterator[tuple[measure.Scratch, str]]:
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


def _runner(scratch: measure.Scratch, dbos_schema: str) -> Any:
    postmaster = measure.server_pid(scratch.admin_dsn)

    def run(config: Config, workflows: int) -> RunResult:
        if config.system == "lab":
            return lab_round(scratch, workflows, config, postmaster)
        return dbos_round(scratch, dbos_schema, workflows, config, postmaster)

    return run


def _check(workflows: int, repeat: int, *counts: int) -> None:
    if workflows < 1 or repeat < 1 or any(count < 1 for count in counts):
        raise errors.UsageError("workflows, workers, repeat and sweep values must be positive")


def throughput(
    admin_dsn: str, workflows: int, workers: int, peer: str | None, repeat: int,
    *, noise: bool = False, batch: int = 1,
) -> dict[str, Any]:
    """Drain backlogs with the lab (``batch`` in flight per worker) and the peer at
    ``workers`` processes, alternating."""
    _check(workflows, repeat, workers, batch)
    configs = [Config("lab", workers, batch)]
    if peer == "dbos":
        configs.append(Config("dbos", workers, DBOS_WORKER_CONCURRENCY, DBOS_POLL_SECONDS))
    with measure.noise(noise), _scratch(admin_dsn, peer is not None) as (scratch, dbos_schema):
        run = _runner(scratch, dbos_schema)
        # An empty run of each system measures its fixed cost: start, idle polls, exit.
        empty = {config.system: run(config, 0) for config in configs}
        rounds = [[run(config, workflows) for config in order]
                  for order in measure.alternating_order(repeat, configs)]
        separate = scratch.separate
    by_system: dict[str, list[RunResult]] = {c.system: [] for c in configs}
    for result in itertools.chain.from_iterable(rounds):
        by_system[result.system].append(result)
    summary = {system: _summary(results, empty[system], workflows)
               for system, results in by_system.items()}
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
        "lab_batch": batch,
        "repeat": repeat,
        "peer": peer,
        "noise": noise,
        "databases": "separate" if separate else "shared (tool share estimated)",
        "idle_exit_seconds": IDLE_EXIT_SECONDS,
        "dbos_settings": configs[1].to_json() if peer == "dbos" else None,
        "empty_runs": {system: result.to_json() for system, result in empty.items()},
        "rounds": [[result.to_json() for result in r] for r in rounds],
        "summary": summary,
        "ratio_vs_peer_per_round": [round(v, 3) for v in pair_ratios],
        "ratio_vs_peer_median": round(statistics.median(pair_ratios), 3) if pair_ratios else None,
        "goals": {"throughput_ratio_vs_dbos": GOAL_RATIO_VS_DBOS,
                  "xacts_per_workflow": GOAL_XACTS_PER_WORKFLOW},
    }


def _summary(results: Sequence[RunResult], empty: RunResult, workflows: int) -> dict[str, Any]:
    rates = [r.per_second for r in results if r.per_second is not None]
    marginal = [measure.marginal_per_workflow(r.xacts, empty.xacts, workflows) for r in results]
    return {
        "workflows_per_second_median": rnd(statistics.median(rates), 2) if rates else None,
        "xacts_per_workflow_marginal_median": {
            key: round(statistics.median(m[key] for m in marginal), 3)
            for key in ("total", "system", "tool")
        },
        "http_calls_per_workflow_median": round(
            statistics.median(r.http_calls / workflows for r in results), 3
        ),
        "worker_cpu_ms_per_workflow_marginal_median": _median_marginal(
            results, empty, "worker_cpu_seconds", workflows, scale=1000.0
        ),
        "wal_syncs_per_workflow_marginal_median": _median_marginal(
            results, empty, "wal_syncs", workflows
        ),
        "machine_busy_share_median": _median_present(
            r.cpu.get("machine_busy_share") for r in results
        ),
        "all_succeeded": all(r.succeeded == workflows for r in results),
    }


def sweep_configs(
    lab_processes: Sequence[int], dbos_processes: Sequence[int],
    dbos_concurrency: Sequence[int], dbos_poll: Sequence[float],
    lab_batch: Sequence[int] = (1,),
) -> list[Config]:
    """Every configuration of the sweep: each system by the product of its knobs."""
    configs = [Config("lab", p, b) for p, b in itertools.product(lab_processes, lab_batch)]
    configs += [Config("dbos", p, c, poll) for p, c, poll
                in itertools.product(dbos_processes, dbos_concurrency, dbos_poll)]
    return configs


def sweep_order(configs: Sequence[Config], repeat: int) -> list[list[Config]]:
    """Rounds of every configuration, lab and DBOS interleaved, reversed every other round."""
    lab = [c for c in configs if c.system == "lab"]
    peer = [c for c in configs if c.system != "lab"]
    interleaved = [c for pair in itertools.zip_longest(lab, peer) for c in pair if c is not None]
    return measure.alternating_order(repeat, interleaved)


def compare(medians: Mapping[Config, float | None]) -> dict[str, Any]:
    """Best against best, and best against best at each process count both systems ran."""
    def best(system: str, processes: int | None = None) -> tuple[Config, float] | None:
        found = [(c, v) for c, v in medians.items() if c.system == system and v is not None
                 and (processes is None or c.processes == processes)]
        return max(found, key=lambda pair: pair[1]) if found else None

    lab, peer = best("lab"), best("dbos")
    equal: dict[str, Any] = {}
    counts = sorted({c.processes for c in medians})
    for count in counts:
        at_lab, at_peer = best("lab", count), best("dbos", count)
        if at_lab and at_peer:
            equal[str(count)] = {"lab": at_lab[0].label, "dbos": at_peer[0].label,
                                 "ratio": rnd(ratio(at_lab[1], at_peer[1]), 3)}
    return {
        "best_lab": lab[0].label if lab else None,
        "best_lab_wf_s": rnd(lab[1], 2) if lab else None,
        "best_dbos": peer[0].label if peer else None,
        "best_dbos_wf_s": rnd(peer[1], 2) if peer else None,
        "best_against_best": rnd(ratio(lab[1] if lab else None, peer[1] if peer else None), 3),
        "at_equal_processes": equal,
    }


def sweep(
    admin_dsn: str, workflows: int, repeat: int, *,
    lab_processes: Sequence[int] = SWEEP_LAB_PROCESSES,
    dbos_processes: Sequence[int] = SWEEP_DBOS_PROCESSES,
    dbos_concurrency: Sequence[int] = SWEEP_DBOS_CONCURRENCY,
    dbos_poll: Sequence[float] = SWEEP_DBOS_POLL,
    noise: bool = False,
    lab_batch: Sequence[int] = SWEEP_LAB_BATCH,
) -> dict[str, Any]:
    """Each system over its own configuration space, alternating; best against best."""
    _check(workflows, repeat, *lab_processes, *dbos_processes, *dbos_concurrency, *lab_batch)
    if any(poll <= 0 for poll in dbos_poll):
        raise errors.UsageError("DBOS polling intervals must be positive")
    configs = sweep_configs(lab_processes, dbos_processes, dbos_concurrency, dbos_poll,
                            lab_batch)
    with measure.noise(noise):
        ceiling_before = measure.ceiling(admin_dsn, CEILING_SECONDS)
        with _scratch(admin_dsn, True) as (scratch, dbos_schema):
            run = _runner(scratch, dbos_schema)
            results = [run(config, workflows)
                       for order in sweep_order(configs, repeat) for config in order]
        ceiling_after = measure.ceiling(admin_dsn, CEILING_SECONDS)
    # The most the server did alone: other load on the machine only ever lowers it.
    ceiling = max(ceiling_before["commits_per_second"], ceiling_after["commits_per_second"])
    per_config: list[dict[str, Any]] = []
    medians: dict[Config, float | None] = {}
    for config in configs:
        mine = [r for r in results if r.config == config]
        rates = [r.per_second for r in mine if r.per_second is not None]
        medians[config] = statistics.median(rates) if rates else None
        figures = [r.to_json() for r in mine]
        xacts = _median_present(f["xacts_per_workflow_raw"]["total"] for f in figures)
        per_config.append({
            **config.to_json(), "label": config.label,
            "workflows_per_second_median": rnd(medians[config], 2),
            "xacts_per_workflow_median": xacts,
            "wal_syncs_per_workflow_median": _median_present(
                f["wal_syncs_per_workflow_raw"] for f in figures),
            "worker_cpu_ms_per_workflow_median": _median_present(
                f["worker_cpu_ms_per_workflow_raw"] for f in figures),
            "cpu_ms_per_workflow_median": {
                share: _median_present(f["cpu_ms_per_workflow"][share] for f in figures)
                for share in ("workers", "bench_and_tool", "postgres", "all")},
            "share_of_ceiling_commits": rnd(
                ratio(None if medians[config] is None or xacts is None
                      else medians[config] * xacts, ceiling), 3),  # type: ignore[operator]
            "all_succeeded": all(r.succeeded == workflows for r in mine),
        })
    return {
        "workflows": workflows,
        "repeat": repeat,
        "configs": per_config,
        "rounds": [r.to_json() for r in results],
        "ceiling": {"before": ceiling_before, "after": ceiling_after,
                    "commits_per_second": ceiling},
        "comparison": compare(medians),
        "noise": noise,
        "goal_best_against_best": GOAL_RATIO_VS_DBOS_NOISE if noise else GOAL_RATIO_VS_DBOS,
        "goals_per_workflow": {"wal_syncs": GOAL_WAL_SYNCS_PER_WORKFLOW,
                               "all_cpu_ms": GOAL_ALL_CPU_MS_PER_WORKFLOW},
        "note": "transactions, WAL syncs and CPU per workflow are raw (fixed start-up cost "
                "included); the ceiling is one session's commits/s, and concurrent sessions "
                "share WAL flushes (group commit), so a share above 1 is possible; absolute "
                "figures depend on the machine's other load",
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


# -- tables -------------------------------------------------------------------------------------


def throughput_table(report: Mapping[str, Any]) -> Table:
    """Every round of ``throughput``."""
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
                str(number), run["system"], fmt(run["workflows_per_second"]),
                fmt(raw["total"]), fmt(raw["system"]), fmt(raw["tool"]),
                fmt(run["http_calls_per_workflow"]),
                f"{fmt(ready['p50_ms'])} / {fmt(ready['p99_ms'])}",
                f"{fmt(claim['p50_ms'])} / {fmt(claim['p99_ms'])}",
                fmt(run["cpu"].get("machine_busy_share")),
            )
    return table


def sweep_table(report: Mapping[str, Any]) -> Table:
    """One row per configuration of the sweep."""
    noise = " beside a busy neighbour (--noise)" if report.get("noise") else ""
    table = Table(title=f"sweep: {report['workflows']} workflows per round, "
                  f"{report['repeat']} round(s) per configuration (medians){noise}; CPU of "
                  "the drain: workers / bench+tool / PostgreSQL / all processes")
    for column in ("configuration", "wf/s", "xacts/wf", "WAL syncs/wf", "worker CPU ms/wf",
                   "CPU ms/wf w / t / pg", "all CPU ms/wf", "share of ceiling", "all ok"):
        table.add_column(column, justify="right")
    for row in report["configs"]:
        cpu = row["cpu_ms_per_workflow_median"]
        table.add_row(row["label"], fmt(row["workflows_per_second_median"]),
                      fmt(row["xacts_per_workflow_median"]),
                      fmt(row["wal_syncs_per_workflow_median"]),
                      fmt(row["worker_cpu_ms_per_workflow_median"]),
                      f"{fmt(cpu['workers'])} / {fmt(cpu['bench_and_tool'])} / "
                      f"{fmt(cpu['postgres'])}", fmt(cpu["all"]),
                      fmt(row["share_of_ceiling_commits"]), str(row["all_succeeded"]))
    return table
