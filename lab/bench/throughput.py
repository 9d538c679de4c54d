"""``lab bench throughput``: workflows/s through worker OS processes, the lab against its peers.

N approved workflows are drained by M ``lab worker`` processes through the real HTTP
tool; workflows/s from the database's own clock, committed transactions per workflow
from ``pg_stat_database``, WAL syncs from ``pg_stat_wal``, worker CPU, HTTP calls per
workflow and latency percentiles. ``--peer dbos`` drains the equivalent DBOS workflow
(a queue, one step calling the same tool; ``python -m lab.peers.dbos_peer worker``) on the
same server, alternating with the lab so machine drift cancels. ``--peer temporal`` drains
the same workflow on Temporal (``lab.bench.temporal_round``: a dev server per round, its
state in SQLite, not PostgreSQL; worker processes ``python -m lab.peers.temporal_peer``).

``--sweep`` measures each system over its own configuration space (the lab: worker
processes; DBOS: processes x ``worker_concurrency`` x queue polling interval; Temporal:
processes x ``max_concurrent_activities`` x ``max_concurrent_workflow_tasks``) in one
sitting, every peer named, alternating configurations, and reports best against best for
each peer, the ratio at equal process counts, and the machine's ceiling (one-row INSERT
commits/s on the same server, measured before and after) with each system's share of it.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rich.table import Table

from lab import errors
from lab.bench import measure, temporal_round
from lab.bench.measure import fmt, ratio, rnd
from lab.bench.rounds import (
    DBOS_POLL_SECONDS,
    DBOS_WORKER_CONCURRENCY,
    IDLE_EXIT_SECONDS,
    Config,
    Run,
    RunResult,
    round_size,
    runner,
    scratch_databases,
)

__all__ = ["Config", "RunResult", "compare", "sweep", "sweep_configs", "sweep_order",
           "throughput"]

GOAL_RATIO_VS_DBOS = 2.0
GOAL_RATIO_VS_DBOS_NOISE = 1.5  # beside the busy neighbours of ``--noise``
GOAL_XACTS_PER_WORKFLOW = 6.0
GOAL_WAL_SYNCS_PER_WORKFLOW = 2.5
GOAL_ALL_CPU_MS_PER_WORKFLOW = 3.0
# Each measured round lasts at least this long: its size comes from a short probe round.
MIN_ROUND_SECONDS = 10.0
SWEEP_LAB_PROCESSES = (2, 4)
SWEEP_LAB_BATCH = (1, 32)
SWEEP_LAB_CONCURRENCY = (1,)
SWEEP_DBOS_PROCESSES = (2, 4)
SWEEP_DBOS_CONCURRENCY = (1, 8, 16)
SWEEP_DBOS_POLL = (0.005, 0.05)
SWEEP_TEMPORAL_PROCESSES = (2,)
SWEEP_TEMPORAL_ACTIVITIES = (1, 8)
SWEEP_TEMPORAL_WORKFLOW_TASKS = (1, 4)
PEERS = ("dbos", "temporal")
PEER_TITLES = {"dbos": "DBOS", "temporal": "Temporal"}
# Said wherever Temporal's figures are printed: what its dev server is, and is not.
TEMPORAL_LIMIT = ("Temporal's dev server (temporal server start-dev) keeps its state in one "
                  "SQLite file, not PostgreSQL: its transactions are not counted, only the "
                  "tool's; a production Temporal on PostgreSQL or Cassandra is another system")
CEILING_SECONDS = 2.0


# A measured round shorter than the minimum (the probe's rate understated the drain's) is
# run again, sized from its own rate, at most this many times in all.
MAX_ROUND_ATTEMPTS = 3


def _measured(run: Run, config: Config, size: int, min_seconds: float) -> RunResult:
    """One measured round of at least ``min_seconds``: a round that ended sooner is run
    again, sized from its own rate (``MAX_ROUND_ATTEMPTS`` in all; the last one counts)."""
    for _ in range(MAX_ROUND_ATTEMPTS - 1):
        result = run(config, size)
        if result.seconds is None or result.seconds >= min_seconds:
            return result
        size = round_size(result, size, min_seconds)
    return run(config, size)


def _sized(run: Run, configs: Sequence[Config], probe: int, min_seconds: float
           ) -> tuple[dict[Config, int], dict[Config, RunResult]]:
    """Each configuration's round size, from a short probe round of ``probe`` workflows."""
    probes = {config: run(config, probe) for config in configs}
    return ({config: round_size(result, probe, min_seconds)
             for config, result in probes.items()}, probes)


