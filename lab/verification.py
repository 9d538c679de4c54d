"""Verification of signed evidence, offline: signature, statement, subjects, verdict.

A verifier decides from the envelope and a trust policy, never from a field the
producer wrote about itself: the signature is checked with ``dsse``, the report's
bytes against the signed subject, the verdict recomputed from the signed rows with
``gate.decide``, and on request every signed source digest against a working tree.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import dsse, evidence, gate
from lab.errors import EvidenceError


@dataclass
class Verdict:
    """The outcome of verifying evidence: ok only when ``problems`` is empty."""

    envelope: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    report: dict[str, Any] | None = None
    signer_keyid: str | None = None

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.problems


def locate(path: Path) -> tuple[Path, Path]:
    """``(envelope, runtime.json)`` for an evidence directory or an envelope file."""
    if path.is_dir():
        return path / evidence.ENVELOPE_FILE, path / evidence.REPORT_FILE
    return path, path.parent / evidence.REPORT_FILE


def verify(
    path: Path,
    *,
    public_key: ed25519.Ed25519PublicKey | None = None,
    check_sources: bool = False,
    root: Path | None = None,
) -> Verdict:
    """Check an evidence envelope offline and name every failure.

    Checks the payload type, the Ed25519 signature (against ``public_key`` when
    pinned, else the key the evidence carries), the statement and its subjects,
    ``runtime.json`` on disk, the gate fields, and with ``check_sources`` the
    subjects against the files under ``root`` (default: the working directory).
    """
    envelope_path, report_path = locate(path)
    verdict = Verdict(envelope_path)
    problems = verdict.problems
    try:
        envelope = json.loads(envelope_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        problems.append(f"envelope: cannot read {envelope_path}: {exc}")
        return verdict
    if not isinstance(envelope, dict):
        problems.append("envelope: not a JSON object")
        return verdict
    payload_type = envelope.get("payloadType")
    if payload_type != dsse.PAYLOAD_TYPE:
        problems.append(f"payload type: {payload_type!r} is not {dsse.PAYLOAD_TYPE!r}")
    try:
        payload = dsse.b64decode(envelope.get("payload"))  # type: ignore[arg-type]
    except ValueError as exc:
        problems.append(f"payload: {exc}")
        return verdict
    parsed: Any = None
    try:
        parsed = json.loads(payload)
    except ValueError as exc:
        problems.append(f"payload: not JSON ({exc})")
    predicate = parsed.get("predicate") if isinstance(parsed, dict) else None
    signing = predicate.get("signing") if isinstance(predicate, dict) else None

    key = public_key
    if key is None:
        embedded = signing.get("public_key") if isinstance(signing, dict) else None
        if not isinstance(embedded, str):
            problems.append("signature: no public key pinned and none in the evidence")
            return verdict
        try:
            key = dsse.load_public_key(embedded.encode())
        except EvidenceError as exc:
            problems.append(f"signature: {exc}")
            return verdict
        verdict.notes.append(
            "verified with the public key the evidence carries: this proves integrity, "
            "not identity; pin the signer with --public-key"
        )
    verdict.signer_keyid = dsse.keyid(key)
    try:
        dsse.check_signature(envelope, payload, key)
    except EvidenceError as exc:
        problems.append(str(exc))
    if isinstance(signing, dict) and signing.get("key_source") == "ephemeral":
        verdict.notes.append(
            "signed with an EPHEMERAL key: not a publication signature "
            f"(set {dsse.KEY_ENV} to sign with a known key)"
        )
    if not isinstance(parsed, dict):
        return verdict
    sources = _check_statement(parsed, report_path, problems)
    if isinstance(predicate, dict):
        verdict.report = predicate
        _check_gate(predicate, problems)
    if check_sources:
        _check_sources(sources, root or Path.cwd(), problems)
    return verdict


def _check_statement(
    statement_: Mapping[str, Any], report_path: Path, problems: list[str]
) -> dict[str, str]:
    """Check the statement against ``runtime.json``; return the source subjects it signs."""
    if statement_.get("_type") != evidence.STATEMENT_TYPE:
        problems.append(
            f"statement: _type {statement_.get('_type')!r} is not {evidence.STATEMENT_TYPE!r}"
        )
    if statement_.get("predicateType") != evidence.PREDICATE_TYPE:
        problems.append(f"statement: predicateType {statement_.get('predicateType')!r} unknown")
    subjects = _subjects(statement_, problems)
    predicate = statement_.get("predicate")
    if evidence.REPORT_FILE not in subjects:
        problems.append(f"subjects: {evidence.REPORT_FILE} is not a subject")
    elif not report_path.is_file():
        problems.append(f"{evidence.REPORT_FILE}: missing next to the envelope ({report_path})")
    else:
        data = report_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != subjects[evidence.REPORT_FILE]:
            problems.append(f"{evidence.REPORT_FILE}: its sha256 does not match the signed subject")
        else:
            try:
                if json.loads(data) != predicate:
                    problems.append(f"{evidence.REPORT_FILE}: differs from the signed predicate")
            except ValueError:
                problems.append(f"{evidence.REPORT_FILE}: not JSON")
    sources = predicate.get("sources") if isinstance(predicate, dict) else None
    declared = {k: v for k, v in subjects.items() if k != evidence.REPORT_FILE}
    if sources != declared:
        problems.append("subjects: the source subjects differ from the report's sources")
    return declared


def _subjects(statement_: Mapping[str, Any], problems: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    items = statement_.get("subject")
    if not isinstance(items, list) or not items:
        problems.append("statement: no subjects")
        return found
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        digest = item.get("digest") if isinstance(item, dict) else None
        sha = digest.get("sha256") if isinstance(digest, dict) else None
        if not isinstance(name, str) or not isinstance(sha, str) or name in found:
            problems.append(f"statement: malformed or duplicate subject {item!r}")
            continue
        found[name] = sha
    return found


def _check_gate(report: Mapping[str, Any], problems: list[str]) -> None:
    """The verdict is recomputed from the signed rows; the signed ``status`` is not trusted."""
    if report.get("schema_version") != evidence.SCHEMA_VERSION:
        problems.append(f"report: schema_version {report.get('schema_version')!r} unsupported")
    recomputed = gate.decide(report)
    recorded = report.get("gate")
    recorded_failures = recorded.get("failures") if isinstance(recorded, Mapping) else None
    if report.get("status") != recomputed.status:
        problems.append(
            f"gate: the report says {report.get('status')!r} but its rows give "
            f"{recomputed.status}"
        )
    elif recorded_failures != recomputed.failures:
        problems.append("gate: the recorded failures differ from those its rows give")
    if recomputed.status != gate.PASS:
        problems.append(f"gate: status is {recomputed.status}, not PASS")
        problems += [f"gate: {failure}" for failure in recomputed.failures[:20]]
    if report.get("missing") != recomputed.missing:
        problems.append("gate: the recorded missing experiments differ from its rows")
    skips = report.get("skips")
    if skips:
        names = ", ".join(str(s.get("nodeid", "?")) if isinstance(s, Mapping) else str(s)
                          for s in (skips if isinstance(skips, list) else [skips]))
        problems.append(f"gate: skipped or xfailed: {names}")


def _check_sources(sources: Mapping[str, str], root: Path, problems: list[str]) -> None:
    for name, digest in sorted(sources.items()):
        path = root / name
        if not path.is_file():
            problems.append(f"source {name}: missing from {root}")
        elif evidence.sha256_file(path) != digest:
            problems.append(f"source {name}: differs from the signed digest")
    for name in evidence.source_files(root):
        if name not in sources:
            problems.append(f"source {name}: present in {root} but not covered by the evidence")


def format_verdict(verdict: Verdict) -> str:
    """A short human verdict: one line, then each failure and note."""
    report = verdict.report or {}
    head = "OK" if verdict.ok else "FAIL"
    lines = [
        f"{head} {verdict.envelope}: status {report.get('status', '?')}, "
        f"commit {report.get('commit') or '?'}, signer {verdict.signer_keyid or '?'}"
    ]
    lines += [f"  failed: {p}" for p in verdict.problems]
    lines += [f"  note: {n}" for n in verdict.notes]
    return "\n".join(lines)
