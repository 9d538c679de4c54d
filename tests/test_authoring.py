"""The author's guide is executed, and a new chapter written from it passes the gate.

``docs/authoring.md`` marks every code block: ``<!-- file: PATH -->`` blocks are
(parts of) experiment files, ``<!-- shell -->`` / ``<!-- shell: exit N -->`` blocks are
commands run in order, ``<!-- output -->`` blocks are lines the previous command must
print (``…`` matches anything). The must-show test writes the guide's chapter into a temporary
copy of the project, runs the guide's commands (``lab manifest sync``, ``lab run``...)
and requires the gate to say PASS; the other shows an undeclared or miscounted
experiment failing ``lab manifest check`` and the gate, by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lab import harness
from lab.evidence.seed import SEED_EXPERIMENTS
from tests.support import labtree

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "authoring.md"
_BLOCK = re.compile(
    r"<!-- (?:file: (?P<file>\S+)|shell(?:: exit (?P<exit>\d+))?|(?P<output>output)) -->\n"
    r"```(?P<lang>\w+)\n(?P<body>.*?)\n```",
    re.S,
)
_FENCE = re.compile(r"^```(\w+)$", re.M)


@dataclass(frozen=True)
class Step:
    """One code block of the guide: a file part to write or shell commands to run."""

    kind: str  # "file", "shell" or "output"
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
        elif match["output"]:
            assert match["lang"] == "text", "an output marker must precede a text block"
            steps.append(Step("output", match["body"]))
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
    # `lab` in the tests' own commands is this interpreter's console script.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


# The copy's scripts/lab: the real wrapper would build a second virtualenv inside the
# copy; this one runs the lab this interpreter has installed, as the wrapper's
# `.venv/bin/lab` does (tests/test_authoring.py::test_scripts_lab_runs_the_venvs_lab runs
# the real one).
_LAB_STAND_IN = f"""#!/usr/bin/env bash
set -euo pipefail
cd -- "$(dirname -- "$0")/.."
exec {sys.executable} -m lab.cli "$@"
"""


def _shell(command: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout, check=False)


def _project(tmp_path: Path, chapters: list[str]) -> Path:
    """A temporary copy of the project: its pytest configuration, manifest and ``chapters``."""
    project = tmp_path / "project"
    (project / "experiments").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    shutil.copy(ROOT / "conftest.py", project / "conftest.py")
    (project / "scripts").mkdir()
    (project / "scripts" / "lab").write_text(_LAB_STAND_IN, encoding="utf-8")
    (project / "scripts" / "lab").chmod(0o755)
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


def run_guide(project: Path) -> dict[str, str]:
    """Write the guide's files into ``project`` and run its commands in order; return each
    command's stdout. Fails on an exit code the guide does not state, or on an output
    block the previous command did not print."""
    written: dict[str, list[str]] = {}
    outputs: dict[str, str] = {}
    last = ""
    for step in guide_steps(GUIDE.read_text(encoding="utf-8")):
        if step.kind == "file":
            written.setdefault(step.path, []).append(step.body)
            target = project / step.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("\n\n\n".join(written[step.path]) + "\n", encoding="utf-8")
            continue
        if step.kind == "output":
            for line in step.body.splitlines():
                pattern = ".*".join(re.escape(part) for part in line.split("…"))
                assert re.search(pattern, outputs[last]), (
                    f"`{last}` did not print the guide's line {line!r}\n{outputs[last][-3000:]}")
            continue
        for command in step.body.splitlines():
            result = _shell(command, project)
            outputs[command] = result.stdout
            last = command
            assert result.returncode == step.exit, (
                f"`{command}` exited {result.returncode}, the guide says {step.exit}\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
    return outputs


def test_a_chapter_written_from_the_guide_registers_and_passes_the_gate(tmp_path):
    """The guide's example chapter (a 500 after commit, a held call killed mid-flight, a
    second tenant, one experiment per fault, acting at boundaries, cancelling, review
    reasons, a killed database, a batch SIGKILLed in flight (non-idempotent and
    idempotent), a clock step, a full disk, an artifact and a chaos round), written into a copy of
    the experiments, is declared by `lab manifest sync` with exact counts, runs as a
    chapter with its verdict line, and passes `lab run`'s gate."""
    project = _project(tmp_path, ["ch01_admission"])
    outputs = run_guide(project)
    assert '+    {"chapter": "ch90_example", "name": "test_a_500_after_the_commit_is_' \
        'reconciled_to_one_effect", "results": 1, "seed": false}' \
        in outputs["scripts/lab manifest sync"]
    declared = json.loads((project / "experiments" / "manifest.json").read_text())["experiments"]
    chapters = {e["chapter"] for e in declared}
    assert {"ch01_admission", "ch90_example"} <= chapters
    assert all(e["seed"] for e in declared if e["chapter"] == "ch01_admission"), "seed lost"
    assert report_seed_floor(project) == {"required": 26, "passed": 26}
    assert "Gate: PASS" in outputs["scripts/lab run"]
    report = _report(project)
    assert report["status"] == "PASS"
    ran = {r["name"]: r["outcome"] for r in report["experiments"]
           if r["chapter"] == "ch90_example"}
    assert len(ran) == 24 and set(ran.values()) == {"passed"}, ran
    observed = {o["nodeid"].rsplit("::", 1)[1] for o in report["observations"]}
    assert set(ran) <= observed, "an example experiment recorded no observation"
    # The artifact is in the evidence, bound by the digest the experiment observed.
    artifact = project / "evidence" / "ch90_audit_trail.json"
    digests = [o["observation"].get("sha256") for o in report["observations"]
               if o["nodeid"].endswith("test_the_audit_trail_is_written_into_the_evidence")]
    assert digests == [hashlib.sha256(artifact.read_bytes()).hexdigest()]