def _check(workflows: int, repeat: int, *counts: int) -> None:
    if workflows < 1 or repeat < 1 or any(count < 1 for count in counts):
        raise errors.UsageError("workflows, workers, repeat and sweep values must be positive")


def throughput(
    admin_dsn: str, workflows: int, workers: int, peer: str | None, repeat: int,
    *, noise: int = 0, batch: int = 1, concurrency: int = 1,
    min_seconds: float = MIN_ROUND_SECONDS,
) -> dict[str, Any]:
    """Drain backlogs with the lab (``concurrency`` x ``batch`` in flight per worker) and
    the peer at ``workers`` processes, alternating, beside ``noise`` busy processes.

    ``workflows`` sizes a first short round of each system; the measured rounds are sized
    from its rate to last at least ``min_seconds``."""
    _check(workflows, repeat, workers, batch, concurrency)
    if peer not in (None, *PEERS):
        raise errors.UsageError(f"no such peer: {peer}")
    configs = [Config("lab", workers, concurrency, batch=batch)]
    if peer == "dbos":
        configs.append(Config("dbos", workers, DBOS_WORKER_CONCURRENCY, DBOS_POLL_SECONDS))
    if peer == "temporal":
        configs.append(Config("temporal", workers, temporal_round.TEMPORAL_ACTIVITIES,
                              workflow_tasks=temporal_round.TEMPORAL_WORKFLOW_TASKS))
    with measure.noise(noise), scratch_databases(admin_dsn, peer == "dbos") as (
        scratch, dbos_schema
    ):
        run, temporal = _runner(scratch, dbos_schema)
        # An empty run of each system measures its fixed cost: start, idle polls, exit.
        empty = {config.system: run(config, 0) for config in configs}
        sizes, _ = _sized(run, configs, workflows, min_seconds)
        rounds = [[_measured(run, config, sizes[config], min_seconds) for config in order]
                  for order in measure.alternating_order(repeat, configs)]
        separate = scratch.separate
    by_system: dict[str, list[RunResult]] = {c.system: [] for c in configs}
    for result in itertools.chain.from_iterable(rounds):
        by_system[result.system].append(result)
    summary = {system: _summary(results, empty[system])
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
        "round_workflows": {r.system: r.workflows for r in rounds[-1]},
        "min_round_seconds": min_seconds,
        "workers": workers,
        "lab_batch": batch,
        "lab_concurrency": concurrency,
        "repeat": repeat,
        "peer": peer,
        "noise": noise,
        "databases": "separate" if separate else "shared (tool share estimated)",
        "idle_exit_seconds": IDLE_EXIT_SECONDS,
        "dbos_settings": configs[1].to_json() if peer == "dbos" else None,
        "temporal_settings": configs[1].to_json() if peer == "temporal" else None,
        "temporal_server": temporal.described or None,
        "limits": [TEMPORAL_LIMIT] if peer == "temporal" else [],
        "empty_runs": {system: result.to_json() for system, result in empty.items()},
        "rounds": [[result.to_json() for result in r] for r in rounds],
        "summary": summary,
        "ratio_vs_peer_per_round": [round(v, 3) for v in pair_ratios],
        "ratio_vs_peer_median": round(statistics.median(pair_ratios), 3) if pair_ratios else None,
        "goals": {"throughput_ratio_vs_dbos": GOAL_RATIO_VS_DBOS,
                  "xacts_per_workflow": GOAL_XACTS_PER_WORKFLOW},
    }


def _runner(scratch: measure.Scratch, dbos_schema: str
            ) -> tuple[Run, temporal_round.TemporalRounds]:
    """One round of any system's configuration; Temporal's rounds keep what they say of
    their dev server."""
    others = runner(scratch, dbos_schema)
    temporal = temporal_round.TemporalRounds(scratch, measure.server_pid(scratch.admin_dsn))

    def run(config: Config, workflows: int) -> RunResult:
        return (temporal if config.system == "temporal" else others)(config, workflows)

    return run, temporal


