"""Evidence: the DSSE encoding, signing, verification, gate and report hygiene.

Pure: no database, no pytest run; reports are built from report-log dicts.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from lab import cli, errors, files, recorder
from lab.evidence import compiler, dsse, gate, report, trust, verification
from tests.support import labtree
from tests.support.keys import KeyFiles, resign

DATABASE = {"provider": "dsn", "server_version": "15.8", "details": {"host": "127.0.0.1"}}


def _record(
    nodeid: str, when: str, outcome: str = "passed", props: list[Any] | None = None, **extra: Any
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "$report_type": "TestReport",
        "nodeid": nodeid,
        "when": when,
        "outcome": outcome,
        "duration": 0.01,
        "longrepr": None,
        "user_properties": props or [],
    }
    record.update(extra)
    return record


def _passing(nodeid: str, observation: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    props: list[Any] = [
        ["lab_claim", "A claim."],
        ["lab_needs_database", True],
        ["lab_database", True],
    ]
    if observation is not None:
        props += [list(p) for p in recorder.observation_properties(
            observation, facts=tuple(observation))]
    return [_record(nodeid, when, props=props) for when in ("setup", "call", "teardown")]


NODE_A = "experiments/ch01_x/test_a.py::test_a"
NODE_B = "experiments/ch01_x/test_a.py::test_b"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A tiny committed source tree for the report's digests: a clean git work tree."""
    root = tmp_path / "repo"
    (root / "lab").mkdir(parents=True)
    (root / "lab" / "core.py").write_text("VALUE = 1\n")
    (root / "lab" / "__init__.py").write_text("")
    (root / "experiments" / "ch01_x").mkdir(parents=True)
    (root / "experiments" / "ch01_x" / "test_a.py").write_text("def test_a(): pass\n")
    declared = [{"chapter": "ch01_x", "name": n, "results": 1, "database": None}
                for n in ("test_a", "test_b")]
    labtree.write_manifest(root, declared)
    (root / "pyproject.toml").write_text("[project]\n")
    labtree.git(root, "init", "-q")
    labtree.git(root, "add", "-A")
    labtree.git(root, "commit", "-q", "-m", "tree")
    return root


def _facts(**overrides: Any) -> compiler.RunFacts:
    values: dict[str, Any] = {
        "records": [*_passing(NODE_A, {"kept": 1}), *_passing(NODE_B)],
        "collected": [NODE_A, NODE_B],
        "experiments_prefix": "experiments/",
        "expected": [compiler.Expected("ch01_x", "test_a"), compiler.Expected("ch01_x", "test_b")],
        "database": DATABASE,
        "command": ["pytest", "experiments"],
        "exitstatus": 0,
    }
    values.update(overrides)
    # The seed floor, the committed manifest, lab from <root>/lab and a clean commit.
    return compiler.RunFacts(**labtree.seed_facts(values))


@pytest.fixture
def signed(repo: Path, tmp_path: Path) -> Path:
    """A passing run's evidence directory, signed with an ephemeral key."""
    directory = tmp_path / "evidence"
    report = compiler.write(directory, _facts(), root=repo, signer=dsse.load_signer({}))
    assert report["status"] == gate.PASS, report["gate"]
    return directory


