"""Experiment trees that can pass the gate, for tests that run an inner pytest.

A publishable run needs what the lab's gate asks of the real repository: the seed's
26 experiments declared, run and passed (``lab.evidence.seed``), ``lab`` imported from the
hashed sources (here a symlink to the package under test, so the tree's ``lab/``
is the code that runs), and a clean git checkout whose conftest is tracked.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import lab
from lab.evidence.seed import SEED_EXPERIMENTS

# Seed stand-ins live in files named test_seed_<chapter>.py (unique module names).
SEED_FILE = "test_seed_"
# What inner runs write into a tree (evidence, pytester's files, caches): never "dirty".
IGNORED = "".join(
    f"{line}\n"
    for line in ("__pycache__/", "/evidence*/", "/ev-*/", "/out/", "/runpytest-*", "/stdout",
                 "/stderr", "/.pytest_cache/")
)


def _stand_ins(entries: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The seed experiments ``entries`` do not provide themselves."""
    given = {(e.get("chapter"), e.get("name")) for e in entries}
    return [seed for seed in SEED_EXPERIMENTS if seed not in given]


def seed_entries(entries: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Manifest entries of the seed floor's stand-ins (pure: no database)."""
    return [
        {"chapter": chapter, "name": name, "results": 1, "database": False, "seed": True}
        for chapter, name in _stand_ins(entries or [])
    ]


def write_seed_experiments(root: Path, entries: list[dict[str, Any]] | None = None) -> None:
    """One passing stand-in test per seed experiment ``entries`` do not provide."""
    by_chapter: dict[str, list[str]] = defaultdict(list)
    for chapter, name in _stand_ins(entries or []):
        by_chapter[chapter].append(name)
    for chapter, names in by_chapter.items():
        directory = root / "experiments" / chapter
        directory.mkdir(parents=True, exist_ok=True)
        body = "".join(
            f'def {name}():\n    """Seed stand-in: {name}."""\n\n\n' for name in names
        )
        (directory / f"{SEED_FILE}{chapter}.py").write_text(body.rstrip() + "\n")


def write_manifest(root: Path, entries: list[dict[str, Any]]) -> None:
    """The manifest: the seed floor first, then ``entries``."""
    manifest = {"experiments": [*seed_entries(entries), *entries]}
    (root / "experiments" / "manifest.json").write_text(json.dumps(manifest, indent=1))


def link_lab(root: Path) -> None:
    """``<root>/lab`` is a copy of the package under test, so lab is imported from the
    tree's own files (a symlink would be one entry of the tree, not the files it hashes)."""
    target = Path(lab.__file__).resolve().parent
    link = root / "lab"
    if not link.exists():
        shutil.copytree(target, link, ignore=shutil.ignore_patterns("__pycache__"))


def git(root: Path, *args: str) -> str:
    """Run git in ``root`` with a fixed identity; return its stdout."""
    done = subprocess.run(
        ["git", "-c", "user.name=lab", "-c", "user.email=lab@example.invalid",
         "-c", "commit.gpgsign=false", *args],
        cwd=root, capture_output=True, text=True, check=True, timeout=60,
    )
    return done.stdout


def commit(root: Path) -> None:
    """Make ``root`` a clean git checkout of everything in it."""
    gitignore = root / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text(IGNORED)
    if not (root / ".git").exists():
        git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "--allow-empty", "-m", "tree")


def publishable(root: Path, entries: list[dict[str, Any]]) -> None:
    """Complete a tree whose own experiments are declared by ``entries``."""
    write_seed_experiments(root, entries)
    write_manifest(root, entries)
    link_lab(root)
    commit(root)


# --------------------------------------------------------------------------- pure reports


def seed_nodeid(chapter: str, name: str) -> str:
    """The node id of a seed stand-in, as ``write_seed_experiments`` lays them out."""
    return f"experiments/{chapter}/{SEED_FILE}{chapter}.py::{name}"