def _marginal(results: Sequence[RunResult], empty: RunResult) -> dict[str, float | None]:
    """Median transactions per workflow beyond the empty run's, per share; None for a
    share not counted (Temporal's own, in SQLite)."""
    keys = ("total", "system", "tool")
    counted = [key for key in keys if empty.xacts.get(key) is not None
               and all(r.xacts.get(key) is not None for r in results)]
    if len(counted) == len(keys):
        marginal = [measure.marginal_per_workflow(r.xacts, empty.xacts, r.workflows)
                    for r in results]
        return {key: round(statistics.median(m[key] for m in marginal), 3) for key in keys}
    found: dict[str, float | None] = dict.fromkeys(keys)
    for key in counted:
        found[key] = round(statistics.median(
            round((r.xacts[key] - empty.xacts[key]) / r.workflows, 3) for r in results), 3)
    return found


def _summary(results: Sequence[RunResult], empty: RunResult) -> dict[str, Any]:
    rates = [r.per_second for r in results if r.per_second is not None]
    return {
        "workflows_per_second_median": rnd(statistics.median(rates), 2) if rates else None,
        "xacts_per_workflow_marginal_median": _marginal(results, empty),
        "http_calls_per_workflow_median": round(
            statistics.median(r.http_calls / max(r.workflows, 1) for r in results), 3
        ),
        "worker_cpu_ms_per_workflow_marginal_median": _median_marginal(
            results, empty, "worker_cpu_seconds", scale=1000.0
        ),
        "wal_syncs_per_workflow_marginal_median": _median_marginal(
            results, empty, "wal_syncs"
        ),
        "machine_busy_share_median": _median_present(
            r.cpu.get("machine_busy_share") for r in results
        ),
        "load_mean_median": _median_present(r.cpu.get("load_mean") for r in results),
        "other_cores_median": _median_present(r.cpu.get("other_cores") for r in results),
        "all_succeeded": all(r.succeeded == r.workflows for r in results),
    }


def sweep_configs(
    lab_processes: Sequence[int], dbos_processes: Sequence[int],
    dbos_concurrency: Sequence[int], dbos_poll: Sequence[float],
    lab_batch: Sequence[int] = (1,),
    lab_concurrency: Sequence[int] = (1,),
    *,
    temporal_processes: Sequence[int] = (),
    temporal_activities: Sequence[int] = (1,),
    temporal_workflow_tasks: Sequence[int] = (1,),
) -> list[Config]:
    """Every configuration of the sweep: each system by the product of its knobs (the
    lab's ``--batch`` values with one workflow per slot, its ``--concurrency`` values
    unbatched), each configuration once. A peer with no processes is left out."""
    lab = [Config("lab", p, 1, batch=b) for p, b in itertools.product(lab_processes, lab_batch)]
    lab += [Config("lab", p, c) for p, c in itertools.product(lab_processes, lab_concurrency)]
    configs = list(dict.fromkeys(lab))
    configs += [Config("dbos", p, c, poll) for p, c, poll
                in itertools.product(dbos_processes, dbos_concurrency, dbos_poll)]
    configs += [Config("temporal", p, a, workflow_tasks=w) for p, a, w in itertools.product(
        temporal_processes, temporal_activities, temporal_workflow_tasks)]
    return configs


def sweep_order(configs: Sequence[Config], repeat: int) -> list[list[Config]]:
    """Rounds of every configuration, the systems interleaved (one of each in turn, the
    lab first), reversed every other round."""
    systems: dict[str, list[Config]] = {"lab": []}
    for config in configs:
        systems.setdefault(config.system, []).append(config)
    interleaved = [c for turn in itertools.zip_longest(*systems.values()) for c in turn
                   if c is not None]
    return measure.alternating_order(repeat, interleaved)


