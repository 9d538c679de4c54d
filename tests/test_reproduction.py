"""Facts and measurements, the comparison of runs, and ``lab reproduce`` on real runs.

The first part is pure (no database): the classification rule, the gate's word on an
undecided key, ``compare`` on hand-built report rows, the signed record and the book's
section. The last part runs real ``lab run`` processes against the outer run's
PostgreSQL in a tiny git repository (``tests/support/labtree.py``): a genuine run reproduces with
every fact the same (exit 0); a commit whose experiment records a fact that changes on
every run does not (exit 1, naming the experiment and the fact, with how often it held).
The re-run step is injected (a fresh clone of the commit, then ``lab run``): the
hermetic ``lab run --hermetic`` of issue 27 is behind ``reproduce.rerun_hermetic``.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from rich.console import Console

from lab import cli, errors, reproduce
from lab.book import reproduction as book_reproduction
from lab.evidence import (
    compiler,
    dsse,
    gate,
    observations,
    reproduction,
    reproduction_evidence,
    trust,
)
from tests.support import labtree
from tests.support.keys import KeyFiles

# --------------------------------------------------------------------------- classification


def test_names_declare_measurements_and_nothing_else_is_a_fact_by_default() -> None:
    """Names of durations, rates and ids are measurements; every other key must be
    declared: a string, a list, a count or a float is never a fact by accident, and the
    one-line error names each such key with the declaration to add."""
    kinds = observations.classify({
        "elapsed_s": 0.31, "wall_ms": 12, "trace_id": "t-1", "claims_per_s": 812.5,
    })
    assert set(kinds.values()) == {"measurement"}
    with pytest.raises(observations.Undeclared) as caught:
        observations.classify({"state": "succeeded", "claimed_by": ["a"], "elapsed_s": 0.3})
    message = str(caught.value)
    assert "\n" not in message
    assert message == (
        "observe: 'state', 'claimed_by' have no declared kind: add facts=('state', "
        "'claimed_by') if every run of the commit observes the same value, else "
        "measurements=('state', 'claimed_by')")
    for value in ("x", ["x"], 1, True, None, 0.5, {"p50": 1.5}):
        with pytest.raises(observations.Undeclared, match="'key' has no declared kind"):
            observations.classify({"key": value})


def test_declarations_decide() -> None:
    """A declared fact or measurement is what it says; one declared as both is
    undecided; a declared key the observation lacks is an error, not a silent no-op."""
    value = {"ratio": 0.5, "outcome": "took 3.1 s", "state": "x"}
    kinds = observations.classify(value, facts=("ratio", "state"), measurements=("outcome",))
    assert kinds == {"ratio": "fact", "outcome": "measurement", "state": "fact"}
    both = observations.classify(value, facts=("state", "ratio"),
                                 measurements=("state", "outcome"))
    assert both["state"] == observations.UNCLASSIFIED
    with pytest.raises(ValueError, match="not in the observation: typo"):
        observations.classify(value, facts=("typo",))


def test_undeclared_keys_are_found_in_the_source_before_a_run() -> None:
    """The collection-time check: literal keys of a literal observe() that no literal
    declaration names, by function, with file and line; computed declarations are left
    to the record-time check."""
    source = (
        "def test_a(observe):\n"
        "    observe({'state': s, 'elapsed_s': 1.0, 'winner': w}, measurements=('winner',))\n"
        "def test_b(observe):\n"
        "    observe({'state': s}, facts=('state',))\n"
        "def test_c(observe):\n"
        "    observe({'state': s}, facts=FACTS)\n"
    )
    assert observations.undeclared_in_source(source, "t.py") == {
        "test_a": ["t.py:2: observe: 'state' has no declared kind: add facts=('state',) if "
                   "every run of the commit observes the same value, else "
                   "measurements=('state',)"]}


def test_gate_names_the_test_and_each_undecided_key() -> None:
    """An unclassified key, a key with no recorded kind, and an observation that is not an
    object each fail, naming the result and the key; classified keys pass."""
    test = {"nodeid": "experiments/ch01_x/test_a.py::test_a",
            "observations": [{"state": "x", "ratio": 0.5}, {"late": 1}, "text"],
            "observation_kinds": [{"state": "fact", "ratio": "unclassified"}]}
    failures = observations.gate_failures(test)
    assert [f.split(" is neither")[0] for f in failures] == [
        "experiments/ch01_x/test_a.py::test_a: observation key 'ratio'",
        "experiments/ch01_x/test_a.py::test_a: observation key 'late'",
        "experiments/ch01_x/test_a.py::test_a: observation key '(not an object)'",
    ]
    fine = {"nodeid": "n", "observations": [{"state": "x"}],
            "observation_kinds": [{"state": "fact"}]}
    assert observations.gate_failures(fine) == []
    report = {"tests": [test], "experiments": []}
    assert set(failures) <= set(gate.decide(report).failures)


# --------------------------------------------------------------------------- compare


def _report(values: dict[str, dict[str, Any]], outcome: str = "passed") -> dict[str, Any]:
    """A report with one experiment per entry of ``values`` (its one observation)."""
    tests, rows = [], []
    for name, observed in values.items():
        nodeid = f"experiments/ch01_x/test_a.py::{name}"
        tests.append({"nodeid": nodeid, "outcome": outcome, "observations": [observed],
                      "observation_kinds": [observations.classify(
                          observed, facts=[k for k in observed if not k.endswith("_s")])]})
        rows.append({"chapter": "ch01_x", "name": name, "outcome": outcome, "tests": [nodeid]})
    return {"tests": tests, "experiments": rows}


ORIGINAL = {"test_one": {"state": "succeeded", "effects": 1, "elapsed_s": 0.2},
            "test_two": {"refused_with": "Conflict"}}


def test_same_facts_are_identical_whatever_the_measurements() -> None:
    """Measurements differ between runs and are shown side by side; facts held: identical."""
    again = copy.deepcopy(ORIGINAL)
    again["test_one"]["elapsed_s"] = 0.9
    result = reproduction.compare(_report(ORIGINAL), [_report(again)])
    assert result.identical and result.verdict == "identical"
    one = result.experiments[0]
    assert [(f.key, f.original, f.values) for f in one.facts] == [
        ("state", "succeeded", ("succeeded",)), ("effects", 1, (1,))]
    assert [(m.key, m.original, m.values) for m in one.measurements] == [
        ("elapsed_s", 0.2, (0.9,))]


def test_a_changed_fact_is_named_with_both_values() -> None:
    """One fact that came out differently makes its experiment differ, and only it."""
    again = copy.deepcopy(ORIGINAL)
    again["test_one"]["effects"] = 2
    result = reproduction.compare(_report(ORIGINAL), [_report(again)])
    assert not result.identical
    assert [e.label for e in result.experiments if not e.same] == ["ch01_x/test_one"]
    (fact,) = result.experiments[0].differing
    assert (fact.key, fact.original, fact.values, fact.held) == ("effects", 1, (2,), 0)


def test_a_missing_result_or_a_failure_is_not_a_reproduction() -> None:
    """A fact no longer observed is ABSENT and differs; a failed re-run is not identical
    even when its facts match."""
    again = copy.deepcopy(ORIGINAL)
    del again["test_two"]
    result = reproduction.compare(_report(ORIGINAL), [_report(again)])
    two = result.experiments[1]
    assert two.outcomes == (gate.MISSING,) and not two.passed
    assert two.differing[0].values == (reproduction.ABSENT,)
    failed = reproduction.compare(_report(ORIGINAL), [_report(ORIGINAL, outcome="failed")])
    assert all(e.same for e in failed.experiments) and not failed.identical


def test_runs_count_how_often_each_fact_held() -> None:
    """Over three re-runs a fact that held twice is reported as held 2 of 3."""
    flaky = copy.deepcopy(ORIGINAL)
    flaky["test_two"]["refused_with"] = "Stale"
    runs = [_report(ORIGINAL), _report(flaky), _report(ORIGINAL)]
    result = reproduction.compare(_report(ORIGINAL), runs)
    (fact,) = result.experiments[1].differing
    assert (fact.held, result.runs) == (2, 3)
    record = reproduction.to_json(result)
    assert record["summary"] == {"experiments": 2, "identical_in_facts": 1,
                                 "passed_everywhere": 2}


# --------------------------------------------------------------------------- evidence, book


def _record(comparison: reproduction.Comparison, envelope: bytes = b"original") -> dict[str, Any]:
    digest = reproduction_evidence.sha256(envelope)
    return {
        "schema_version": 1, "reproduced_at_utc": "2026-12-01T16:00:00Z",
        "inputs": [{"name": "original runtime.intoto.json", "digest": {"sha256": digest}}],
        "original": {"envelope_sha256": digest, "commit": "a" * 40, "status": "PASS"},
        "runs": [{"evidence": "runs/run-1", "envelope_sha256": "b" * 64, "status": "PASS",
                  "wall_s": 1.0}],
        "comparison": reproduction.to_json(comparison), "wall_s": 1.5,
    }


def test_signed_record_verifies_and_tampering_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The record is signed; an edited reproduction.json no longer verifies."""
    again = copy.deepcopy(ORIGINAL)
    again["test_one"]["effects"] = 2
    comparison = reproduction.compare(_report(ORIGINAL), [_report(again)])
    signer = dsse.Signer(ed25519.Ed25519PrivateKey.generate(), "ephemeral")
    reproduction_evidence.write(tmp_path, _record(comparison), signer)
    checked = reproduction_evidence.verify(tmp_path)
    assert checked.ok, checked.problems
    assert checked.record is not None and checked.record["comparison"]["verdict"] == "differs"
    # ``lab evidence verify`` knows a reproduction when it sees one.
    assert cli.main(["evidence", "verify", str(tmp_path)]) == 0
    line = capsys.readouterr().out
    assert line.startswith(f"OK {tmp_path}: reproduction of commit ") and "differs, " in line
    assert "1 of 2 experiments identical" in line and "UNPINNED" in line
    path = tmp_path / reproduction_evidence.RECORD_FILE
    path.write_text(path.read_text().replace('"differs"', '"identical"'))
    assert "reproduction.json: its sha256 is not the signed subject's" in (
        reproduction_evidence.verify(tmp_path).problems)
    assert cli.main(["evidence", "verify", str(tmp_path)]) == 1
    assert capsys.readouterr().out.startswith(f"FAIL {tmp_path}: reproduction.json: its sha256")