CONSTANT = '''
def test_constant(lab, observe):
    """Records a conclusion instead of a measurement."""
    job = lab.approved()
    lab.credit_tool().worker.run_one()
    assert lab.state(job.id).state == "succeeded"
    observe({"effects": 1, "replayed": False}, facts=("effects", "replayed"))
'''


def test_a_constant_observation_fails_a_chapter_run_naming_the_key(tmp_path):
    """`lab run --chapter` fails an experiment whose observation is constant before it
    runs, and the summary and the gate name the test and the key."""
    project = _project(tmp_path, [])
    chapter = project / "experiments" / "ch91_constant"
    chapter.mkdir()
    (chapter / "test_constant.py").write_text(CONSTANT, encoding="utf-8")
    assert _shell("lab manifest sync", project).returncode == 0
    labtree.commit(project)
    run = _shell("lab run --chapter ch91_constant", project)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "chapter ch91_constant: 0 of 1 passed" in run.stdout
    assert "constant observation: key 'replayed' is the literal False" in run.stdout
    failures = _report(project)["gate"]["failures"]
    assert any("test_constant.py::test_constant failed" in f for f in failures), failures
    test = next(t for t in _report(project)["tests"] if t["nodeid"].endswith("test_constant"))
    assert "key 'replayed' is the literal False (test_constant.py:7)" in test["message"]