def _envelope(directory: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((directory / compiler.ENVELOPE_FILE).read_text())
    return data


def _save(directory: Path, envelope: dict[str, Any]) -> None:
    (directory / compiler.ENVELOPE_FILE).write_text(json.dumps(envelope))


# --------------------------------------------------------------------------- DSSE


def test_pae_matches_the_dsse_specification_vector() -> None:
    """PAE is byte-exact with the DSSE protocol's published example and its signature."""
    body, kind = b"hello world", "http://example.com/HelloWorld"
    assert dsse.pae(kind, body) == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"

    # The protocol's ECDSA P-256 signature verifies over exactly our bytes.
    x = 46950820868899156662930047687818585632848591499744589407958293238635476079160
    y = 5640078356564379163099075877009565129882514886557779369047442380624545832820
    key = ec.EllipticCurvePublicNumbers(x, y, ec.SECP256R1()).public_key()
    raw = base64.b64decode(
        "A3JqsQGtVsJ2O2xqrI5IcnXip5GToJ3F+FnZ+O88SjtR6rDAajabZKciJTfUiHqJPcIAriEGAHTVeCUjW2JIZA=="
    )
    der = encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
    key.verify(der, dsse.pae(kind, body), ec.ECDSA(hashes.SHA256()))


def test_pae_counts_bytes_not_characters() -> None:
    """Lengths are of the UTF-8 bytes, and an empty body still ends with a space."""
    assert dsse.pae("application/vnd.exämple+json", b"{}").startswith(b"DSSEv1 29 ")
    assert dsse.pae("application/vnd.in-toto+json", b"") == (
        b"DSSEv1 28 application/vnd.in-toto+json 0 "
    )


def test_round_trip_verifies_and_says_the_key_is_ephemeral(signed: Path, repo: Path) -> None:
    """Evidence just written verifies, sources included, and owns up to its ephemeral key."""
    verdict = verification.verify(signed, check_sources=True, root=repo)
    assert verdict.ok, verdict.problems
    assert verdict.pinned_by is None
    assert any("EPHEMERAL" in note for note in verdict.notes)
    assert any("integrity, not identity" in note for note in verdict.notes)
    first = verification.format_verdict(verdict).splitlines()[0]
    assert first.startswith(f"UNPINNED {signed / compiler.ENVELOPE_FILE}: status PASS, local run, ")
    assert ", commit " in first
    assert "(DIRTY" not in first and first.endswith(" UNPINNED")
    envelope = _envelope(signed)
    assert envelope["payloadType"] == "application/vnd.in-toto+json"
    statement = json.loads(base64.b64decode(envelope["payload"]))
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    names = [s["name"] for s in statement["subject"]]
    assert names == [
        "experiments/ch01_x/test_a.py",
        "experiments/manifest.json",
        "lab/__init__.py",
        "lab/core.py",
        "pyproject.toml",
        "runtime.json",
        "tests.jsonl",
    ]
    assert statement["predicate"]["signing"]["key_source"] == "ephemeral"


def test_url_safe_base64_is_accepted(signed: Path) -> None:
    """Verifiers must accept URL-safe base64, padded or not."""
    envelope = _envelope(signed)
    payload = base64.b64decode(envelope["payload"])
    sig = base64.b64decode(envelope["signatures"][0]["sig"])
    envelope["payload"] = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    envelope["signatures"][0]["sig"] = base64.urlsafe_b64encode(sig).decode()
    _save(signed, envelope)
    verdict = verification.verify(signed)
    assert verdict.ok, verdict.problems


def test_one_changed_payload_byte_fails_the_signature(signed: Path) -> None:
    """Changing one byte of the signed payload is caught and named."""
    envelope = _envelope(signed)
    payload = bytearray(base64.b64decode(envelope["payload"]))
    index = payload.index(b'"PASS"') + 1
    payload[index] = ord("F")
    envelope["payload"] = base64.b64encode(bytes(payload)).decode()
    _save(signed, envelope)
    verdict = verification.verify(signed)
    assert not verdict.ok
    assert any(p.startswith("signature: does not verify") for p in verdict.problems)


def test_one_changed_signature_byte_fails(signed: Path) -> None:
    """Changing one byte of the signature is caught and named."""
    envelope = _envelope(signed)
    sig = bytearray(base64.b64decode(envelope["signatures"][0]["sig"]))
    sig[10] ^= 0x01
    envelope["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    _save(signed, envelope)
    verdict = verification.verify(signed)
    assert [p for p in verdict.problems if p.startswith("signature:")], verdict.problems


def test_payload_type_is_authenticated(signed: Path) -> None:
    """Swapping the payload type breaks the signature and is named as well."""
    envelope = _envelope(signed)
    envelope["payloadType"] = "application/json"
    _save(signed, envelope)
    problems = verification.verify(signed).problems
    assert any(p.startswith("payload type:") for p in problems)
    assert any(p.startswith("signature:") for p in problems)


def test_changed_report_file_fails(signed: Path) -> None:
    """runtime.json on disk must be the signed one."""
    path = signed / compiler.REPORT_FILE
    path.write_bytes(path.read_bytes().replace(b'"PASS"', b'"FAIL"', 1))
    problems = verification.verify(signed).problems
    assert "runtime.json: its sha256 does not match the signed subject" in problems


def test_changed_source_fails_only_with_check_sources(signed: Path, repo: Path) -> None:
    """A source edited after the run is named when the subjects are checked."""
    (repo / "lab" / "core.py").write_text("VALUE = 2\n")
    (repo / "lab" / "new.py").write_text("")
    # The sources are the files git tracks (the tree id): a new file is added to the index.
    labtree.git(repo, "add", "lab/new.py")
    assert verification.verify(signed, root=repo).ok
    problems = verification.verify(signed, check_sources=True, root=repo).problems
    assert "source lab/core.py: differs from the signed digest" in problems
    assert any(p.startswith("source lab/new.py: present") for p in problems)
    assert any(p.startswith("sources: the files tracked in") for p in problems)


def test_pinned_wrong_public_key_fails(signed: Path, make_key: Callable[[str], KeyFiles]) -> None:
    """A pinned key that did not sign is named as the cause."""
    verdict = verification.verify(signed, public_key=make_key("other").public)
    assert not verdict.ok
    assert any("not by the expected key" in p for p in verdict.problems)


def test_publication_key_from_environment(
    repo: Path, tmp_path: Path, make_key: Callable[[str], KeyFiles]
) -> None:
    """LAB_EVIDENCE_KEY signs; the pinned public key verifies through the command."""
    key = make_key("publication")
    signer = dsse.load_signer({dsse.KEY_ENV: str(key.private_pem)})
    assert signer.source == "key_file"
    directory = tmp_path / "evidence"
    compiler.write(directory, _facts(), root=repo, signer=signer)
    assert (directory / compiler.PUBLIC_KEY_FILE).read_text() == key.public_pem.read_text()

    argv = ["evidence", "verify", str(directory), "--public-key", str(key.public_pem)]
    assert cli.main(argv) == 0
    verdict = verification.verify(directory, public_key=key.public)
    assert verdict.ok and verdict.pinned_by == "--public-key"
    # A clean tree, a pinned publication key: nothing to add but that the run was local.
    assert all(note.startswith("LOCAL run") for note in verdict.notes), verdict.notes


def test_verify_command_exits_non_zero_and_names_the_failure(
    signed: Path, make_key: Callable[[str], KeyFiles], capsys: pytest.CaptureFixture[str]
) -> None:
    """``lab evidence verify`` prints FAIL and the cause."""
    wrong = make_key("wrong").public_pem
    args = ["evidence", "verify", str(signed / compiler.ENVELOPE_FILE), "--public-key", str(wrong)]
    assert cli.main(args) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL ")
    assert "not by the expected key" in out


def test_an_independent_dsse_implementation_verifies_our_envelope(signed: Path) -> None:
    """securesystemslib's DSSE Envelope verifies our signature over our payload."""
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey  # type: ignore[attr-defined]

    envelope = _envelope(signed)
    report = json.loads((signed / compiler.REPORT_FILE).read_text())
    public = dsse.load_public_key(report["signing"]["public_key"].encode())
    key = SSlibKey(
        keyid=dsse.keyid(public),
        keytype="ed25519",
        scheme="ed25519",
        keyval={"public": dsse.raw_public_key(public).hex()},
    )
    parsed = Envelope.from_dict(envelope)
    accepted = parsed.verify([key], 1)
    assert list(accepted) == [key.keyid]
    assert parsed.payload == base64.b64decode(envelope["payload"])


# --------------------------------------------------------------------------- the report


def _comparable(report: dict[str, Any]) -> dict[str, Any]:
    """A report without the fields allowed to differ between runs of one commit."""
    copy: dict[str, Any] = json.loads(json.dumps(report))
    for key in ("timestamp_utc", "signing"):
        copy.pop(key)
    for test in copy["tests"]:
        test.pop("duration")
    for row in copy["experiments"]:
        row.pop("duration")
    return copy


def test_two_compilations_differ_only_in_time_and_signature(repo: Path, tmp_path: Path) -> None:
    """Same results, different run: only times, durations and the signature change."""
    first = compiler.write(tmp_path / "one", _facts(), root=repo, signer=dsse.load_signer({}))
    shuffled = _facts(records=[*_passing(NODE_B), *_passing(NODE_A, {"kept": 1})])
    for record in shuffled.records:
        record["duration"] = 0.5
    second = compiler.write(tmp_path / "two", shuffled, root=repo, signer=dsse.load_signer({}))
    assert first != second
    assert _comparable(first) == _comparable(second)
    assert first["signing"]["keyid"] != second["signing"]["keyid"]


def test_secrets_on_the_command_line_stay_out_of_the_report(repo: Path, tmp_path: Path) -> None:
    """A DSN password and a token given on the command line never reach the compiler."""
    command = [
        "pytest",
        "--lab-dsn",
        "postgresql://lab:hunter2pw@127.0.0.1:5432/lab",
        "--lab-dsn=host=127.0.0.1 user=lab password=hunter3pw",
        "--token",
        "tok_ABCDEF123456",
        "--api-token=tok_ZYXWVU654321",
        "--url=postgresql://lab:hunter4pw@127.0.0.1/lab",
        "experiments",
    ]
    database = {
        "provider": "dsn",
        "server_version": "15.8",
        "details": {"dsn": "postgresql://lab:hunter5pw@127.0.0.1/lab", "password": "hunter6pw"},
    }
    env = {"BOOK_LAB_DSN": "postgresql://x:hunter7pw@h/db", "GITHUB_TOKEN": "ghp_secret_value"}
    directory = tmp_path / "evidence"
    compiler.write(
        directory,
        _facts(command=[*command, "ghp_secret_value"], database=database),
        root=repo,
        signer=dsse.load_signer({}),
        environ=env,
    )
    text = "".join(p.read_text() for p in directory.iterdir())
    payload = base64.b64decode(_envelope(directory)["payload"]).decode()
    for secret in ("hunter", "tok_ABCDEF", "tok_ZYXWVU", "ghp_secret_value"):
        assert secret not in text
        assert secret not in payload
    report = json.loads((directory / compiler.REPORT_FILE).read_text())
    assert report["command"][0:2] == ["pytest", "--lab-dsn"]
    assert report["command"][-2] == "experiments"
    assert report["postgresql"]["server_version"] == "15.8"


def test_gate_rules(repo: Path) -> None:
    """Each gate rule on compiled records, without running pytest."""

    def status(**overrides: Any) -> tuple[str, list[str]]:
        report = compiler.compile_report(_facts(**overrides), root=repo, signing={})
        return report["status"], report["gate"]["failures"]

    assert status() == (gate.PASS, [])
    assert status(database=None)[0] == gate.FAIL
    only_a = [*_passing(NODE_A)]
    assert status(records=only_a, collected=[NODE_A])[0] == gate.FAIL
    assert status(records=only_a, collected=[NODE_A], narrowed=["-k test_a"]) == (
        gate.PARTIAL,
        [],
    )
    # A skip, an xfail, and xdist's report for a crashed worker (when "???").
    skipped = [_record(NODE_B, "setup", "skipped", longrepr=["experiments/x.py", 1, "Skipped: no"])]
    state, failures = status(records=[*only_a, *skipped])
    assert state == gate.FAIL and f"{NODE_B} skipped" in failures
    xfailed = [_record(NODE_B, "call", "skipped", wasxfail="flaky")]
    assert f"{NODE_B} xfailed" in status(records=[*only_a, *xfailed])[1]
    crashed = [_record(NODE_B, "???", "failed", longrepr="worker 'gw0' crashed")]
    assert f"{NODE_B} failed" in status(records=[*only_a, *crashed])[1]
    # Setup and teardown without the body (--setup-only) is not a pass.
    bodiless = [_record(NODE_B, w) for w in ("setup", "teardown")]
    assert f"{NODE_B} not run" in status(records=[*only_a, *bodiless])[1]
    # Collected but never reported (an interrupted run) is a failure.
    assert f"{NODE_B} was collected but never reported" in status(records=only_a)[1]
    # A test that asked for the database (or is declared to need it) but never reached it.
    asked = [["lab_needs_database", True]]
    no_db = [_record(NODE_B, w, props=asked) for w in ("setup", "call", "teardown")]
    assert f"{NODE_B} did not reach a real database" in status(records=[*only_a, *no_db])[1]
    pure = [compiler.Expected("ch01_x", "test_a"), compiler.Expected("ch01_x", "test_b", 1, False)]
    assert status(records=[*only_a, *no_db], expected=pure)[0] == gate.PASS
    no_fixture = [_record(NODE_B, w) for w in ("setup", "call", "teardown")]
    assert status(records=[*only_a, *no_fixture])[0] == gate.PASS
    declared = [
        compiler.Expected("ch01_x", "test_a"),
        compiler.Expected("ch01_x", "test_b", 1, True),
    ]
    assert (
        f"{NODE_B} did not reach a real database"
        in status(records=[*only_a, *no_fixture], expected=declared)[1]
    )
    # Fewer results than declared, and an experiment the manifest does not declare.
    two = [compiler.Expected("ch01_x", "test_a", 2), compiler.Expected("ch01_x", "test_b")]
    assert "ch01_x/test_a produced 1 of 2 results" in status(expected=two)[1]
    assert (
        "ch01_x/test_b ran but is not declared in the manifest"
        in status(expected=[compiler.Expected("ch01_x", "test_a")])[1]
    )


def test_report_lists_expected_missing_skips_and_observations(repo: Path) -> None:
    """The report's own fields, as the book and the verifier read them."""
    skipped = [
        _record(NODE_B, "setup", "skipped", longrepr=["experiments/x.py", 1, "Skipped: why"])
    ]
    report = compiler.compile_report(
        _facts(
            records=[*_passing(NODE_A, {"kept": 1}), *skipped],
            expected=[*_facts().expected, compiler.Expected("ch02_y", "test_c")],
        ),
        root=repo,
        signing={},
    )
    assert report["schema_version"] == 1
    assert report["missing"] == ["ch02_y/test_c"]
    assert report["skips"] == [{"nodeid": NODE_B, "outcome": "skipped", "reason": "Skipped: why"}]
    assert report["observations"] == [
        {"nodeid": NODE_A, "observation": {"kept": 1}, "kinds": {"kept": "fact"}}
    ]
    own = [t for t in report["tests"] if t["chapter"] == "ch01_x"]
    assert [t["claim"] for t in own] == ["A claim.", None]
    assert len(report["limits"]) >= 6
    assert set(report["versions"]) >= {"python", "pytest", "psycopg", "httpx", "durable-agent-lab"}


def test_run_url_from_environment() -> None:
    """BOOK_RUN_URL wins; otherwise GitHub's variables compose the run's address."""
    github = {
        "GITHUB_SERVER_URL": "https://github.com",
        "GITHUB_REPOSITORY": "o/r",
        "GITHUB_RUN_ID": "7",
    }
    assert compiler.run_url(github) == "https://github.com/o/r/actions/runs/7"
    assert compiler.run_url({**github, "BOOK_RUN_URL": "https://ci/1"}) == "https://ci/1"
    assert compiler.run_url({}) is None


def test_manifest_shape_is_enforced(tmp_path: Path) -> None:
    """A malformed manifest is an error, never an empty expectation."""
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"experiments": [{"chapter": "c", "name": "test_a", "results": 0}]}))
    with pytest.raises(errors.EvidenceError, match="results"):
        compiler.load_manifest(path)
    path.write_text(json.dumps({"experiments": [{"chapter": "c", "name": "test_a"}] * 2}))
    with pytest.raises(errors.EvidenceError, match="twice"):
        compiler.load_manifest(path)


