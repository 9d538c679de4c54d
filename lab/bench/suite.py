"""``lab bench suite``: the experiment suite's wall time serially and with ``-n 2``/``-n 4``.

Each run's wall time is split into inherent waiting (a real lease running out, a
persisted backoff, a chaos fault phase: counted from the experiments' source),
test work, and the harness's own time around tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from lab import protocol
from lab.bench import measure
from lab.bench.measure import fmt, ratio, rnd

SUITE_TIMEOUT_SECONDS = 900.0
SUITE_VARIANTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("serial", ()),
    ("-n 2", ("-n", "2")),
    ("-n 4", ("-n", "4")),
)
GOAL_N4_OVER_SERIAL = 0.5

def suite_command(extra: Sequence[str]) -> list[str]:
    """The pytest command the suite benchmark times, with ``extra`` (``-n 4``) appended."""
    return [sys.executable, "-m", "pytest", "experiments", "-q", "-p", "no:cacheprovider",
            "-p", "no:hypothesispytest", "--lab-no-evidence", "--durations=0",
            "--durations-min=0", *extra]


def suite_waits(experiments: Path) -> dict[str, float]:
    """Known inherent waits of every experiment, by test function name."""
    waits: dict[str, float] = {}
    lease = measure.SEED_LEASE_SECONDS
    for path in sorted(experiments.rglob("test_*.py")):
        waits.update(measure.known_waits(path.read_text(encoding="utf-8"), lease))
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
        "inherent_share_of_wall": rnd(ratio(inherent, wall), 3) if serial else None,
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
        cpu_before = measure.children_cpu()
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False,
                              timeout=SUITE_TIMEOUT_SECONDS)
        wall = time.perf_counter() - started
        # pytest, its xdist workers and worker processes; not the daemonized PostgreSQL.
        cpu = measure.children_cpu() - cpu_before
        summary = [line for line in done.stdout.splitlines() if " in " in line and "passed" in line]
        runs[label] = {
            "command": " ".join(command[1:]),
            "exit_code": done.returncode,
            "summary": summary[-1].strip("= ") if summary else done.stdout[-300:],
            **suite_breakdown(wall, measure.parse_durations(done.stdout), waits, serial=not extra),
            "cpu_seconds": round(cpu, 2),
            # Two cores cannot finish this CPU work sooner than this, however many workers.
            "cpu_floor_seconds": round(cpu / (os.cpu_count() or 1), 2),
        }
    serial = runs["serial"]
    for label in runs:
        runs[label]["fraction_of_serial"] = rnd(
            ratio(runs[label]["wall_seconds"], serial["wall_seconds"]), 3
        )
    # No worker count beats the longest test plus the session's own start-up.
    floor = serial["outside_tests_seconds"] + serial["longest_test_seconds"]
    return {
        "known_waits": waits,
        "runs": runs,
        "parallel_floor_fraction": rnd(ratio(floor, serial["wall_seconds"]), 3),
        "goal_n4_fraction": GOAL_N4_OVER_SERIAL,
        "database": protocol.DSN_ENV if os.environ.get(protocol.DSN_ENV) else "plugin auto",
    }


def suite_table(report: Mapping[str, Any]) -> Table:
    """Each run of the suite."""
    table = Table(title="experiment suite wall time")
    for column in ("run", "exit", "wall s", "x serial", "inherent waits s", "inherent share",
                   "outside tests s", "longest test s", "CPU s", "CPU floor s"):
        table.add_column(column, justify="right")
    for label, run in report["runs"].items():
        table.add_row(label, str(run["exit_code"]), fmt(run["wall_seconds"]),
                      fmt(run["fraction_of_serial"]), fmt(run["inherent_wait_seconds"]),
                      fmt(run["inherent_share_of_wall"]), fmt(run["outside_tests_seconds"]),
                      fmt(run["longest_test_seconds"]), fmt(run["cpu_seconds"]),
                      fmt(run["cpu_floor_seconds"]))
    return table

