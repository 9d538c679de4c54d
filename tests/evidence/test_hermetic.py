"""Issue 27: evidence that trusts nothing left on the machine.

Each case of the issue's "Why" (1 stale bytecode, 2 start-up hooks, 3 edited
dependencies, 4 reruns, 5 model evidence under the wrong pin, 7 untracked keys,
8 tracebacks) gives a verdict other than PASS, a verification that fails naming the
cause, or a refusal; the hermetic run's isolation is decided from the report's own
facts. The interpreters here are real: separate venvs and processes, real pycs, real
RECORD files, real git repositories.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.util
import json
import marshal
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import cli, errors, files, runner
from lab.book import builder
from lab.evidence import (
    compiler,
    crashmatrix,
    dsse,
    gate,
    hermetic,
    provenance,
    trust,
    verification,
)
from lab.model import signed
from tests.support import labtree
from tests.support.canned_model import write_evidence as write_model_evidence

ROOT = Path(__file__).resolve().parents[2]
NODE = labtree.ONE_NODE


def _git(root: Path, *args: str) -> str:
    return labtree.git(root, *args)


_records = labtree.phase_records
_tree = labtree.one_experiment_tree


def _facts(**overrides: Any) -> compiler.RunFacts:
    return compiler.RunFacts(**labtree.one_experiment_facts(**overrides))


def _hermetic_run(root: Path) -> dict[str, Any]:
    """The ``run`` section a hermetic pytest process in ``root`` records."""
    lock = provenance.lock_digest(root, None)
    assert lock is not None
    env = hermetic.environment({"PATH": "/usr/bin"}, pycache="/p", home="/h", tmp="/t",
                               lock_sha256=str(lock["sha256"]),
                               commit=_git(root, "rev-parse", "HEAD").strip(),
                               tree=_git(root, "rev-parse", "HEAD^{tree}").strip())
    return hermetic.observe(env, no_user_site=True, safe_path=True, pycache_prefix="/p",
                            ignored=provenance.stray_files(root), lock=provenance.lock_digest(
                                root, env[hermetic.LOCK_ENV]))


# --------------------------------------------------------------------------- the hermetic record


def test_a_hermetic_record_is_publishable_and_a_local_one_is_not(tmp_path: Path) -> None:
    """A run whose recorded facts are hermetic is PASS and publishable, verify's first
    line says hermetic; the same run without them is still PASS for its author, but
    local and not publishable."""
    root = _tree(tmp_path)
    report = compiler.write(tmp_path / "ev-h", _facts(run=_hermetic_run(root)), root=root,
                            signer=dsse.load_signer({}))
    assert report["status"] == gate.PASS and report["publishable"] is True, report["gate"]
    verdict = verification.verify(tmp_path / "ev-h", check_sources=True, root=root)
    assert verdict.ok, verdict.problems
    assert "status PASS, hermetic run" in verification.format_verdict(verdict).splitlines()[0]

    local = compiler.write(tmp_path / "ev-l", _facts(), root=root, signer=dsse.load_signer({}))
    assert local["status"] == gate.PASS and local["publishable"] is False
    verdict = verification.verify(tmp_path / "ev-l", check_sources=True, root=root)
    assert verdict.ok, verdict.problems
    assert "status PASS, local run" in verification.format_verdict(verdict).splitlines()[0]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda run: run["environment"].append("PYTEST_ADDOPTS"), "outside the allowlist"),
        (lambda run: run["environment"].append("PYTHONPATH"), "outside the allowlist"),
        (lambda run: run.update(no_user_site=False), "user site"),
        (lambda run: run.update(fresh_bytecode=False), "bytecode"),
        (lambda run: run.update(ignored=["lab/__pycache__/"]), "not exactly the commit's tree"),
        (lambda run: run.update(source=None), "not exported from a commit's git objects"),
        (lambda run: run["lock"].update(installed="0" * 64), "not installed from"),
        (lambda run: run.update(kind="local"), "a local run"),
    ],
)
def test_a_run_missing_any_isolation_is_not_hermetic(tmp_path: Path, change: Any,
                                                     reason: str) -> None:
    """Each isolation fact the hermetic runner sets is checked from the record."""
    root = _tree(tmp_path)
    run = _hermetic_run(root)
    assert hermetic.failures(run) == []
    change(run)
    found = hermetic.failures(run)
    assert any(reason in f for f in found), found


def test_the_hermetic_environment_is_the_allowlist_and_nothing_else() -> None:
    """PYTEST_ADDOPTS, PYTHONPATH, PYTHONSTARTUP, PYTHONHOME and LD_PRELOAD never reach
    the run, whatever the caller has set; the isolation settings always do."""
    caller = {"PATH": "/bin", "PYTEST_ADDOPTS": "--reruns 2", "PYTHONPATH": "/evil",
              "PYTHONSTARTUP": "/evil.py", "PYTHONHOME": "/x", "LD_PRELOAD": "/evil.so",
              "PYTEST_PLUGINS": "evil", "LAB_EVIDENCE_KEY": "k", "HOME": "/root"}
    env = hermetic.environment(caller, pycache="/p", home="/h", tmp="/t", lock_sha256="a" * 64,
                               commit="c" * 40, tree="d" * 40)
    assert set(env) <= set(hermetic.allowed_names())
    for name in ("PYTEST_ADDOPTS", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "LD_PRELOAD",
                 "PYTEST_PLUGINS"):
        assert name not in env
    assert env["HOME"] == "/h" and env["PYTHONPYCACHEPREFIX"] == "/p"
    assert env["PYTHONNOUSERSITE"] == "1" and env["PYTHONSAFEPATH"] == "1"
    assert env["LAB_EVIDENCE_KEY"] == "k"


def test_hermetic_commit_is_checked_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lab run --hermetic --commit`` with no such commit, or --commit alone, is a
    usage error (exit 2) in one line."""
    root = _tree(tmp_path)
    monkeypatch.chdir(root)
    assert cli.main(["run", "--hermetic", "--commit", "no-such-rev", "--evidence", "ev"]) == 2
    assert "--commit no-such-rev: no such commit" in capsys.readouterr().err
    assert cli.main(["run", "--commit", "HEAD", "--evidence", "ev"]) == 2
    assert "--commit needs --hermetic" in capsys.readouterr().err
    assert runner.resolve_commit(root, "HEAD") == _git(root, "rev-parse", "HEAD").strip()


