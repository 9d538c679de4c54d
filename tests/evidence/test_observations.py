"""Observations are measurements: an experiment's ``observe({...})`` must carry values read
back from what it ran, never only constants written in the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.evidence import observations

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"

pytest_plugins = ["pytester"]


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ('observe({"rejected": True, "state": s})', 1),
        ('observe({"a": 1, "b": "x"})', 1),
        ('observe({"effects": 1, "replayed": False})', 2),
        ('observe({"a": [1, 2], "b": -1})', 1),
        ('observe({"error": type(exc).__name__, "label": "SQL-injected"})', 0),
        ('observe({"state": lab.state(j).state, "done": s == "succeeded"})', 0),
    ],
)
def test_the_rule_flags_constants_and_accepts_measurements(source, flagged):
    assert len(observations.constant_observations(source)) == flagged


def test_every_experiment_observation_is_a_measurement():
    files = sorted(EXPERIMENTS.rglob("test_*.py"))
    assert files, "no experiments found"
    found = [
        problem
        for path in files
        for problem in observations.constant_observations(path.read_text(encoding="utf-8"),
                                             str(path.relative_to(EXPERIMENTS)))
    ]
    assert found == []


def test_every_experiment_declares_the_kind_of_every_key():
    """No key of an experiment's observe({...}) is a fact by default (issue 41): each is
    declared in facts= or measurements=, or named as a measurement. The same check fails
    an experiment at collection; keys spread in from a helper are checked when recorded."""
    files = sorted(EXPERIMENTS.rglob("test_*.py"))
    found = [
        problem
        for path in files
        for problems in observations.undeclared_in_source(
            path.read_text(encoding="utf-8"), str(path.relative_to(EXPERIMENTS))).values()
        for problem in problems
    ]
    assert found == []


UNDECLARED = '''
def test_literal(observe):
    """A literal observation with an undeclared key."""
    observe({"seen": int("42"), "took_s": 0.1})


def test_computed(observe):
    """A computed observation with an undeclared key."""
    observe(dict(seen=int("42")))
'''


def _run_undeclared(pytester, *options: str):
    """Run the two undeclared-observation experiments through the real plugin."""
    pytester.makeini("[pytest]\n")
    chapter = pytester.path / "experiments" / "ch01_x"
    chapter.mkdir(parents=True)
    (chapter / "test_a.py").write_text(UNDECLARED)
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", "--lab-postgres=none", *options,
        "experiments")


def test_an_undeclared_key_fails_its_experiment_in_one_line(pytester):
    """Through the real plugin: an undeclared key fails its experiment with one line that
    suggests the declaration; found in the source before the test runs, or when recorded."""
    result = _run_undeclared(pytester, "--lab-no-evidence", "-rf")
    result.assert_outcomes(failed=2)
    hint = ("observe: 'seen' has no declared kind: add facts=('seen',) if every run of the "
            "commit observes the same value, else measurements=('seen',)")
    # Each failure's whole report is the one line (the literal one also names file:line).
    result.stdout.fnmatch_lines([f"test_a.py:4: {hint}", hint])
    assert "Traceback" not in result.stdout.str()


def test_a_refused_experiment_is_noted_as_its_raw_failure(pytester):
    """Through the real plugin: the refusal of a constant or undeclared observation happens
    before the body runs, yet inside the call's innermost wrapper, so the signed log notes
    the call's raw outcome as failed, matching its report (no raw-outcome problem)."""
    result = _run_undeclared(pytester, "--lab-evidence=ev")
    result.assert_outcomes(failed=2)
    lines = [json.loads(x) for x in (pytester.path / "ev" / "tests.jsonl").open()]
    calls = [x for x in lines if x.get("when") == "call"]
    assert [x["outcome"] for x in calls] == ["failed", "failed"]
    assert all(["lab_raw_outcome", "failed"] in x["user_properties"] for x in calls)
    report = json.loads((pytester.path / "ev" / "runtime.json").read_text())
    assert not [f for f in report["gate"]["failures"] if "raw outcome" in f]
