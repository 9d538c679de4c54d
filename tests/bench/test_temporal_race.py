"""Temporal in ``lab bench throughput``: its configurations, its place in the sweep's table
and comparison, its share of the CPU, and one small real round. No timing asserts."""

from __future__ import annotations

import os

import pytest
from rich.console import Console

from lab import cli
from lab.bench import command, measure, temporal_round, throughput
from lab.bench.throughput import Config
from lab.bench.window import Sample, Window


def test_temporal_configurations_are_processes_by_activities_by_workflow_tasks() -> None:
    configs = throughput.sweep_configs([2], [2], [8], [0.005], temporal_processes=[1, 2],
                                       temporal_activities=[1, 8], temporal_workflow_tasks=[4])
    temporal = [c for c in configs if c.system == "temporal"]
    assert [c.label for c in temporal] == ["temporal p1 a1 wt4", "temporal p1 a8 wt4",
                                           "temporal p2 a1 wt4", "temporal p2 a8 wt4"]
    assert temporal[-1].to_json() == {"system": "temporal", "processes": 2,
                                      "max_concurrent_activities": 8,
                                      "max_concurrent_workflow_tasks": 4}
    assert temporal[-1].in_flight == 8


def test_a_peer_without_processes_is_left_out_of_the_sweep() -> None:
    configs = throughput.sweep_configs([2], [], [8], [0.005], temporal_processes=[2])
    assert [c.system for c in configs] == ["lab", "temporal"]


def test_the_sweep_interleaves_all_three_systems_and_reverses_every_other_round() -> None:
    configs = throughput.sweep_configs([2, 4], [2], [1], [0.005], temporal_processes=[2],
                                       temporal_activities=[1, 8])
    rounds = throughput.sweep_order(configs, 2)
    assert [c.label for c in rounds[0]] == [
        "lab p2", "dbos p2 c1 poll 5ms", "temporal p2 a1 wt1",
        "lab p4", "temporal p2 a8 wt1"]
    assert rounds[1] == list(reversed(rounds[0]))


def test_compare_names_best_against_best_for_each_peer() -> None:
    medians: dict[Config, float | None] = {
        Config("lab", 2): 100.0, Config("lab", 4): 150.0,
        Config("dbos", 4, 8, 0.005): 120.0,
        Config("temporal", 2, 8, workflow_tasks=4): 50.0,
        Config("temporal", 2, 1, workflow_tasks=1): 25.0,
    }
    result = throughput.compare(medians)
    # DBOS keeps its top-level keys; every peer measured has its own entry.
    assert result["best_dbos"] == "dbos p4 c8 poll 5ms" and result["best_against_best"] == 1.25
    assert result["peers"]["temporal"] == {
        "best": "temporal p2 a8 wt4", "best_wf_s": 50.0, "best_against_best": 3.0,
        "at_equal_processes": {"2": {"lab": "lab p2", "temporal": "temporal p2 a8 wt4",
                                     "ratio": 2.0}}}
    assert set(result["peers"]) == {"dbos", "temporal"}
    alone = throughput.compare({Config("lab", 2): 100.0,
                                Config("temporal", 2, 1, workflow_tasks=1): 20.0})
    assert set(alone["peers"]) == {"temporal"} and alone["best_against_best"] is None


def _row(config: Config, rate: float, peer_server: float | None) -> dict[str, object]:
    return {**config.to_json(), "label": config.label, "in_flight": config.in_flight,
            "workflows_per_second_median": rate, "round_workflows": 300,
            "xacts_per_workflow_median": None if config.system == "temporal" else 4.0,
            "wal_syncs_per_workflow_median": 1.0,
            "cpu_ms_per_workflow_median": {"workers": 1.0, "bench_and_tool": 0.5,
                                           "postgres": 0.25, "peer_server": peer_server,
                                           "all": 3.0},
            "share_of_ceiling_commits": None, "load_mean": 1.0, "load_max": 2.0,
            "other_cores": 0.1, "idle_cores": 0.2, "all_succeeded": True}


def _text(table: object) -> str:
    console = Console(width=400, record=True)
    console.print(table)
    return console.export_text()


