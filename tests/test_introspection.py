"""Introspection never provisions, and a pytest process pays only for what it uses.

``pytest --fixtures``, ``--collect-only``, ``--co -q``, ``--markers``, ``--help``,
``--version`` (and ``--fixtures-per-test``, ``--setup-plan``) describe the suite: they
start no PostgreSQL, write no evidence and print no gate. The lab plugin is loaded by
every pytest process, so it imports neither psycopg, httpx nor llama_cpp until a
fixture needs them. Both are checked in a fresh interpreter through the real entry
point, on a tree with experiments and a manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import labtree

pytest_plugins = ["pytester"]

OPTIONS = [
    ["--fixtures"],
    ["--collect-only"],
    ["--co", "-q"],
    ["--markers"],
    ["--help"],
    ["--version"],
    ["--fixtures-per-test"],
    ["--setup-plan"],
]
# What a describing run must never import: the drivers, the model, and the provisioner.
HEAVY = ("psycopg", "httpx", "llama_cpp", "lab.pg.cluster", "lab.runtime.store", "lab.harness")

SCRIPT = """
import json, sys
import pytest

options = json.loads(sys.argv[1])
codes = []
for args in options:
    codes.append(int(pytest.main([*args, "-p", "no:hypothesispytest", "experiments"])))
heavy = [name for name in json.loads(sys.argv[2]) if name in sys.modules]
print("RESULT " + json.dumps({"codes": codes, "heavy": heavy}))
"""

EXPERIMENT = '''
def test_db(lab, observe):
    """Needs the database."""
    observe({"state": lab.state(lab.approved().id).state}, facts=("state",))
'''


def _run(root: object, options: list[list[str]]) -> tuple[dict[str, object], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "BOOK_"))}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(options), json.dumps(HEAVY)],
        cwd=str(root), env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, object] = json.loads(line[len("RESULT "):])
    return result, done.stdout + done.stderr


@pytest.fixture
def tree(pytester: pytest.Pytester) -> pytest.Pytester:
    """A tree the real plugin would run against PostgreSQL, were it asked to run it."""
    (pytester.path / "experiments" / "ch01_x").mkdir(parents=True)
    (pytester.path / "experiments" / "ch01_x" / "test_a.py").write_text(EXPERIMENT)
    labtree.publishable(pytester.path, [{"chapter": "ch01_x", "name": "test_db", "results": 1}])
    return pytester


def test_introspection_starts_nothing_and_writes_nothing(tree: pytest.Pytester) -> None:
    """Each describing run exits 0, leaves no evidence/, prints no gate, and never
    imports the provisioner (so no PostgreSQL can have started) nor any driver."""
    result, output = _run(tree.path, OPTIONS)
    assert result["codes"] == [0] * len(OPTIONS), output[-3000:]
    assert result["heavy"] == [], output[-3000:]
    assert not (tree.path / "evidence").exists()
    assert "lab evidence" not in output and "gate:" not in output
    assert "lab: no PostgreSQL (--fixtures starts no PostgreSQL)" in output
    assert "lab_schema" in output  # --fixtures did describe the lab's fixtures


def test_pytest_help_imports_no_driver() -> None:
    """`pytest --help` in a fresh interpreter imports neither psycopg, httpx nor llama_cpp."""
    result, output = _run(os.getcwd(), [["--help"]])
    assert result["codes"] == [0], output[-3000:]
    assert result["heavy"] == [], output[-3000:]
