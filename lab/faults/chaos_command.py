"""The chaos run as a person reads it: its tables, its summary, and ``lab chaos``."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lab import errors
from lab.faults.chaos import Chaos
from lab.faults.chaos_settings import HostFlags, Settings, fault_option, release_option
from lab.options import option
from lab.pg import providers


@dataclass(frozen=True)
class ChaosOptions:
    """What ``lab chaos`` is asked to do: its flags, declared here or, for those it shares
    with ``lab soak``, in ``chaos_settings.FAULT_FLAGS`` (ms and seconds as the flags say)."""

    workflows: int = option(500, help="workflows in the round")
    workers: int = fault_option("workers")
    duration: float = option(60.0, help="seconds of faults at most")
    kill_every: float = option(200.0, help="mean ms between SIGKILLs")
    batch: int = fault_option("batch")
    concurrency: int = fault_option("concurrency")
    drop_replies: float = fault_option("drop_replies", 0.1)
    reject_429: float = fault_option("reject_429", 0.1)
    terminate_backends: float = option(
        2000.0, help="mean ms between pg_terminate_backend of a worker (0: never)")
    non_idempotent_share: float = fault_option("non_idempotent_share")
    non_idempotent_fenced: bool = option(
        False, help="the non-idempotent tool offers the fenced lookup: its unknowns whose "
                    "lookup is absent are requeued with proof, not reviewed")
    seed: int = option(42, help="seed of the fault schedule")
    restart_postgres_every: float = option(
        0.0, metavar="MS", help="SIGKILL and restart PostgreSQL about every MS (0: never; "
                                "implies --durable; embedded provider)")
    min_restarts: int = option(
        2, metavar="N", help="with restarts, the fault phase lasts until N happened (within "
                             "--duration), even when all work settled sooner")
    partition_every: float = option(
        0.0, metavar="MS", help="cut one link (blackhole or reset) about every MS (0: never); "
                                "the fault phase lasts until one partition healed")
    partition_for: float = fault_option("partition_for", 1000.0)
    latency: float = option(0.0, metavar="MS", help="delay on every proxied link")
    durable: bool = option(
        False, help="run PostgreSQL with fsync=on and synchronous_commit=on")
    release_over: float = release_option(0.0, "0, all at once")
    disk_full_every: float = fault_option("disk_full_every", 0.0)
    disk_full_for: float = fault_option("disk_full_for")
    disk_full_mb: int = fault_option("disk_full_mb", 96)
    disk_full_fs: str = fault_option("disk_full_fs")
    clock_step_every: float = fault_option("clock_step_every", 0.0)
    clock_step_max: int = fault_option("clock_step_max", 60)
    hosts: int = fault_option("hosts")
    replication: str = fault_option("replication")
    failover_every: float = fault_option("failover_every")
    min_failovers: int = fault_option("min_failovers")
    net_fault_every: float = fault_option("net_fault_every")
    net_fault_for: float = fault_option("net_fault_for")
    min_net_faults: int = fault_option("min_net_faults")
    skew_max: int = fault_option("skew_max")
    output: str = option("evidence/chaos.json", help="the report (JSON)")
    lab_postgres: str = providers.mode_option()


def settings_from(options: ChaosOptions) -> Settings:
    """The run's settings from ``lab chaos`` options: restarts imply a durable server,
    and ``--min-restarts`` counts only when there are restarts."""
    restarts = options.restart_postgres_every > 0
    return Settings(
        workflows=options.workflows,
        workers=options.workers,
        duration=options.duration,
        kill_every_ms=options.kill_every,
        drop_replies=options.drop_replies,
        reject_429=options.reject_429,
        non_idempotent_fenced=options.non_idempotent_fenced,
        terminate_every_ms=options.terminate_backends,
        non_idempotent_share=options.non_idempotent_share,
        seed=options.seed,
        restart_every_ms=options.restart_postgres_every,
        partition_every_ms=options.partition_every,
        partition_for_ms=options.partition_for,
        latency_ms=options.latency,
        durable=options.durable or restarts,
        min_restarts=options.min_restarts if restarts else 0,
        disk_full_every_ms=options.disk_full_every,
        disk_full_for_ms=options.disk_full_for,
        disk_full_mb=options.disk_full_mb,
        disk_full_fs=options.disk_full_fs,
        clock_step_every_ms=options.clock_step_every,
        clock_step_max_s=options.clock_step_max,
        batch=options.batch,
        concurrency=options.concurrency,
        release_over=options.release_over,
        hosts=HostFlags.from_options(options),
    )


def summary_tables(report: dict[str, Any]) -> list[Table]:
    """The report as rich tables: states per population, faults, invariants."""
    populations = report["populations"]
    states = Table(title="final states")
    states.add_column("state")
    for population in populations:
        states.add_column(population["label"], justify="right")
    states.add_column("total", justify="right")
    for state in sorted(report["states"]):
        states.add_row(state, *[str(p["states"].get(state, 0)) for p in populations],
                       str(report["states"][state]))
    states.add_row("effects in ledger", *[str(p["effects"]) for p in populations],
                   str(report["effects"]))
    states.add_row("manual reviews", *[str(sum(p["manual_reviews"].values()))
                                       for p in populations], str(report["manual_reviews"]))

    faults = Table(title="faults and recovery")
    faults.add_column("what")
    faults.add_column("count", justify="right")
    f, w, r = report["faults"], report["workers"], report["recovery"]
    rows = [
        ("worker SIGKILLs", f["kills"]),
        ("kill timers with no working process to hit", f["kill_timer_without_target"]),
        ("backend terminations", f["backend_terminations"]),
        ("PostgreSQL SIGKILLs and restarts", f["postgres_restarts"]),
        ("PostgreSQL down (s)", report["database"]["down_s"]),
        ("network partitions", f["partitions"]),
        ("disk-full faults (data / wal; met by a write)", "{} ({} / {}; {})".format(
            f["disk_full"]["count"], f["disk_full"].get("by_target", {}).get("data", 0),
            f["disk_full"].get("by_target", {}).get("wal", 0),
            f["disk_full"].get("met_by_a_write", 0))),
        ("postmaster restarted by the lab after a full disk",
         f["disk_full"].get("postmaster_restarted_by_lab", 0)),
        ("clock steps (forward / backward)", "{} ({} / {})".format(
            f["clock_steps"]["count"], f["clock_steps"].get("forward", 0),
            f["clock_steps"].get("backward", 0))),
        ("leases a step expired early / late", "{} / {}".format(
            f["clock_steps"].get("leases_expired_early", 0),
            f["clock_steps"].get("leases_expired_late", 0))),
        ("connections reset by the proxy", f["proxy_resets"]),
        ("controller reads that found the database away",
         report["database"]["unreachable_reads"]),
        ("replies dropped after commit", f["dropped_replies"]),
        ("429 answers", f["rejected_429"]),
        ("worker process starts", w["starts"]),
        ("leases expired and recovered", r["leases_expired"]),
        ("tool calls / lookups", f"{report['tool']['calls']} / {report['tool']['lookups']}"),
    ]
    rows += [(f"reconciled: {kind}", n) for kind, n in r["reconciled"].items()]
    rows += [(f"proven undispatched, out of review: {state}", n)
             for state, n in r["undispatched_out_of_review"].items()]
    rows += [(f"manual review: {why}", n) for why, n in report["manual_review_reasons"].items()]
    rows += [(f"worker exits: {cause}", n) for cause, n in w["exits"].items()]
    for what, count in rows:
        faults.add_row(what, str(count))

    checks = Table(title="invariants")
    checks.add_column("invariant")
    checks.add_column("violations", justify="right")
    for kind, count in report["violations_by_kind"].items():
        checks.add_row(kind, str(count), style="red" if count else None)
    checks.add_row("total", str(report["violation_count"]),
                   style="bold red" if report["violation_count"] else "bold green")
    checks.add_row("independent SQL audit: findings", str(report["audit"]["audit_findings"]),
                   style="red" if report["audit"]["audit_findings"] else None)
    checks.add_row("the two checkers agree", "yes" if report["checkers_agree"] else "NO",
                   style="bold green" if report["checkers_agree"] else "bold red")
    return [states, faults, checks]


def print_summary(report: dict[str, Any], console: Console) -> None:
    """Print the report's tables, timing and any violations."""
    for table in summary_tables(report):
        console.print(table)
    t, run_ = report["timing"], report["run"]
    console.print(
        f"seed {run_['seed']}; {run_['workflows']} workflows, {run_['worker_processes']} worker "
        f"processes; lease {run_['lease_s']}s, heartbeat {run_['heartbeat_s']}s; "
        f"wall {t['wall_s']}s (setup {t['setup_s']}s, warm-up {t['warm_up_s']}s, "
        f"faults {t['fault_phase_s']}s, drain {t['drain_s']}s, check {t['check_s']}s); "
        f"{t['settled_before_drain']} of {run_['workflows']} workflows settled before the drain"
    )
    database = report["database"]
    settings = ", ".join(f"{k}={v}" for k, v in sorted(database["durability"].items()))
    console.print(f"durability: {settings}")
    for restart in database["restarts"]:
        console.print(f"restart at {restart['at_s']}s: down {restart['down_s']}s")
    for cut in report["faults"]["partition_log"]:
        console.print(f"partition at {cut['at_s']}s for {cut['for_s']}s: {cut['link']} "
                      f"{cut['mode']}")
    disk = report["faults"]["disk_full"]
    if disk["count"]:
        console.print(f"disk full ({disk_fs(report)}): server log {disk['server_log']}")
        for name, line in disk["server_log_examples"].items():
            console.print(f"  {name}: {line}")
    for violation in report["violations"][:20]:
        console.print(f"[red]{violation['kind']}[/red] {violation['workflow_id']} "
                      f"{violation['effect_key']}: {violation['detail']}")
    console.print(f"violations: {report['violation_count']}",
                  style="bold red" if report["violation_count"] else "bold green")


