"""``lab bench throughput --replicated``: what a replicated workflow database costs.

Each mode named gets a server of its own on lab hosts (``lab.hosts``, network namespaces
on a bridge; root only), every server the same durable embedded PostgreSQL (on disk, fsync
and synchronous commits on, as the bench's own embedded server) with the same replication
settings:

- ``none``: a primary alone on its host (no standby, no WAL sender);
- ``sync``: a primary and a streaming standby on another host, the standby named in
  ``synchronous_standby_names``: a commit returns once the standby has flushed its WAL;
- ``async``: the same pair, the standby streaming, a commit waiting for the primary alone.

The WAL crosses the bridge between the two hosts; the bench's own processes (the lab
workers, the tool, the bench) stay in the root namespace and reach each primary over its
unix socket (``Replicated.local_dsn``). A round is a lab round (``lab.bench.rounds``)
unchanged, on scratch databases of that mode's primary. The modes alternate round by
round (reversed every other round), as the sweep's systems do, so machine drift cancels;
each mode's throughput is also given as a ratio to ``none``'s, round by round. After each
round the bench waits (with a deadline) until the standby has replayed all of the
primary's WAL, so an asynchronous standby's catch-up never runs into the next round; and
it reads, for the report, how much WAL each standby replayed over the rounds and the
primary's ``sync_state`` for it (what makes a figure trustworthy as "sync").

Every server and every host is stopped and removed when the measurement ends, pass or fail.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from lab import errors
from lab.bench import measure, throughput
from lab.bench.measure import fmt, ratio, rnd
from lab.bench.rounds import Config, RunResult, round_size, runner, scratch_databases
from lab.hosts import network, replication
from lab.pg import edge
from lab.pg.binaries import DISK_DIR

MODES = ("none", "sync", "async")
# Each mode's hosts: the primary's and the standby's (none: no standby).
HOSTS: dict[str, tuple[str, str | None]] = {
    "none": ("alone", None), "sync": ("syncp", "syncs"), "async": ("asyncp", "asyncs")}
# How long an asynchronous standby may take to replay a round's WAL before the next one.
CATCH_UP_SECONDS = 60.0
LIMIT = ("each mode's PostgreSQL is an embedded server on lab hosts (network namespaces "
         "on one bridge of this machine): the standby shares the machine's CPUs and disk, "
         "and the bridge has no real network's latency; 'postgres' CPU is the primary's, "
         "the standby's is its own column")


def modes(text: str) -> tuple[str, ...]:
    """The modes of ``--replicated`` (comma-separated), each once, in the order given."""
    found = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [mode for mode in found if mode not in MODES]
    if unknown:
        raise errors.UsageError(f"--replicated takes modes among {','.join(MODES)}, "
                                f"not {','.join(unknown)}")
    if len(set(found)) != len(found):
        raise errors.UsageError("--replicated names each mode once")
    return found


def refuse(chosen: Sequence[str], *, peers: Sequence[str], sweep: bool,
           lab_postgres: str, default_postgres: str) -> None:
    """Refuse, in one line and before anything starts, what ``--replicated`` cannot do."""
    if not chosen:
        return
    if peers:
        raise errors.UsageError("--replicated measures the lab alone: leave out --peer")
    if sweep:
        raise errors.UsageError("--replicated does not sweep: leave out --sweep")
    if lab_postgres != default_postgres:
        raise errors.UsageError("--replicated makes its own servers on lab hosts: "
                                "leave out --lab-postgres")
    reason = network.refusal()
    if reason is not None:
        raise errors.UsageError(f"--replicated: {reason}")


@contextlib.contextmanager
def servers(chosen: Sequence[str]) -> Iterator[dict[str, replication.Replicated]]:
    """Each mode's server (or pair) on hosts of its own, all durable; stopped and their
    hosts removed on the way out, pass or fail."""
    names = [name for mode in chosen for name in HOSTS[mode] if name is not None]
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(network.Hosts(names))
        pairs: dict[str, replication.Replicated] = {}
        for mode in chosen:
            primary, standby = HOSTS[mode]
            pairs[mode] = stack.enter_context(replication.Replicated(
                hosts, primary, standby, mode="async" if mode == "none" else mode,
                durable=True))
        yield pairs


# -- the standby's own figures --------------------------------------------------------------------


def _standby(pair: replication.Replicated) -> replication.Node | None:
    return next((node for node in pair.nodes if node.role == "standby"), None)


def _replay_lsn(pair: replication.Replicated) -> str | None:
    """The standby's last replayed WAL position (None: no standby)."""
    node = _standby(pair)
    if node is None:
        return None
    with edge.session(pair.local_dsn(node), "read the standby's replay position") as conn:
        row = conn.execute("SELECT pg_last_wal_replay_lsn()::text AS lsn").fetchone()
    return None if row is None else row["lsn"]


