"""``lab chaos --hosts`` and ``lab soak --hosts`` as a person reads them: the round (or
the rounds) on lab hosts, the chaos tables, and the hosts' own: failovers, faults between
hosts per kind, clock skew. The verdict: no violation, the two checkers agreeing, and
every minimum asked for met (``--min-failovers``, ``--min-net-faults``)."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lab.faults import chaos_hosts
from lab.faults.chaos_settings import Settings


def host_tables(hosts: dict[str, Any]) -> list[Table]:
    """The report's ``hosts`` as rich tables: failovers, and faults between hosts."""
    failovers = Table(title=f"failovers ({hosts['replication']['mode']})")
    for column in ("at (s)", "fenced", "promoted", "no primary (s)", "rejoin (s)",
                   "standby lag before (bytes)"):
        failovers.add_column(column, justify="right")
    for f in hosts["failovers"]:
        failovers.add_row(str(f["at_s"]), f["fenced"], f["promoted"], str(f["no_primary_s"]),
                          str(f["rejoin_s"]), str(f["standby_lag_bytes_before"]))
    net = Table(title="faults between hosts")
    net.add_column("kind")
    net.add_column("count", justify="right")
    net.add_column("made by")
    for kind, count in hosts["net_fault_counts"].items():
        net.add_row(kind, str(count), ", ".join(hosts["paths"].get(kind, [])) or "-")
    return [failovers, net]


def print_hosts(hosts: dict[str, Any], console: Console) -> None:
    """The hosts' tables and lines: layout, windows, skew, shortfalls."""
    console.print("hosts: " + ", ".join(f"{n}={a} ({hosts['layout'][n]})"
                                        for n, a in hosts["addresses"].items()))
    for table in host_tables(hosts):
        console.print(table)
    console.print(f"no-primary window s {hosts['no_primary_s']}; rejoin s {hosts['rejoin_s']}; "
                  f"final primary {hosts['final_primary']}")
    skew = hosts["skew"]
    if skew["initial"]:
        console.print(f"clock offsets s: initial {skew['initial']} (measured "
                      f"{skew['measured']}), {len(skew['steps'])} steps, final {skew['final']}")
    console.print("shapers (connections / chunks / reordered): " + ", ".join(
        f"{name} {r['connections']}/{r['chunks']}/{r['reordered']}"
        for name, r in hosts["shapers"].items()))
    for short in hosts["shortfalls"]:
        console.print(f"[bold red]short of a minimum:[/bold red] {short}")


def passed(report: dict[str, Any]) -> bool:
    """No violation, the checkers agree, every minimum met."""
    return (report["violation_count"] == 0 and report["checkers_agree"]
            and not report["hosts"]["shortfalls"])


def chaos_main(settings: Settings, output: str, console: Console, progress: Console,
               print_summary: Callable[[dict[str, Any], Console], None]) -> int:
    """Body of ``lab chaos --hosts``: the round, its report written, its tables printed
    (the chaos tables by ``print_summary``, ``lab chaos``'s own)."""
    report = chaos_hosts.run(settings, log=progress.log)
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print_summary(report, console)
    print_hosts(report["hosts"], console)
    console.print(f"report written to {path}")
    for problem in report["cleanup"]:
        print(f"lab chaos: cleanup: {problem}", file=sys.stderr)
    return 0 if passed(report) else 1


def _round(index: int, report: dict[str, Any]) -> dict[str, Any]:
    hosts = report["hosts"]
    return {
        "round": index + 1, "seed": report["run"]["seed"],
        "workflows": report["run"]["workflows"], "wall_s": report["timing"]["wall_with_hosts_s"],
        "states": report["states"], "effects": report["effects"],
        "violations": report["violation_count"], "audit_findings":
        report["audit"]["audit_findings"], "checkers_agree": report["checkers_agree"],
        "kills": report["faults"]["kills"], "failovers": hosts["failover_count"],
        "no_primary_s": hosts["no_primary_s"], "rejoin_s": hosts["rejoin_s"],
        "net_fault_counts": hosts["net_fault_counts"], "skew": hosts["skew"],
        "shortfalls": hosts["shortfalls"], "cleanup": report["cleanup"],
    }


def soak_main(sizes: list[int], settings: Settings, output: str) -> int:
    """Body of ``lab soak --hosts``: chaos rounds of ``sizes`` workflows on hosts built for
    each round, back to back, each checked; the report written. No memory figure: the
    one-machine soak's."""
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)

    def say(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    began = time.monotonic()
    rounds = []
    for index, size in enumerate(sizes):
        chosen = replace(settings, workflows=size, seed=settings.seed + index)
        report = chaos_hosts.run(chosen, log=say)
        rounds.append(_round(index, report))
        say(f"round {index + 1}/{len(sizes)}: {report['violation_count']} "
            f"violations, {report['hosts']['failover_count']} failovers, faults "
            f"{report['hosts']['net_fault_counts']}")
    kinds: Counter[str] = Counter()
    for r in rounds:
        kinds.update(r["net_fault_counts"])
    total = {
        "settings": {"workflows": sum(sizes), "round_size": max(sizes),
                     "chaos": settings.describe(max_attempts=0, proxied_links=[])},
        "wall_s": round(time.monotonic() - began, 1),
        "workflows_run": sum(r["workflows"] for r in rounds),
        "rounds": rounds,
        "failovers": sum(r["failovers"] for r in rounds),
        "net_fault_counts": dict(sorted(kinds.items())),
        "kills": sum(r["kills"] for r in rounds),
        "violations": sum(r["violations"] for r in rounds),
        "checkers_agree": all(r["checkers_agree"] for r in rounds),
        "shortfalls": [f"round {r['round']}: {s}" for r in rounds for s in r["shortfalls"]],
    }
    total["verdict"] = ("pass" if total["violations"] == 0 and total["checkers_agree"]
                        and not total["shortfalls"] else "fail")
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(total, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"soak on {settings.hosts.hosts} hosts: {total['workflows_run']} workflows in "
          f"{len(rounds)} rounds, {total['wall_s']} s; {total['failovers']} failovers; "
          f"faults between hosts {total['net_fault_counts']}; {total['kills']} kills")
    for short in total["shortfalls"]:
        print(f"short of a minimum: {short}")
    print(f"violations: {total['violations']}; checkers agree: {total['checkers_agree']}; "
          f"verdict: {total['verdict']}")
    print(f"report written to {path}")
    return 0 if total["verdict"] == "pass" else 1
