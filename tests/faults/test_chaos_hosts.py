"""``lab chaos --hosts``: its flags refused in one line when they cannot make a run, and a
small round on four lab hosts with failovers, every kind of fault between hosts and skewed
clocks, judged by the invariant checker and the SQL audit on the final primary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import errors
from lab.faults import chaos_hosts
from lab.faults.chaos_settings import NET_FAULT_KINDS, HostFlags, Settings
from lab.hosts import network


def _refused(command: str, args: list[str], message: str, tmp_path: Path) -> None:
    """``lab COMMAND ARGS`` is a usage error: exit 2, one line on stderr naming
    ``message``, and nothing written."""
    output = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "lab.cli", command, *args, "--output", str(output)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not output.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--failover-every", "10"], "--failover-every needs --hosts"),
        (["--skew-max", "5"], "--skew-max needs --hosts"),
        (["--hosts", "2"], "between 3 and 16"),
        (["--hosts", "17"], "between 3 and 16"),
        (["--hosts", "4", "--failover-every", "1"], "at least 5 seconds"),
        (["--hosts", "4", "--min-failovers", "2"], "min-failovers needs failover-every"),
        (["--hosts", "4", "--min-net-faults", "2"], "min-net-faults needs net-fault-every"),
        (["--hosts", "4", "--net-fault-every", "50"], "at least 100 ms"),
        (["--hosts", "4", "--net-fault-for", "0"], "net-fault-for"),
        (["--hosts", "4", "--skew-max", "-1"], "skew-max"),
        (["--hosts", "4", "--restart-postgres-every", "5000"], "--restart-postgres-every is "
                                                              "the one-machine fault"),
        (["--hosts", "4", "--partition-every", "1000"], "--partition-every is the one-machine"),
    ],
)
def test_host_flags_that_cannot_make_a_run_exit_2_with_one_line(
    args: list[str], message: str, tmp_path: Path
) -> None:
    _refused("chaos", args, message, tmp_path)


def test_the_soak_refuses_the_same_flags_the_same_way(tmp_path: Path) -> None:
    _refused("soak", ["--min-failovers", "1", "--workflows", "20", "--round", "10"],
             "--min-failovers needs --hosts", tmp_path)


def test_hosts_need_root() -> None:
    assert "needs root" in (chaos_hosts.refusal(euid=1000) or "")
    assert chaos_hosts.refusal(euid=1000) == chaos_hosts.refusal(euid=65534)


@pytest.mark.parametrize("count", [3, 4, 16])
def test_the_layout_gives_the_pair_the_tool_and_the_workers_hosts(count: int) -> None:
    roles = chaos_hosts.layout(count)
    assert len(roles) == count
    assert list(roles)[:3] == ["db1", "db2", "tool"]
    workers = chaos_hosts.worker_hosts(count)
    assert workers == (["tool"] if count == 3 else [f"w{i}" for i in range(1, count - 2)])


def test_clock_steps_are_a_kind_only_with_a_skew() -> None:
    assert HostFlags(hosts=4, skew_max=5).kinds() == NET_FAULT_KINDS
    assert "clock_step" not in HostFlags(hosts=4).kinds()
    with pytest.raises(errors.UsageError):
        Settings(hosts=HostFlags(hosts=4, replication="quorum")).validate()


def test_a_small_round_on_four_hosts_fails_over_strikes_every_kind_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """Four hosts, a synchronous pair: at least one failover and one fault of each kind
    between hosts, skewed worker clocks, and the round ends with no violation, the checkers
    agreeing on the final primary, and nothing of its hosts left."""
    reason = chaos_hosts.refusal()
    if reason is not None:
        pytest.fail(reason, pytrace=False)
    output = tmp_path / "chaos.json"
    done = subprocess.run(
        [sys.executable, "-m", "lab.cli", "chaos", "--hosts", "4", "--workflows", "60",
         "--workers", "2", "--duration", "90", "--kill-every", "2000",
         "--failover-every", "8", "--min-failovers", "1", "--net-fault-every", "300",
         "--net-fault-for", "300", "--min-net-faults", "1", "--skew-max", "5", "--seed", "7",
         "--output", str(output)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(output.read_text(encoding="utf-8"))
    hosts = report["hosts"]
    assert report["violation_count"] == 0
    assert report["checkers_agree"] and report["audit"]["audit_findings"] == 0
    assert hosts["failover_count"] >= 1 and hosts["shortfalls"] == []
    assert all(hosts["net_fault_counts"][kind] >= 1 for kind in NET_FAULT_KINDS)
    assert sorted(hosts["skew"]["initial"]) == ["w1"]
    assert all(abs(v) <= 5 for v in hosts["skew"]["final"].values())
    assert report["cleanup"] == []
    assert network.leftovers(hosts["run_id"]) == []
