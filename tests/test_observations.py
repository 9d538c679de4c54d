"""Observations are measurements: an experiment's ``observe({...})`` must carry values read
back from what it ran, never only constants written in the test."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def _constant(node: ast.expr) -> bool:
    """True for a value fixed in the source: a literal, or a container of literals."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
        return True
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return all(_constant(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(v is not None and _constant(v) for v in node.values)
    return False


def constant_observations(source: str, filename: str = "<source>") -> list[str]:
    """Where ``observe`` is given a dict whose values are all constants, or a literal boolean.

    A literal ``True`` or ``False`` states a conclusion rather than what was read back;
    a string label (how a fault was injected) is fine beside measured values.
    """
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "observe" and node.args):
            continue
        value = node.args[0]
        where = f"{filename}:{node.lineno}"
        if _constant(value):
            found.append(f"{where}: every value of the observation is a constant")
            continue
        if isinstance(value, ast.Dict):
            for key, item in zip(value.keys, value.values, strict=True):
                if isinstance(item, ast.Constant) and isinstance(item.value, bool):
                    name = key.value if isinstance(key, ast.Constant) else "?"
                    found.append(f"{where}: {name!s} is the literal {item.value}")
    return found


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ('observe({"rejected": True, "state": s})', 1),
        ('observe({"a": 1, "b": "x"})', 1),
        ('observe({"a": [1, 2], "b": -1})', 1),
        ('observe({"error": type(exc).__name__, "label": "SQL-injected"})', 0),
        ('observe({"state": lab.state(j).state, "done": s == "succeeded"})', 0),
    ],
)
def test_the_rule_flags_constants_and_accepts_measurements(source, flagged):
    assert len(constant_observations(source)) == flagged


def test_every_experiment_observation_is_a_measurement():
    files = sorted(EXPERIMENTS.rglob("test_*.py"))
    assert files, "no experiments found"
    found = [
        problem
        for path in files
        for problem in constant_observations(path.read_text(encoding="utf-8"),
                                             str(path.relative_to(EXPERIMENTS)))
    ]
    assert found == []
