"""Issue 42: publication that trusts nothing of the machine but what it checks itself.

One test (or a few) per class of the issue, each showing the attack refused or the
verdict not PASS, naming the cause: sources exported from git objects whatever the
caller's git does (1, 3), caches the run would reuse (2), reproduction that cannot be
led (4), keys trusted at the default branch's tip and revoked for every commit (5), and
a verifier that rebuilds every row from the signed test log (7). The git
repositories, venvs, wheels and installers are real.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from lab import cli, errors, reproduce
from lab.evidence import (
    compiler,
    dsse,
    gate,
    hermetic,
    provenance,
    reproduction,
    tree,
    trust,
    verification,
    wheels,
)
from tests.support import labtree
from tests.support.keys import KeyFiles

NODE = labtree.ONE_NODE
FAILED_NODE = "experiments/ch01_x/test_a.py::test_b"


def _tree(tmp_path: Path) -> Path:
    """A committed tree with one experiment, ``lab/`` and a schema file outside any
    pattern list (``lab/runtime/store/schema.sql``)."""
    root = tmp_path / "tree"
    (root / "lab" / "runtime" / "store").mkdir(parents=True)
    (root / "lab" / "__init__.py").write_text("")
    (root / "lab" / "runtime" / "store" / "schema.sql").write_text("create table t (x int);\n")
    (root / "experiments" / "ch01_x").mkdir(parents=True)
    (root / "experiments" / "ch01_x" / "test_a.py").write_text(
        "def test_a(): pass\n\ndef test_b(): pass\n")
    (root / "tool.sh").write_text("#!/bin/sh\necho x\n")
    (root / "tool.sh").chmod(0o755)
    labtree.write_manifest(root, [{"chapter": "ch01_x", "name": "test_a", "results": 1,
                                   "database": None}])
    (root / "pyproject.toml").write_text("[project]\n")
    labtree.commit(root)
    return root


def _facts(**overrides: Any) -> compiler.RunFacts:
    """The facts of a run in which ``NODE`` passed, with ``overrides``."""
    return compiler.RunFacts(**labtree.one_experiment_facts(**overrides))


def _head(root: Path) -> tuple[str, str]:
    return (labtree.git(root, "rev-parse", "HEAD").strip(),
            labtree.git(root, "rev-parse", "HEAD^{tree}").strip())


def _hermetic_run(root: Path, commit: str, tree_id: str) -> dict[str, Any]:
    lock = provenance.lock_digest(root, None)
    assert lock is not None
    env = hermetic.environment({"PATH": "/usr/bin", "LAB_PG_CACHE": "/srv/planted-cache"},
                               pycache="/p", home="/h", tmp="/t",
                               lock_sha256=str(lock["sha256"]), commit=commit, tree=tree_id)
    return hermetic.observe(env, no_user_site=True, safe_path=True, pycache_prefix="/p",
                            ignored=[], lock=provenance.lock_digest(root, env[hermetic.LOCK_ENV]))


def _resign(directory: Path, report: dict[str, Any], tests_bytes: bytes,
            signer: dsse.Signer) -> None:
    """Write ``report`` and ``tests_bytes`` and sign them again: what a producer holding
    the key can do."""
    report_bytes = compiler.dumps_report(report)
    payload = json.dumps(compiler.statement(report_bytes, report, tests_bytes), sort_keys=True,
                         separators=(",", ":"), ensure_ascii=False).encode()
    (directory / compiler.TESTS_FILE).write_bytes(tests_bytes)
    (directory / compiler.REPORT_FILE).write_bytes(report_bytes)
    (directory / compiler.ENVELOPE_FILE).write_text(
        json.dumps(dsse.sign_envelope(payload, signer)))


# --------------------------------------------------------------------------- 1: the caller's git


def _hostile_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Everything of the caller's that decides what ``git clone`` writes: a global
    configuration with a smudge filter, attributes applying it, ``GIT_*`` variables and
    a ``git`` first on ``PATH`` that lies."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text(
        "[filter \"evil\"]\n\tsmudge = sed s/pass/EVIL/\n\tclean = cat\n"
        "[core]\n\tattributesFile = " + str(home / "attributes") + "\n")
    (home / "attributes").write_text("*.py filter=evil\n")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "git").write_text("#!/bin/sh\necho 0000000000000000000000000000000000000000\n")
    (fake / "git").chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(home / ".gitconfig"))
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "elsewhere.git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(tmp_path))


def test_the_callers_git_cannot_change_what_a_hermetic_run_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Class 1: with a smudge filter in the caller's global configuration, GIT_DIR and
    GIT_WORK_TREE set and a lying ``git`` first on PATH, the export still holds exactly
    the commit's blobs (modes included) and names the commit's tree; the caller's own
    checkout of the same commit is what the filter made of it."""
    root = _tree(tmp_path)
    commit, tree_id = _head(root)
    _hostile_git(tmp_path, monkeypatch, root)
    checkout = tmp_path / "checkout"
    callers = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE")}
    subprocess.run(["/usr/bin/git", "clone", "-q", str(root), str(checkout)], check=True,
                   env=callers, capture_output=True)
    assert "EVIL" in (checkout / "experiments/ch01_x/test_a.py").read_text()

    exported = tmp_path / "export"
    assert tree.export(root, commit, exported) == tree_id
    assert (exported / "experiments/ch01_x/test_a.py").read_text() == (
        "def test_a(): pass\n\ndef test_b(): pass\n")
    assert os.access(exported / "tool.sh", os.X_OK)
    assert not (exported / ".git").exists()
    assert tree.walk(exported).tree == tree_id


