"""Experiments use only the lab's public authoring face.

``lab.harness.PUBLIC_MODULES`` names what an experiment may import; the plugin's
fixtures (``lab``, ``observe``, ``reached_database``, ``evidence_artifact``) and the
top-level ``conftest.py`` (``killable_postgres``, ``killable_lab``) reach the internals
for it. No experiment imports the plugin, the recorder, the evidence, the PostgreSQL
providers or worker processes, nor any ``_private`` name of the lab.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from lab import harness

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
GUIDE = ROOT / "docs" / "authoring.md"


def _public(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in harness.PUBLIC_MODULES)


def private_uses(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` imports a lab module outside the public face, or a ``_private``
    name from a lab module (``from lab.x import _y``, ``module._y`` on an imported one)."""
    found: list[str] = []
    lab_names: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lab":
                    if not _public(alias.name):
                        found.append(f"{where}: imports {alias.name}")
                    lab_names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and (
            node.module.split(".")[0] == "lab"
        ):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if alias.name.startswith("_"):
                    found.append(f"{where}: imports the private {name}")
                elif node.module == "lab" or "." not in node.module.removeprefix("lab."):
                    # ``from lab import x`` / ``from lab.runtime import x``: x is a module.
                    if not _public(name):
                        found.append(f"{where}: imports {name}")
                    lab_names.add(alias.asname or alias.name)
                elif not _public(node.module):
                    found.append(f"{where}: imports from {node.module}")
    for node in ast.walk(ast.parse(source, filename)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                and node.value.id in lab_names):
            found.append(f"{filename}:{node.lineno}: uses the private "
                         f"{node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("from lab import pytest_plugin", 1),
        ("from lab import recorder, harness", 1),
        ("from lab.pg import cluster", 1),
        ("import lab.evidence.gate", 1),
        ("from lab.runtime.processes import spawn_worker", 1),
        ("from lab.harness import _private", 1),
        ("from lab import harness\nharness._t0", 1),
        ("from lab import errors, harness, protocol\nfrom lab.runtime import store", 0),
        ("from lab.faults import chaos, proxy\nfrom lab.peers import dbos_peer", 0),
        ("from lab.runtime.plan import Plan", 0),
        ("import json\njson._default_encoder", 0),
    ],
)
def test_the_rule_flags_internals_and_accepts_the_face(source: str, flagged: int) -> None:
    assert len(private_uses(source)) == flagged, private_uses(source)


def test_no_experiment_imports_a_private_module_or_a_plugin_internal() -> None:
    """Every experiment imports only modules of ``harness.PUBLIC_MODULES`` and no private
    name of the lab."""
    files = sorted(EXPERIMENTS.rglob("*.py"))
    assert files, "no experiments found"
    found = [problem for path in files
             for problem in private_uses(path.read_text(encoding="utf-8"),
                                         str(path.relative_to(ROOT)))]
    assert found == []


def test_the_public_modules_exist_and_the_guide_lists_them() -> None:
    """Every public module imports, and the guide's "public face" names each of them."""
    import importlib

    guide = GUIDE.read_text(encoding="utf-8")
    for module in harness.PUBLIC_MODULES:
        importlib.import_module(module)
        assert f"`{module}`" in guide, f"the guide does not name {module}"


def test_the_top_level_conftest_is_tracked() -> None:
    """The repository's conftest.py is git-tracked, so the evidence can hash it and the
    gate accepts a run that loaded it."""
    listed = subprocess.run(["git", "ls-files", "conftest.py"], cwd=ROOT, capture_output=True,
                            text=True, check=True, timeout=30).stdout.split()
    assert listed == ["conftest.py"]
