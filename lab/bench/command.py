"""``lab bench``: benchmarks that print figures and write them to ``evidence/bench/``.

Nothing here is a timed test: each subcommand measures, prints a table and writes
JSON, and a reader compares the figures with the goals. The benchmarks live in
their own modules and share only ``lab.bench.measure``:

- ``throughput`` (``bench_throughput``): workflows/s through worker OS processes,
  against DBOS with ``--peer dbos`` or Temporal with ``--peer temporal``, over each
  system's configurations with ``--sweep`` (``--peer`` repeated: every peer in one sitting)
- ``claim`` (``bench_claim``): claim latency as the finished history grows, and the plan
- ``suite`` (``bench_suite``): the experiment suite's wall time, serial and parallel
- ``startup`` (``bench_startup``): provisioning and a worker's spawn-to-ready time

This module is the command: it picks the benchmark, provisions the server, prints and
writes. Failures are raised as ``errors.LabError`` for ``lab.cli`` to report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from lab import errors, protocol
from lab.bench import claim, measure, replicated, startup, suite, throughput
from lab.bench.measure import fmt
from lab.options import option
from lab.pg import providers

OUTPUT_DIR = "evidence/bench"


@dataclass(frozen=True)
class OutputOptions:
    """What every ``lab bench`` subcommand is given: the flag of ``lab bench`` itself
    (each subcommand's own are declared by its class below)."""

    output_dir: str = option(OUTPUT_DIR, help="where the figures' JSON goes")


@dataclass(frozen=True)
class SuiteOptions(OutputOptions):
    """``lab bench suite``: where to write the figures."""


@dataclass(frozen=True)
class StartupOptions(OutputOptions):
    """``lab bench startup``: where to write the figures."""


@dataclass(frozen=True)
class ClaimOptions(OutputOptions):
    """``lab bench claim``: the finished-history sizes to measure (none: the defaults)."""

    history: tuple[int, ...] = option(
        (), metavar="N",
        help="finished workflows before measuring (repeatable; none: the bench's own series)")
    lab_postgres: str = providers.mode_option()


@dataclass(frozen=True)
class ThroughputOptions(OutputOptions):
    """``lab bench throughput``: the workload, the peers (``--peer``, repeatable), and the
    sweep's configurations (comma-separated lists, as the flags take them)."""

    workflows: int = option(
        1000, help="workflows in each configuration's first short round, which sizes its "
                   "measured rounds to last --min-seconds")
    min_seconds: float = option(
        10.0, help="the shortest measured round, seconds (release to last completion)")
    workers: int = option(2, help="worker processes")
    batch: int = option(
        1, help="workflows per shared transaction per lab worker (its --batch)")
    concurrency: int = option(
        1, help="workflows in flight per lab worker, each with its own transactions (its "
                "--concurrency)")
    peers: tuple[str, ...] = option(
        (), flags=("--peer",), choices=("dbos", "temporal"),
        help="also measure this peer in the same rounds (repeatable with --sweep: every peer "
             "named races in one sitting)")
    repeat: int = option(1, help="rounds per configuration")
    sweep: bool = option(False, help="each system over its own configurations, best against best")
    lab_processes: str = option("2,4", help="sweep: lab worker processes")
    lab_batch: str = option("1,32", help="sweep: lab worker --batch values")
    lab_concurrency: str = option("1", help="sweep: lab worker --concurrency values")
    dbos_processes: str = option("2,4", help="sweep: DBOS processes")
    dbos_concurrency: str = option("1,8,16", help="sweep: DBOS worker_concurrency values")
    dbos_poll: str = option("0.005,0.05", help="sweep: DBOS queue polling intervals, seconds")
    temporal_processes: str = option("2", help="sweep: Temporal worker processes")
    temporal_activities: str = option(
        "1,8", help="sweep: Temporal workers' max_concurrent_activities values")
    temporal_workflow_tasks: str = option(
        "1,4", help="sweep: Temporal workers' max_concurrent_workflow_tasks values")
    noise: str = option(
        "0", help="busy processes beside every system's rounds; the sweep takes a "
                  "comma-separated list, each level a sitting of its own")
    replicated: str = option(
        "", metavar="MODES",
        help="the lab on a replicated PostgreSQL: comma-separated modes among none,sync,async "
             "(none: a primary alone; sync, async: a primary and a streaming standby on "
             "another lab host), each its own durable server on lab hosts, the modes "
             "alternating round by round, with each mode's throughput over none's; needs "
             "root; not with --peer, --sweep or --lab-postgres (default: the bench's one "
             "server, not on lab hosts)")
    lab_postgres: str = providers.mode_option()


BenchOptions = SuiteOptions | StartupOptions | ClaimOptions | ThroughputOptions


def cli_main(options: BenchOptions, console: Console | None = None) -> int:
    """Run one ``lab bench`` subcommand (by the options' kind); print its table and write
    its JSON."""
    out = console or Console()
    if console is None and not out.is_terminal:
        out.width = 140  # piped output keeps whole table rows
    if isinstance(options, ThroughputOptions):
        _validate(options)
    if isinstance(options, SuiteOptions):
        report = {"environment": measure.environment(None, None), **suite.suite()}
        out.print(suite.suite_table(report))
        n4 = report["runs"]["-n 4"]["fraction_of_serial"]
        out.print(f"-n 4 wall time / serial: {fmt(n4)} (goal <= "
                  f"{suite.GOAL_N4_OVER_SERIAL}); floor set by the longest test and "
                  f"start-up: {fmt(report['parallel_floor_fraction'])}")
        name = "suite"
    elif isinstance(options, ThroughputOptions) and options.replicated:
        report = replicated.bench(
            replicated.modes(options.replicated), options.workflows, options.workers,
            options.repeat, noise=_ints(options.noise)[0], batch=options.batch,
            concurrency=options.concurrency, min_seconds=options.min_seconds)
        replicated.print_report(report, out)
        name = "throughput-replicated"
    else:
        mode = providers.AUTO if isinstance(options, StartupOptions) else options.lab_postgres
        with measure.postgres(mode) as (dsn, provision):
            environment = measure.environment(dsn, provision)
            name, report = _measure(options, dsn)
            report = {"environment": environment, **report}
        server = environment["postgres"]
        out.print(f"PostgreSQL {server['server_version']} "
                  f"({server['provisioned'].get('provider')}), fsync={server['fsync']}, "
                  f"synchronous_commit={server['synchronous_commit']}; load average "
                  f"{environment['load_average_1_5_15']} on {environment['cpus']} CPUs "
                  "(other work on the machine skews every figure)")
        if server["fsync"] != "on":
            out.print("fsync is off: every commit cost is understated; for figures that "
                      "compare systems use an fsync-on server (--lab-postgres dsn)",
                      style="yellow")
        _print(name, report, out)
    path = measure.write(options.output_dir, name, report)
    out.print(f"wrote {path}")
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise errors.UsageError(f"not a comma-separated list of integers: {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part]
    except ValueError:
        raise errors.UsageError(f"not a comma-separated list of numbers: {text!r}") from None


def _validate(options: ThroughputOptions) -> None:
    """Refuse bad arguments before a server is provisioned for nothing."""
    counts = [options.workflows, options.workers, options.repeat, options.batch,
              options.concurrency]
    noise = _ints(options.noise)
    if not noise or any(level < 0 for level in noise):
        raise errors.UsageError("--noise: counts of busy processes, 0 or more")
    if not options.sweep and len(noise) > 1:
        raise errors.UsageError("--noise takes a list only with --sweep")
    if options.min_seconds < 0:
        raise errors.UsageError("--min-seconds must not be negative")
    replicated.refuse(replicated.modes(options.replicated), peers=options.peers,
                      sweep=options.sweep, lab_postgres=options.lab_postgres,
                      default_postgres=providers.AUTO)
    if len(set(options.peers)) != len(options.peers):
        raise errors.UsageError("--peer names each peer once")
    if not options.sweep and len(options.peers) > 1:
        raise errors.UsageError("more than one --peer only with --sweep")
    if options.sweep:
        if not options.peers:
            raise errors.UsageError("--sweep compares with peers: add --peer dbos and/or "
                                    "--peer temporal")
        counts += [*_ints(options.lab_processes), *_ints(options.lab_batch),
                   *_ints(options.lab_concurrency),
                   *_ints(options.dbos_processes),
                   *_ints(options.dbos_concurrency),
                   *_ints(options.temporal_processes), *_ints(options.temporal_activities),
                   *_ints(options.temporal_workflow_tasks)]
        if not all(poll > 0 for poll in _floats(options.dbos_poll)):
            raise errors.UsageError("--dbos-poll intervals must be positive")
    if any(count < 1 for count in counts):
        raise errors.UsageError("workflows, workers, repeat and sweep values must be positive")
    batches = [options.batch, *(_ints(options.lab_batch) if options.sweep else [])]
    if max(batches) > protocol.MAX_BATCH:
        raise errors.UsageError(f"a lab batch is at most {protocol.MAX_BATCH}")
    threads = [options.concurrency, *(_ints(options.lab_concurrency) if options.sweep else [])]
    if max(threads) > protocol.MAX_CONCURRENCY:
        raise errors.UsageError(f"a lab worker's concurrency is at most "
                                f"{protocol.MAX_CONCURRENCY}")


def _measure(options: BenchOptions, dsn: str) -> tuple[str, dict[str, Any]]:
    if isinstance(options, ThroughputOptions) and options.sweep:
        return "throughput-sweep", throughput.sweep(
            dsn, options.workflows, options.repeat,
            lab_processes=_ints(options.lab_processes),
            lab_batch=_ints(options.lab_batch),
            dbos_processes=_ints(options.dbos_processes),
            dbos_concurrency=_ints(options.dbos_concurrency),
            dbos_poll=_floats(options.dbos_poll),
            noise=_ints(options.noise),
            lab_concurrency=_ints(options.lab_concurrency),
            min_seconds=options.min_seconds,
            peers=options.peers,
            temporal_processes=_ints(options.temporal_processes),
            temporal_activities=_ints(options.temporal_activities),
            temporal_workflow_tasks=_ints(options.temporal_workflow_tasks),
        )
    if isinstance(options, ThroughputOptions):
        return "throughput", throughput.throughput(
            dsn, options.workflows, options.workers,
            options.peers[0] if options.peers else None, options.repeat,
            noise=_ints(options.noise)[0], batch=options.batch,
            concurrency=options.concurrency, min_seconds=options.min_seconds,
        )
    if isinstance(options, ClaimOptions):
        sizes = list(options.history) or list(claim.DEFAULT_HISTORY)
        return "claim", claim.claim_latency(dsn, sizes)
    if isinstance(options, StartupOptions):
        return "startup", startup.startup(dsn)
    raise errors.UsageError(f"unknown bench command {type(options).__name__}")


def _print(name: str, report: Mapping[str, Any], out: Console) -> None:
    if name == "throughput-sweep":
        _print_sweep(report, out)
    elif name == "throughput":
        out.print(throughput.throughput_table(report))
        for system, figures in report["summary"].items():
            marginal = figures["xacts_per_workflow_marginal_median"]
            cpu_ms = figures["worker_cpu_ms_per_workflow_marginal_median"]
            out.print(f"{system}: {fmt(figures['workflows_per_second_median'])} workflows/s; "
                      f"{fmt(marginal['total'])} xacts/workflow beyond fixed cost "
                      f"({fmt(marginal['system'])} orchestrator + {fmt(marginal['tool'])} tool); "
                      f"{fmt(figures['http_calls_per_workflow_median'])} HTTP calls/workflow; "
                      f"{fmt(figures['wal_syncs_per_workflow_marginal_median'])} WAL "
                      f"syncs/workflow; {fmt(cpu_ms)} worker CPU ms/workflow")
        if report["peer"]:
            out.print(f"lab / {report['peer']} throughput: {fmt(report['ratio_vs_peer_median'])} "
                      f"(per round {report['ratio_vs_peer_per_round']}; goal >= "
                      f"{throughput.GOAL_RATIO_VS_DBOS})")
        for limit in report.get("limits", []):
            out.print(f"limit of the comparison: {limit}")
    elif name == "claim":
        out.print(claim.claim_table(report))
        out.print(f"p50 {report['largest']:,} / {report['smallest']:,}: "
                  f"{fmt(report['ratio_p50_largest_over_smallest'])}; p99: "
                  f"{fmt(report['ratio_p99_largest_over_smallest'])} "
                  f"(goal <= {claim.GOAL_RATIO_1M_OVER_1K})")
        out.print(f"plan with {report['largest']:,} finished workflows:")
        out.print(report["sizes"][report["largest"]]["plan"], markup=False, highlight=False)
    elif name == "startup":
        out.print(startup.startup_table(report))
        out.print(f"worker spawn-to-ready / bare python: {fmt(report['ratio_worker_over_bare'])}")


def _span(speed: Mapping[str, Any]) -> str:
    """A ``measure.cpu_speed`` result's fastest to slowest run, in seconds."""
    return f"{speed['cpu_seconds_min']}-{speed['cpu_seconds_max']}"


def _print_sweep(report: Mapping[str, Any], out: Console) -> None:
    for sitting in report["sittings"]:
        out.print(throughput.sweep_table(report, sitting))
        ceiling = sitting["ceiling"]
        out.print(f"machine ceiling: {fmt(ceiling['commits_per_second'])} one-row INSERT "
                  f"commits/s (before {fmt(ceiling['before']['commits_per_second'])}, after "
                  f"{fmt(ceiling['after']['commits_per_second'])}), one session; share = wf/s "
                  "x xacts/wf / ceiling (above 1 when concurrent commits share WAL flushes)")
        speed = sitting.get("cpu_speed")
        if speed:
            out.print(f"machine speed: a {speed['before']['loop_steps']:,}-step Python loop "
                      f"took {_span(speed['before'])} s of CPU before the sitting and "
                      f"{_span(speed['after'])} s after it, no busy process running; CPU "
                      "figures of two sittings compare only as these do")
        comparison = sitting["comparison"]
        peers = comparison.get("peers", {})
        out.print(f"best lab: {comparison['best_lab']} at {fmt(comparison['best_lab_wf_s'])} "
                  "wf/s; " + "; ".join(
                      f"best {throughput.PEER_TITLES[system]}: {figures['best']} at "
                      f"{fmt(figures['best_wf_s'])} wf/s" for system, figures in peers.items()))
        for system, figures in peers.items():
            title = throughput.PEER_TITLES[system]
            goal = (f" (goal >= {sitting['goal_best_against_best']})"
                    if system == "dbos" else "")
            out.print(f"best against best (lab / {title}): "
                      f"{fmt(figures['best_against_best'])}{goal}")
            for count, pair in figures["at_equal_processes"].items():
                out.print(f"at {count} processes: {pair['lab']} / {pair[system]} = "
                          f"{fmt(pair['ratio'])}")
        for table in throughput.blast_radius_tables(sitting):
            out.print(table)
    for limit in report.get("limits", []):
        out.print(f"limit of the comparison: {limit}")
