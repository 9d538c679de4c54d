"""``lab bench startup``: embedded PostgreSQL provisioning, and a worker's spawn-to-ready time.

A worker's start-up is compared with a bare interpreter's and with importing the
worker's modules alone, so what the lab adds is visible, and an exec'd worker with one
forked from the fork server (``lab.runtime.forkserver``), so what that saves is too.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.table import Table

from lab import protocol
from lab.bench import measure
from lab.bench.measure import fmt, ratio, rnd
from lab.pg import cluster, edge
from lab.runtime import processes, store, tool

STARTUP_REPEAT = 7
PROVISION_REPEAT = 3

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
        lambda: _time_exit([sys.executable, "-c", "import lab.cli, lab.runtime.processes"]), repeat
    )
    schema = measure.new_schema("bench_start")
    store.create_schema(dsn, schema)
    service = tool.ToolService(dsn, schema, idempotent=True).start()

    def spawn_to_ready(fork: bool) -> float:
        started = time.perf_counter()
        child = processes.spawn_worker(dsn, schema, service.endpoint, service.token,
                                       "bench-startup", "--start-gate", fork=fork)
        try:
            child.wait_for(protocol.READY, timeout=60)
            elapsed = time.perf_counter() - started
            child.release()
            child.finish(timeout=60)
        finally:
            child.cleanup()
        return elapsed

    try:
        report["worker_spawn_to_ready"] = _samples(lambda: spawn_to_ready(False), repeat)
        spawn_to_ready(True)  # starts the fork server: its one-off start is not a spawn's
        report["worker_forked_to_ready"] = _samples(lambda: spawn_to_ready(True), repeat)
    finally:
        service.stop()
        edge.drop_schema(dsn, schema)
    report["ratio_worker_over_bare"] = rnd(ratio(
        report["worker_spawn_to_ready"]["median_ms"], report["bare_python"]["median_ms"]), 2)
    return report


def startup_table(report: Mapping[str, Any]) -> Table:
    """Provisioning and start-up times."""
    table = Table(title="startup")
    table.add_column("what")
    table.add_column("median ms", justify="right")
    table.add_column("min / max ms", justify="right")
    provisioning = report["provisioning"]
    table.add_row("embedded PostgreSQL start", fmt(provisioning["start_median_ms"]),
                  " / ".join(fmt(v) for v in provisioning["start_all_ms"]))
    table.add_row("embedded PostgreSQL stop", fmt(provisioning["stop_median_ms"]), "")
    for key, label in (("bare_python", "python -c pass"),
                       ("import_worker_modules",
                        "python -c 'import lab.cli, lab.runtime.processes'"),
                       ("worker_spawn_to_ready", f"lab worker --start-gate → {protocol.READY}"),
                       ("worker_forked_to_ready", "the same, forked from the fork server")):
        figures = report[key]
        table.add_row(label, fmt(figures["median_ms"]),
                      f"{fmt(figures['min_ms'])} / {fmt(figures['max_ms'])}")
    return table

