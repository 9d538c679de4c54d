"""Work in flight while faults strike (``lab.faults.traffic``) and the soak that uses it."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest

from lab import errors
from lab.faults import soak, traffic
from lab.faults.chaos_settings import Settings


@pytest.mark.parametrize(("total", "over"), [(1, 5.0), (300, 9.0), (2000, 45.0), (7, 0.2)])
def test_approvals_start_at_once_grow_in_waves_and_are_all_out_by_the_end(
    total: int, over: float
) -> None:
    counts = [traffic.due(total, step * traffic.WAVE_S / 2, over) for step in range(200)]
    assert counts[0] >= 1  # a first wave at once: the warm-up has work
    assert counts == sorted(counts)
    assert traffic.due(total, over, over) == total
    assert traffic.due(total, math.inf, over) == total
    if over >= 4 * traffic.WAVE_S and total >= 100:
        assert traffic.due(total, over / 2, over) < total  # spread, not all at once


def test_without_a_release_time_everything_is_approved_at_once() -> None:
    assert traffic.due(500, 0.0, 0.0) == 500


class _Database:
    """Approvals that fail while ``away``; counts each approval of each workflow."""

    def __init__(self) -> None:
        self.away = False
        self.approved: dict[str, int] = {}

    def pending(self, n: int) -> list[traffic.Pending]:
        return [traffic.Pending(f"w{i}", lambda i=i: self._approve(f"w{i}")) for i in range(n)]

    def _approve(self, workflow_id: str) -> None:
        if self.away:
            raise errors.StoreError("the database is away")
        self.approved[workflow_id] = self.approved.get(workflow_id, 0) + 1


def test_a_database_away_delays_approvals_and_loses_or_doubles_none() -> None:
    database = _Database()
    release = traffic.Release(database.pending(40), over=2.0)
    assert release.step(0.0) == 10  # the first of four waves
    database.away = True
    assert release.step(1.0) == 0 and release.refusals == 1
    database.away = False
    assert release.step(1.0) == 20  # the delayed wave and the one now due
    release.finish()
    assert release.complete and set(database.approved.values()) == {1}
    assert len(database.approved) == 40
    assert release.describe()["steps_refused_by_database"] == 1


def test_a_database_that_stays_away_fails_the_drain_naming_what_is_left(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(traffic, "FINISH_PATIENCE_S", 0.3)
    database = _Database()
    release = traffic.Release(database.pending(8), over=4.0)
    release.step(0.0)
    database.away = True
    with pytest.raises(errors.CheckFailed, match="7 workflows of the round could not"):
        release.finish()


def test_strikes_count_work_in_flight_per_kind_and_merge_over_rounds() -> None:
    first, second = traffic.Strikes(), traffic.Strikes()
    for busy in (True, True, False):
        first.record("disk_full", busy)
    second.record("disk_full", True)
    second.record("postgres_restart", False, after_work=True)
    assert first.report() == {
        "disk_full": {"strikes": 3, "busy": 2, "after_work": 0, "busy_share": 0.667}}
    assert traffic.merge([first.report(), second.report()]) == {
        "disk_full": {"strikes": 4, "busy": 3, "after_work": 0, "busy_share": 0.75},
        "postgres_restart": {"strikes": 1, "busy": 0, "after_work": 1, "busy_share": 0.0},
    }


_ALL_APPROVED = traffic.Release([], over=0.0)  # a round whose approvals are all out


class _Flight:
    """Work that comes into flight (or goes idle) ``after`` seconds from now."""

    def __init__(self, after: float) -> None:
        self.at = time.monotonic() + after

    def __call__(self) -> bool:
        return time.monotonic() >= self.at


def test_a_due_fault_waits_for_work_however_long_the_machine_keeps_it_out_of_flight() -> None:
    # Longer than the 2 s the wait once had: a loaded machine's workers can take that
    # long to start, and a fault that gave up would strike an idle system.
    strikes, stop = traffic.Strikes(), threading.Event()
    began = time.monotonic()
    assert strikes.meet("postgres_restart", _Flight(2.5), _Flight(math.inf), stop, _ALL_APPROVED)
    assert time.monotonic() - began >= 2.5
    assert strikes.report()["postgres_restart"]["busy"] == 1


def test_a_fault_due_once_the_work_is_done_strikes_and_says_it_came_after_the_work() -> None:
    strikes = traffic.Strikes()
    assert strikes.meet("disk_full", _Flight(math.inf), _Flight(0.2), threading.Event(),
                        _ALL_APPROVED)
    assert strikes.report() == {
        "disk_full": {"strikes": 1, "busy": 0, "after_work": 1, "busy_share": 0.0}}


def test_a_fault_whose_phase_ends_while_it_waits_is_withheld_not_counted() -> None:
    strikes, stop = traffic.Strikes(), threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert not strikes.meet("clock_step", _Flight(math.inf), _Flight(math.inf), stop,
                            _ALL_APPROVED)
    assert strikes.report() == {}


def test_without_waves_a_fault_strikes_at_once_busy_or_not() -> None:
    strikes = traffic.Strikes()
    assert strikes.meet("partition", _Flight(math.inf), _Flight(math.inf), threading.Event(),
                        None)
    assert strikes.report()["partition"] == {"strikes": 1, "busy": 0, "after_work": 0,
                                             "busy_share": 0.0}


@pytest.mark.parametrize("bad", [dict(batch=2, concurrency=2), dict(concurrency=0),
                                 dict(duration=10.0, release_over=11.0),
                                 dict(release_over=-1.0)])
def test_settings_that_cannot_make_a_round_are_usage_errors(bad: dict[str, Any]) -> None:
    with pytest.raises(errors.UsageError):
        Settings(**bad).validate()


def test_the_soak_releases_over_three_quarters_of_its_fault_phase_unless_told() -> None:
    told = soak.settings_from(soak.SoakOptions(fault_phase=40.0, release_over=10.0,
                                               concurrency=4))
    assert told.chaos.release_over == 10.0 and told.chaos.concurrency == 4
    default = soak.settings_from(soak.SoakOptions(fault_phase=40.0, batch=8))
    assert default.chaos.release_over == 30.0 and default.chaos.batch == 8
    assert soak.settings_from(soak.SoakOptions(release_over=0.0)).chaos.release_over == 0.0


def test_a_soak_strikes_every_fault_while_work_is_in_flight(faulty_server: Any) -> None:
    """Two soak rounds with every database fault on a short timer: each kind of fault
    struck, every one while work was in flight, and the invariants held."""
    running = faulty_server
    settings = soak.settings_from(soak.SoakOptions(
        workflows=400, round=200, workers=3, fault_phase=12.0, kill_every=600.0,
        restart_postgres_every=4000.0, partition_every=3000.0, disk_full_every=3000.0,
        disk_full_for=1000.0, clock_step_every=3000.0, clock_step_max=5, seed=7,
        concurrency=2))
    try:
        report = soak.run(running.provisioned.dsn, settings, server=running.server,
                          restart=running.crash_restart)
    finally:
        running.server.set_clock(0)
    assert report["verdict"] == "pass", (report["violations"], report["checkers_agree"])
    struck = report["faults_in_flight"]
    for kind in ("worker_sigkill", "postgres_restart", "partition", "disk_full",
                 "clock_step"):
        assert struck.get(kind, {}).get("strikes", 0) >= 1, (kind, struck)
    # A database fault struck only into work in flight, or once the round's work was all
    # done (a minimum still asking for it); and each kind met work in flight.
    for kind in ("postgres_restart", "disk_full", "clock_step"):
        assert struck[kind]["busy"] + struck[kind]["after_work"] == struck[kind]["strikes"], (
            kind, struck)
        assert struck[kind]["busy"] >= 1, (kind, struck)
    assert all(r["release"]["approved"] == 200 for r in report["rounds"])
    assert report["workflows_run"] == 400


def test_an_idle_moment_between_waves_is_not_the_end_of_the_work() -> None:
    # Approvals still to come: an idle system now is a gap between waves, so the fault
    # waits on (here until its phase ends) instead of striking as if the work were done.
    strikes, stop = traffic.Strikes(), threading.Event()
    waves = traffic.Release([traffic.Pending("w1", lambda: None)], over=5.0)
    threading.Timer(0.3, stop.set).start()
    assert not strikes.meet("disk_full", _Flight(math.inf), _Flight(0.0), stop, waves)
    assert strikes.report() == {}
