"""Signed model evidence: the model report, every trace, the case set and the model's digest.

``lab model run`` writes into one directory (default ``evidence/model``)::

    model-experiment.json   the report (``generation``)
    cases.json              the case set, byte for byte
    traces/<case>.<mode>.json
    model.intoto.json       DSSE envelope over an in-toto statement
    model.pub.pem           the signer's public key

The statement's subjects are the report, the case set, every trace and the
model file (``model/<file name>`` with the GGUF's sha256; the file itself stays
outside the evidence). It is signed with the runtime evidence's key
(``LAB_EVIDENCE_KEY``, else an ephemeral key). ``verify`` trusts nothing the
producer says about itself: it checks the signature, every subject's bytes, that
no uncovered file sits in the directory, that the report's rows and summary hold
(``generation.check``, admission re-run) and that no admitted plan is unsafe.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import errors, files
from lab.errors import EvidenceError, InputError
from lab.evidence import compiler, dsse, model_evidence, trust, verification
from lab.model import generation
from lab.model.cases import CaseSet


@dataclass
class Verdict:
    """The outcome of verifying model evidence: ok only when ``problems`` is empty."""

    envelope: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    report: dict[str, Any] | None = None
    signer_keyid: str | None = None
    # The pin that vouched for the signer (None: UNPINNED), as in ``verification``.
    pinned_by: str | None = None

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.problems

# The shape of every field of the model report that verify, the book and the chart
# read, checked before any of them reads it: a string where an object belongs, or
# ``"performance": []``, is refused here instead of raising in a renderer.
_COUNTS = {
    "type": "object",
    "required": ["outcomes", "generations", "schema_valid", "as_expected", "unsafe"],
    "properties": {
        "outcomes": {"type": "object", "additionalProperties": {"type": "integer"}},
        "generations": {"type": "integer"},
        "schema_valid": {"type": "integer"},
        "as_expected": {"type": "integer"},
        "unsafe": {"type": "integer"},
        "rejected_by_reason": {
            "type": ["object", "null"], "additionalProperties": {"type": "integer"},
        },
    },
}
REPORT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["summary", "cases"],
    "properties": {
        "summary": {"type": "object", "additionalProperties": _COUNTS},
        "cases": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["case", "mode", "outcome", "trace"],
                "properties": {
                    "case": {"type": "string"},
                    "mode": {"type": "string"},
                    "trace": {"type": "string"},
                    "outcome": {"type": "string"},
                    "unsafe": {"type": "boolean"},
                },
            },
        },
        "performance": {
            "type": "object",
            "properties": {"load_seconds": {"type": ["number", "null"]}},
            "additionalProperties": {
                "anyOf": [{"type": "object", "properties": {
                    "tokens_per_second": {"type": ["number", "null"]},
                    "median_tokens_per_second": {"type": ["number", "null"]},
                }}, {"type": ["number", "null"]}],
            },
        },
        "case_set": {"type": "object"},
        "limitations": {"type": "array", "items": {"type": "string"}},
        "total_seconds": {"type": ["number", "null"]},
    },
}

ENVELOPE_FILE = model_evidence.ENVELOPE_FILE
PUBLIC_KEY_FILE = model_evidence.PUBLIC_KEY_FILE
CASES_FILE = model_evidence.CASES_FILE
REPORT_FILE = model_evidence.REPORT_FILE
TRACES_DIR = model_evidence.TRACES_DIR
MODEL_SUBJECT_PREFIX = "model/"
PREDICATE_TYPE = "https://durable-agent-lab.dev/model-evidence/v1"
DEFAULT_DIR = Path("evidence/model")

MAX_ENVELOPE_BYTES = 8 << 20
MAX_REPORT_BYTES = 32 << 20
MAX_TRACE_BYTES = 4 << 20


def is_model_evidence(path: Path) -> bool:
    """True for a model evidence directory or its envelope."""
    return (path / ENVELOPE_FILE).is_file() if path.is_dir() else path.name == ENVELOPE_FILE


def check_target(directory: Path) -> None:
    """Refuse to replace a directory that holds anything but earlier model compiler."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise InputError(f"{directory} is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not is_model_evidence(directory):
        raise InputError(
            f"refusing to replace {directory}: it is not empty and holds no {ENVELOPE_FILE}"
        )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dumps(value: Any) -> bytes:
    """The bytes a JSON document is written as."""
    return (json.dumps(value, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def statement(
    files: Mapping[str, bytes], report: Mapping[str, Any], signing: Mapping[str, str]
) -> dict[str, Any]:
    """The in-toto statement over ``files`` (relative name to bytes) and the model file."""
    subjects = [
        {"name": name, "digest": {"sha256": _sha256(data)}} for name, data in sorted(files.items())
    ]
    subjects.append(
        {
            "name": MODEL_SUBJECT_PREFIX + str(report["model_file"]),
            "digest": {"sha256": str(report["model_sha256"])},
        }
    )
    return {
        "_type": compiler.STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "model": report["model"],
            "model_file": report["model_file"],
            "model_sha256": report["model_sha256"],
            "case_set": report["case_set"],
            "summary": report["summary"],
            "tested_at_utc": report["tested_at_utc"],
            "signing": dict(signing),
        },
    }


def write(
    directory: Path,
    report: Mapping[str, Any],
    traces: Path,
    case_set: CaseSet,
    signer: dsse.Signer,
) -> None:
    """Sign the report, ``traces`` and the case set into ``directory``, replacing it whole.

    Everything is written to a fresh directory beside ``directory`` first and
    swapped in at the end, so a stale trace of an earlier run can never sit
    among the signed ones.
    """
    check_target(directory)
    files = {REPORT_FILE: dumps(report), CASES_FILE: case_set.data}
    for path in sorted(traces.iterdir()):
        files[f"{TRACES_DIR}/{path.name}"] = path.read_bytes()
    signing = signer.describe()
    payload = json.dumps(
        statement(files, report, signing),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode("utf-8")
    envelope = dsse.sign_envelope(payload, signer)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        for name, data in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
        (staging / ENVELOPE_FILE).write_bytes(dumps(envelope))
        (staging / PUBLIC_KEY_FILE).write_text(signing["public_key"], encoding="ascii")
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _read(path: Path, limit: int) -> bytes:
    """A bounded read of a regular file only (no FIFO can hang it, no device flood it)."""
    try:
        return files.read_bytes(path, limit, path.name)
    except errors.InputError as exc:
        raise ValueError(str(exc)) from exc


def _safe_name(name: str) -> bool:
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def verify(
    path: Path,
    *,
    public_key: ed25519.Ed25519PublicKey | None = None,
    trusted: Sequence[trust.TrustedKey] = (),
    model_path: Path | None = None,
) -> Verdict:
    """Check a model evidence directory offline and name every failure (see the module doc)."""
    directory = path if path.is_dir() else path.parent
    verdict = Verdict(directory / ENVELOPE_FILE)
    problems = verdict.problems
    try:
        envelope = files.parse_json(
            _read(directory / ENVELOPE_FILE, MAX_ENVELOPE_BYTES), ENVELOPE_FILE
        )
        payload = dsse.b64decode(envelope["payload"])
        statement_ = files.parse_json(payload, f"{ENVELOPE_FILE} payload")
    except (OSError, ValueError, KeyError, TypeError, InputError) as exc:
        problems.append(f"{ENVELOPE_FILE}: cannot read a DSSE envelope: {exc}")
        return verdict
    if not isinstance(envelope, dict) or not isinstance(statement_, dict):
        problems.append(f"{ENVELOPE_FILE}: not a DSSE envelope over a JSON statement")
        return verdict
    if envelope.get("payloadType") != dsse.PAYLOAD_TYPE:
        problems.append(f"payload type: {envelope.get('payloadType')!r} is not in-toto")
    predicate = statement_.get("predicate")
    predicate = predicate if isinstance(predicate, dict) else {}
    # The one trust decision (verification.check_signer): this file's signer, this pin.
    signer = verification.check_signer(
        envelope, payload, predicate.get("signing"), public_key, trusted
    )
    problems += signer.problems
    verdict.notes += signer.notes
    verdict.signer_keyid, verdict.pinned_by = signer.keyid, signer.pinned_by
    key = signer.key
    if key is None or signer.problems:
        return verdict
    if statement_.get("_type") != compiler.STATEMENT_TYPE:
        problems.append(f"statement: _type {statement_.get('_type')!r} is not in-toto v1")
    if statement_.get("predicateType") != PREDICATE_TYPE:
        problems.append(f"statement: predicateType {statement_.get('predicateType')!r} unknown")
    subjects = verification.subjects(statement_, problems)
    models = {n: d for n, d in subjects.items() if n.startswith(MODEL_SUBJECT_PREFIX)}
    signed_files = {n: d for n, d in subjects.items() if n not in models}
    data = _check_files(directory, signed_files, problems)
    if len(models) != 1:
        problems.append(f"statement: {len(models)} model subjects, expected one")
    _check_public_key(directory, key, problems)
    report = _load_report(data, problems)
    if report is None:
        return verdict
    verdict.report = report
    _check_report(report, predicate, signed_files, models, data, problems)
    if model_path is not None and models:
        (model_digest,) = models.values()
        try:
            if files.sha256_file(model_path) != model_digest:
                problems.append(f"model {model_path}: its sha256 is not the signed model digest")
        except InputError as exc:
            problems.append(str(exc))
    return verdict


def _check_files(
    directory: Path, files: Mapping[str, str], problems: list[str]
) -> dict[str, bytes]:
    """Every signed file's bytes when its digest holds; every uncovered file named."""
    data: dict[str, bytes] = {}
    for name, digest in sorted(files.items()):
        if not _safe_name(name):
            problems.append(f"statement: subject {name!r} is not a path inside the evidence")
            continue
        limit = MAX_REPORT_BYTES if name == REPORT_FILE else MAX_TRACE_BYTES
        try:
            content = _read(directory / name, limit)
        except (OSError, ValueError) as exc:
            problems.append(f"{name}: cannot read: {getattr(exc, 'strerror', None) or exc}")
            continue
        if _sha256(content) != digest:
            problems.append(f"{name}: its sha256 does not match the signed subject")
            continue
        data[name] = content
    for path in sorted(directory.rglob("*")):
        name = path.relative_to(directory).as_posix()
        if path.is_file() and name not in files and name not in (ENVELOPE_FILE, PUBLIC_KEY_FILE):
            problems.append(f"{name}: present in {directory} but not covered by the signature")
    return data


def _check_public_key(directory: Path, key: ed25519.Ed25519PublicKey, problems: list[str]) -> None:
    path = directory / PUBLIC_KEY_FILE
    if not path.is_file():
        return
    try:
        present = dsse.load_public_key(_read(path, 64 << 10))
    except (OSError, ValueError, EvidenceError) as exc:
        problems.append(f"{PUBLIC_KEY_FILE}: {exc}")
        return
    if dsse.raw_public_key(present) != dsse.raw_public_key(key):
        problems.append(f"{PUBLIC_KEY_FILE} is not the key that signed the evidence")


def _load_report(data: Mapping[str, bytes], problems: list[str]) -> dict[str, Any] | None:
    if REPORT_FILE not in data:
        if not any(p.startswith(REPORT_FILE) for p in problems):
            problems.append(f"{REPORT_FILE}: not a signed subject")
        return None
    try:
        report = files.parse_json(data[REPORT_FILE], REPORT_FILE)
    except InputError as exc:
        problems.append(str(exc))
        return None
    if not isinstance(report, dict):
        problems.append(f"{REPORT_FILE}: not a JSON object")
        return None
    found = sorted(
        f"{'/'.join(str(p) for p in error.absolute_path) or '(top)'}: {error.message}"
        for error in jsonschema.Draft202012Validator(REPORT_SCHEMA).iter_errors(report)
    )
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        problems.append(f"{REPORT_FILE}: not a valid model report: {'; '.join(found[:3])}{more}")
        return None
    return report


def _check_report(
    report: Mapping[str, Any],
    predicate: Mapping[str, Any],
    signed_files: Mapping[str, str],
    models: Mapping[str, str],
    data: Mapping[str, bytes],
    problems: list[str],
) -> None:
    problems += [f"{REPORT_FILE}: {p}" for p in generation.check(report)]
    for name in ("summary", "model_sha256", "case_set", "model"):
        if predicate.get(name) != report.get(name):
            problems.append(f"{REPORT_FILE}: {name} differs from the signed predicate")
    if models and list(models.values()) != [report.get("model_sha256")]:
        problems.append(f"{REPORT_FILE}: model_sha256 is not the signed model digest")
    case_set = report.get("case_set")
    if CASES_FILE not in signed_files:
        problems.append(f"{CASES_FILE}: not a signed subject")
    elif not isinstance(case_set, dict) or case_set.get("sha256") != signed_files[CASES_FILE]:
        problems.append(f"{REPORT_FILE}: case_set.sha256 is not the signed {CASES_FILE}")
    rows = [r for r in report.get("cases", []) if isinstance(r, dict)]
    named = {str(r.get("trace")) for r in rows}
    signed = {n for n in signed_files if n.startswith(f"{TRACES_DIR}/")}
    for name in sorted(named - signed):
        problems.append(f"{name}: a report row's trace is not a signed subject")
    for name in sorted(signed - named):
        problems.append(f"{name}: signed but no report row names it")
    for row in rows:
        name = str(row.get("trace"))
        if name not in data:
            continue
        try:
            trace = files.parse_json(data[name], name)
            text = trace["response"]["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError, InputError):
            problems.append(f"{name}: not a trace of one chat completion")
            continue
        if (trace.get("case"), trace.get("mode")) != (row.get("case"), row.get("mode")):
            problems.append(f"{name}: is not the trace of {row.get('case')}/{row.get('mode')}")
        if text != row.get("generated_text"):
            problems.append(f"{name}: its text is not the report's generated_text")
    summary = report.get("summary")
    if isinstance(summary, dict):
        for mode, counts in sorted(summary.items()):
            unsafe = counts.get("unsafe") if isinstance(counts, dict) else None
            if unsafe != 0:
                problems.append(
                    f"{REPORT_FILE}: {unsafe} unsafe admitted plans in mode {mode} (must be 0)"
                )


def format_verdict(verdict: Verdict) -> str:
    """A short human verdict: one line, then each failure and note."""
    report = verdict.report or {}
    head = "FAIL" if not verdict.ok else ("OK" if verdict.pinned_by else "UNPINNED")
    summary = report.get("summary")
    summary = summary if isinstance(summary, dict) else {}
    counts = ", ".join(
        f"{mode} unsafe {c.get('unsafe')} of {c.get('generations')}"
        for mode, c in sorted(summary.items())
        if isinstance(c, dict)
    )
    lines = [
        f"{head} {verdict.envelope}: model {report.get('model_file', '?')} "
        f"sha256 {report.get('model_sha256', '?')}, {counts or 'no summary'}, "
        f"signer {verdict.signer_keyid or '?'}"
    ]
    lines += [f"  failed: {p}" for p in verdict.problems]
    lines += [f"  note: {n}" for n in verdict.notes]
    return "\n".join(lines)