def test_the_sweep_table_prints_temporal_beside_the_lab_and_dbos_with_its_servers_cpu() -> None:
    report = {"repeat": 1, "min_round_seconds": 10.0}
    rows = [_row(Config("lab", 2), 100.0, None), _row(Config("dbos", 2, 8, 0.005), 80.0, None),
            _row(Config("temporal", 2, 8, workflow_tasks=4), 40.0, 7.5)]
    text = _text(throughput.sweep_table(report, {"noise": 0, "configs": rows}))
    assert "temporal p2 a8 wt4" in text and "dbos p2 c8 poll 5ms" in text
    assert "/ tsrv" in text and "1.000 / 0.500 / 0.250 / 7.500" in text
    assert "not counted" in text  # Temporal's own transactions are in SQLite
    without = _text(throughput.sweep_table(report, {"noise": 0, "configs": rows[:2]}))
    assert "tsrv" not in without and "1.000 / 0.500 / 0.250 " in without


def test_the_sweep_prints_best_against_best_for_each_peer_and_the_sqlite_limit() -> None:
    lab, temporal = Config("lab", 2), Config("temporal", 2, 8, workflow_tasks=4)
    medians: dict[Config, float | None] = {lab: 100.0, temporal: 40.0}
    sitting = {"noise": 0, "configs": [_row(lab, 100.0, None), _row(temporal, 40.0, 7.5)],
               "ceiling": {"commits_per_second": 500.0, "before": {"commits_per_second": 500.0},
                           "after": {"commits_per_second": 490.0}},
               "comparison": throughput.compare(medians), "goal_best_against_best": 2.0,
               "blast_radius": throughput.blast_radius(medians)}
    report = {"repeat": 1, "min_round_seconds": 10.0, "sittings": [sitting],
              "limits": [throughput.TEMPORAL_LIMIT]}
    console = Console(width=400, record=True)
    command._print_sweep(report, console)
    text = console.export_text()
    assert "best Temporal: temporal p2 a8 wt4 at 40.0 wf/s" in text
    assert "best against best (lab / Temporal): 2.500" in text
    assert "at 2 processes: lab p2 / temporal p2 a8 wt4 = 2.500" in text
    assert "SQLite" in text and "best DBOS" not in text


def test_the_sweep_prints_the_machines_speed_beside_its_figures() -> None:
    """Each sitting times a fixed Python loop before and after it: the same loop's CPU
    time moves with a shared VM's speed, and so does every CPU figure."""
    speed = measure.cpu_speed(runs=2)
    assert speed["loop_steps"] == measure.SPEED_LOOP_STEPS and speed["runs"] == 2
    assert 0 < speed["cpu_seconds_min"] <= speed["cpu_seconds_max"]
    lab = Config("lab", 2)
    medians: dict[Config, float | None] = {lab: 100.0}
    sitting = {"noise": 0, "configs": [_row(lab, 100.0, None)],
               "ceiling": {"commits_per_second": 500.0, "before": {"commits_per_second": 500.0},
                           "after": {"commits_per_second": 490.0}},
               "cpu_speed": {"before": {**speed, "cpu_seconds_min": 0.5, "cpu_seconds_max": 0.6},
                             "after": {**speed, "cpu_seconds_min": 0.7, "cpu_seconds_max": 0.9}},
               "comparison": throughput.compare(medians), "goal_best_against_best": 2.0,
               "blast_radius": throughput.blast_radius(medians)}
    report = {"repeat": 1, "min_round_seconds": 10.0, "sittings": [sitting], "limits": []}
    console = Console(width=400, record=True)
    command._print_sweep(report, console)
    text = console.export_text()
    assert (f"machine speed: a {measure.SPEED_LOOP_STEPS:,}-step Python loop took 0.5-0.6 s "
            "of CPU before the sitting and 0.7-0.9 s after it") in text