def test_an_export_holds_committed_files_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hermetic export has no ignored, untracked or modified file of the origin, and
    a process handed the export sees no stray file exactly when its files make the
    commit's tree."""
    root = _tree(tmp_path)
    (root / "lab" / "__pycache__").mkdir()
    (root / "lab" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"stale")
    (root / "untracked.py").write_text("x = 1\n")
    (root / "lab" / "__init__.py").write_text("EDITED = True\n")
    sha = runner.resolve_commit(root, "HEAD")
    tree_id = runner.export(root, sha, tmp_path / "export")
    assert not (tmp_path / "export" / "lab" / "__pycache__").exists()
    assert not (tmp_path / "export" / "untracked.py").exists()
    assert (tmp_path / "export" / "lab" / "__init__.py").read_text() == ""
    assert provenance.stray_files(root)  # the origin has them
    monkeypatch.setenv(hermetic.COMMIT_ENV, sha)
    monkeypatch.setenv(hermetic.TREE_ENV, tree_id)
    assert provenance.stray_files(tmp_path / "export") == []
    (tmp_path / "export" / "lab" / "planted.py").write_text("x = 1\n")
    (stray,) = provenance.stray_files(tmp_path / "export") or [""]
    assert stray.startswith("its files make tree ") and stray.endswith(f"not {tree_id[:12]}")


# --------------------------------------------------------------------------- case 1: stale pyc


