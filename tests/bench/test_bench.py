"""The benchmark's pure parts: percentiles, transaction accounting, parsing. No timing asserts."""

from __future__ import annotations

import textwrap
from datetime import timedelta

import pytest

from lab import cli, harness
from lab.bench import claim, measure, rounds, suite, throughput
from lab.bench.throughput import Config
from lab.bench.window import Sample, Window


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    values = [float(v) for v in range(1, 101)]
    assert measure.percentile(values, 50) == pytest.approx(50.5)
    assert measure.percentile(values, 99) == pytest.approx(99.01)
    assert measure.percentile(values, 0) == 1.0
    assert measure.percentile(values, 100) == 100.0
    assert measure.percentile([3.0, 1.0, 2.0], 50) == 2.0  # order of input does not matter
    assert measure.percentile([7.0], 99) == 7.0


@pytest.mark.parametrize(("values", "q"), [([], 50), ([1.0], -1), ([1.0], 101)])
def test_percentile_refuses_nonsense(values: list[float], q: float) -> None:
    with pytest.raises(ValueError):
        measure.percentile(values, q)


def test_latency_summary_reports_milliseconds_and_nothing_for_no_samples() -> None:
    assert measure.latency_summary([0.010, 0.020, 0.030]) == {
        "p50_ms": 20.0, "p99_ms": pytest.approx(29.8), "max_ms": 30.0
    }
    assert measure.latency_summary([]) == {"p50_ms": None, "p99_ms": None, "max_ms": None}


def test_ratio_is_none_when_a_side_is_missing_or_zero() -> None:
    assert measure.ratio(3.0, 2.0) == 1.5
    assert measure.ratio(None, 2.0) is None
    assert measure.ratio(3.0, None) is None
    assert measure.ratio(3.0, 0.0) is None


def test_xact_delta_subtracts_the_benchmarks_own_reads() -> None:
    before = {"store": 100, "tool": 10}
    after = {"store": 520, "tool": 110}
    assert measure.xact_delta(before, after) == {"store": 420, "tool": 100}
    assert measure.xact_delta(before, after, own={"store": 20}) == {"store": 400, "tool": 100}


def test_xact_delta_refuses_snapshots_of_different_databases() -> None:
    with pytest.raises(ValueError, match="disagree"):
        measure.xact_delta({"store": 1}, {"tool": 2})


def test_separate_databases_measure_the_tool_share() -> None:
    split = measure.split_transactions(
        {"store": 400, "tool": 103}, system_db="store", tool_db="tool", tool_calls=100
    )
    assert split == {"total": 503, "system": 400, "tool": 103, "tool_measured": True}


def test_a_shared_database_estimates_one_tool_transaction_per_call() -> None:
    split = measure.split_transactions(
        {"db": 500}, system_db="db", tool_db="db", tool_calls=100
    )
    assert split == {"total": 500, "system": 400, "tool": 100, "tool_measured": False}


def test_marginal_cost_removes_the_empty_runs_fixed_cost() -> None:
    run = {"total": 5_040, "system": 4_030, "tool": 1_010}
    empty = {"total": 40, "system": 30, "tool": 10}
    assert measure.marginal_per_workflow(run, empty, 1_000) == {
        "total": 5.0, "system": 4.0, "tool": 1.0
    }
    with pytest.raises(ValueError):
        measure.marginal_per_workflow(run, empty, 0)


def test_rounds_alternate_so_drift_cancels() -> None:
    assert measure.alternating_order(3, ["lab", "dbos"]) == [
        ["lab", "dbos"], ["dbos", "lab"], ["lab", "dbos"]
    ]
    assert measure.alternating_order(2, ["lab"]) == [["lab"], ["lab"]]


DURATIONS = """\
============================= slowest durations ==============================
3.21s call     experiments/ch05_crashes/test_crashes.py::test_sigkill_after_claim
0.40s setup    experiments/ch05_crashes/test_crashes.py::test_sigkill_after_claim
0.30s call     experiments/ch07_retries/test_retries.py::test_trusted_429_uses_timed_retry[a]
0.31s call     experiments/ch07_retries/test_retries.py::test_trusted_429_uses_timed_retry[b]
0.01s teardown experiments/ch05_crashes/test_crashes.py::test_sigkill_after_claim
26 passed in 9.12s
"""


def test_parse_durations_reads_pytests_slowest_durations_section() -> None:
    rows = measure.parse_durations(DURATIONS)
    assert len(rows) == 5
    assert rows[0] == (
        "experiments/ch05_crashes/test_crashes.py::test_sigkill_after_claim",
        "call",
        3.21,
    )
    assert {phase for _, phase, _ in rows} == {"setup", "call", "teardown"}