def standby_facts(pair: replication.Replicated, since: str | None) -> dict[str, Any] | None:
    """What the primary says of its standby (``sync_state``, ``state``) and how many bytes
    of WAL the standby replayed since ``since`` (its replay position before the rounds)."""
    node = _standby(pair)
    if node is None or since is None:
        return None
    now = _replay_lsn(pair)
    with edge.session(pair.local_dsn(pair.primary), "read the replication state") as conn:
        row = conn.execute(
            "SELECT state, sync_state, pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)::bigint AS n "
            "FROM pg_stat_replication WHERE application_name = %s",
            (now, since, node.name)).fetchone()
    return {"host": node.name, "address": node.host.address,
            "state": None if row is None else row["state"],
            "sync_state": None if row is None else row["sync_state"],
            "replay_lsn_before": since, "replay_lsn_after": now,
            "replayed_bytes": None if row is None else int(row["n"])}


def _settled(run: Callable[[Config, int], RunResult], pair: replication.Replicated
             ) -> Callable[[Config, int], RunResult]:
    """``run``, then wait until the standby replayed everything (a deadline), and count
    the standby's CPU through the round beside the primary's figures."""
    node = _standby(pair)
    postmaster = None if node is None or node.cluster.postmaster is None \
        else node.cluster.postmaster.pid

    def settled(config: Config, workflows: int) -> RunResult:
        before = measure.server_cpu(postmaster)
        result = run(config, workflows)
        if node is not None:
            pair.wait_until("the standby to replay the round's WAL",
                            lambda: pair.replay_lag_bytes() == 0, within=CATCH_UP_SECONDS)
        used = measure.difference(measure.server_cpu(postmaster), before)
        result.cpu["standby_cpu_seconds"] = None if used is None else round(used, 3)
        return result

    return settled


# -- the measurement ------------------------------------------------------------------------------


def bench(chosen: Sequence[str], workflows: int, workers: int, repeat: int, *,
          noise: int = 0, batch: int = 1, concurrency: int = 1,
          min_seconds: float = throughput.MIN_ROUND_SECONDS) -> dict[str, Any]:
    """The lab's rounds at ``workers`` processes on each mode's primary, the modes
    alternating; the report (its ``environment`` included). Each mode's first short round
    of ``workflows`` sizes its measured rounds to last at least ``min_seconds``."""
    if workflows < 1 or repeat < 1 or min(workers, batch, concurrency) < 1:
        raise errors.UsageError("workflows, workers, repeat, batch and concurrency must be "
                                "positive")
    config = Config("lab", workers, concurrency, batch=batch)
    with servers(chosen) as pairs, measure.noise(noise), contextlib.ExitStack() as stack:
        environment = measure.environment(pairs[chosen[0]].local_dsn(), None)
        environment["postgres"]["provisioned"] = {
            "provider": "embedded on lab hosts",
            "storage": f"disk ({DISK_DIR}), fsync on",
            "modes": {mode: {**pair.describe(), "mode": mode} for mode, pair in pairs.items()}}
        runs = {}
        for mode, pair in pairs.items():
            scratch, _ = stack.enter_context(scratch_databases(pair.local_dsn(), peer=False))
            runs[mode] = _settled(runner(scratch, ""), pair)
        since = {mode: _replay_lsn(pair) for mode, pair in pairs.items()}
        # An empty run of each mode measures its fixed cost: start, idle polls, exit.
        empty = {mode: runs[mode](config, 0) for mode in chosen}
        sizes = {mode: round_size(runs[mode](config, workflows), workflows, min_seconds)
                 for mode in chosen}
        rounds = [[(mode, throughput._measured(runs[mode], config, sizes[mode], min_seconds))
                   for mode in order] for order in measure.alternating_order(repeat, chosen)]
        standby = {mode: standby_facts(pair, since[mode]) for mode, pair in pairs.items()}
    by_mode: dict[str, list[RunResult]] = {mode: [] for mode in chosen}
    for mode, result in itertools.chain.from_iterable(rounds):
        by_mode[mode].append(result)
    return {
        "environment": environment,
        "replicated": list(chosen),
        "workflows": workflows,
        "round_workflows": sizes,
        "min_round_seconds": min_seconds,
        "workers": workers, "lab_batch": batch, "lab_concurrency": concurrency,
        "repeat": repeat, "noise": noise,
        "empty_runs": {mode: result.to_json() for mode, result in empty.items()},
        "rounds": [[{"mode": mode, **result.to_json()} for mode, result in turn]
                   for turn in rounds],
        "summary": {mode: _summary(results, empty[mode]) for mode, results in by_mode.items()},
        "ratio_vs_none": _ratios(rounds),
        "standby": standby,
        "limits": [LIMIT],
    }


