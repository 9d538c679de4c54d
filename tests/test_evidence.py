"""Evidence: the DSSE encoding, signing, verification, gate and report hygiene.

Pure: no database, no pytest run; reports are built from report-log dicts.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from lab import cli, dsse, errors, evidence, gate, verification

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
        props.append(["lab_observation", observation])
    return [_record(nodeid, when, props=props) for when in ("setup", "call", "teardown")]


NODE_A = "experiments/ch01_x/test_a.py::test_a"
NODE_B = "experiments/ch01_x/test_a.py::test_b"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A tiny source tree for the report's digests."""
    root = tmp_path / "repo"
    (root / "lab").mkdir(parents=True)
    (root / "lab" / "core.py").write_text("VALUE = 1\n")
    (root / "experiments" / "ch01_x").mkdir(parents=True)
    (root / "experiments" / "ch01_x" / "test_a.py").write_text("def test_a(): pass\n")
    (root / "experiments" / "manifest.json").write_text("{}\n")
    (root / "pyproject.toml").write_text("[project]\n")
    return root


def _facts(**overrides: Any) -> evidence.RunFacts:
    values: dict[str, Any] = {
        "records": [*_passing(NODE_A, {"kept": 1}), *_passing(NODE_B)],
        "collected": [NODE_A, NODE_B],
        "experiments_prefix": "experiments/",
        "expected": [evidence.Expected("ch01_x", "test_a"), evidence.Expected("ch01_x", "test_b")],
        "database": DATABASE,
        "command": ["pytest", "experiments"],
    }
    values.update(overrides)
    return evidence.RunFacts(**values)


@pytest.fixture
def signed(repo: Path, tmp_path: Path) -> Path:
    """A passing run's evidence directory, signed with an ephemeral key."""
    directory = tmp_path / "evidence"
    report = evidence.write(directory, _facts(), root=repo, signer=dsse.load_signer({}))
    assert report["status"] == gate.PASS, report["gate"]
    return directory


