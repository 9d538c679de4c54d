"""lab/rawoutcome.py: each phase report's outcome against the raw outcome the lab noted."""

from __future__ import annotations

import contextlib
import unittest
from types import SimpleNamespace
from typing import Any, cast

import pytest

from lab import rawoutcome

NODE = "experiments/ch01_x/test_a.py::test_a"


def _record(when: str, outcome: str, *raw: str, nodeid: str = NODE) -> dict[str, Any]:
    """A report-log record of one phase whose report carries the raw outcomes ``raw``."""
    return {"$report_type": "TestReport", "nodeid": nodeid, "when": when, "outcome": outcome,
            "user_properties": [["lab_claim", "A claim."],
                                *([rawoutcome.RAW_OUTCOME, r] for r in raw)]}


@pytest.mark.parametrize(
    "phases",
    [
        pytest.param([("setup", "passed"), ("call", "passed"), ("teardown", "passed")],
                     id="passed"),
        pytest.param([("setup", "passed"), ("call", "failed"), ("teardown", "passed")],
                     id="failed"),
        pytest.param([("setup", "skipped"), ("teardown", "passed")], id="skipped"),
        pytest.param([("setup", "failed"), ("teardown", "failed")], id="error"),
    ],
)
def test_reports_that_say_what_their_phase_did_are_no_problem(
    phases: list[tuple[str, str]],
) -> None:
    """Passes, genuine failures, skips and errors: each report's outcome is its raw one."""
    assert rawoutcome.problems([_record(w, o, o) for w, o in phases]) == []


def test_a_forged_pass_is_named_in_one_line() -> None:
    """A call that raised, reported passed: the node id, the phase and both outcomes."""
    records = [_record("setup", "passed", "passed"), _record("call", "passed", "failed"),
               _record("teardown", "passed", "passed")]
    assert rawoutcome.problems(records) == [
        f"{NODE} call: raw outcome failed, reported passed: something changed the report "
        "after the phase ran"
    ]


def test_an_xfail_is_a_mismatch() -> None:
    """pytest's skipping plugin turns a raw failure into skipped: not silent either."""
    [problem] = rawoutcome.problems([_record("call", "skipped", "failed")])
    assert problem.startswith(f"{NODE} call: raw outcome failed, reported skipped")


def test_a_phase_without_or_with_two_raw_outcomes_is_named() -> None:
    """No raw outcome (the lab never saw the phase) or a second one written by someone
    else: each is a problem naming the phase."""
    found = rawoutcome.problems([_record("setup", "passed"),
                                 _record("call", "passed", "passed", "failed")])
    assert found == [
        f"{NODE} setup: no raw outcome was recorded, reported passed: the lab did not see "
        "the phase it reports",
        f"{NODE} call: 2 raw outcomes recorded (passed, failed), reported passed: something "
        "else wrote lab_raw_outcome",
    ]


def test_a_crashed_workers_report_and_collection_reports_are_not_phases() -> None:
    """xdist's report for a crashed worker's test (phase ``???``, failed anyway) and
    collection reports carry no raw outcome and need none."""
    crashed = _record("???", "failed")
    collected = {"$report_type": "CollectReport", "nodeid": "experiments/x.py",
                 "outcome": "failed"}
    assert rawoutcome.problems([crashed, collected]) == []


def _unittest_skip() -> None:
    raise unittest.SkipTest("no")


@pytest.mark.parametrize(
    ("body", "raw"),
    [
        pytest.param(lambda: None, "passed", id="returns"),
        pytest.param(lambda: pytest.skip("no"), "skipped", id="pytest-skip"),
        pytest.param(_unittest_skip, "skipped", id="unittest-skip"),
        pytest.param(lambda: pytest.fail("no"), "failed", id="pytest-fail"),
        pytest.param(lambda: pytest.xfail("known"), "failed", id="pytest-xfail"),
        pytest.param(lambda: 1 / 0, "failed", id="error"),
    ],
)
def test_noting_tells_a_skip_from_any_other_exception(body: Any, raw: str) -> None:
    """What pytest's report builder counts as a skip is skipped; every other exception is
    failed (an xfail too: its report says skipped, so it cannot pass silently)."""
    item = cast(pytest.Item, SimpleNamespace(stash=pytest.Stash()))
    with contextlib.suppress(BaseException), rawoutcome.noting(item, "call"):
        body()
    assert item.stash[rawoutcome._noted] == {"call": raw}