def _stale_pyc(package: Path, source: str, payload: str) -> Path:
    """``package/mod.py`` holds ``source``; its cached pyc carries ``payload``'s code with
    a header matching the source's mtime and size, as a leftover or a forger leaves it."""
    module = package / "mod.py"
    module.write_text(source)
    stat = module.stat()
    code = compile(payload, str(module), "exec", dont_inherit=True)
    pyc = Path(importlib.util.cache_from_source(str(module)))
    pyc.parent.mkdir(exist_ok=True)
    header = (importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
              + (int(stat.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
              + (stat.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
    pyc.write_bytes(header + marshal.dumps(code))
    return module


def _run_python(python: str, script: str, cwd: Path, env: dict[str, str] | None = None) -> Any:
    done = subprocess.run([python, "-c", textwrap.dedent(script)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False,
                          env={"PATH": os.environ.get("PATH", "/usr/bin"), **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


RAN = """
import json, sys
from lab.evidence import provenance
import {module}
print(json.dumps({{"value": {module}.VALUE, "ran": [m for m in provenance.ran_modules()
                   if m["module"] == "{module}"], "hooks": provenance.startup_hooks()}}))
"""


def test_stale_bytecode_that_runs_instead_of_its_source_fails_the_gate(tmp_path: Path) -> None:
    """Case 1: a pyc whose header matches the committed source runs instead of it; the
    process that ran it reports it, and the gate fails naming the module."""
    root = _tree(tmp_path)
    (root / "experiments" / "helper").mkdir()
    module = _stale_pyc(root / "experiments" / "helper", "VALUE = 'source'\n",
                        "VALUE = 'stale'\n")
    labtree.commit(root)
    # A separate interpreter imports the module as any run would: the pyc wins.
    result = _run_python(sys.executable, RAN.format(module="mod"), root,
                         {"PYTHONPATH": f"{root / 'experiments' / 'helper'}:{ROOT}"})
    assert result["value"] == "stale"
    assert result["ran"][0]["bytecode"] == provenance.BYTECODE_STALE
    report = compiler.compile_report(_facts(ran=result["ran"], git=("0" * 40, False)),
                                     root=root, signing=dsse.load_signer({}).describe())
    assert report["status"] == gate.FAIL
    assert any(f"{module}): {provenance.BYTECODE_STALE}" in f
               for f in report["gate"]["failures"]), report["gate"]["failures"]
    # The same module compiled from its source is vouched for.
    Path(importlib.util.cache_from_source(str(module))).unlink()
    clean = _run_python(sys.executable, RAN.format(module="mod"), root,
                        {"PYTHONPATH": f"{root / 'experiments' / 'helper'}:{ROOT}"})
    assert clean["value"] == "source" and clean["ran"][0]["bytecode"] is None
    report = compiler.compile_report(_facts(ran=clean["ran"], git=("0" * 40, False)),
                                     root=root, signing=dsse.load_signer({}).describe())
    assert report["status"] == gate.PASS, report["gate"]


# --------------------------------------------------------------------------- cases 2 and 3


def _venv_with(tmp_path: Path, site: Path) -> str:
    """A fresh venv (the hermetic runner's own) whose path file puts this checkout, the
    dev venv's dependencies and ``site`` on sys.path; its python."""
    dependencies = Path(sysconfig_purelib())
    python = runner.run_venv(tmp_path, ROOT, dependencies)
    pth = next((tmp_path / "venv").rglob("lab-hermetic.pth"))
    pth.write_text(pth.read_text() + f"{site}\n")
    return str(python)


def sysconfig_purelib() -> str:
    import sysconfig

    return sysconfig.get_path("purelib")


def _fake_distribution(site: Path, body: str) -> Path:
    """An installed distribution ``fakedist`` whose RECORD hashes ``body``."""
    package = site / "fakedist"
    package.mkdir(parents=True)
    module = package / "__init__.py"
    module.write_text(body)
    info = site / "fakedist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakedist\nVersion: 1.0\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(body.encode()).digest()).rstrip(b"=")
    (info / "RECORD").write_text(
        f"fakedist/__init__.py,sha256={digest.decode()},{len(body)}\n"
        "fakedist-1.0.dist-info/METADATA,,\nfakedist-1.0.dist-info/RECORD,,\n"
    )
    (info / "top_level.txt").write_text("fakedist\n")
    return module


def _verdict(root: Path, result: dict[str, Any]) -> list[str]:
    report = compiler.compile_report(
        _facts(ran=result["ran"], hooks=result["hooks"], git=("0" * 40, False)),
        root=root, signing=dsse.load_signer({}).describe())
    assert report["status"] != gate.PASS or not report["gate"]["failures"]
    return list(report["gate"]["failures"])


def test_edited_dependency_and_bytecode_only_payloads_fail_the_gate(tmp_path: Path) -> None:
    """Case 3: a module of an installed distribution that matches its RECORD is vouched
    for; edited in place, run from a forged pyc beside the untouched source, or shipped
    as bytecode only, it fails the gate naming the file."""
    root = _tree(tmp_path)
    site = tmp_path / "site"
    module = _fake_distribution(site, "VALUE = 'installed'\n")
    python = _venv_with(tmp_path / "v", site)
    script = RAN.format(module="fakedist")
    assert _verdict(root, _run_python(python, script, tmp_path)) == []

    module.write_text("VALUE = 'edited!!!'\n")  # same size, another body
    # Bytecode is checked against the source's size and whole-second mtime: an edit in
    # the same second as the first run's compile would stay hidden behind that pyc (CI
    # saw it). Date the edit later, as any edit after the fact is.
    edited = module.stat()
    os.utime(module, (edited.st_atime, edited.st_mtime + 5))
    result = _run_python(python, script, tmp_path)
    assert result["value"] == "edited!!!"
    assert any("matches no installed distribution's RECORD" in f and "fakedist" in f
               for f in _verdict(root, result))

    module.write_text("VALUE = 'installed'\n")
    _stale_pyc(site / "fakedist", "VALUE = 'installed'\n", "VALUE = 'payload'\n")
    (site / "fakedist" / "mod.py").rename(module)  # the source stays the RECORD's bytes
    pyc = Path(importlib.util.cache_from_source(str(site / "fakedist" / "mod.py")))
    pyc.rename(importlib.util.cache_from_source(str(module)))
    os.utime(module, (module.stat().st_atime, module.stat().st_mtime))
    result = _run_python(python, script, tmp_path)
    assert result["value"] == "payload"
    assert any(provenance.BYTECODE_STALE in f for f in _verdict(root, result))

    module.unlink()
    Path(importlib.util.cache_from_source(str(module))).rename(site / "fakedist" / "__init__.pyc")
    result = _run_python(python, script, tmp_path)
    assert result["value"] == "payload"
    assert any(provenance.BYTECODE_ONLY in f for f in _verdict(root, result))


def test_start_up_hooks_outside_the_environment_fail_the_gate(tmp_path: Path) -> None:
    """Case 2: a ``.pth`` that executes code and a ``sitecustomize`` on the path run
    before pytest; each is found and fails the gate, while a path-only ``.pth`` is not
    a hook."""
    root = _tree(tmp_path)
    site = tmp_path / "site"
    _fake_distribution(site, "VALUE = 1\n")
    python = _venv_with(tmp_path / "v", site)
    script = RAN.format(module="fakedist")
    assert _verdict(root, _run_python(python, script, tmp_path)) == []

    venv_site = next((tmp_path / "v" / "venv").rglob("lab-hermetic.pth")).parent
    (venv_site / "zz-evil.pth").write_text("import os; os.environ['EMPTIED'] = '1'\n")
    failures = _verdict(root, _run_python(python, script, tmp_path))
    assert any("start-up hook pth" in f and "zz-evil.pth" in f for f in failures), failures

    (venv_site / "zz-evil.pth").unlink()
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "sitecustomize.py").write_text("import os\n")
    failures = _verdict(root, _run_python(python, script, tmp_path, {"PYTHONPATH": str(custom)}))
    assert any("start-up hook sitecustomize" in f for f in failures), failures


# --------------------------------------------------------------------------- case 4: reruns


def test_a_rerun_is_not_a_pass(tmp_path: Path) -> None:
    """Case 4: a failed attempt followed by a passing one (pytest-rerunfailures'
    ``rerun`` report, or two call reports) folds to ``rerun`` and fails the gate."""
    root = _tree(tmp_path)
    for calls in (["rerun", "passed"], ["failed", "passed"]):
        report = compiler.compile_report(_facts(records=_records(NODE, calls)), root=root,
                                         signing=dsse.load_signer({}).describe())
        row = next(t for t in report["tests"] if t["nodeid"] == NODE)
        assert row["outcome"] == gate.RERUN
        assert report["status"] == gate.FAIL
        assert f"{NODE} rerun" in report["gate"]["failures"]


def test_verify_rebuilds_the_test_rows_from_the_signed_records(tmp_path: Path) -> None:
    """Case 4, verifier side: a signer whose folded rows say passed while its own signed
    ``tests.jsonl`` holds a rerun is refused, naming the test."""
    root = _tree(tmp_path)
    signer = dsse.load_signer({})
    directory = tmp_path / "ev"
    report = compiler.write(directory, _facts(), root=root, signer=signer)
    assert report["status"] == gate.PASS
    lines = (directory / compiler.TESTS_FILE).read_text().splitlines()
    rerun = json.loads(next(line for line in lines if NODE in line and '"call"' in line))
    rerun["outcome"] = "rerun"
    tests_bytes = ("\n".join([lines[0], json.dumps(rerun, sort_keys=True), *lines[1:]])
                   + "\n").encode()
    report_bytes = compiler.dumps_report(report)
    payload = json.dumps(compiler.statement(report_bytes, report, tests_bytes), sort_keys=True,
                         separators=(",", ":"), ensure_ascii=False).encode()
    (directory / compiler.TESTS_FILE).write_bytes(tests_bytes)
    (directory / compiler.ENVELOPE_FILE).write_text(
        json.dumps(dsse.sign_envelope(payload, signer)))
    verdict = verification.verify(directory)
    assert f"tests: {NODE} is 'passed' in the report but rerun in the signed tests.jsonl" \
        in verdict.problems, verdict.problems


# --------------------------------------------------------------------------- case 5 and 7


def _key(tmp_path: Path, name: str) -> tuple[ed25519.Ed25519PrivateKey, Path]:
    key = ed25519.Ed25519PrivateKey.generate()
    path = tmp_path / f"{name}.pub.pem"
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    return key, path


def test_model_evidence_is_judged_by_its_own_signer_not_the_runtime_pin(tmp_path: Path) -> None:
    """Case 5: runtime evidence pinned by a trusted key beside model evidence signed by
    an ephemeral key: the book's model section says unpinned, never "pinned"."""
    root = _tree(tmp_path)
    key, pem = _key(tmp_path, "publication")
    trusted = [trust.TrustedKey(dsse.load_public_key(pem.read_bytes()), "test pin")]
    evidence = tmp_path / "evidence"
    compiler.write(evidence, _facts(), root=root, signer=dsse.Signer(key, "key_file"))
    write_model_evidence(evidence / "model", tmp_path / "scratch", ["account-a", "zero"])
    out = tmp_path / "book"
    builder.build(evidence, out, trusted=trusted, root=root, model_verifier=signed.verify)
    head = (out / "index.md").read_text()
    model = (out / "model.md").read_text()
    assert "pinned by" in head
    assert "verified with the key it carries (integrity, not identity)" in model
    assert "against the pinned public key" not in model
    # Pinned explicitly, the model evidence must be signed by that very key.
    with pytest.raises(errors.Refused, match="model"):
        builder.build(evidence, tmp_path / "book2", public_key=trusted[0].key, root=root,
                      model_verifier=signed.verify)


def test_only_keys_git_tracks_are_trusted(tmp_path: Path) -> None:
    """Case 7: a key merely present in ./keys/trusted/ is not trusted; committed, it is;
    replaced in the working tree after the commit, the committed key still rules."""
    root = _tree(tmp_path)
    (root / "keys" / "trusted").mkdir(parents=True)
    _, stranger = _key(root / "keys" / "trusted", "stranger")
    assert trust.trusted_keys(root, environ={}) == []
    labtree.commit(root)
    (committed,) = trust.trusted_keys(root, environ={})
    head = _git(root, "rev-parse", "HEAD").strip()
    branch = _git(root, "symbolic-ref", "--short", "HEAD").strip()
    assert committed.origin == f"keys/trusted/stranger.pub.pem at {head[:12]} (tip of {branch})"
    original = dsse.raw_public_key(committed.key)
    _key(root / "keys" / "trusted", "stranger")  # overwrite the file, uncommitted
    (again,) = trust.trusted_keys(root, environ={})
    assert dsse.raw_public_key(again.key) == original
    assert stranger.exists()


def test_keys_are_the_ones_git_tracks_at_the_default_branchs_tip(tmp_path: Path) -> None:
    """Case 7, by branch: the keys are those tracked at the tip of the default branch,
    whichever branch is checked out; origin/HEAD, when recorded, names that branch; a
    repository where none resolves is refused in one line."""
    root = _tree(tmp_path)
    branch = _git(root, "symbolic-ref", "--short", "HEAD").strip()
    keys = root / "keys" / "trusted"
    keys.mkdir(parents=True)
    _, old = _key(keys, "old")
    labtree.commit(root)
    first = _git(root, "rev-parse", "HEAD").strip()
    old.unlink()
    _key(keys, "new")
    labtree.commit(root)
    second = _git(root, "rev-parse", "HEAD").strip()

    (at_tip,) = trust.trusted_keys(root, environ={})
    assert at_tip.origin == f"keys/trusted/new.pub.pem at {second[:12]} (tip of {branch})"
    # Checked out elsewhere, the default branch still decides.
    _git(root, "checkout", "-q", "-b", "side", first)
    (still,) = trust.trusted_keys(root, environ={})
    assert still.origin == at_tip.origin
    # origin/HEAD, when a clone recorded it, names the default branch.
    _git(root, "update-ref", "refs/remotes/origin/side", first)
    _git(root, "symbolic-ref", "refs/remotes/origin/HEAD", "refs/remotes/origin/side")
    (remote,) = trust.trusted_keys(root, environ={})
    assert remote.origin == (f"keys/trusted/old.pub.pem at {first[:12]} "
                             "(tip of refs/remotes/origin/side)")
    # No origin/HEAD, no main or master, a detached HEAD: no default branch.
    _git(root, "checkout", "-q", "--detach")
    for ref in ("refs/remotes/origin/HEAD", "refs/remotes/origin/side", f"refs/heads/{branch}",
                "refs/heads/side"):
        _git(root, "update-ref", "-d", "--no-deref", ref)
    with pytest.raises(errors.InputError, match="no default branch") as refused:
        trust.trusted_keys(root, environ={})
    assert "\n" not in str(refused.value)
    # Outside any repository nothing is tracked: the explicit keys only.
    outside = tmp_path / "outside"
    outside.mkdir()
    assert trust.trusted_keys(outside, environ={}) == []


def test_one_function_decides_signer_trust() -> None:
    """Every signature check of evidence goes through ``verification.check_signer``:
    no other module calls ``dsse.check_signature``."""
    callers = set()
    for path in sorted((ROOT / "lab").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "check_signature":
                callers.add(path.relative_to(ROOT).as_posix())
            if isinstance(node, ast.FunctionDef) and path.name == "verification.py" \
                    and node.name != "check_signer":
                assert "check_signature" not in ast.unparse(node), node.name
    assert callers == {"lab/evidence/verification.py"}


# --------------------------------------------------------------------------- case 8


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_deeply_nested_or_mistyped_model_evidence_is_a_problem_not_a_traceback(
    tmp_path: Path,
) -> None:
    """Case 8: nesting depth and ``"performance": []`` in signed model evidence are named
    problems of verify."""
    evidence = write_model_evidence(tmp_path / "model", tmp_path / "scratch", ["zero"])
    report = json.loads((evidence / signed.REPORT_FILE).read_text())
    report["performance"] = []
    resigned = tmp_path / "resigned"
    traces = tmp_path / "traces"
    traces.mkdir()
    for trace in (evidence / signed.TRACES_DIR).iterdir():
        (traces / trace.name).write_bytes(trace.read_bytes())
    from lab.model import cases

    case_set = cases.subset(cases.load(), ["zero"])
    signed.write(resigned, report, traces, case_set, dsse.load_signer({}))
    verdict = signed.verify(resigned)
    assert any("performance" in p for p in verdict.problems), verdict.problems

    (evidence / signed.ENVELOPE_FILE).write_bytes(_nested(200_000))
    verdict = signed.verify(evidence)
    assert verdict.problems and "nested" in verdict.problems[0]


def test_crash_point_matrix_with_wrong_types_or_depth_is_refused_in_one_line() -> None:
    """Case 8: a string where a fault belongs, or deep nesting, is an ``InputError``."""
    with pytest.raises(errors.InputError, match="nested"):
        crashmatrix.load(_nested(200_000))
    matrix = {"format": crashmatrix.FORMAT, "cells": [], "boundaries": [], "kinds": [],
              "faults": ["worker_sigkill"]}
    with pytest.raises(errors.InputError, match="faults/0"):
        crashmatrix.load(json.dumps(matrix).encode())


def test_publish_refuses_a_fifo_or_a_huge_public_key_without_reading_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Case 8: ``lab publish --public-key`` on a FIFO or a huge file exits 2 in one line,
    before anything runs."""
    private = tmp_path / "signing.pem"
    private.write_bytes(ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    monkeypatch.setenv(dsse.KEY_ENV, str(private))
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.pem"
    huge.write_bytes(b"A" * (files.PUBLIC_KEY_LIMIT + 1))
    for path in (fifo, huge):
        code = cli.main(["publish", "--out", str(tmp_path / "out"), "--public-key", str(path)])
        err = capsys.readouterr().err
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_nothing_left_on_the_machine_reaches_a_hermetic_interpreter(tmp_path: Path) -> None:
    """Cases 1-4 against the hermetic runner's own parts: a code-running ``.pth`` in the
    dependency venv, ``PYTHONPATH`` with a ``sitecustomize``, ``PYTEST_ADDOPTS`` and a
    user site never reach a process started in the run's venv with the run's environment,
    and its bytecode goes to the fresh prefix, not to ``__pycache__`` beside the source."""
    dependencies = tmp_path / "deps"
    dependencies.mkdir()
    (dependencies / "evil.pth").write_text("import os; os.environ['EMPTIED'] = '1'\n")
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "sitecustomize.py").write_text("import os; os.environ['CUSTOM'] = '1'\n")
    python = runner.run_venv(tmp_path, ROOT, dependencies)
    caller = {**os.environ, "PYTHONPATH": str(custom), "PYTEST_ADDOPTS": "--reruns 2"}
    prefix = tmp_path / "pycache"
    env = hermetic.environment(caller, pycache=str(prefix), home=str(tmp_path),
                               tmp=str(tmp_path), lock_sha256="0" * 64, commit="c" * 40,
                               tree="d" * 40)
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "probe_mod.py").write_text("VALUE = 1\n")
    script = ("import json, os, sys; sys.path.append(sys.argv[1]); import probe_mod; "
              "print(json.dumps({k: os.environ.get(k) for k in "
              "('EMPTIED', 'CUSTOM', 'PYTEST_ADDOPTS', 'PYTHONPATH')} | "
              "{'user_site': sys.flags.no_user_site, 'safe': sys.flags.safe_path, "
              "'deps': sys.argv[2] in sys.path}))")
    done = subprocess.run([str(python), "-c", script, str(tmp_path / "probe"),
                           str(dependencies)], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    seen = json.loads(done.stdout)
    assert seen == {"EMPTIED": None, "CUSTOM": None, "PYTEST_ADDOPTS": None,
                    "PYTHONPATH": None, "user_site": 1, "safe": True, "deps": True}
    assert not (tmp_path / "probe" / "__pycache__").exists()
    assert list(prefix.rglob("probe_mod*.pyc"))