def compare(medians: Mapping[Config, float | None]) -> dict[str, Any]:
    """Best against best, and best against best at each process count both systems ran,
    for DBOS (the top-level keys) and for each peer measured (``peers``)."""
    def best(system: str, processes: int | None = None) -> tuple[Config, float] | None:
        found = [(c, v) for c, v in medians.items() if c.system == system and v is not None
                 and (processes is None or c.processes == processes)]
        return max(found, key=lambda pair: pair[1]) if found else None

    lab = best("lab")
    counts = sorted({c.processes for c in medians})
    against: dict[str, dict[str, Any]] = {}
    for system in PEERS:
        peer = best(system)
        equal: dict[str, Any] = {}
        for count in counts:
            at_lab, at_peer = best("lab", count), best(system, count)
            if at_lab and at_peer:
                equal[str(count)] = {"lab": at_lab[0].label, system: at_peer[0].label,
                                     "ratio": rnd(ratio(at_lab[1], at_peer[1]), 3)}
        against[system] = {
            "best": peer[0].label if peer else None,
            "best_wf_s": rnd(peer[1], 2) if peer else None,
            "best_against_best": rnd(ratio(lab[1] if lab else None,
                                           peer[1] if peer else None), 3),
            "at_equal_processes": equal,
        }
    dbos = against["dbos"]
    return {
        "best_lab": lab[0].label if lab else None,
        "best_lab_wf_s": rnd(lab[1], 2) if lab else None,
        "best_dbos": dbos["best"],
        "best_dbos_wf_s": dbos["best_wf_s"],
        "best_against_best": dbos["best_against_best"],
        "at_equal_processes": dbos["at_equal_processes"],
        "peers": {system: figures for system, figures in against.items()
                  if figures["best"] is not None},
    }


def sweep(
    admin_dsn: str, workflows: int, repeat: int, *,
    lab_processes: Sequence[int] = SWEEP_LAB_PROCESSES,
    dbos_processes: Sequence[int] = SWEEP_DBOS_PROCESSES,
    dbos_concurrency: Sequence[int] = SWEEP_DBOS_CONCURRENCY,
    dbos_poll: Sequence[float] = SWEEP_DBOS_POLL,
    noise: Sequence[int] = (0,),
    lab_batch: Sequence[int] = SWEEP_LAB_BATCH,
    lab_concurrency: Sequence[int] = SWEEP_LAB_CONCURRENCY,
    min_seconds: float = MIN_ROUND_SECONDS,
    peers: Sequence[str] = ("dbos",),
    temporal_processes: Sequence[int] = SWEEP_TEMPORAL_PROCESSES,
    temporal_activities: Sequence[int] = SWEEP_TEMPORAL_ACTIVITIES,
    temporal_workflow_tasks: Sequence[int] = SWEEP_TEMPORAL_WORKFLOW_TASKS,
) -> dict[str, Any]:
    """Each system (the lab and every one of ``peers``) over its own configuration space,
    alternating, at each ``noise`` level (busy processes beside every system) in one
    sitting; best against best, and each blast radius at equal work in flight per process.

    ``workflows`` is the size of each configuration's first short round, which sizes its
    measured rounds to last at least ``min_seconds``."""
    if not peers or any(peer not in PEERS for peer in peers):
        raise errors.UsageError(f"the sweep races the lab against peers among {PEERS}")
    dbos_processes = dbos_processes if "dbos" in peers else ()
    temporal_processes = temporal_processes if "temporal" in peers else ()
    _check(workflows, repeat, *lab_processes, *dbos_processes, *dbos_concurrency, *lab_batch,
           *lab_concurrency, *temporal_processes, *temporal_activities,
           *temporal_workflow_tasks)
    if any(poll <= 0 for poll in dbos_poll):
        raise errors.UsageError("DBOS polling intervals must be positive")
    if not noise or any(level < 0 for level in noise):
        raise errors.UsageError("--noise levels are counts of busy processes, 0 or more")
    configs = sweep_configs(lab_processes, dbos_processes, dbos_concurrency, dbos_poll,
                            lab_batch, lab_concurrency, temporal_processes=temporal_processes,
                            temporal_activities=temporal_activities,
                            temporal_workflow_tasks=temporal_workflow_tasks)
    sittings = [_sitting(admin_dsn, configs, workflows, repeat, min_seconds, level)
                for level in noise]
    return {
        "peers": list(peers),
        "limits": [TEMPORAL_LIMIT] if "temporal" in peers else [],
        "workflows": workflows,
        "repeat": repeat,
        "min_round_seconds": min_seconds,
        "noise_levels": list(noise),
        "sittings": sittings,
        "goals_per_workflow": {"wal_syncs": GOAL_WAL_SYNCS_PER_WORKFLOW,
                               "all_cpu_ms": GOAL_ALL_CPU_MS_PER_WORKFLOW},
        "note": "rates and CPU are over each round's window, from release to the last "
                "completion; transactions and WAL syncs per workflow are raw (fixed start-up "
                "cost included); the ceiling is one session's commits/s, and concurrent "
                "sessions share WAL flushes (group commit), so a share above 1 is possible; "
                "load, other processes' cores and idle cores are sampled through each round",
    }