SOURCE = textwrap.dedent(
    """
    from datetime import timedelta

    def test_two_lease_waits(lab):
        lab.recover_by_elapsed_lease(a)
        lab.recover_by_elapsed_lease(b)

    def test_backoff(lab):
        rig.worker.backoff = timedelta(milliseconds=250)
        lab.wait_until(lambda: True)

    def test_no_wait(lab):
        rig.worker.backoff = timedelta(0)

    def test_chaos(lab_dsn):
        chaos.run(lab_dsn, chaos.Settings(workflows=120, duration=20.0, seed=1))

    def helper(lab):
        lab.recover_by_elapsed_lease(c)
    """
)


def test_known_waits_count_lease_expiries_backoffs_and_fault_phases_only() -> None:
    waits = measure.known_waits(SOURCE, lease_seconds=3.0)
    assert waits == {"test_two_lease_waits": 6.0, "test_backoff": 0.25, "test_chaos": 20.0}


def test_suite_breakdown_splits_wall_time() -> None:
    durations = measure.parse_durations(DURATIONS)
    waits = {
        "test_sigkill_after_claim": 30.0,  # an upper bound beyond the test's time is capped
        "test_trusted_429_uses_timed_retry": 0.25,
        "test_not_in_this_run": 99.0,
    }
    figures = suite.suite_breakdown(10.0, durations, waits)
    assert figures["tests"] == 3
    # Each parametrized instance waits its own backoff; the 30 s bound is capped at 3.62 s.
    assert figures["inherent_wait_seconds"] == pytest.approx(4.12)
    assert figures["inherent_share_of_wall"] == 0.412
    assert figures["overhead_seconds"] == pytest.approx(5.88)
    assert figures["outside_tests_seconds"] == pytest.approx(10.0 - 4.23)
    assert figures["longest_test_seconds"] == pytest.approx(3.62)
    parallel = suite.suite_breakdown(2.0, durations, waits, serial=False)
    # Under xdist the tests overlap: time outside them and shares are not defined.
    assert parallel["outside_tests_seconds"] is None
    assert parallel["inherent_share_of_wall"] is None


def test_dbos_url_carries_the_admin_dsns_server_and_credentials() -> None:
    scratch = measure.Scratch(
        "host=127.0.0.1 port=55440 user=lab password=p@ss dbname=postgres",
        "s", "t", "lab_bench_x_dbos", separate=True,
    )
    assert scratch.dbos_url() == "postgresql://lab:p%40ss@127.0.0.1:55440/lab_bench_x_dbos"
    assert scratch.databases() == ["lab_bench_x_dbos", "s", "t"]


def test_literal_timedelta_ignores_what_it_cannot_evaluate() -> None:
    assert measure.known_waits("def test_x():\n    w.backoff = timedelta(seconds=n)\n", 3.0) == {}
    assert timedelta(milliseconds=250).total_seconds() == 0.25


def test_clone_query_overrides_identity_and_copies_every_other_column() -> None:
    text = claim.clone_query(["id", "tenant", "trace_id", "state"]).as_string(None)
    assert text.startswith('INSERT INTO workflows ("id", "tenant", "trace_id", "state") SELECT ')
    assert "%(prefix)s::text || g" in text
    assert 't."tenant"' in text and 't."trace_id"' in text
    assert 't."id"' not in text and 't."state"' not in text
    assert "generate_series(1, %(count)s)" in text


def test_the_benchmarks_lease_is_the_experiments_lease() -> None:
    assert harness.SEED_LEASE.total_seconds() == measure.SEED_LEASE_SECONDS


def test_sweep_covers_each_systems_configuration_space_interleaved() -> None:
    configs = throughput.sweep_configs([2, 4], [2], [1, 16], [0.005])
    assert [c.label for c in configs] == [
        "lab p2", "lab p4", "dbos p2 c1 poll 5ms", "dbos p2 c16 poll 5ms"]
    rounds = throughput.sweep_order(configs, 2)
    assert [c.label for c in rounds[0]] == [
        "lab p2", "dbos p2 c1 poll 5ms", "lab p4", "dbos p2 c16 poll 5ms"]
    assert rounds[1] == list(reversed(rounds[0]))


def test_compare_names_best_against_best_and_equal_process_ratios() -> None:
    medians: dict[Config, float | None] = {
        Config("lab", 2): 100.0, Config("lab", 4): 150.0,
        Config("dbos", 2, 16, 0.005): 80.0, Config("dbos", 4, 8, 0.005): 120.0,
        Config("dbos", 4, 1, 0.005): None,
    }
    result = throughput.compare(medians)
    assert result["best_lab"] == "lab p4" and result["best_dbos"] == "dbos p4 c8 poll 5ms"
    assert result["best_against_best"] == 1.25
    assert result["at_equal_processes"]["2"]["ratio"] == 1.25
    assert result["at_equal_processes"]["4"] == {
        "lab": "lab p4", "dbos": "dbos p4 c8 poll 5ms", "ratio": 1.25}