def seed_records() -> list[dict[str, Any]]:
    """Report-log records of every seed stand-in passing (setup, call, teardown)."""
    return [
        {"$report_type": "TestReport", "nodeid": seed_nodeid(chapter, name), "when": when,
         "outcome": "passed", "duration": 0.0, "longrepr": None,
         "user_properties": [["lab_claim", f"Seed stand-in: {name}."]]}
        for chapter, name in SEED_EXPERIMENTS
        for when in ("setup", "call", "teardown")
    ]


def seed_facts(values: dict[str, Any], root_has_lab: bool = True) -> dict[str, Any]:
    """``RunFacts`` keyword arguments completed with the seed floor and a clean commit.

    The seed's records, node ids and manifest entries are added to those given; the
    manifest is the committed one, ``lab`` comes from ``<root>/lab`` and nothing else
    was loaded.
    """
    from lab.evidence import compiler

    done = dict(values)
    done["records"] = [*values.get("records", []), *seed_records()]
    done["collected"] = [*values.get("collected", []),
                         *(seed_nodeid(c, n) for c, n in SEED_EXPERIMENTS)]
    expected = list(values.get("expected", []))
    have = {(e.chapter, e.name) for e in expected}
    expected += [compiler.Expected(c, n, 1, False) for c, n in SEED_EXPERIMENTS
                 if (c, n) not in have]
    done["expected"] = expected
    done.setdefault("manifest", Path("experiments/manifest.json"))
    done.setdefault("arguments", {"command_line": [], "environment": [], "ini": []})
    done.setdefault("loaded", [])
    # Built facts, not a run: no module or start-up hook was observed beyond those given.
    done.setdefault("ran", [])
    done.setdefault("hooks", [])
    done.setdefault("lab_file", "lab/__init__.py" if root_has_lab else None)
    done.setdefault("git", ("0" * 40, False))
    return done


# --------------------------------------------------------------------------- one experiment

ONE_NODE = "experiments/ch01_x/test_a.py::test_a"


def phase_records(nodeid: str, call: list[str] | None = None) -> list[dict[str, Any]]:
    """pytest's records of one test: setup, each call attempt's outcome, teardown."""
    phases = [("setup", "passed"), *(("call", o) for o in (call or ["passed"])),
              ("teardown", "passed")]
    return [{"$report_type": "TestReport", "nodeid": nodeid, "when": when, "outcome": outcome,
             "duration": 0.01, "longrepr": None, "user_properties": [["lab_claim", "A claim."]]}
            for when, outcome in phases]


def one_experiment_tree(tmp_path: Path) -> Path:
    """A committed tree with one experiment (``ONE_NODE``) and ``lab/`` as its hashed
    package."""
    root = tmp_path / "tree"
    (root / "lab").mkdir(parents=True)
    (root / "lab" / "__init__.py").write_text("")
    (root / "experiments" / "ch01_x").mkdir(parents=True)
    (root / "experiments" / "ch01_x" / "test_a.py").write_text("def test_a(): pass\n")
    write_manifest(root, [{"chapter": "ch01_x", "name": "test_a", "results": 1,
                           "database": None}])
    (root / "pyproject.toml").write_text("[project]\n")
    commit(root)
    return root


def one_experiment_facts(**overrides: Any) -> dict[str, Any]:
    """The ``RunFacts`` values of a run in which ``ONE_NODE`` passed, with ``overrides``."""
    from lab.evidence import compiler

    values: dict[str, Any] = {
        "records": phase_records(ONE_NODE),
        "collected": [ONE_NODE],
        "experiments_prefix": "experiments/",
        "expected": [compiler.Expected("ch01_x", "test_a")],
        "database": {"provider": "embedded", "server_version": "15.8",
                     "details": {"method": "initdb"}},
        "command": ["pytest", "experiments"],
        "exitstatus": 0,
        "git": None,
    }
    values.update(overrides)
    return seed_facts(values)