def test_an_export_that_is_not_the_commits_tree_is_refused(tmp_path: Path) -> None:
    """Class 1: a commit id that is not the object git hands back, and a target that
    already holds files, are refused before anything runs."""
    root = _tree(tmp_path)
    commit, _ = _head(root)
    with pytest.raises(errors.UsageError, match="commit"):
        tree.export(root, "f" * 40, tmp_path / "x")
    (tmp_path / "full").mkdir()
    with pytest.raises(FileExistsError):
        tree.export(root, commit, tmp_path / "full")


def test_the_evidence_names_the_tree_and_verify_compares_every_tracked_file(
    tmp_path: Path,
) -> None:
    """Class 3: the report records the tree id of every tracked file; a changed file no
    pattern list ever named (the moved schema) fails ``--check-sources`` by the tree id,
    and so does one the evidence does not cover."""
    root = _tree(tmp_path)
    _, tree_id = _head(root)
    report = compiler.write(tmp_path / "ev", _facts(), root=root, signer=dsse.load_signer({}))
    assert report["tree"] == tree_id
    assert "lab/runtime/store/schema.sql" in report["sources"]
    assert "tool.sh" in report["sources"]
    assert verification.verify(tmp_path / "ev", check_sources=True, root=root).ok

    (root / "lab/runtime/store/schema.sql").write_text("create table t (x text);\n")
    labtree.commit(root)
    problems = verification.verify(tmp_path / "ev", check_sources=True, root=root).problems
    assert any(p.startswith("sources: the files tracked in") and f"not the signed {tree_id[:12]}"
               in p for p in problems), problems
    assert "source lab/runtime/store/schema.sql: differs from the signed digest" in problems


def test_a_hermetic_report_whose_files_are_not_the_exported_tree_is_not_publishable(
    tmp_path: Path,
) -> None:
    """Class 3: a hermetic run whose sources, hashed after the run, make another tree than
    the commit the runner exported is PASS for its author but never publishable."""
    root = _tree(tmp_path)
    commit, tree_id = _head(root)
    report = compiler.compile_report(_facts(run=_hermetic_run(root, commit, tree_id)),
                                     root=root, signing=dsse.load_signer({}).describe())
    assert report["status"] == gate.PASS and report["publishable"] is True, report["gate"]
    other = _hermetic_run(root, commit, "1" * 40)
    report = compiler.compile_report(_facts(run=other), root=root,
                                     signing=dsse.load_signer({}).describe())
    assert report["publishable"] is False
    assert any("the sources make tree" in f for f in gate.decide(report).local)


# --------------------------------------------------------------------------- 2: caches