def _summary(results: Sequence[RunResult], empty: RunResult) -> dict[str, Any]:
    figures = [r.to_json() for r in results]
    standby = [r.cpu.get("standby_cpu_seconds") for r in results]
    return {
        **throughput._summary(results, empty),
        "all_cpu_ms_per_workflow_median": _median(
            f["cpu_ms_per_workflow"]["all"] for f in figures),
        "standby_cpu_ms_per_workflow_median": _median(
            None if s is None else s * 1000 / max(r.workflows, 1)
            for s, r in zip(standby, results, strict=True)),
    }


def _median(values: Iterator[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def _ratios(rounds: Sequence[Sequence[tuple[str, RunResult]]]) -> dict[str, Any]:
    """Each mode's wf/s over ``none``'s in the same round (drift cancels), and the median."""
    found: dict[str, list[float]] = {}
    for turn in rounds:
        rates = {mode: result.per_second for mode, result in turn}
        for mode, rate in rates.items():
            value = ratio(rate, rates.get("none"))
            if mode != "none" and value is not None:
                found.setdefault(mode, []).append(round(value, 3))
    return {mode: {"per_round": values, "median": rnd(statistics.median(values), 3)}
            for mode, values in found.items()}


# -- printing -------------------------------------------------------------------------------------


def table(report: Mapping[str, Any]) -> Table:
    """Every round, its replication mode beside every figure."""
    shown = Table(title=f"throughput, replicated {','.join(report['replicated'])}: "
                  f"{report['workers']} lab workers (batch {report['lab_batch']}, concurrency "
                  f"{report['lab_concurrency']}), beside {report['noise']} busy process(es); "
                  "rates and CPU over release → last completion; xacts and WAL syncs raw per "
                  "workflow; standby CPU through the whole round and its catch-up")
    for column in ("round", "replicated", "workflows", "wf/s", "window s", "xacts/wf",
                   "WAL syncs/wf", "all CPU ms/wf", "standby CPU ms/wf",
                   "ready→done p50 / p99 ms", throughput.BESIDE):
        shown.add_column(column, justify="right")
    for number, turn in enumerate(report["rounds"], start=1):
        for run in turn:
            ready = run["latency_ready_to_done"]
            standby = run["cpu"].get("standby_cpu_seconds")
            shown.add_row(
                str(number), run["mode"], str(run["workflows"]),
                fmt(run["workflows_per_second"]), fmt(run["seconds"]),
                fmt(run["xacts_per_workflow_raw"]["total"]),
                fmt(run["wal_syncs_per_workflow_raw"]), fmt(run["cpu_ms_per_workflow"]["all"]),
                fmt(None if standby is None else standby * 1000 / max(run["workflows"], 1)),
                f"{fmt(ready['p50_ms'])} / {fmt(ready['p99_ms'])}", throughput._beside(run))
    return shown


def print_report(report: Mapping[str, Any], out: Console) -> None:
    """The servers, the table, each mode's figures, the ratios to ``none``, the standbys."""
    environment = report["environment"]
    server = environment["postgres"]
    out.print(f"PostgreSQL {server['server_version']} (embedded on lab hosts, one server or "
              f"pair per mode: {','.join(report['replicated'])}; "
              f"{server['provisioned']['storage']}), fsync={server['fsync']}, "
              f"synchronous_commit={server['synchronous_commit']}; load average "
              f"{environment['load_average_1_5_15']} on {environment['cpus']} CPUs "
              "(other work on the machine skews every figure)")
    out.print(table(report))
    for mode, figures in report["summary"].items():
        marginal = figures["xacts_per_workflow_marginal_median"]
        out.print(f"replicated {mode}: {fmt(figures['workflows_per_second_median'])} "
                  f"workflows/s; {fmt(marginal['total'])} xacts/workflow beyond fixed cost; "
                  f"{fmt(figures['wal_syncs_per_workflow_marginal_median'])} WAL "
                  f"syncs/workflow; {fmt(figures['worker_cpu_ms_per_workflow_marginal_median'])}"
                  f" worker CPU ms/workflow; {fmt(figures['all_cpu_ms_per_workflow_median'])} "
                  f"all CPU ms/workflow (+ {fmt(figures['standby_cpu_ms_per_workflow_median'])}"
                  " standby)")
    for mode, figures in report["ratio_vs_none"].items():
        out.print(f"replicated {mode} / none throughput: {fmt(figures['median'])} "
                  f"(per round {figures['per_round']})")
    for mode, facts in report["standby"].items():
        if facts is not None:
            out.print(f"replicated {mode}: standby {facts['host']} ({facts['address']}) "
                      f"{facts['state']}, sync_state {facts['sync_state']}, replayed "
                      f"{fmt(facts['replayed_bytes'])} bytes of WAL over the rounds")
    for limit in report["limits"]:
        out.print(f"limit of the comparison: {limit}")