def test_scripts_lab_runs_the_venvs_lab():
    """`scripts/lab`, the guide's command, runs the lab of the repository's virtualenv
    (creating it first when missing) from any directory."""
    if not (ROOT / ".venv" / "bin" / "lab").exists():
        pytest.fail("no .venv here: scripts/lab would create it (run scripts/ensure-venv)",
                    pytrace=False)
    done = subprocess.run([str(ROOT / "scripts" / "lab"), "manifest", "check"], cwd="/",
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "manifest" in done.stdout.lower()


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


# -- the guide's reference lists cannot drift from the code ------------------------------

_REFERENCE = re.compile(r"<!-- reference: begin -->\n(?P<body>.*?)<!-- reference: end -->", re.S)


def test_the_guides_reference_is_generated_from_the_code():
    """The guide's lists of states, workflow fields, event kinds, review reasons and
    default budgets are exactly ``harness.reference()``, which reads them from the code."""
    found = _REFERENCE.search(GUIDE.read_text(encoding="utf-8"))
    assert found, "docs/authoring.md has no <!-- reference: begin/end --> section"
    assert found["body"] == harness.reference(), (
        "the guide's reference is stale: replace its body with the output of\n"
        "  .venv/bin/python -c 'from lab import harness; print(harness.reference(), end=\"\")'"
    )


def _literals(pattern: str, *paths: Path) -> set[str]:
    return {m for path in paths for m in re.findall(pattern, path.read_text(encoding="utf-8"))}


# The store is a package: its modules together write the kinds and reasons.
STORE = tuple(sorted((ROOT / "lab" / "runtime" / "store").glob("*.py")))
WORKER = ROOT / "lab" / "runtime" / "worker.py"


def test_the_event_kinds_are_those_the_store_writes():
    """Every event kind the store writes as a literal is listed in ``harness.EVENT_KINDS``,
    and every listed kind is one the store can write (a literal there, a retry's state,
    a review decision, or ``resolved_`` + an outcome)."""
    written = (
        _literals(r'event_(?:seq|queued)\(\s*conn, [^,]+, "(\w+)"', *STORE)
        | _literals(r'event=\("(\w+)"', *STORE)
        | _literals(r"SELECT id, '(\w+)', fence", *STORE)
        | _literals(r'return \("\w+", "(\w+)", "\w*"\)', *STORE)  # what a claim diverts to
        | _literals(r'\{"ready": "(\w+)"\}', *STORE)
        | _literals(r'decision = "(\w+)" if barrier is None else "\w+"', *STORE)
        | _literals(r'decision = "\w+" if barrier is None else "(\w+)"', *STORE)
    )
    assert written, "the patterns no longer match lab/runtime/store/"
    assert written <= set(harness.EVENT_KINDS), written - set(harness.EVENT_KINDS)
    source = "".join(p.read_text(encoding="utf-8") for p in STORE)
    for kind in harness.EVENT_KINDS:
        derived = kind.startswith("resolved_") and f'"{kind[9:]}"' in source
        assert f'"{kind}"' in source or f"'{kind}'" in source or derived, f"{kind} is not written"


def test_the_review_reasons_are_those_the_code_records():
    """Every review reason written as a literal (store and worker) is listed in
    ``harness.REVIEW_REASONS``, and every listed reason appears in that code."""
    recorded = (
        _literals(r"review_reason = '(\w+)'", *STORE)
        | _literals(r'reason = "(\w+)"', *STORE)
        | _literals(r'UNDISPATCHED_REVIEW = "(\w+)"', *STORE)
        | _literals(r'else "(non_idempotent_dispatched)"', *STORE)
        | _literals(r'return \("\w+", "\w+", "(\w+)"\)', *STORE)
        | _literals(r'\.(?:fail|quarantine)\(\w+, "(\w+)"\)', WORKER)
    ) - {"non_idempotent"}  # the request require_review refines into one of two proofs
    assert recorded, "the patterns no longer match lab/runtime/store/"
    assert recorded <= set(harness.REVIEW_REASONS), recorded - set(harness.REVIEW_REASONS)
    source = "".join(p.read_text(encoding="utf-8") for p in (*STORE, WORKER))
    for reason in harness.REVIEW_REASONS:
        assert f'"{reason}"' in source or f"'{reason}'" in source, f"{reason} is not recorded"


def test_a_chapter_run_prints_one_verdict_per_chapter_and_one_not_run_line():
    """A narrowed run's summary lists only the chapter's rows, its verdict line ("chapter
    X: N of M passed; a chapter run is never publishable") and a single "not run" line for
    the rest of the manifest, never a row per missing experiment; a full run lists every
    experiment that did not pass (the missing ones too) and prints no chapter verdict."""
    import io

    from rich.console import Console

    from lab.evidence import summary

    rows = [{"chapter": "ch20_outsider", "name": f"test_{i}", "outcome": "passed"}
            for i in range(4)]
    rows += [{"chapter": "ch20_outsider", "name": "test_4", "outcome": "failed"}]
    rows += [{"chapter": f"ch0{c}_other", "name": f"test_missing_{c}_{i}",
              "outcome": "missing"} for c in (1, 2) for i in range(3)]
    report = {"experiments": rows, "status": "PARTIAL", "gate": {"narrowed": ["--chapter"]}}

    def printed(given: dict) -> str:
        out = io.StringIO()
        summary.print_summary(given, Path("evidence"), Console(file=out, width=200))
        return out.getvalue()

    text = printed(report)
    assert "chapter ch20_outsider: 4 of 5 passed; a chapter run is never publishable" in text
    assert "not run: 6 experiments of 2 other chapters" in text
    assert "test_missing" not in text
    full = printed({**report, "status": "FAIL", "gate": {"narrowed": []}})
    assert "test_missing_1_0" in full and "chapter ch20_outsider:" not in full