def test_a_publishable_run_never_copies_a_postgresql_template(tmp_path: Path) -> None:
    """Class 2: the caller's LAB_PG_CACHE never reaches a hermetic run (it is always
    off), and a report whose cluster was a cached copy is not publishable, naming it."""
    env = hermetic.environment({"LAB_PG_CACHE": "/srv/planted-cache", "PATH": "/bin"},
                               pycache="/p", home="/h", tmp="/t", lock_sha256="0" * 64,
                               commit="c" * 40, tree="d" * 40)
    assert env["LAB_PG_CACHE"] == "off"
    root = _tree(tmp_path)
    commit, tree_id = _head(root)
    copied = {"provider": "embedded", "server_version": "15.8",
              "details": {"method": "cached-copy"}}
    report = compiler.compile_report(
        _facts(run=_hermetic_run(root, commit, tree_id), database=copied), root=root,
        signing=dsse.load_signer({}).describe())
    assert report["status"] == gate.PASS and report["publishable"] is False
    assert any("cached template is never publishable" in f for f in gate.decide(report).local)


def _wheel(directory: Path, name: str, files: dict[str, bytes]) -> Path:
    """A real wheel of ``name`` 1.0 holding ``files``, with its RECORD."""
    dist_info = f"{name}-1.0.dist-info"
    members = dict(files)
    members[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode())
    members[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    rows = []
    for member, data in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{member},sha256={digest},{len(data)}")
    rows.append(f"{dist_info}/RECORD,,")
    members[f"{dist_info}/RECORD"] = ("\n".join(rows) + "\n").encode()
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in members.items():
            archive.writestr(member, data)
    return path


def _uv() -> str:
    done = subprocess.run([str(Path(__file__).resolve().parents[2] / "scripts" / "ensure-uv")],
                          capture_output=True, text=True, check=True, timeout=600)
    return done.stdout.strip().splitlines()[-1]


def test_a_venv_is_judged_by_the_locks_wheels_not_by_its_record(tmp_path: Path) -> None:
    """Class 2: a venv installed by uv from hash-checked wheels passes (headers the wheel
    installs outside site-packages included, as greenlet's are); a file planted in it,
    even with a line added to the distribution's RECORD, fails naming the file, as does
    an installed file edited in place; a wheel whose sha256 the lock does not give is
    refused before it is unpacked."""
    store = tmp_path / "wheels"
    store.mkdir()
    wheel = _wheel(store, "tinydist", {"tinydist/__init__.py": b"VALUE = 1\n",
                                       "tinydist-1.0.data/headers/tiny.h": b"int tiny;\n"})
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"tinydist==1.0 \\\n    --hash=sha256:{sha}\n")
    locked = wheels.locked_hashes(requirements.read_text())
    assert locked == {"tinydist": {sha}}
    found = wheels.verified([wheel], locked)
    with pytest.raises(errors.EnvironmentFailure, match="its sha256 is none the lock gives"):
        wheels.verified([wheel], {"tinydist": {"0" * 64}})

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    uv = _uv()
    subprocess.run([uv, "pip", "install", "--python", str(venv / "bin" / "python"),
                    "--no-deps", "--no-index", "--offline", "--require-hashes", "--quiet",
                    "--find-links", str(store), "-r", str(requirements)], check=True,
                   timeout=300, env={**os.environ, "UV_CACHE_DIR": str(tmp_path / "uvc"),
                                     "UV_LINK_MODE": "copy"})
    (site,) = venv.glob("lib/python*/site-packages")
    assert wheels.venv_problems(venv, site, found) == []
    (header,) = venv.glob("include/site/python*/tinydist/tiny.h")
    header.write_text("int planted;\n")
    assert wheels.venv_problems(venv, site, found) == [
        f"{header.relative_to(venv).as_posix()}: differs from its wheel"]
    header.write_text("int tiny;\n")

    planted = site / "tinydist" / "planted.py"
    planted.write_text("import os\n")
    record = site / "tinydist-1.0.dist-info" / "RECORD"
    digest = base64.urlsafe_b64encode(hashlib.sha256(b"import os\n").digest()).rstrip(b"=")
    record.write_text(record.read_text() + f"tinydist/planted.py,sha256={digest.decode()},10\n")
    assert "tinydist/planted.py: installed by no locked wheel" in wheels.venv_problems(
        venv, site, found)
    planted.unlink()
    (site / "tinydist" / "__init__.py").write_text("VALUE = 2\n")
    assert wheels.venv_problems(venv, site, found) == [
        "tinydist/__init__.py: differs from its wheel"]


# --------------------------------------------------------------------------- 4: reproduction