@pytest.mark.parametrize("argv", [
    ["bench", "throughput", "--sweep"],
    ["bench", "throughput", "--workflows", "0"],
    ["bench", "throughput", "--sweep", "--peer", "dbos", "--dbos-concurrency", "x"],
    ["bench", "throughput", "--sweep", "--peer", "dbos", "--dbos-poll", "0"],
    ["bench", "throughput", "--noise", "-1"],
    ["bench", "throughput", "--noise", "1,4"],
    ["bench", "throughput", "--concurrency", "0"],
    ["bench", "throughput", "--concurrency", "65"],
    ["bench", "throughput", "--min-seconds", "-1"],
])
def test_bad_bench_arguments_exit_2_before_any_server_starts(argv, capsys) -> None:
    assert cli.main([*argv, "--lab-postgres", "dsn"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_lab_round_counts_its_worker_processes_cpu(lab_dsn: str) -> None:
    """The meter counts reaped children: the measured workers must be this process's
    own (a worker forked from the fork server was counted as 0.000 ms/workflow)."""
    scratch = measure.Scratch.create(lab_dsn)
    try:
        result = rounds.lab_round(scratch, 20, throughput.Config("lab", 1))
    finally:
        scratch.drop()
    assert result.succeeded == 20
    assert (result.cpu["drain_worker_cpu_seconds"] or 0) > 0, result.cpu
    # The window, release to last completion, is measured and its CPU counted in it.
    assert (result.seconds or 0) > 0 and result.cpu["window_workers_cpu_seconds"] > 0


def test_sweep_names_concurrency_and_batch_apart() -> None:
    configs = throughput.sweep_configs([2], [2], [8], [0.005], lab_batch=[1, 8],
                                       lab_concurrency=[1, 8])
    assert [c.label for c in configs] == [
        "lab p2", "lab p2 b8", "lab p2 c8", "dbos p2 c8 poll 5ms"]
    assert [(c.in_flight, c.blast_radius) for c in configs] == [(1, 1), (8, 8), (8, 1), (8, 1)]


def test_blast_radius_compares_at_equal_processes_and_in_flight_work() -> None:
    medians: dict[Config, float | None] = {
        Config("lab", 2, 8): 300.0, Config("lab", 2, 1, batch=8): 600.0,
        Config("dbos", 2, 8, 0.005): 100.0, Config("dbos", 2, 8, 0.05): 50.0,
        Config("lab", 2): 90.0,
    }
    tables = throughput.blast_radius(medians)
    assert tables["one_per_transaction"] == [
        {"processes": 2, "in_flight": 1, "lab_concurrency": 90.0, "dbos": None,
         "lab_over_dbos": None},
        {"processes": 2, "in_flight": 8, "lab_concurrency": 300.0, "dbos": 100.0,
         "lab_over_dbos": 3.0}]
    assert tables["whole_batch_per_transaction"] == [
        {"processes": 2, "in_flight": 8, "lab_batch": 600.0, "lab_concurrency": 300.0,
         "dbos": 100.0, "batch_over_concurrency": 2.0, "batch_over_dbos": 6.0}]


def test_round_size_lasts_the_minimum_at_the_probes_rate() -> None:
    probe = rounds.RunResult(Config("lab", 1), 100, 2.0, 100, 0, {}, {}, {})
    assert rounds.round_size(probe, 100, 10.0) == 600  # 50 wf/s x 10 s, a fifth more
    slow = rounds.RunResult(Config("lab", 1), 100, 20.0, 100, 0, {}, {}, {})
    assert rounds.round_size(slow, 100, 10.0) == 100


def test_window_reads_each_share_at_the_last_completion() -> None:
    """CPU after the last completion (idle polls, exit) is interpolated away."""
    window = Window(postmaster=None)
    window.samples = [
        Sample(at=100.0, load=1.0, busy_ticks=0, total_ticks=0, workers=1.0, server=10.0,
               own=5.0),
        Sample(at=101.0, load=3.0, busy_ticks=100, total_ticks=200, workers=2.0, server=12.0,
               own=5.5),
        Sample(at=102.0, load=5.0, busy_ticks=200, total_ticks=400, workers=4.0, server=12.0,
               own=6.0),
    ]
    figures = window.figures(101.5)
    assert figures["window_seconds"] == 1.5
    assert figures["window_workers_cpu_seconds"] == 2.0  # 1.0 -> 3.0 halfway to 4.0
    assert figures["window_server_cpu_seconds"] == 2.0
    assert figures["window_bench_cpu_seconds"] == 0.75
    assert figures["window_all_cpu_seconds"] == 4.75
    assert (figures["load_mean"], figures["load_max"]) == (2.0, 3.0)
    assert window.figures(None) == {"window_seconds": None}


def test_a_round_shorter_than_the_minimum_is_run_again_sized_from_its_own_rate() -> None:
    sizes: list[int] = []

    def run(config: Config, workflows: int) -> rounds.RunResult:
        sizes.append(workflows)  # 100 wf/s whatever the size: 300 end in 3 s
        return rounds.RunResult(config, workflows, workflows / 100.0, workflows, 0, {}, {}, {})

    result = throughput._measured(run, Config("lab", 1), 300, 10.0)
    assert sizes == [300, 1200] and result.workflows == 1200