def _sitting(
    admin_dsn: str, configs: Sequence[Config], workflows: int, repeat: int,
    min_seconds: float, noise: int,
) -> dict[str, Any]:
    """Every configuration beside ``noise`` busy processes: probes, then sized rounds."""
    speed_before = measure.cpu_speed()
    with measure.noise(noise):
        ceiling_before = measure.ceiling(admin_dsn, CEILING_SECONDS)
        dbos = any(config.system == "dbos" for config in configs)
        with scratch_databases(admin_dsn, dbos) as (scratch, dbos_schema):
            run, temporal = _runner(scratch, dbos_schema)
            sizes, probes = _sized(run, configs, workflows, min_seconds)
            results = [_measured(run, config, sizes[config], min_seconds)
                       for order in sweep_order(configs, repeat) for config in order]
        ceiling_after = measure.ceiling(admin_dsn, CEILING_SECONDS)
    speed_after = measure.cpu_speed()
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
            "in_flight": config.in_flight, "blast_radius": config.blast_radius,
            "round_workflows": max((r.workflows for r in mine), default=sizes[config]),
            "probe_workflows_per_second": probes[config].to_json()["workflows_per_second"],
            "workflows_per_second_median": rnd(medians[config], 2),
            "window_seconds_min": min((f["seconds"] for f in figures if f["seconds"]),
                                      default=None),
            "xacts_per_workflow_median": xacts,
            "wal_syncs_per_workflow_median": _median_present(
                f["wal_syncs_per_workflow_raw"] for f in figures),
            "worker_cpu_ms_per_workflow_median": _median_present(
                f["worker_cpu_ms_per_workflow_raw"] for f in figures),
            "cpu_ms_per_workflow_median": {
                share: _median_present(f["cpu_ms_per_workflow"][share] for f in figures)
                for share in ("workers", "bench_and_tool", "postgres", "peer_server", "all")},
            **{key: _median_present(f[key] for f in figures)
               for key in ("load_mean", "load_max", "other_cores", "idle_cores")},
            "share_of_ceiling_commits": rnd(
                ratio(None if medians[config] is None or xacts is None
                      else medians[config] * xacts, ceiling), 3),  # type: ignore[operator]
            "all_succeeded": all(r.succeeded == r.workflows for r in mine),
        })
    return {
        "noise": noise,
        "configs": per_config,
        "rounds": [r.to_json() for r in results],
        "ceiling": {"before": ceiling_before, "after": ceiling_after,
                    "commits_per_second": ceiling},
        "cpu_speed": {"before": speed_before, "after": speed_after},
        "comparison": compare(medians),
        "temporal_server": temporal.described or None,
        "blast_radius": blast_radius(medians),
        "goal_best_against_best": GOAL_RATIO_VS_DBOS_NOISE if noise else GOAL_RATIO_VS_DBOS,
    }