def _report(values: dict[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
    test = {"nodeid": NODE, "outcome": "passed", "observations": [values],
            "observation_kinds": [kinds]}
    return {"experiments": [{"chapter": "ch01_x", "name": "test_a", "outcome": "passed",
                             "tests": [NODE]}], "tests": [test]}


def test_an_original_that_calls_every_key_a_measurement_does_not_reproduce() -> None:
    """Class 4: the kinds come from the re-runs (the commit's own declaration), never the
    original's JSON: an original calling its facts measurements differs, naming the key
    and both kinds, even where the values happen to agree."""
    original = _report({"effects": 2, "state": "ok"},
                       {"effects": "measurement", "state": "measurement"})
    rerun = _report({"effects": 1, "state": "ok"}, {"effects": "fact", "state": "fact"})
    comparison = reproduction.compare(original, [rerun])
    assert comparison.verdict == reproduction.DIFFERS
    (experiment,) = comparison.experiments
    assert {(v.key, v.original_kind, v.kind) for v in experiment.differing} == {
        ("effects", "measurement", "fact"), ("state", "measurement", "fact")}
    screen = io.StringIO()
    Console(file=screen, width=300).print(reproduce.table(comparison))
    assert "the original calls it a measurement; the commit declares a fact" in screen.getvalue()
    honest = _report({"effects": 1, "state": "ok"}, {"effects": "fact", "state": "fact"})
    assert reproduction.compare(honest, [rerun]).identical


def _evidence(tmp_path: Path, root: Path, signer: dsse.Signer) -> Path:
    directory = tmp_path / "ev"
    compiler.write(directory, _facts(), root=root, signer=signer)
    return directory


def test_unpinned_evidence_and_a_commit_on_no_branch_are_not_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Class 4: evidence signed by a key no pin vouches for is refused before any re-run;
    so is pinned evidence of a commit no branch reaches."""
    root = _tree(tmp_path)
    calls: list[str] = []

    def rerun(commit: str, evidence: Path, workers: str | None) -> None:
        calls.append(commit)

    unpinned = _evidence(tmp_path, root, dsse.load_signer({}))
    with pytest.raises(errors.Refused, match="UNPINNED: only evidence a pinned key"):
        reproduce.reproduce(unpinned, out=tmp_path / "out", rerun=rerun, root=root,
                            console=Console(file=io.StringIO()))
    assert calls == []

    key_file = tmp_path / "key.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key_file)],
                   check=True, capture_output=True)
    signer = dsse.load_signer({dsse.KEY_ENV: str(key_file)})
    labtree.git(root, "checkout", "-q", "--detach")
    (root / "orphan.txt").write_text("on no branch\n")
    labtree.git(root, "add", "-A")
    labtree.git(root, "commit", "-q", "-m", "detached")
    pinned_dir = tmp_path / "pinned"
    compiler.write(pinned_dir, _facts(), root=root, signer=signer)
    labtree.git(root, "checkout", "-q", "-")
    public = signer.key.public_key()
    with pytest.raises(errors.Refused, match="is on no branch"):
        reproduce.reproduce(pinned_dir, out=tmp_path / "out", rerun=rerun, root=root,
                            public_key=public, console=Console(file=io.StringIO()))
    assert calls == []


# --------------------------------------------------------------------------- 5: key trust


def _commit_key(root: Path, key: KeyFiles, where: str, name: str) -> None:
    """Track ``key``'s public PEM as ``keys/<where>/<name>.pub.pem`` in a new commit."""
    (root / "keys" / where).mkdir(parents=True, exist_ok=True)
    (root / "keys" / where / f"{name}.pub.pem").write_bytes(key.public_pem.read_bytes())
    labtree.commit(root)


def _verify_cli(root: Path, evidence: Path, monkeypatch: pytest.MonkeyPatch,
                capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    """``lab evidence verify EVIDENCE [extra]`` run in ``root``: its exit and output."""
    monkeypatch.chdir(root)
    code = cli.main(["evidence", "verify", str(evidence), *extra])
    return code, capsys.readouterr().out


def test_a_key_added_by_a_commit_on_no_branch_vouches_for_nothing(
    tmp_path: Path, make_key: Callable[[str], KeyFiles], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Class 5 (a): a side commit on no branch adds the key that signs evidence naming
    that very commit. Keys are read at the default branch's tip, so the key pins
    nothing: the evidence, claiming a publication key, fails as UNPINNED, and ``lab
    reproduce`` refuses it before any re-run."""
    root = _tree(tmp_path)
    mallory = make_key("mallory")
    labtree.git(root, "checkout", "-q", "--detach")
    _commit_key(root, mallory, "trusted", "mallory")
    side = labtree.git(root, "rev-parse", "HEAD").strip()
    evidence = tmp_path / "ev-side"
    report = compiler.write(evidence, _facts(), root=root,
                            signer=dsse.Signer(mallory.private, "key_file"))
    assert report["commit"] == side
    labtree.git(root, "checkout", "-q", "-")
    assert reproduce.on_a_branch(root, side) == []
    assert [k.origin for k in trust.trusted_keys(root, environ={})] == []

    code, out = _verify_cli(root, evidence, monkeypatch, capsys)
    assert code == 1, out
    assert out.startswith("FAIL ") and "UNPINNED" in out
    assert "presented as a publication key" in out
    calls: list[str] = []
    with pytest.raises(errors.Refused, match="UNPINNED"):
        reproduce.reproduce(evidence, out=tmp_path / "out", root=root,
                            rerun=lambda commit, _e, _w: calls.append(commit),
                            console=Console(file=io.StringIO()))
    assert calls == []


def test_a_revoked_key_vouches_for_no_evidence_of_any_age_however_named(
    tmp_path: Path, make_key: Callable[[str], KeyFiles], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Class 5 (b): evidence signed at an old commit, when its key was trusted; the key
    is then revoked (``keys/revoked/`` at the tip). The evidence fails naming the
    revoked key's file, through keys/trusted (kept there too), --public-key and
    LAB_TRUSTED_KEYS alike, and ``lab reproduce`` refuses it."""
    root = _tree(tmp_path)
    old = make_key("old")
    _commit_key(root, old, "trusted", "old")
    evidence = tmp_path / "ev-old"
    compiler.write(evidence, _facts(), root=root, signer=dsse.Signer(old.private, "key_file"))
    code, out = _verify_cli(root, evidence, monkeypatch, capsys)
    assert code == 0 and "pinned by keys/trusted/old.pub.pem" in out, out

    _commit_key(root, old, "revoked", "old")  # still in keys/trusted/ as well
    reason = "is REVOKED by keys/revoked/old.pub.pem at "
    for extra, environ in (((), {}), (("--public-key", str(old.public_pem)), {}),
                           ((), {trust.TRUSTED_ENV: str(old.public_pem)})):
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        code, out = _verify_cli(root, evidence, monkeypatch, capsys, *extra)
        assert code == 1, (extra, environ, out)
        assert out.startswith("FAIL ") and "pinned by" not in out.splitlines()[0], out
        failed = [line for line in out.splitlines() if line.startswith("  failed: ")]
        assert failed and reason in failed[0], (extra, out)
        monkeypatch.delenv(trust.TRUSTED_ENV, raising=False)
    checked = verification.verify(evidence, public_key=old.public,
                                  trusted=trust.trusted_keys(root, environ={}))
    assert not checked.ok and checked.pinned_by is None
    with pytest.raises(errors.Refused, match=r"REVOKED by keys/revoked/old\.pub\.pem"):
        reproduce.reproduce(evidence, out=tmp_path / "out", root=root,
                            public_key=old.public, rerun=lambda *_: None,
                            console=Console(file=io.StringIO()))


def test_which_keys_are_revoked_is_not_the_callers_git_to_say(
    tmp_path: Path, make_key: Callable[[str], KeyFiles], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``git`` first on ``PATH`` that hides ``keys/revoked/`` from every listing, and a
    global configuration of the caller's: the revoked key is still revoked, because the
    trusted keys are read through the lab's own git with no caller configuration."""
    root = _tree(tmp_path)
    old = make_key("old")
    _commit_key(root, old, "trusted", "old")
    _commit_key(root, old, "revoked", "old")
    liar = tmp_path / "bin"
    liar.mkdir()
    (liar / "git").write_text('#!/bin/sh\n/usr/bin/git "$@" | grep -av revoked\n')
    (liar / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{liar}:/usr/bin:/bin")
    known = trust.trusted_keys(root, environ={})
    assert [(k.origin.split(" at ")[0], k.revoked) for k in known] == [
        ("keys/trusted/old.pub.pem", False), ("keys/revoked/old.pub.pem", True)]
    assert trust.revoked(known, old.public) is not None


def test_a_key_trusted_at_the_tip_vouches_for_evidence_older_than_it(
    tmp_path: Path, make_key: Callable[[str], KeyFiles], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Class 5 (c): evidence signed at a commit that does not hold its key, the key
    committed under keys/trusted/ afterwards: it is the tip that counts, so it vouches."""
    root = _tree(tmp_path)
    late = make_key("late")
    evidence = tmp_path / "ev-early"
    report = compiler.write(evidence, _facts(), root=root,
                            signer=dsse.Signer(late.private, "key_file"))
    code, out = _verify_cli(root, evidence, monkeypatch, capsys)
    assert code == 1 and "UNPINNED" in out, out
    _commit_key(root, late, "trusted", "late")
    tip = labtree.git(root, "rev-parse", "HEAD").strip()
    assert report["commit"] != tip
    code, out = _verify_cli(root, evidence, monkeypatch, capsys)
    assert code == 0, out
    assert f"pinned by keys/trusted/late.pub.pem at {tip[:12]} (tip of " in out


# --------------------------------------------------------------------------- 7: the rows


def _signed_with_a_failure(tmp_path: Path) -> tuple[Path, dict[str, Any], list[str],
                                                    dsse.Signer]:
    root = _tree(tmp_path)
    signer = dsse.load_signer({})
    directory = tmp_path / "ev"
    records = [*labtree.phase_records(NODE), *labtree.phase_records(FAILED_NODE, ["failed"])]
    facts = _facts(records=records, collected=[NODE, FAILED_NODE])
    report = compiler.write(directory, facts, root=root, signer=signer)
    assert report["status"] == gate.FAIL
    lines = (directory / compiler.TESTS_FILE).read_text().splitlines()
    return directory, report, lines, signer


def test_a_failed_result_left_out_of_the_rows_does_not_verify(tmp_path: Path) -> None:
    """Class 7: a failed result present in the signed tests.jsonl, removed from the
    report's rows (its test row and its experiment's list), re-signed: not PASS,
    naming the result."""
    directory, report, lines, signer = _signed_with_a_failure(tmp_path)
    forged = json.loads(json.dumps(report))
    forged["tests"] = [t for t in forged["tests"] if t["nodeid"] != FAILED_NODE]
    forged["experiments"] = [row for row in forged["experiments"] if row["name"] != "test_b"]
    forged["unreported"] = []
    verdict = gate.decide(forged)
    forged.update(status=verdict.status, missing=verdict.missing,
                  publishable=verdict.publishable,
                  gate={"failures": verdict.failures, "narrowed": verdict.narrowed})
    assert forged["status"] == gate.PASS  # the forged rows alone would pass
    _resign(directory, forged, ("\n".join(lines) + "\n").encode(), signer)
    result = verification.verify(directory)
    assert not result.ok
    assert (f"tests: {FAILED_NODE} is in tests.jsonl but not among the report's rows"
            in result.problems), result.problems
    assert any(p.startswith("experiments: the report's rows are not what the signed")
               for p in result.problems), result.problems


def test_a_duplicate_or_renamed_row_or_a_record_without_node_id_does_not_verify(
    tmp_path: Path,
) -> None:
    """Class 7: a row listed twice, a row renamed away from its record, and a test
    record without a node id are each named."""
    directory, report, lines, signer = _signed_with_a_failure(tmp_path)
    passed_row = next(t for t in report["tests"] if t["nodeid"] == NODE)

    duplicated = json.loads(json.dumps(report))
    duplicated["tests"].append(passed_row)
    _resign(directory, duplicated, ("\n".join(lines) + "\n").encode(), signer)
    assert f"tests: {NODE} has more than one row" in verification.verify(directory).problems
    assert "a result has more than one row" in gate.decide(duplicated).failures

    renamed = json.loads(json.dumps(report))
    for test in renamed["tests"]:
        if test["nodeid"] == FAILED_NODE:
            test["nodeid"] = FAILED_NODE + "[renamed]"
    _resign(directory, renamed, ("\n".join(lines) + "\n").encode(), signer)
    problems = verification.verify(directory).problems
    assert f"tests: {FAILED_NODE}[renamed] has a row but no record in tests.jsonl" in problems

    nameless = [json.loads(line) for line in lines]
    for record in nameless:
        if record.get("nodeid") == FAILED_NODE:
            del record["nodeid"]
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in nameless)
    _resign(directory, report, text.encode(), signer)
    problems = verification.verify(directory).problems
    assert any("a TestReport without a node id" in p for p in problems), problems