def test_book_section_counts_and_escapes() -> None:
    """The book says how many experiments were identical in their facts, lists the
    differing fact with both values, and escapes what the evidence says."""
    again = copy.deepcopy(ORIGINAL)
    again["test_one"]["state"] = "[click](javascript:alert(1)) <img>"
    comparison = reproduction.compare(_report(ORIGINAL), [_report(again)])
    lines = book_reproduction.lines(json.dumps(_record(comparison)).encode(),
                                    by="keys/trusted/r.pub.pem at abc, key 12ab")
    text = "\n".join(lines)
    assert ("Reproduced independently by `keys/trusted/r.pub.pem at abc, key 12ab` on "
            "2026-12-01, 1 of 2 experiments identical in their facts") in text
    assert "| ch01_x/test_one | state | succeeded |" in text
    assert "\\[click\\](javascript:alert(1)) &lt;img&gt;" in text
    assert "<img>" not in text and "[click]" not in text
    assert book_reproduction.lines(None) == []
    # Verified but vouched for by no independent key: no table, and the reason.
    unvouched = "\n".join(book_reproduction.lines(json.dumps(_record(comparison)).encode()))
    assert unvouched.startswith("**Not pinned**") and "| ch01_x" not in unvouched


# --------------------------------------------------------------------------- real runs