def test_real_manifest_matches_the_experiment_tree() -> None:
    """The repository's manifest declares exactly the experiments its chapters define."""
    import ast

    root = Path(__file__).resolve().parents[2] / "experiments"
    declared = {(e.chapter, e.name) for e in compiler.load_manifest(root / "manifest.json")}
    defined: set[tuple[str, str]] = set()
    for module in root.glob("*/test_*.py"):
        tree = ast.parse(module.read_text(encoding="utf-8"))
        defined |= {
            (module.parent.name, node.name)
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test")
        }
    assert declared == defined


# --------------------------------------------------------------------------- forged evidence
#
# The attacker of issue 14: edit the report, re-sign it with a fresh key, and hope
# the verifier trusts what the report says about itself.


def _forge(
    directory: Path,
    change: Callable[[dict[str, Any]], None],
    *,
    key_source: str = "ephemeral",
    signer: dsse.Signer | None = None,
) -> dsse.Signer:
    return resign(directory, change, key_source=key_source, signer=signer)


def _first_line(verdict: verification.Verdict) -> str:
    return verification.format_verdict(verdict).splitlines()[0]


def test_resigned_report_claiming_a_publication_key_is_unpinned_and_fails(
    signed: Path, repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 14, attack 3: a fresh key that says ``key_source: key_file`` is not a
    publication key. Without a pin verify fails and says UNPINNED, even though the
    signature is sound; runtime.pub.pem beside it (the same fresh key) is no pin."""
    _forge(signed, lambda r: None, key_source="key_file")
    verdict = verification.verify(signed, check_sources=True, root=repo)
    assert not verdict.ok and verdict.pinned_by is None
    assert any("UNPINNED key" in p and "presented as a publication key" in p
               for p in verdict.problems), verdict.problems
    first = _first_line(verdict)
    assert first.startswith("FAIL ") and first.endswith(" UNPINNED")
    assert cli.main(["evidence", "verify", str(signed)]) == 1
    assert capsys.readouterr().out.startswith("FAIL ")


def test_a_pin_is_the_only_trust(
    signed: Path,
    repo: Path,
    make_key: Callable[[str], KeyFiles],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The same evidence signed by a publication key verifies OK once pinned: by
    --public-key, by a key committed under keys/trusted/, or by LAB_TRUSTED_KEYS."""
    key = make_key("publication")
    _forge(signed, lambda r: None, signer=dsse.Signer(key.private, "key_file"))
    assert verification.verify(signed).pinned_by is None

    pinned = verification.verify(signed, public_key=key.public)
    assert pinned.ok and pinned.pinned_by == "--public-key", pinned.problems
    assert _first_line(pinned).startswith("OK ")

    (repo / "keys" / "trusted").mkdir(parents=True)
    (repo / "keys" / "trusted" / "ci.pub.pem").write_bytes(key.public_pem.read_bytes())
    # Only a key git tracks is trusted: commit it.
    labtree.git(repo, "add", "keys/trusted/ci.pub.pem")
    labtree.commit(repo)
    trusted = trust.trusted_keys(repo, environ={})
    head = labtree.git(repo, "rev-parse", "HEAD").strip()
    committed = verification.verify(signed, trusted=trusted)
    assert committed.ok and str(committed.pinned_by).startswith(
        f"keys/trusted/ci.pub.pem at {head[:12]} (tip of "), committed.pinned_by
    assert "pinned by keys/trusted/ci.pub.pem" in _first_line(committed)

    from_env = trust.trusted_keys(
        repo / "lab", environ={trust.TRUSTED_ENV: str(key.public_pem)}
    )
    assert verification.verify(signed, trusted=from_env).ok

    # Through the command, from the keys git tracks at the default branch's tip: the
    # evidence names the commit before the key was committed, and the key still vouches.
    monkeypatch.chdir(repo)
    assert cli.main(["evidence", "verify", str(signed)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {signed / compiler.ENVELOPE_FILE}")
    assert f"pinned by keys/trusted/ci.pub.pem at {head[:12]}" in out

    # A trusted key list that does not hold the signer: the pin does not vouch.
    stranger = trust.trusted_keys(
        repo / "lab", environ={trust.TRUSTED_ENV: str(make_key("other").public_pem)}
    )
    assert not verification.verify(signed, trusted=stranger).ok


def test_the_report_must_name_the_key_that_signed_it(
    signed: Path, make_key: Callable[[str], KeyFiles]
) -> None:
    """A pinned signature over a report whose ``signing`` names another key is refused."""
    key, other = make_key("signer"), make_key("named")

    def name_other(data: dict[str, Any]) -> None:
        data["signing"] = dsse.Signer(other.private, "key_file").describe()

    _forge(signed, name_other, signer=dsse.Signer(key.private, "key_file"))
    verdict = verification.verify(signed, public_key=key.public)
    assert "signing: the report's public_key is not the key that signed it" in verdict.problems


def _fail_a_row(data: dict[str, Any]) -> None:
    data["tests"][1]["outcome"] = gate.FAILED
    data["experiments"][1]["outcome"] = gate.FAILED


def _skip_a_row(data: dict[str, Any]) -> None:
    data["tests"][1]["outcome"] = gate.SKIPPED
    data["experiments"][1]["outcome"] = gate.SKIPPED


@pytest.mark.parametrize(
    ("change", "named"),
    [
        pytest.param(_fail_a_row, "gate: the report says PASS but its rows give FAIL",
                     id="failed-row"),
        pytest.param(lambda r: r["gate"].update(failures=["x failed"]),
                     "gate: the recorded failures differ from those its rows give",
                     id="gate-failures"),
        pytest.param(lambda r: r["gate"].update(narrowed=["-k test_a"]),
                     "gate: the report says PASS but its rows give PARTIAL", id="narrowed"),
        pytest.param(lambda r: r.update(exitstatus=1),
                     "gate: the report says PASS but pytest exited with status 1",
                     id="exitstatus"),
        pytest.param(_skip_a_row, "gate: the recorded skips differ from the skipped rows",
                     id="skipped-row"),
        pytest.param(lambda r: r.update(missing=["ch01_x/test_c"]),
                     "gate: the recorded missing experiments differ from those its rows give",
                     id="missing"),
        pytest.param(lambda r: r.update(problems=["the manifest was not found"]),
                     "gate: the report says PASS but its rows give FAIL", id="problems"),
    ],
)
def test_a_pass_that_its_rows_contradict_fails(
    signed: Path, change: Callable[[dict[str, Any]], None], named: str
) -> None:
    """Issue 14, attack 3: the signed ``status`` is a claim, recomputed from the signed
    rows; any disagreement fails verification and is named."""
    _forge(signed, change)
    verdict = verification.verify(signed)
    assert named in verdict.problems, verdict.problems
    assert not verdict.ok


def test_the_attack_report_of_issue_14_fails(signed: Path) -> None:
    """All at once: PASS with failed rows, gate.failures, narrowing and exit status 1."""

    def everything(data: dict[str, Any]) -> None:
        _fail_a_row(data)
        data["gate"] = {"failures": [f"{NODE_B} failed"], "narrowed": ["-k test_a"]}
        data["exitstatus"] = 1

    _forge(signed, everything)
    problems = verification.verify(signed).problems
    assert "gate: the report says PASS but its rows give FAIL" in problems
    assert "gate: the report says PASS but pytest exited with status 1" in problems
    assert "gate: narrowed: -k test_a" in problems


def test_tests_log_is_a_signed_subject(signed: Path) -> None:
    """tests.jsonl edited (or removed) after signing is named."""
    path = signed / compiler.TESTS_FILE
    original = path.read_bytes()
    path.write_bytes(original.replace(b'"failed"', b'"passed"') + b"\n")
    assert "tests.jsonl: its sha256 does not match the signed subject" in (
        verification.verify(signed).problems
    )
    path.unlink()
    assert any(p.startswith(f"tests.jsonl {path}: no such file")
               for p in verification.verify(signed).problems)


def test_a_trimmed_manifest_fails_against_the_committed_one(repo: Path, tmp_path: Path) -> None:
    """Issue 14, attack 1 as the verifier sees it: an honest-looking PASS that expected
    fewer experiments than the committed manifest declares fails --check-sources."""
    directory = tmp_path / "evidence"
    trimmed = _facts(
        records=_passing(NODE_A), collected=[NODE_A],
        expected=[compiler.Expected("ch01_x", "test_a")],
    )
    report_ = compiler.write(directory, trimmed, root=repo, signer=dsse.load_signer({}))
    assert report_["status"] == gate.PASS
    assert verification.verify(directory).ok  # the signature alone cannot know
    problems = verification.verify(directory, check_sources=True, root=repo).problems
    assert (
        "expected: differs from the committed experiments/manifest.json: "
        "not expected: ch01_x/test_b"
    ) in problems


def test_every_recorded_file_digest_is_compared_with_the_tree(signed: Path, repo: Path) -> None:
    """A conftest or ini digest the producer records (``{"path", "sha256"}`` anywhere)
    must match the tree under --check-sources; paths may not leave the tree."""
    digest = "0" * 64

    def record_inputs(data: dict[str, Any]) -> None:
        data["inputs"] = {"conftests": [{"path": "conftest.py", "sha256": digest},
                                        {"path": "../outside.py", "sha256": digest},
                                        {"path": "/usr/lib/x.py", "sha256": digest}],
                          "ini": {"path": "pyproject.toml", "sha256": digest}}

    _forge(signed, record_inputs)
    problems = verification.verify(signed, check_sources=True, root=repo).problems
    assert f"recorded file conftest.py: missing from {repo}" in problems
    assert "recorded file '../outside.py': not a path inside the repository" in problems
    assert "recorded file pyproject.toml: differs from the signed digest" in problems
    assert not any("/usr/lib/x.py" in p for p in problems)  # outside the repo: not comparable


def test_source_names_cannot_leave_the_tree(signed: Path, repo: Path) -> None:
    """A signed source name with ``..`` is a failure, never a read outside the tree."""

    def escape(data: dict[str, Any]) -> None:
        data["sources"]["../../../../etc/hostname"] = "0" * 64

    _forge(signed, escape)
    problems = verification.verify(signed, check_sources=True, root=repo).problems
    assert "source '../../../../etc/hostname': not a path inside the repository" in problems


def test_dirty_tree_is_said_on_the_first_line(repo: Path, tmp_path: Path) -> None:
    """Evidence of a dirty tree may verify, but its OK line says DIRTY."""
    (repo / "notes.txt").write_text("uncommitted\n")
    directory = tmp_path / "evidence"
    compiler.write(directory, _facts(git=None), root=repo, signer=dsse.load_signer({}))
    verdict = verification.verify(directory, check_sources=True, root=repo)
    assert "(DIRTY tree)" in _first_line(verdict)
    assert any("DIRTY" in note for note in verdict.notes)
    # The gate fails a dirty tree: verify recomputes that verdict from the rows.
    assert any("uncommitted changes" in p for p in verdict.problems), verdict.problems


def test_evidence_show_verifies_first(
    signed: Path, repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lab evidence show`` prints the verdict, the summary and what it could not
    verify; an unverified PASS exits non-zero."""
    monkeypatch.chdir(repo)
    assert cli.main(["evidence", "show", str(signed), "--check-sources"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"UNPINNED {signed / compiler.ENVELOPE_FILE}: status PASS")
    assert "Gate: PASS" in out
    assert "not verified: the signer's identity" in out
    assert "not verified: the sources" not in out

    _forge(signed, lambda r: r.update(exitstatus=1))
    assert cli.main(["evidence", "show", str(signed)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL ") and "Gate: PASS" in out
    assert "failed: gate: the report says PASS but pytest exited with status 1" in out
    assert "not verified: the sources against a working tree" in out


# --------------------------------------------------------------------------- bad inputs


def _one_line_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 2
) -> str:
    assert cli.main(argv) == code
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_show_names_the_path_that_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    """``lab evidence show /nonexistent`` names /nonexistent, not a file beside it."""
    for command in ("verify", "show"):
        line = _one_line_error(capsys, ["evidence", command, "/nonexistent"])
        assert line == f"lab evidence {command}: evidence /nonexistent: no such file or directory"
    verdict = verification.verify(Path("/nonexistent"))
    assert verdict.problems == ["evidence /nonexistent: no such file or directory"]


def test_device_as_envelope_is_refused(signed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """/dev/zero as the envelope: refused by kind, no MemoryError."""
    envelope = signed / compiler.ENVELOPE_FILE
    envelope.unlink()
    envelope.symlink_to("/dev/zero")
    for command in ("verify", "show"):
        line = _one_line_error(capsys, ["evidence", command, str(signed)])
        assert line == f"lab evidence {command}: envelope {envelope}: a device, not a regular file"


def test_device_as_public_key_is_refused(signed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """/dev/zero as --public-key: a one-line input error naming the option and the path."""
    line = _one_line_error(
        capsys, ["evidence", "verify", str(signed), "--public-key", "/dev/zero"]
    )
    assert line == "lab evidence verify: --public-key /dev/zero: a device, not a regular file"


def test_fifo_as_envelope_does_not_hang(signed: Path) -> None:
    """A FIFO as the envelope is refused at once (in a child, so a hang cannot stall
    the suite: the timeout would fail the test)."""
    envelope = signed / compiler.ENVELOPE_FILE
    envelope.unlink()
    os.mkfifo(envelope)
    done = subprocess.run(
        [sys.executable, "-P", "-m", "lab.cli", "evidence", "verify", str(signed)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"lab evidence verify: envelope {envelope}: a FIFO, not a regular file\n"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        pytest.param(lambda r: r.update(skips=["a string"]), "skips/0", id="skips-strings"),
        pytest.param(lambda r: r.update(experiments=["a string"]), "experiments/0",
                     id="experiments-strings"),
        pytest.param(lambda r: r["tests"][0].pop("nodeid"), "tests/0", id="test-without-nodeid"),
        pytest.param(lambda r: r.update(gate="PASS"), "gate", id="gate-string"),
        pytest.param(lambda r: r.update(status=["PASS"]), "status", id="status-list"),
    ],
)
def test_a_signed_report_of_the_wrong_shape_is_refused_by_name(
    signed: Path,
    capsys: pytest.CaptureFixture[str],
    change: Callable[[dict[str, Any]], None],
    field: str,
) -> None:
    """Validly signed but malformed: the schema names the field before anything reads it."""
    _forge(signed, change)
    verdict = verification.verify(signed)
    assert verdict.report is None
    assert any(p.startswith(f"report: not a valid report: {field}") for p in verdict.problems), (
        verdict.problems
    )
    assert cli.main(["evidence", "verify", str(signed)]) == 1
    assert "Traceback" not in capsys.readouterr().err
    line = _one_line_error(capsys, ["evidence", "show", str(signed)])
    assert f"report: not a valid report: {field}" in line


def test_closed_stdout_is_not_a_traceback(signed: Path, repo: Path) -> None:
    """``lab evidence verify … | head -1`` with more output than a pipe holds: the
    reader goes away, the command ends quietly."""
    for n in range(800):  # each an uncovered source: one line of output
        (repo / "lab" / f"extra_module_number_{n:05d}_with_a_long_name.py").write_text("")
    # Tracked, so each is a source of the tree the evidence does not cover.
    labtree.git(repo, "add", "lab")
    script = (
        f"{sys.executable} -P -m lab.cli evidence verify {signed} --check-sources | head -1; "
        "exit ${PIPESTATUS[0]}"
    )
    done = subprocess.run(
        ["bash", "-c", script], cwd=repo, capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert done.stdout.startswith("FAIL ") and done.stdout.count("\n") == 1
    assert done.returncode == 1
    assert done.stderr == ""

    # A reader that is gone before the first byte is written.
    child = subprocess.Popen(
        [sys.executable, "-P", "-m", "lab.cli", "evidence", "show", str(signed)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()
    assert child.stderr.read() == b""
    assert child.wait(timeout=60) == 1
    child.stderr.close()


def test_terminal_output_escapes_control_characters(signed: Path) -> None:
    """A commit with a newline and an escape sequence cannot forge an OK line."""
    _forge(signed, lambda r: r.update(commit="x\nOK evidence: status PASS\x1b[2J"))
    text = verification.format_verdict(verification.verify(signed))
    assert "\nOK" not in text and "\x1b" not in text
    assert "x\\x0aOK evidence" in text


# --------------------------------------------------------------------------- files and schema


def test_bounded_reader(tmp_path: Path) -> None:
    """Regular files up to the limit; anything else is an InputError naming the path."""
    path = tmp_path / "data"
    path.write_bytes(b"12345")
    assert files.read_bytes(path, 5, "data") == b"12345"
    with pytest.raises(errors.InputError, match=rf"^data {path}: 5 bytes, over the 4-byte limit$"):
        files.read_bytes(path, 4, "data")
    with pytest.raises(errors.InputError, match=rf"^data {tmp_path}: is a directory|a directory"):
        files.read_bytes(tmp_path, 5, "data")
    with pytest.raises(errors.InputError, match=r"^data /dev/zero: a device, not a regular file$"):
        files.read_bytes(Path("/dev/zero"), 5, "data")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(errors.InputError, match=r"a FIFO, not a regular file$"):
        files.read_bytes(fifo, 5, "data")
    with pytest.raises(errors.InputError, match=rf"^data {tmp_path / 'absent'}: no such file$"):
        files.read_bytes(tmp_path / "absent", 5, "data")
    path.write_bytes(b'{"a": NaN}')
    with pytest.raises(errors.InputError, match="not JSON"):
        files.read_json(path, 100, "data")
    path.write_bytes(b"\xff")
    with pytest.raises(errors.InputError, match="not UTF-8"):
        files.read_json(path, 100, "data")
    path.write_bytes(b"[" * 100_000)
    with pytest.raises(errors.InputError, match=f"^data {path}: "):
        files.read_json(path, 200_000, "data")


def test_compiled_reports_match_the_shipped_schema(repo: Path) -> None:
    """What the producer compiles is what the readers' schema accepts."""
    compiled = compiler.compile_report(_facts(), root=repo, signing=dsse.load_signer({}).describe())
    assert report.problems(json.loads(json.dumps(compiled))) == []
    assert report.validate(compiled) is compiled
    with pytest.raises(errors.EvidenceError, match=r"^runtime.json: not a valid report: skips/0"):
        report.validate({**compiled, "skips": ["x"]}, "runtime.json")


def test_typed_report_mirrors_the_schema() -> None:
    """The TypedDicts and the JSON Schema declare the same required fields."""
    schema = report.schema()
    assert set(schema["required"]) == set(report.Report.__annotations__)
    defs = schema["$defs"]
    assert set(defs["experiment"]["required"]) == set(report.Experiment.__annotations__)
    assert set(defs["test"]["required"]) == set(report.Test.__required_keys__)
    assert set(defs["test"]["properties"]) == set(report.Test.__annotations__)
    assert set(schema["properties"]["signing"]["required"]) == set(report.Signing.__annotations__)


def test_schema_ships_with_the_package() -> None:
    """The schema is package data: listed in pyproject and beside the module."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert report.SCHEMA_FILE in pyproject["tool"]["setuptools"]["package-data"]["lab.evidence"]
    assert report.schema()["$id"].endswith("report.schema.json")


def test_deeply_nested_signed_json_is_refused(
    signed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An observation nested 500 deep (valid JSON, validly signed) cannot push a reader
    into Python's recursion limit: the payload is refused by its depth."""
    nested: Any = "leaf"
    for _ in range(500):
        nested = [nested]

    def deep(data: dict[str, Any]) -> None:
        data["tests"][0]["observations"] = [nested]

    _forge(signed, deep)
    verdict = verification.verify(signed)
    assert "payload: JSON nested deeper than 64 levels" in verdict.problems
    assert cli.main(["evidence", "verify", str(signed)]) == 1
    assert "Traceback" not in capsys.readouterr().err
    with pytest.raises(errors.InputError, match="nested deeper than 2 levels"):
        files.parse_json(b'{"a": [[1]]}', "x", max_depth=2)


def test_signing_key_file_is_read_bounded(tmp_path: Path) -> None:
    """LAB_EVIDENCE_KEY naming a device or a directory is an EvidenceError naming it."""
    for path in ("/dev/zero", str(tmp_path)):
        with pytest.raises(errors.EvidenceError, match=f"{dsse.KEY_ENV} {path}: "):
            dsse.load_signer({dsse.KEY_ENV: path})
