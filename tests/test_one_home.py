"""One home per fact: what the house once wrote twice is defined in exactly one module.

Copies drift (two signer-trust checks, three escapers, a signed limit that contradicted
the code), so each of these facts is held to its one home, read from the AST.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lab.evidence import compiler

LAB = Path(compiler.__file__).resolve().parents[1]


def _modules() -> dict[str, ast.Module]:
    return {
        path.relative_to(LAB.parent).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
        for path in sorted(LAB.rglob("*.py"))
    }


def _defining(name: str) -> list[str]:
    return sorted(
        module
        for module, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
    )


@pytest.mark.parametrize(
    ("function", "home"),
    [
        ("sha256_file", ["lab/evidence/provenance.py", "lab/files.py"]),
        ("translated", ["lab/pg/edge.py"]),
        ("_translated", []),
        ("drop_schema", ["lab/pg/edge.py"]),
    ],
)
def test_a_function_has_one_home(function: str, home: list[str]) -> None:
    """The digest of a file, the psycopg edge and dropping a schema are written once
    (provenance's ``sha256_file`` only wraps ``files.sha256_file`` to record None)."""
    assert _defining(function) == home


def _strings(tree: ast.Module) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def test_the_lease_expiry_question_is_asked_only_by_the_store() -> None:
    """``lease_until <= clock_timestamp()`` (has the lease run out?) is SQL of the store."""
    asking = sorted(
        module for module, tree in _modules().items()
        if any("lease_until <= clock_timestamp()" in s for s in _strings(tree))
    )
    assert asking == ["lab/runtime/store/queries.py"]


def test_provider_modes_are_spelled_once() -> None:
    """The PostgreSQL provider names are literals of ``lab.pg.providers`` only; every
    ``--lab-postgres`` option offers its constants."""
    spelled = sorted(
        module for module, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.List | ast.Tuple | ast.Set)
        and {"auto", "embedded"} <= {e.value for e in node.elts if isinstance(e, ast.Constant)}
    )
    assert spelled == []


def test_limits_are_derived_from_what_the_run_did() -> None:
    """No fixed limit speaks of killing (or not killing) the database server: that
    sentence is derived from the restarts the run recorded."""
    assert not any("database server" in limit or "fsync" in limit
                   for limit in compiler.LIMITS)
    killed = compiler.limits(
        {"provider": "embedded", "details": {"durability": "fsync=off"}},
        [{"nodeid": "a", "outcome": "passed"}],
        restarts={"a": 3},
    )
    quiet = compiler.limits(
        {"provider": "embedded", "details": {"durability": "fsync=off"}},
        [{"nodeid": "a", "outcome": "passed"}],
        restarts={},
    )
    assert any("3 SIGKILLs and restarts" in limit and "in 1 experiment (1 passed)" in limit
               for limit in killed)
    assert any("No experiment of this run killed a database server" in limit
               for limit in quiet)
    assert any("ran with fsync=off" in limit for limit in quiet)