@pytest.mark.parametrize("argv", [
    ["bench", "throughput", "--sweep", "--peer", "dbos", "--peer", "dbos"],
    ["bench", "throughput", "--peer", "dbos", "--peer", "temporal"],
    ["bench", "throughput", "--sweep", "--peer", "temporal", "--temporal-activities", "0"],
    ["bench", "throughput", "--sweep", "--peer", "temporal", "--temporal-workflow-tasks", "x"],
    ["bench", "throughput", "--sweep", "--peer", "temporal", "--temporal-processes", "-1"],
])
def test_bad_temporal_bench_arguments_exit_2_before_any_server_starts(argv, capsys) -> None:
    assert cli.main([*argv, "--lab-postgres", "dsn"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_every_peer_named_races_in_the_one_sitting() -> None:
    args = cli.build_parser().parse_args(
        ["bench", "throughput", "--sweep", "--peer", "dbos", "--peer", "temporal",
         "--temporal-activities", "1,8", "--temporal-workflow-tasks", "2"])
    options = cli.options_from(command.ThroughputOptions, args)
    assert options.peers == ("dbos", "temporal") and options.sweep
    assert (options.temporal_activities, options.temporal_workflow_tasks) == ("1,8", "2")


def test_an_orchestrator_outside_postgresql_counts_only_the_tools_transactions() -> None:
    split = measure.split_transactions({"tool": 103}, system_db=None, tool_db="tool",
                                       tool_calls=100)
    assert split["tool"] == 103 and split["total"] is None and split["system"] is None


def test_the_window_counts_a_peers_own_server_among_every_process() -> None:
    window = Window(postmaster=None)
    window.samples = [
        Sample(at=100.0, load=1.0, busy_ticks=0, total_ticks=0, workers=1.0, server=10.0,
               own=5.0, peer_server=20.0),
        Sample(at=102.0, load=1.0, busy_ticks=0, total_ticks=0, workers=3.0, server=11.0,
               own=6.0, peer_server=24.0),
    ]
    figures = window.figures(102.0)
    assert figures["window_peer_server_cpu_seconds"] == 4.0
    assert figures["window_all_cpu_seconds"] == 8.0  # 2 workers + 1 own + 1 PostgreSQL + 4


def test_a_temporal_round_drains_its_backlog_and_counts_its_servers_cpu(lab_dsn: str) -> None:
    """A real round, small: a dev server of its own (stopped after), one gated worker
    process, the tool's ledger in PostgreSQL; every workflow completes, the window holds
    the Temporal server's CPU, and its SQLite transactions are not claimed as counted."""
    scratch = measure.Scratch.create(lab_dsn)
    try:
        run = temporal_round.TemporalRounds(scratch, measure.server_pid(lab_dsn))
        result = run(Config("temporal", 1, 2, workflow_tasks=2), 10)
    finally:
        scratch.drop()
    assert result.succeeded == 10 and result.http_calls >= 10
    assert (result.seconds or 0) > 0
    assert result.cpu["window_peer_server_cpu_seconds"] > 0, result.cpu
    assert result.cpu["window_workers_cpu_seconds"] > 0, result.cpu
    assert result.xacts["system"] is None and result.xacts["tool"] >= 10
    assert run.described["persistence"] == "sqlite file"
    assert result.latency_claim["p50_ms"] is not None
    # The round's server is stopped: no Temporal server outlives its round.
    assert run._known is not None and not _alive(run._known.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_blast_radius_one_puts_temporals_activities_beside_dbos_at_equal_work_in_flight() -> None:
    medians: dict[Config, float | None] = {
        Config("lab", 2, 8): 300.0, Config("dbos", 2, 8, 0.005): 100.0,
        Config("temporal", 2, 8, workflow_tasks=1): 30.0,
        Config("temporal", 2, 8, workflow_tasks=4): 60.0,
    }
    rows = throughput.blast_radius(medians)["one_per_transaction"]
    assert rows == [{"processes": 2, "in_flight": 8, "lab_concurrency": 300.0, "dbos": 100.0,
                     "lab_over_dbos": 3.0, "temporal": 60.0, "lab_over_temporal": 5.0}]
    sitting = {"noise": 0, "blast_radius": throughput.blast_radius(medians),
               "configs": [_row(c, v or 0.0, None) for c, v in medians.items()]}
    text = _text(throughput.blast_radius_tables(sitting)[0])
    assert "Temporal max_concurrent_activities" in text and "5.000" in text