def disk_fs(report: dict[str, Any]) -> str:
    """The bounded filesystem the run's data directory was on, as the server described it."""
    details = report.get("postgres", {}).get("details", {})
    return str(details.get("volume", "?"))


def cli_main(options: ChaosOptions) -> int:
    """Body of ``lab chaos``: provision PostgreSQL, run, print, write ``--output``, clean up.

    Returns 0 when every invariant held, 1 when any was violated; a run that
    cannot be made raises (``lab.cli`` maps it to its exit code). The report is
    written before cleanup; a cleanup failure is reported after the verdict and
    added to the written report, never in place of it.
    """
    from lab.pg import cluster, embedded

    console = Console()
    progress = Console(stderr=True)
    # The pool's reconnect warnings are this run's faults working as meant; the report
    # counts them. Anything worse than a warning still shows.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    settings = settings_from(options)
    settings.validate()
    if settings.hosts.enabled:
        from lab.faults import chaos_hosts_command

        return chaos_hosts_command.chaos_main(settings, options.output, console, progress,
                                              print_summary)
    volume = (embedded.Volume(settings.disk_full_mb, settings.disk_full_fs)
              if settings.disk_full_every_ms > 0 else None)
    running = cluster.start(mode=options.lab_postgres, durable=settings.durable, volume=volume,
                            faketime=settings.clock_step_every_ms > 0)
    try:
        if settings.restart_every_ms > 0 and not running.can_crash_restart:
            raise errors.ProvisioningError(
                f"--restart-postgres-every needs a server this run starts; provider "
                f"{running.provisioned.provider!r} cannot be restarted by the lab"
            )
        database = running.provisioned.describe()
        progress.log(f"PostgreSQL {database.get('server_version')} via "
                     f"{database.get('provider')}")
        chaos = Chaos(
            running.provisioned.dsn, settings, log=progress.log,
            restart=running.crash_restart if settings.restart_every_ms > 0 else None,
            server=running.server,
        )
        try:
            report = chaos.run()
        finally:
            problems = chaos.close()
        report["postgres"] = database
        report["cleanup"] = []
        output = Path(options.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print_summary(report, console)
        console.print(f"report written to {output}")
        if problems:
            report["cleanup"] = problems
            output.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n",
                              encoding="utf-8")
            for problem in problems:
                print(f"lab chaos: cleanup: {problem}", file=sys.stderr)
    finally:
        running.stop()
    return 0 if report["violation_count"] == 0 and report["checkers_agree"] else 1
