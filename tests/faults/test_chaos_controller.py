"""The chaos controller: bad settings are usage errors, and cleanup never hides a verdict."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lab import errors
from lab.faults import chaos, chaos_population
from lab.pg import edge


def _exits_2_with_one_line(args: list[str], message: str) -> None:
    """``lab chaos`` with ``args`` is a usage error: exit 2, one line on stderr, naming
    ``message``."""
    done = subprocess.run(
        [sys.executable, "-m", "lab.cli", "chaos", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--restart-postgres-every", "10"], "at least 1000 ms"),
        (["--partition-every", "-1"], "must not be negative"),
        (["--partition-for", "0"], "partition-for"),
        (["--latency", "5000"], "latency"),
        (["--workers", "0"], "workers"),
    ],
)
def test_bad_fault_settings_exit_2_with_one_line(args: list[str], message: str) -> None:
    _exits_2_with_one_line(args, message)


def test_restarts_need_a_server_the_run_can_restart(lab_dsn: str) -> None:
    with pytest.raises(errors.ProvisioningError, match="embedded"):
        chaos.Chaos(lab_dsn, chaos.Settings(workflows=4, workers=2, restart_every_ms=2000))


def test_a_failed_cleanup_is_reported_after_the_verdict(
    lab_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The schemas cannot be dropped: the run still checks and reports, and says so."""
    dropped: list[str] = []

    def refuse(dsn: str, schema: str) -> None:
        dropped.append(schema)
        raise errors.StoreError("PostgreSQL could not drop the schema (SQLSTATE 57P01)")

    monkeypatch.setattr(chaos_population, "CLEANUP_PATIENCE_S", 0.3)
    monkeypatch.setattr(chaos_population.edge, "drop_schema", refuse)
    settings = chaos.Settings(workflows=12, workers=2, duration=5.0, kill_every_ms=0,
                              terminate_every_ms=0, drop_replies=0, reject_429=0, seed=3)
    try:
        report = chaos.run(lab_dsn, settings)
    finally:
        monkeypatch.undo()
        for schema in set(dropped):
            edge.drop_schema(lab_dsn, schema)
    assert report["violation_count"] == 0
    assert sum(report["states"].values()) == 12
    assert len(report["cleanup"]) == len(set(dropped)) == 2
    assert all("was not dropped" in problem for problem in report["cleanup"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disk-full-every", "10"], "disk-full-every must be at least 1000 ms"),
        (["--disk-full-for", "0"], "disk-full-for"),
        (["--disk-full-mb", "8"], "disk-full-mb"),
        (["--clock-step-every", "5"], "clock-step-every must be at least 1000 ms"),
        (["--clock-step-max", "0"], "clock-step-max"),
    ],
)
def test_bad_disk_and_clock_settings_exit_2_with_one_line(args: list[str], message: str) -> None:
    _exits_2_with_one_line(args, message)


def test_disk_and_clock_faults_need_a_server_this_run_started(lab_dsn: str) -> None:
    with pytest.raises(errors.ProvisioningError, match="size-limited"):
        chaos.Chaos(lab_dsn, chaos.Settings(workflows=4, workers=2, disk_full_every_ms=2000))
    with pytest.raises(errors.ProvisioningError, match="libfaketime"):
        chaos.Chaos(lab_dsn, chaos.Settings(workflows=4, workers=2, clock_step_every_ms=2000))


def test_work_settled_before_the_first_partition_still_meets_one(lab_dsn: str) -> None:
    """Twelve workflows settle in well under a second; partitions are due about every
    4 s. The fault phase lasts until one partition has struck and healed, so the round
    shows one however fast the machine, and reports it as a strike."""
    settings = chaos.Settings(workflows=12, workers=2, duration=30.0, kill_every_ms=0,
                              terminate_every_ms=0, drop_replies=0, reject_429=0, seed=5,
                              partition_every_ms=4000, partition_for_ms=300)
    report = chaos.run(lab_dsn, settings)
    assert report["violation_count"] == 0
    assert report["faults"]["partitions"] >= 1
    assert report["faults"]["in_flight"]["partition"]["strikes"] == report["faults"]["partitions"]
