"""The soak's pure parts, the disk-full log reading and the clock step's offsets."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from lab import errors, protocol
from lab.faults import clocksteps, diskfull, soak
from lab.faults.chaos_settings import Settings
from lab.pg import embedded
from lab.runtime import processes


def test_rounds_cover_exactly_the_asked_workflows() -> None:
    assert soak.SoakSettings(workflows=4500, round_size=2000).rounds() == [2000, 2000, 500]
    assert soak.SoakSettings(workflows=10, round_size=10).rounds() == [10]


@pytest.mark.parametrize("bad", [dict(workflows=0), dict(round_size=5), dict(sample_every=0.0)])
def test_bad_soak_settings_are_usage_errors(bad: dict[str, float]) -> None:
    with pytest.raises(errors.UsageError):
        soak.SoakSettings(**bad).validate()  # type: ignore[arg-type]


def _samples() -> list[dict[str, object]]:
    return [{"t": float(t), "rss_mb": {"controller": 40.0 + t, "postgres": 80.0,
                                       "workers": 120.0, "other": 4.0},
             "processes": {}, "connections": None if t == 2 else 10 + t} for t in range(5)]


def test_the_figure_is_valid_svg_and_deterministic() -> None:
    first = soak.figure_svg(_samples(), "soak <test>")
    assert first == soak.figure_svg(_samples(), "soak <test>")
    root = ET.fromstring(first)  # noqa: S314 -- our own output, parsed to check its shape
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == len(soak.ROLES) + 1  # one per role, and the connections
    assert "soak &lt;test&gt;" in first


def test_a_sample_sees_a_child_process_and_its_memory() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in soak.descendants(os.getpid())
        assert soak.anon_kib(child.pid) > 0
        taken = soak.sample("postgresql://nobody@127.0.0.1:1/none", 0.0)
        assert taken["processes"]["other"] >= 1 and taken["connections"] is None
    finally:
        child.kill()
        child.wait()


def test_a_worker_forked_from_the_fork_server_counts_as_a_worker() -> None:
    env = {"PATH": os.environ.get("PATH", ""), protocol.DSN_ENV: "postgresql://127.0.0.1:9/x",
           protocol.TOKEN_ENV: "token"}  # a worker retrying a database that is not there
    child = processes.forked([sys.executable, "-m", "lab.cli", "worker", "--schema", "s",
                              "--tool", "http://127.0.0.1:9"], env)
    assert child is not None
    try:
        assert child.pid in soak.descendants(os.getpid())  # below the fork server, below us
        assert soak.role(child.pid) == "workers"
    finally:
        child.kill()
        child.wait(30)


def test_the_heap_trim_reports_memory_before_and_after() -> None:
    held = [bytearray(4096) for _ in range(5000)]
    del held
    trimmed = soak.release_free_heap()
    assert 0 < trimmed["after_mb"] <= trimmed["before_mb"] + 1.0


def test_the_server_log_is_counted_by_kind() -> None:
    text = (
        '2026-12-01 UTC [7] lab-tool: ERROR:  could not extend file "base/5/1": '
        "No space left on device\n"
        '2026-12-01 UTC [8] lab-worker-x: PANIC:  could not write to file "pg_wal/xlogtemp.8": '
        "No space left on device\n"
        "2026-12-01 UTC [1] : LOG:  all server processes terminated; reinitializing\n"
    )
    counted = diskfull.count_log(text)
    assert counted == {"no_space_left": 2, "could_not_extend_file": 1, "error": 1,
                       "could_not_write_wal": 1, "panic": 1, "crash_reinitialize": 1}


class _QuietServer:
    """A server whose disk fills at once and whose log stays empty (the fault's calls)."""

    def fill_disk(self, leave: int = 0) -> int:
        return 1 << 20

    def free_disk(self) -> None:
        return None

    def prime_wal(self, switches: int = 3) -> str:
        return ""

    def revive(self) -> bool:
        return False

    def log_from(self, offset: int) -> tuple[str, int]:
        return "", offset


def test_a_disk_fault_has_struck_every_target_only_after_it_filled_for_both() -> None:
    fault = diskfull.DiskFull(server=_QuietServer(), rng=random.Random(33), hold_s=0.0)
    fault.start()
    assert not fault.struck_every_target()
    first = fault.strike(1.0)
    assert not fault.struck_every_target(), first
    second = fault.strike(2.0)
    assert {first["target"], second["target"]} == set(diskfull.TARGETS)
    assert fault.struck_every_target()


def test_clock_offsets_stay_within_the_bound_and_always_move() -> None:
    steps = clocksteps.ClockSteps(server=None, dsn="", schemas=[],  # type: ignore[arg-type]
                                  rng=random.Random(3), max_s=5)
    seen = []
    for _ in range(50):
        offset = steps.next_offset()
        assert -5 <= offset <= 5 and offset != steps.offset_s
        steps.offset_s = offset
        seen.append(offset)
    assert min(seen) < 0 < max(seen)


class _Clock:
    """A server whose clock offset is only remembered."""

    offset_s = 0

    def set_clock(self, offset_s: int) -> None:
        self.offset_s = offset_s


def test_the_clock_has_stepped_both_ways_only_after_a_step_forward_and_one_back() -> None:
    clock = _Clock()
    steps = clocksteps.ClockSteps(server=clock, dsn="", schemas=[], rng=random.Random(3),
                                  max_s=20)
    steps.step_to(1.0, 5)
    steps.step_to(2.0, 12)
    assert not steps.stepped_both_ways(), steps.log
    steps.step_to(3.0, -4)
    assert steps.stepped_both_ways() and clock.offset_s == -4


def test_a_volume_of_an_unknown_kind_or_size_is_refused() -> None:
    with pytest.raises(errors.UsageError):
        embedded.Volume(64, "nfs").validate()
    with pytest.raises(errors.UsageError):
        embedded.Volume(8).validate()


def test_settings_describe_the_new_faults() -> None:
    described = Settings(disk_full_every_ms=5000, clock_step_every_ms=4000).describe(
        max_attempts=3, proxied_links=[])
    assert described["disk_full_every_ms"] == 5000 and described["clock_step_every_ms"] == 4000
    assert described["disk_full_volume_mb"] == 96 and described["clock_step_max_s"] == 60


def test_chaos_and_soak_share_each_fault_flag_from_one_declaration() -> None:
    """Every flag of ``chaos_settings.FAULT_FLAGS`` is a field of both commands' options
    with the one spelling and help (and type); only the defaults marked ``OWN_DEFAULT``
    are each command's own, and the lab-hosts flags default to ``HostFlags``."""
    import dataclasses
    import typing

    from lab.faults import chaos_command, chaos_settings
    from lab.options import flag_of

    kinds = (chaos_command.ChaosOptions, soak.SoakOptions)
    for name, (default, spelling) in chaos_settings.FAULT_FLAGS.items():
        fields = [next(f for f in dataclasses.fields(kind) if f.name == name) for kind in kinds]
        flags = [flag_of(field) for field in fields]
        assert flags[0] is not None and flags[0] == flags[1], name
        assert flags[0].help == spelling["help"]
        assert len({str(typing.get_type_hints(kind)[name]) for kind in kinds}) == 1, name
        if default != chaos_settings.OWN_DEFAULT:
            assert [field.default for field in fields] == [default, default], name
    for kind in kinds:
        assert chaos_settings.HostFlags.from_options(kind()) == chaos_settings.HostFlags()
    with pytest.raises(TypeError, match="workers"):
        chaos_settings.fault_option("workers", 5)
    with pytest.raises(TypeError, match="drop_replies"):
        chaos_settings.fault_option("drop_replies")
