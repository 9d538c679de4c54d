"""Observations are measurements: an experiment's ``observe({...})`` must carry values read
back from what it ran, never only constants written in the test."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab import pytest_plugin

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


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
    assert len(pytest_plugin.constant_observations(source)) == flagged


def test_every_experiment_observation_is_a_measurement():
    files = sorted(EXPERIMENTS.rglob("test_*.py"))
    assert files, "no experiments found"
    found = [
        problem
        for path in files
        for problem in pytest_plugin.constant_observations(path.read_text(encoding="utf-8"),
                                             str(path.relative_to(EXPERIMENTS)))
    ]
    assert found == []