def blast_radius(medians: Mapping[Config, float | None]) -> dict[str, list[dict[str, Any]]]:
    """At equal processes and equal work in flight per process: the lab's ``--concurrency``
    (one workflow per transaction) against DBOS's ``worker_concurrency`` (and Temporal's
    ``max_concurrent_activities``, when it ran), and the lab's ``--batch`` (the whole batch
    per transaction) against both."""
    def rate(system: str, processes: int, in_flight: int, batched: bool) -> float | None:
        found = [v for c, v in medians.items() if v is not None and c.system == system
                 and c.processes == processes and c.in_flight == in_flight
                 and (c.batch > 1) == batched]
        return max(found) if found else None

    keys = sorted({(c.processes, c.in_flight) for c in medians})
    temporal = any(c.system == "temporal" for c in medians)
    one: list[dict[str, Any]] = []
    shared: list[dict[str, Any]] = []
    for processes, in_flight in keys:
        lab = rate("lab", processes, in_flight, False)
        dbos = rate("dbos", processes, in_flight, False)
        peer = rate("temporal", processes, in_flight, False)
        if lab is not None or dbos is not None or peer is not None:
            one.append({"processes": processes, "in_flight": in_flight,
                        "lab_concurrency": rnd(lab, 2), "dbos": rnd(dbos, 2),
                        "lab_over_dbos": rnd(ratio(lab, dbos), 3)})
            if temporal:
                one[-1].update(temporal=rnd(peer, 2), lab_over_temporal=rnd(ratio(lab, peer), 3))
        batch = rate("lab", processes, in_flight, True)
        if batch is not None:
            shared.append({"processes": processes, "in_flight": in_flight,
                           "lab_batch": rnd(batch, 2), "lab_concurrency": rnd(lab, 2),
                           "dbos": rnd(dbos, 2),
                           "batch_over_concurrency": rnd(ratio(batch, lab), 3),
                           "batch_over_dbos": rnd(ratio(batch, dbos), 3)})
    return {"one_per_transaction": one, "whole_batch_per_transaction": shared}


def _median_marginal(
    results: Sequence[RunResult], empty: RunResult, key: str, scale: float = 1.0
) -> float | None:
    base = empty.cpu.get(key)
    values = [
        (value - base) * scale / max(r.workflows, 1)
        for r, value in ((r, r.cpu.get(key)) for r in results)
        if value is not None and base is not None
    ]
    return round(statistics.median(values), 3) if values else None


