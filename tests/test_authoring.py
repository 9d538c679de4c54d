"""The author's guide is executed, and a new chapter written from it passes the gate.

``docs/authoring.md`` marks every code block: ``<!-- file: PATH -->`` blocks are
(parts of) experiment files, ``<!-- shell -->`` / ``<!-- shell: exit N -->`` blocks are
commands run in order. The must-show test writes the guide's chapter into a temporary
copy of the project, runs the guide's commands (``lab manifest sync``, ``lab run``...)
and requires the gate to say PASS; the other shows an undeclared or miscounted
experiment failing ``lab manifest check`` and the gate, by name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import labtree

from lab.evidence.seed import SEED_EXPERIMENTS

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "authoring.md"
_BLOCK = re.compile(
    r"<!-- (?:file: (?P<file>\S+)|shell(?:: exit (?P<exit>\d+))?) -->\n"
    r"```(?P<lang>\w+)\n(?P<body>.*?)\n```",
    re.S,
)
_FENCE = re.compile(r"^```(\w+)$", re.M)


@dataclass(frozen=True)
class Step:
    """One code block of the guide: a file part to write or shell commands to run."""

    kind: str  # "file" or "shell"
    body: str
    path: str = ""
    exit: int = 0


def guide_steps(text: str) -> list[Step]:
    """The guide's code blocks in document order, each with its marker."""
    steps = []
    for match in _BLOCK.finditer(text):
        if match["file"]:
            assert match["lang"] == "python", f"{match['file']} is not a python block"
            steps.append(Step("file", match["body"], path=match["file"]))
        else:
            assert match["lang"] == "sh", "a shell marker must precede an sh block"
            steps.append(Step("shell", match["body"], exit=int(match["exit"] or 0)))
    return steps


def test_every_code_block_of_the_guide_is_marked_for_execution():
    """No code block in the guide escapes execution: each one carries a file or shell
    marker, and the README's quickstart links the guide."""
    text = GUIDE.read_text(encoding="utf-8")
    assert len(_FENCE.findall(text)) == len(guide_steps(text)) > 0
    assert "docs/authoring.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LAB_EVIDENCE"))}
    # `lab` in the guide's commands is this interpreter's console script.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _shell(command: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout, check=False)


def _project(tmp_path: Path, chapters: list[str]) -> Path:
    """A temporary copy of the project: its pytest configuration, manifest and ``chapters``."""
    project = tmp_path / "project"
    (project / "experiments").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    shutil.copy(ROOT / "experiments" / "manifest.json", project / "experiments" / "manifest.json")
    for chapter in chapters:
        shutil.copytree(ROOT / "experiments" / chapter, project / "experiments" / chapter,
                        ignore=shutil.ignore_patterns("__pycache__"))
    # What the gate asks of a publishable run: the seed floor (stand-ins for the seed
    # chapters not copied), lab from the tree's hashed sources, a clean git checkout.
    copied = [{"chapter": c, "name": n} for c, n in SEED_EXPERIMENTS if c in chapters]
    labtree.write_seed_experiments(project, copied)
    labtree.link_lab(project)
    labtree.commit(project)
    labtree.git(project, "config", "user.name", "author")
    labtree.git(project, "config", "user.email", "author@example.invalid")
    return project


def _report(project: Path) -> dict:
    return json.loads((project / "evidence" / "runtime.json").read_text(encoding="utf-8"))


def report_seed_floor(project: Path) -> dict:
    return _report(project)["seed_floor"]


def test_a_chapter_written_from_the_guide_registers_and_passes_the_gate(tmp_path):
    """The guide's example chapter (a 500 after commit, a held call killed mid-flight, a
    second tenant, and one experiment per fault), written into a copy of the experiments,
    is declared by `lab manifest sync` with exact counts and passes `lab run`'s gate."""
    project = _project(tmp_path, ["ch01_admission"])
    written: dict[str, list[str]] = {}
    outputs: dict[str, str] = {}
    for step in guide_steps(GUIDE.read_text(encoding="utf-8")):
        if step.kind == "file":
            written.setdefault(step.path, []).append(step.body)
            target = project / step.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("\n\n\n".join(written[step.path]) + "\n", encoding="utf-8")
            continue
        for command in step.body.splitlines():
            result = _shell(command, project)
            outputs[command] = result.stdout
            assert result.returncode == step.exit, (
                f"`{command}` exited {result.returncode}, the guide says {step.exit}\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
    assert '+    {"chapter": "ch11_example", "name": "test_a_500_after_the_commit_is_' \
        'reconciled_to_one_effect", "results": 1, "seed": false}' in outputs["lab manifest sync"]
    declared = json.loads((project / "experiments" / "manifest.json").read_text())["experiments"]
    chapters = {e["chapter"] for e in declared}
    assert {"ch01_admission", "ch11_example"} <= chapters
    assert all(e["seed"] for e in declared if e["chapter"] == "ch01_admission"), "seed lost"
    assert report_seed_floor(project) == {"required": 26, "passed": 26}
    assert "Gate: PASS" in outputs["lab run"]
    report = _report(project)
    assert report["status"] == "PASS"
    ran = {r["name"]: r["outcome"] for r in report["experiments"]
           if r["chapter"] == "ch11_example"}
    assert len(ran) == 10 and set(ran.values()) == {"passed"}, ran
    observed = {o["nodeid"].rsplit("::", 1)[1] for o in report["observations"]}
    assert set(ran) <= observed, "an example experiment recorded no observation"


TINY = '''
import pytest


@pytest.mark.parametrize("n", [1, 2])
def test_counted(n):
    """Two results, declared as three."""
    assert n


def test_extra():
    """Not declared at all."""
'''


def test_an_undeclared_or_miscounted_experiment_fails_check_and_gate_by_name(tmp_path):
    """`lab manifest check` and the gate of `lab run` both fail, naming the experiment that
    is not declared and the one whose declared count differs from what it produced."""
    project = _project(tmp_path, [])
    chapter = project / "experiments" / "ch01_tiny"
    chapter.mkdir()
    (chapter / "test_tiny.py").write_text(TINY, encoding="utf-8")
    (project / "experiments" / "manifest.json").write_text(json.dumps({"experiments": [
        {"chapter": "ch01_tiny", "name": "test_counted", "results": 3, "seed": False},
    ]}), encoding="utf-8")
    check = _shell("lab manifest check", project)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "ch01_tiny/test_extra is not declared in the manifest" in check.stdout
    assert "ch01_tiny/test_counted produced 2 of 3 results" in check.stdout
    run = _shell("lab run", project)
    assert run.returncode == 1, run.stdout + run.stderr
    failures = _report(project)["gate"]["failures"]
    assert "ch01_tiny/test_extra ran but is not declared in the manifest" in failures
    assert "ch01_tiny/test_counted produced 2 of 3 results" in failures
    assert "test_extra" in run.stdout and "test_counted" in run.stdout