EXPERIMENT = '''
import time


def test_one_credit(lab, observe):
    """An approved credit run by a worker succeeds with exactly one effect."""
    started = time.monotonic()
    job = lab.approved()
    rig = lab.credit_tool()
    rig.worker.run_one()
    final = lab.state(job.id)
    assert final.state == "succeeded"
    assert lab.effects() == 1
    observe({"state": final.state, "effects": lab.effects(), "post_calls": rig.service.calls,
             "elapsed_s": round(time.monotonic() - started, 4)},
            facts=("state", "effects", "post_calls"))
'''
# The deliberate change: a fact that cannot come out the same twice (a fresh workflow id
# under a name that is not a measurement's).
CHANGED = EXPERIMENT.replace(
    '"post_calls": rig.service.calls,', '"post_calls": rig.service.calls, "workflow": job.id,'
).replace('"post_calls")', '"post_calls", "workflow")')
ENTRIES = [{"chapter": "ch01_repro", "name": "test_one_credit", "results": 1,
            "database": True}]


def _env(dsn: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LAB_EVIDENCE"))}
    env["BOOK_LAB_DSN"] = dsn
    return env


def _lab_run(cwd: Path, evidence: Path, dsn: str, key: KeyFiles | None = None) -> None:
    """A real ``lab run`` of the whole tree, on the outer run's PostgreSQL; signed with
    ``key`` (a publication key) when given, else with an ephemeral key."""
    env = _env(dsn)
    if key is not None:
        env[dsse.KEY_ENV] = str(key.private_pem)
    done = subprocess.run(
        [sys.executable, "-m", "lab.cli", "run", "--evidence", str(evidence), "--",
         "--lab-postgres=dsn"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert (evidence / compiler.ENVELOPE_FILE).is_file(), done.stdout[-3000:] + done.stderr


class CloneAndRun:
    """The injected re-run: a fresh clone of the commit, then a real ``lab run`` in it."""

    def __init__(self, repo: Path, scratch: Path, dsn: str) -> None:
        self.repo, self.scratch, self.dsn, self.count = repo, scratch, dsn, 0

    def __call__(self, commit: str, evidence: Path, workers: str | None) -> None:
        self.count += 1
        self.workers = workers
        clone = self.scratch / f"clone-{self.count}"
        subprocess.run(["git", "clone", "-q", str(self.repo), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", commit], check=True)
        _lab_run(clone, evidence, self.dsn)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A publishable tree: the seed's stand-ins and one real-database experiment."""
    root = tmp_path / "repo"
    chapter = root / "experiments" / "ch01_repro"
    chapter.mkdir(parents=True)
    (chapter / "test_repro.py").write_text(EXPERIMENT)
    labtree.publishable(root, ENTRIES)
    return root


def _reproduce(repo: Path, original: Path, out: Path, rerun: CloneAndRun,
               runs: int = 1, key: KeyFiles | None = None) -> tuple[int, str]:
    """``lab reproduce`` of ``original``, pinned by ``key`` (``--public-key``) when given."""
    screen = io.StringIO()
    code = reproduce.reproduce(original, runs=runs, out=out, rerun=rerun, root=repo,
                               public_key=key.public if key is not None else None,
                               console=Console(file=screen, width=250))
    return code, screen.getvalue()


def test_a_genuine_run_reproduces_with_every_fact_the_same(
    repo: Path, tmp_path: Path, lab_dsn: str, make_key: Callable[[str], KeyFiles]
) -> None:
    """Reproducing a genuine signed run of a clean commit: every fact the same, every
    experiment passed in both runs, exit 0, and signed reproduction evidence that names
    the original's envelope digest as its input."""
    # Only an original a pinned key vouches for is re-run: sign it with a publication key
    # and pin that key, as `lab reproduce --public-key` does.
    key = make_key("original")
    original = tmp_path / "original"
    _lab_run(repo, original, lab_dsn, key)
    out = tmp_path / "reproduction"
    code, screen = _reproduce(repo, original, out, CloneAndRun(repo, tmp_path, lab_dsn),
                              key=key)
    assert code == 0, screen
    assert "reproduction IDENTICAL: 27 of 27 experiments identical in their facts" in screen
    checked = reproduction_evidence.verify(out)
    assert checked.ok, checked.problems
    record = checked.record
    assert record is not None
    digest = reproduction_evidence.sha256((original / compiler.ENVELOPE_FILE).read_bytes())
    assert record["inputs"][0]["digest"]["sha256"] == digest
    (row,) = [e for e in record["comparison"]["experiments"] if e["name"] == "test_one_credit"]
    assert {f["key"]: f["held"] for f in row["facts"]} == {
        "effects": 1, "post_calls": 1, "state": 1}
    assert [m["key"] for m in row["measurements"]] == ["elapsed_s"]


def test_a_changed_experiment_differs_naming_experiment_and_fact(
    repo: Path, tmp_path: Path, lab_dsn: str, make_key: Callable[[str], KeyFiles]
) -> None:
    """Evidence of a commit whose experiment records a fact that is new on every run:
    reproduced twice, it exits 1 naming the experiment and the fact, held 0 of 2."""
    (repo / "experiments" / "ch01_repro" / "test_repro.py").write_text(CHANGED)
    labtree.commit(repo)
    # A pinned original, so that the difference is the reproduction's verdict, not a refusal.
    key = make_key("original")
    original = tmp_path / "original"
    _lab_run(repo, original, lab_dsn, key)
    out = tmp_path / "reproduction"
    code, screen = _reproduce(repo, original, out, CloneAndRun(repo, tmp_path, lab_dsn), runs=2,
                              key=key)
    assert code == 1
    assert "reproduction DIFFERS: 26 of 27 experiments identical" in screen
    assert "differing: ch01_repro/test_one_credit" in screen
    # The table names the fact and calls it unreliable (rich may fold the cell's lines).
    assert "workflow" in screen and "unreliable" in screen
    record = reproduction_evidence.verify(out).record
    assert record is not None and record["comparison"]["verdict"] == "differs"
    (row,) = [e for e in record["comparison"]["experiments"] if not e["same"]]
    (fact,) = [f for f in row["facts"] if f["held"] != 2]
    assert (row["name"], fact["key"], fact["held"]) == ("test_one_credit", "workflow", 0)
    assert fact["original"].startswith("wf_") and fact["original"] not in fact["values"]
    assert row["passed"] is True, "the experiment passed everywhere: only its fact differs"


def test_evidence_compare_fails_naming_experiment_and_key_of_a_differing_fact(
    repo: Path, tmp_path: Path, lab_dsn: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``lab evidence compare``, CI's check of its two genuine runs: two runs of a commit
    whose experiment declares a fresh workflow id a fact differ, exit 1 naming the
    experiment and the key (and not the measurement that differs too); a run compared
    with itself is identical, exit 0."""
    (repo / "experiments" / "ch01_repro" / "test_repro.py").write_text(CHANGED)
    labtree.commit(repo)
    first, second = tmp_path / "first", tmp_path / "second"
    _lab_run(repo, first, lab_dsn)
    _lab_run(repo, second, lab_dsn)
    monkeypatch.chdir(repo)
    code = cli.main(["evidence", "compare", str(first), str(second)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "facts DIFFER: 26 of 27 experiments the same" in out
    differs = [line for line in out.splitlines() if line.startswith("differs: ")]
    assert len(differs) == 1, out
    assert differs[0].startswith("differs: ch01_repro/test_one_credit workflow: ")
    assert "elapsed_s" not in differs[0]
    assert cli.main(["evidence", "compare", str(first), str(first)]) == 0
    assert "facts IDENTICAL: 27 of 27 experiments the same" in capsys.readouterr().out


def test_unverified_evidence_is_refused_before_any_rerun(
    repo: Path, tmp_path: Path, lab_dsn: str
) -> None:
    """Evidence whose report was edited after signing is refused, naming why; nothing
    is re-run and nothing is written."""
    original = tmp_path / "original"
    _lab_run(repo, original, lab_dsn)
    report = original / compiler.REPORT_FILE
    report.write_text(report.read_text().replace('"succeeded"', '"failed"', 1))
    rerun = CloneAndRun(repo, tmp_path, lab_dsn)
    with pytest.raises(errors.Refused, match=r"not verified: runtime\.json"):
        _reproduce(repo, original, tmp_path / "reproduction", rerun)
    assert rerun.count == 0 and not (tmp_path / "reproduction").exists()


def test_a_lock_the_commit_does_not_carry_is_an_environment_refusal(repo: Path) -> None:
    """A lock digest the commit's uv.lock cannot satisfy is refused with one line (exit 3)."""
    commit = labtree.git(repo, "rev-parse", "HEAD").strip()
    report = {"commit": commit, "hermetic": {"lock_sha256": "c" * 64}}
    with pytest.raises(errors.ProvisioningError, match=r"has no uv\.lock") as refused:
        reproduce.check_environment(report, repo)
    assert errors.exit_code(refused.value) == errors.EXIT_ENVIRONMENT
    (repo / "uv.lock").write_text("version = 1\n")
    labtree.commit(repo)
    head = labtree.git(repo, "rev-parse", "HEAD").strip()
    with pytest.raises(errors.ProvisioningError, match=r"uv\.lock is "):
        reproduce.check_environment({**report, "commit": head}, repo)
    wanted = reproduction_evidence.sha256(b"version = 1\n")
    assert reproduce.check_environment(
        {"commit": head, "environment": {"lock_sha256": wanted}}, repo) == wanted
    with pytest.raises(errors.ProvisioningError, match="not in the repository"):
        reproduce.check_environment({"commit": "d" * 40}, repo)


def test_the_book_takes_only_a_verified_reproduction_of_its_own_run(tmp_path: Path) -> None:
    """``evidence/reproduction/`` reaches the book only when it verifies, names this
    run's envelope as its input and an independent trusted key signed it; otherwise the
    book is refused, or the reproduction withheld, naming why."""
    comparison = reproduction.compare(_report(ORIGINAL), [_report(ORIGINAL)])
    directory = tmp_path / reproduction_evidence.BOOK_DIR
    key = ed25519.Ed25519PrivateKey.generate()
    signer = dsse.Signer(key, "key_file")
    trusted = [trust.TrustedKey(key.public_key(), "keys/trusted/r.pub.pem at abc")]
    assert reproduction_evidence.book_files(
        tmp_path, b"original", original_keyid="0" * 64, trusted=trusted) is None
    reproduction_evidence.write(directory, _record(comparison, b"original"), signer)
    found = reproduction_evidence.book_files(
        tmp_path, b"original", original_keyid="0" * 64, trusted=trusted)
    assert found is not None and found.withheld is None
    assert sorted(found.files) == ["reproduction/reproduction.intoto.json",
                                   "reproduction/reproduction.json"]
    assert found.reproducer == f"keys/trusted/r.pub.pem at abc, key {signer.keyid}"
    own = reproduction_evidence.book_files(
        tmp_path, b"original", original_keyid=signer.keyid, trusted=trusted)
    assert own is not None and not own.files
    assert str(own.withheld).startswith("not independent: it is signed by the original run's")
    with pytest.raises(errors.Refused, match="presented as a publication key"):
        reproduction_evidence.book_files(tmp_path, b"original", original_keyid="0" * 64)
    reproduction_evidence.write(directory, _record(comparison, b"original"),
                                dsse.Signer(key, "ephemeral"))
    unpinned = reproduction_evidence.book_files(tmp_path, b"original", original_keyid="0" * 64)
    assert unpinned is not None and not unpinned.files
    assert str(unpinned.withheld).startswith("not pinned: its signer, key ")
    with pytest.raises(errors.Refused, match="reproduces another run"):
        reproduction_evidence.book_files(
            tmp_path, b"another run", original_keyid="0" * 64, trusted=trusted)
    (directory / reproduction_evidence.RECORD_FILE).write_text("{}")
    with pytest.raises(errors.Refused, match="not the signed subject"):
        reproduction_evidence.book_files(
            tmp_path, b"original", original_keyid="0" * 64, trusted=trusted)


@pytest.mark.parametrize(("command", "workers"), [
    (["pytest", "experiments", "-n", "3"], "3"),
    (["pytest", "experiments", "--numprocesses=2"], "2"),
    (["pytest", "experiments", "-n4"], "4"),
    (["pytest", "experiments"], None),
    (["pytest", "-n", "auto"], None),
    (["pytest", "-n", "-p"], None),
    ("pytest -n 3", None),
])
def test_a_reproduction_schedules_its_experiments_as_the_original_did(
    command: Any, workers: str | None
) -> None:
    """The re-run gets the original's pytest-xdist worker count, when it recorded a plain one."""
    assert reproduce.recorded_workers({"command": command}) == workers