def _median_present(values: Iterator[float | None] | Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


# -- tables -------------------------------------------------------------------------------------


def _beside(row: Mapping[str, Any]) -> str:
    """What else the machine did through a figure's window: load mean (max), other
    processes' cores, idle cores."""
    return (f"{fmt(row.get('load_mean'))} ({fmt(row.get('load_max'))}) / "
            f"{fmt(row.get('other_cores'))} / {fmt(row.get('idle_cores'))}")


BESIDE = "load mean (max) / other cores / idle cores"


def throughput_table(report: Mapping[str, Any]) -> Table:
    """Every round of ``throughput``."""
    table = Table(title=f"throughput: {report['workers']} workers, rounds of "
                  f"{report['round_workflows']} workflows, beside {report['noise']} busy "
                  "process(es) (rates and CPU over release → last completion; xacts: raw per "
                  "workflow, system = workflow store or DBOS tables; Temporal's are in SQLite, "
                  "not counted: -)")
    for column in ("round", "system", "wf/s", "window s", "xacts/wf", "system", "tool",
                   "HTTP/wf", "all CPU ms/wf", "ready→done p50 / p99 ms",
                   "claim→done p50 / p99 ms", BESIDE):
        table.add_column(column, justify="right")
    for number, round_results in enumerate(report["rounds"], start=1):
        for run in round_results:
            raw = run["xacts_per_workflow_raw"]
            ready, claim = run["latency_ready_to_done"], run["latency_claim_to_done"]
            table.add_row(
                str(number), run["label"], fmt(run["workflows_per_second"]),
                fmt(run["seconds"]), fmt(raw["total"]), fmt(raw["system"]), fmt(raw["tool"]),
                fmt(run["http_calls_per_workflow"]), fmt(run["cpu_ms_per_workflow"]["all"]),
                f"{fmt(ready['p50_ms'])} / {fmt(ready['p99_ms'])}",
                f"{fmt(claim['p50_ms'])} / {fmt(claim['p99_ms'])}", _beside(run),
            )
    return table


def sweep_table(report: Mapping[str, Any], sitting: Mapping[str, Any]) -> Table:
    """One row per configuration of one sitting of the sweep (with Temporal's rows, its
    dev server's CPU as a share of its own: ``tsrv``)."""
    temporal = any(row["system"] == "temporal" for row in sitting["configs"])
    shares = ("workers", "bench_and_tool", "postgres", *(("peer_server",) if temporal else ()))
    table = Table(title=f"sweep beside {sitting['noise']} busy process(es): "
                  f"{report['repeat']} round(s) of at least {fmt(report['min_round_seconds'])} s "
                  "per configuration (medians; rates and CPU over release → last completion); "
                  "CPU of the window: workers / bench+tool / PostgreSQL"
                  + (" / Temporal server" if temporal else "") + " / all processes"
                  + ("; Temporal's xacts are in SQLite, not counted" if temporal else ""))
    for column in ("configuration", "in flight", "wf/s", "workflows", "xacts/wf",
                   "WAL syncs/wf", "CPU ms/wf w / t / pg" + (" / tsrv" if temporal else ""),
                   "all CPU ms/wf", "share of ceiling", BESIDE, "all ok"):
        table.add_column(column, justify="right")
    for row in sitting["configs"]:
        cpu = row["cpu_ms_per_workflow_median"]
        table.add_row(row["label"], str(row["in_flight"]),
                      fmt(row["workflows_per_second_median"]), str(row["round_workflows"]),
                      fmt(row["xacts_per_workflow_median"]),
                      fmt(row["wal_syncs_per_workflow_median"]),
                      " / ".join(fmt(cpu.get(share)) for share in shares), fmt(cpu["all"]),
                      fmt(row["share_of_ceiling_commits"]), _beside(row),
                      str(row["all_succeeded"]))
    return table


def blast_radius_tables(sitting: Mapping[str, Any]) -> list[Table]:
    """Two tables per sitting: one workflow per transaction, and the whole batch."""
    loads = {(row["processes"], row["in_flight"], row["system"], row["batch"] > 1
              if row["system"] == "lab" else False): row for row in sitting["configs"]}

    def beside(processes: int, in_flight: int, system: str, batched: bool) -> str:
        row = loads.get((processes, in_flight, system, batched))
        return "-" if row is None else f"{fmt(row['load_mean'])} / {fmt(row['other_cores'])}"

    noise = sitting["noise"]
    one = Table(title=f"blast radius 1 (each workflow its own transactions), beside {noise} "
                "busy process(es): wf/s at equal processes and in-flight work per process "
                "[load mean / other cores]")
    rows = sitting["blast_radius"]["one_per_transaction"]
    temporal = any("temporal" in row for row in rows)
    for column in ("processes", "in flight", "lab --concurrency", "DBOS worker_concurrency",
                   "lab / DBOS", *(("Temporal max_concurrent_activities", "lab / Temporal")
                                   if temporal else ())):
        one.add_column(column, justify="right")
    for row in rows:
        p, n = row["processes"], row["in_flight"]
        one.add_row(str(p), str(n),
                    f"{fmt(row['lab_concurrency'])} [{beside(p, n, 'lab', False)}]",
                    f"{fmt(row['dbos'])} [{beside(p, n, 'dbos', False)}]",
                    fmt(row["lab_over_dbos"]),
                    *((f"{fmt(row['temporal'])} [{beside(p, n, 'temporal', False)}]",
                       fmt(row["lab_over_temporal"])) if temporal else ()))
    whole = Table(title=f"blast radius = in flight (the batch shares its transactions), beside "
                  f"{noise} busy process(es): wf/s [load mean / other cores]")
    for column in ("processes", "in flight", "lab --batch", "lab --concurrency", "DBOS",
                   "batch / concurrency", "batch / DBOS"):
        whole.add_column(column, justify="right")
    for row in sitting["blast_radius"]["whole_batch_per_transaction"]:
        p, n = row["processes"], row["in_flight"]
        whole.add_row(str(p), str(n), f"{fmt(row['lab_batch'])} [{beside(p, n, 'lab', True)}]",
                      fmt(row["lab_concurrency"]), fmt(row["dbos"]),
                      fmt(row["batch_over_concurrency"]), fmt(row["batch_over_dbos"]))
    return [one, whole]