def _envelope(directory: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((directory / evidence.ENVELOPE_FILE).read_text())
    return data


def _save(directory: Path, envelope: dict[str, Any]) -> None:
    (directory / evidence.ENVELOPE_FILE).write_text(json.dumps(envelope))


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
    assert any("EPHEMERAL" in note for note in verdict.notes)
    assert any("integrity, not identity" in note for note in verdict.notes)
    envelope = _envelope(signed)
    assert envelope["payloadType"] == "application/vnd.in-toto+json"
    statement = json.loads(base64.b64decode(envelope["payload"]))
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    names = [s["name"] for s in statement["subject"]]
    assert names == [
        "experiments/ch01_x/test_a.py",
        "experiments/manifest.json",
        "lab/core.py",
        "pyproject.toml",
        "runtime.json",
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
    path = signed / evidence.REPORT_FILE
    path.write_bytes(path.read_bytes().replace(b'"PASS"', b'"FAIL"', 1))
    problems = verification.verify(signed).problems
    assert "runtime.json: its sha256 does not match the signed subject" in problems


def test_changed_source_fails_only_with_check_sources(signed: Path, repo: Path) -> None:
    """A source edited after the run is named when the subjects are checked."""
    (repo / "lab" / "core.py").write_text("VALUE = 2\n")
    (repo / "lab" / "new.py").write_text("")
    assert verification.verify(signed, root=repo).ok
    problems = verification.verify(signed, check_sources=True, root=repo).problems
    assert "source lab/core.py: differs from the signed digest" in problems
    assert any(p.startswith("source lab/new.py: present") for p in problems)


def test_pinned_wrong_public_key_fails(signed: Path) -> None:
    """A pinned key that did not sign is named as the cause."""
    other = ed25519.Ed25519PrivateKey.generate().public_key()
    verdict = verification.verify(signed, public_key=other)
    assert not verdict.ok
    assert any("not by the expected key" in p for p in verdict.problems)


def test_publication_key_from_environment(repo: Path, tmp_path: Path) -> None:
    """LAB_EVIDENCE_KEY signs; the pinned public key verifies through the command."""
    private = ed25519.Ed25519PrivateKey.generate()
    key_path = tmp_path / "signing.pem"
    key_path.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public_path = tmp_path / "signer.pub.pem"
    public_path.write_text(dsse.public_pem(private.public_key()))
    signer = dsse.load_signer({dsse.KEY_ENV: str(key_path)})
    assert signer.source == "key_file"
    directory = tmp_path / "evidence"
    evidence.write(directory, _facts(), root=repo, signer=signer)
    assert (directory / evidence.PUBLIC_KEY_FILE).read_text() == public_path.read_text()

    assert cli.main(["evidence", "verify", str(directory), "--public-key", str(public_path)]) == 0
    verdict = verification.verify(directory, public_key=private.public_key())
    assert verdict.ok and not verdict.notes


def test_verify_command_exits_non_zero_and_names_the_failure(
    signed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lab evidence verify`` prints FAIL and the cause."""
    wrong = tmp_path / "wrong.pem"
    wrong.write_text(dsse.public_pem(ed25519.Ed25519PrivateKey.generate().public_key()))
    args = ["evidence", "verify", str(signed / evidence.ENVELOPE_FILE), "--public-key", str(wrong)]
    assert cli.main(args) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL ")
    assert "not by the expected key" in out


def test_an_independent_dsse_implementation_verifies_our_envelope(signed: Path) -> None:
    """securesystemslib's DSSE Envelope verifies our signature over our payload."""
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey  # type: ignore[attr-defined]

    envelope = _envelope(signed)
    report = json.loads((signed / evidence.REPORT_FILE).read_text())
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
    first = evidence.write(tmp_path / "one", _facts(), root=repo, signer=dsse.load_signer({}))
    shuffled = _facts(records=[*_passing(NODE_B), *_passing(NODE_A, {"kept": 1})])
    for record in shuffled.records:
        record["duration"] = 0.5
    second = evidence.write(tmp_path / "two", shuffled, root=repo, signer=dsse.load_signer({}))
    assert first != second
    assert _comparable(first) == _comparable(second)
    assert first["signing"]["keyid"] != second["signing"]["keyid"]


def test_secrets_on_the_command_line_stay_out_of_the_report(repo: Path, tmp_path: Path) -> None:
    """A DSN password and a token given on the command line never reach the evidence."""
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
    evidence.write(
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
    report = json.loads((directory / evidence.REPORT_FILE).read_text())
    assert report["command"][0:2] == ["pytest", "--lab-dsn"]
    assert report["command"][-2] == "experiments"
    assert report["postgresql"]["server_version"] == "15.8"


def test_gate_rules(repo: Path) -> None:
    """Each gate rule on compiled records, without running pytest."""

    def status(**overrides: Any) -> tuple[str, list[str]]:
        report = evidence.compile_report(_facts(**overrides), root=repo, signing={})
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
    pure = [evidence.Expected("ch01_x", "test_a"), evidence.Expected("ch01_x", "test_b", 1, False)]
    assert status(records=[*only_a, *no_db], expected=pure)[0] == gate.PASS
    no_fixture = [_record(NODE_B, w) for w in ("setup", "call", "teardown")]
    assert status(records=[*only_a, *no_fixture])[0] == gate.PASS
    declared = [
        evidence.Expected("ch01_x", "test_a"),
        evidence.Expected("ch01_x", "test_b", 1, True),
    ]
    assert (
        f"{NODE_B} did not reach a real database"
        in status(records=[*only_a, *no_fixture], expected=declared)[1]
    )
    # Fewer results than declared, and an experiment the manifest does not declare.
    two = [evidence.Expected("ch01_x", "test_a", 2), evidence.Expected("ch01_x", "test_b")]
    assert "ch01_x/test_a produced 1 of 2 results" in status(expected=two)[1]
    assert (
        "ch01_x/test_b ran but is not declared in the manifest"
        in status(expected=[evidence.Expected("ch01_x", "test_a")])[1]
    )


def test_report_lists_expected_missing_skips_and_observations(repo: Path) -> None:
    """The report's own fields, as the book and the verifier read them."""
    skipped = [
        _record(NODE_B, "setup", "skipped", longrepr=["experiments/x.py", 1, "Skipped: why"])
    ]
    report = evidence.compile_report(
        _facts(
            records=[*_passing(NODE_A, {"kept": 1}), *skipped],
            expected=[*_facts().expected, evidence.Expected("ch02_y", "test_c")],
        ),
        root=repo,
        signing={},
    )
    assert report["schema_version"] == 1
    assert report["missing"] == ["ch02_y/test_c"]
    assert report["skips"] == [{"nodeid": NODE_B, "outcome": "skipped", "reason": "Skipped: why"}]
    assert report["observations"] == [{"nodeid": NODE_A, "observation": {"kept": 1}}]
    assert [t["claim"] for t in report["tests"]] == ["A claim.", None]
    assert len(report["limits"]) >= 6
    assert set(report["versions"]) >= {"python", "pytest", "psycopg", "httpx", "durable-agent-lab"}


def test_run_url_from_environment() -> None:
    """BOOK_RUN_URL wins; otherwise GitHub's variables compose the run's address."""
    github = {
        "GITHUB_SERVER_URL": "https://github.com",
        "GITHUB_REPOSITORY": "o/r",
        "GITHUB_RUN_ID": "7",
    }
    assert evidence.run_url(github) == "https://github.com/o/r/actions/runs/7"
    assert evidence.run_url({**github, "BOOK_RUN_URL": "https://ci/1"}) == "https://ci/1"
    assert evidence.run_url({}) is None


def test_manifest_shape_is_enforced(tmp_path: Path) -> None:
    """A malformed manifest is an error, never an empty expectation."""
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"experiments": [{"chapter": "c", "name": "test_a", "results": 0}]}))
    with pytest.raises(errors.EvidenceError, match="results"):
        evidence.load_manifest(path)
    path.write_text(json.dumps({"experiments": [{"chapter": "c", "name": "test_a"}] * 2}))
    with pytest.raises(errors.EvidenceError, match="twice"):
        evidence.load_manifest(path)


def test_real_manifest_matches_the_experiment_tree() -> None:
    """The repository's manifest declares exactly the experiments its chapters define."""
    import ast

    root = Path(__file__).resolve().parents[1] / "experiments"
    declared = {(e.chapter, e.name) for e in evidence.load_manifest(root / "manifest.json")}
    defined: set[tuple[str, str]] = set()
    for module in root.glob("*/test_*.py"):
        tree = ast.parse(module.read_text(encoding="utf-8"))
        defined |= {
            (module.parent.name, node.name)
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test")
        }
    assert declared == defined
