"""Signed reproduction evidence: what ``lab reproduce`` found, and its check.

A reproduction directory holds::

    reproduction.json         the record: the original's envelope digest (its input),
                              each re-run, the fact-by-fact comparison, the verdict
    reproduction.intoto.json  a DSSE envelope over an in-toto statement whose subjects
                              are reproduction.json and every re-run's envelope, and whose
                              predicate is the record
    reproduction.pub.pem      the signer's public key (never trusted, only checked)
    runs/run-N/               each re-run's own signed runtime evidence

It is signed under the runtime evidence's key rules (``LAB_EVIDENCE_KEY``, else an
ephemeral key) and checked under the same trust policy: ``verify`` uses the runtime
verifier's signer check, so a pin (and a revocation) means the same thing for both. The
book shows a reproduction only when a trusted key other than the original's signer
vouches for it (``book_files``): an independent reproducer, named with its fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import files
from lab.errors import EvidenceError, InputError, Refused
from lab.evidence import compiler, dsse, trust, verification

RECORD_FILE = "reproduction.json"
ENVELOPE_FILE = "reproduction.intoto.json"
PUBLIC_KEY_FILE = "reproduction.pub.pem"
RUNS_DIR = "runs"
PREDICATE_TYPE = "https://durable-agent-lab.dev/reproduction-evidence/v1"
SCHEMA_VERSION = 1
RECORD_LIMIT = files.REPORT_LIMIT

_DIGEST = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_VALUE = {
    "type": "object",
    "required": ["nodeid", "key", "original", "values", "held"],
    "properties": {"nodeid": {"type": "string"}, "key": {"type": "string"},
                   "values": {"type": "array"}, "held": {"type": "integer", "minimum": 0}},
}
# What the book and the verifier read of a record; anything else is carried, not read.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "reproduced_at_utc", "inputs", "original", "runs",
                 "comparison", "wall_s", "signing"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "reproduced_at_utc": {"type": "string", "maxLength": 40},
        "inputs": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "digest"],
            "properties": {"name": {"type": "string"},
                           "digest": {"type": "object", "required": ["sha256"],
                                      "properties": {"sha256": _DIGEST}}}}},
        "original": {"type": "object", "required": ["envelope_sha256", "commit", "status"],
                     "properties": {"envelope_sha256": _DIGEST,
                                    "commit": {"type": ["string", "null"]},
                                    "status": {"type": "string"}}},
        "runs": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["evidence", "envelope_sha256", "status", "wall_s"],
            "properties": {"evidence": {"type": "string"}, "envelope_sha256": _DIGEST,
                           "status": {"type": "string"}, "wall_s": {"type": "number"}}}},
        "comparison": {
            "type": "object", "required": ["verdict", "runs", "summary", "experiments"],
            "properties": {
                "verdict": {"enum": ["identical", "differs"]},
                "runs": {"type": "integer", "minimum": 1},
                "summary": {"type": "object",
                            "required": ["experiments", "identical_in_facts"],
                            "properties": {"experiments": {"type": "integer"},
                                           "identical_in_facts": {"type": "integer"}}},
                "experiments": {"type": "array", "items": {
                    "type": "object",
                    "required": ["chapter", "name", "same", "passed", "original_outcome",
                                 "outcomes", "facts", "measurements"],
                    "properties": {
                        "chapter": {"type": "string"}, "name": {"type": "string"},
                        "same": {"type": "boolean"}, "passed": {"type": "boolean"},
                        "original_outcome": {"type": "string"},
                        "outcomes": {"type": "array", "items": {"type": "string"}},
                        "facts": {"type": "array", "items": _VALUE},
                        "measurements": {"type": "array", "items": _VALUE},
                    }}},
            }},
        "wall_s": {"type": "number"},
        "signing": {"type": "object"},
    },
}


def sha256(data: bytes) -> str:
    """The hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def dumps(value: Any) -> bytes:
    """The bytes a JSON document is written as (sorted keys, so the record is stable)."""
    return (json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True) + "\n").encode()


def problems(record: Any) -> list[str]:
    """Every way ``record`` breaks the reproduction schema, each naming the field."""
    validator = jsonschema.Draft202012Validator(SCHEMA)
    found = sorted(validator.iter_errors(record), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message[:200]}"
            for e in found]


def write(directory: Path, record: Mapping[str, Any], signer: dsse.Signer) -> bytes:
    """Sign ``record`` (its ``signing`` is set here) into ``directory``; return the envelope.

    The re-runs' evidence must already be in ``directory/runs/``: each envelope named by
    the record's ``runs`` becomes a subject, so the statement binds what was compared.
    """
    full = dict(record)
    full["signing"] = signer.describe()
    found = problems(full)
    if found:
        raise EvidenceError(f"reproduction record: {found[0]}")
    body = dumps(full)
    subjects = [{"name": RECORD_FILE, "digest": {"sha256": sha256(body)}}]
    for run in full["runs"]:
        name = f"{run['evidence']}/{compiler.ENVELOPE_FILE}"
        subjects.append({"name": name, "digest": {"sha256": run["envelope_sha256"]}})
    statement = {"_type": compiler.STATEMENT_TYPE, "subject": subjects,
                 "predicateType": PREDICATE_TYPE, "predicate": full}
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":"),
                         ensure_ascii=False).encode()
    envelope = dumps(dsse.sign_envelope(payload, signer))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / RECORD_FILE).write_bytes(body)
    (directory / ENVELOPE_FILE).write_bytes(envelope)
    (directory / PUBLIC_KEY_FILE).write_text(full["signing"]["public_key"], encoding="ascii")
    return envelope


@dataclass
class Verified:
    """The outcome of checking reproduction evidence: ok only when ``problems`` is empty."""

    directory: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    record: dict[str, Any] | None = None
    pinned_by: str | None = None
    signer_keyid: str | None = None
    # The bytes the checks ran on, by file name (the envelope and the record), once ok.
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.problems


def format_verdict(checked: Verified) -> str:
    """One line: OK or FAIL, what was reproduced and how it came out, and the signer."""
    signer = (f"signer pinned by {checked.pinned_by}" if checked.pinned_by
              else "signer UNPINNED (integrity, not identity)")
    record = checked.record
    if not checked.ok or record is None:
        first = checked.problems[0] if checked.problems else "no record"
        return f"FAIL {checked.directory}: {verification.printable(first)}"
    summary = record["comparison"]["summary"]
    return (f"OK {checked.directory}: reproduction of commit {record['original']['commit']} "
            f"(envelope sha256 {record['original']['envelope_sha256'][:16]}): "
            f"{record['comparison']['verdict']}, {summary['identical_in_facts']} of "
            f"{summary['experiments']} experiments identical in their facts over "
            f"{record['comparison']['runs']} re-run(s); {signer}")


def is_reproduction(directory: Path) -> bool:
    """True when ``directory`` holds a reproduction envelope."""
    return (directory / ENVELOPE_FILE).is_file()


def verify(
    directory: Path,
    *,
    public_key: ed25519.Ed25519PublicKey | None = None,
    trusted: Sequence[trust.TrustedKey] = (),
) -> Verified:
    """Check the envelope, its signer (runtime trust rules), the statement and the record."""
    result = Verified(directory)
    try:
        sealed = files.read_bytes(directory / ENVELOPE_FILE, files.ENVELOPE_LIMIT, ENVELOPE_FILE)
        envelope = files.parse_json(sealed, f"{ENVELOPE_FILE} {directory / ENVELOPE_FILE}")
        raw = envelope.get("payload") if isinstance(envelope, dict) else None
        payload = dsse.b64decode(raw if isinstance(raw, str) else "")
        statement = files.parse_json(payload, f"{ENVELOPE_FILE} payload")
    except (InputError, ValueError) as exc:
        result.problems.append(f"{ENVELOPE_FILE}: {exc}")
        return result
    if not isinstance(envelope, dict) or not isinstance(statement, dict):
        result.problems.append(f"{ENVELOPE_FILE}: not a DSSE envelope over a JSON statement")
        return result
    if envelope.get("payloadType") != dsse.PAYLOAD_TYPE:
        result.problems.append(f"{ENVELOPE_FILE}: payload type is not in-toto")
    predicate = statement.get("predicate")
    # One signer policy for runtime and reproduction evidence: the runtime verifier's.
    signing = predicate.get("signing") if isinstance(predicate, dict) else None
    signer = verification.check_signer(envelope, payload, signing, public_key, trusted)
    result.problems += signer.problems
    result.notes += signer.notes
    result.pinned_by = signer.pinned_by
    result.signer_keyid = signer.keyid
    if statement.get("_type") != compiler.STATEMENT_TYPE:
        result.problems.append("statement: _type is not in-toto v1")
    if statement.get("predicateType") != PREDICATE_TYPE:
        result.problems.append("statement: predicateType is not reproduction evidence")
    found = problems(predicate)
    if found:
        result.problems.append(f"record: not a valid reproduction record: {found[0]}")
        return result
    subjects = verification.subjects(statement, result.problems)
    try:
        body = files.read_bytes(directory / RECORD_FILE, RECORD_LIMIT, RECORD_FILE)
    except InputError as exc:
        result.problems.append(str(exc))
        return result
    if subjects.get(RECORD_FILE) != sha256(body):
        result.problems.append(f"{RECORD_FILE}: its sha256 is not the signed subject's")
    elif files.parse_json(body, RECORD_FILE) != predicate:
        result.problems.append(f"{RECORD_FILE}: differs from the signed predicate")
    if result.ok:
        result.record = predicate
        result.files = {ENVELOPE_FILE: sealed, RECORD_FILE: body}
    return result


BOOK_DIR = "reproduction"  # beside the runtime evidence: ``lab reproduce E --out E/reproduction``


@dataclass(frozen=True)
class BookReproduction:
    """A verified reproduction of the published run, and whether the book shows it.

    ``files`` are the record and its envelope, and ``reproducer`` names who vouches for
    them (the trusted key's origin and fingerprint), only for an **independent**
    reproduction: signed by a trusted key other than the original's signer. Otherwise
    ``files`` is empty and ``withheld`` says why (not pinned, or not independent).
    """

    files: dict[str, bytes] = field(default_factory=dict)
    reproducer: str | None = None
    withheld: str | None = None


def book_files(
    evidence_dir: Path,
    original_envelope: bytes,
    *,
    original_keyid: str,
    trusted: Sequence[trust.TrustedKey] = (),
) -> BookReproduction | None:
    """The reproduction of ``evidence_dir/reproduction/`` as the book may show it.

    None when there is no reproduction. ``Refused`` naming the cause when there is one
    that does not verify (a revoked signer included), or that reproduces another run (its
    input is not the digest of ``original_envelope``): the book shows a reproduction only
    of the run it publishes. Its signer is pinned only by a ``trusted`` key, never by the
    original's ``--public-key``; a reproduction no trusted key vouches for, or one signed
    by the original's own key (``original_keyid``), is withheld with its reason: only an
    independent reproducer's word is worth a table.
    """
    directory = evidence_dir / BOOK_DIR
    if not is_reproduction(directory):
        return None
    checked = verify(directory, trusted=trusted)
    if not checked.ok or checked.record is None:
        first = checked.problems[0] if checked.problems else "no record"
        raise Refused(f"{directory}: {first}")
    if checked.record["original"]["envelope_sha256"] != sha256(original_envelope):
        raise Refused(f"{directory}: it reproduces another run, not this evidence")
    keyid = checked.signer_keyid or "?"
    if checked.pinned_by is None:
        return BookReproduction(withheld=(
            f"not pinned: its signer, key {keyid[:16]}, is not a trusted key "
            f"({trust.TRUSTED_DIR}/ at the default branch's tip or {trust.TRUSTED_ENV}), "
            "so nothing says who reproduced the run"))
    if keyid == original_keyid:
        return BookReproduction(withheld=(
            f"not independent: it is signed by the original run's own key, key "
            f"{keyid[:16]} ({checked.pinned_by}); a reproduction counts only when another "
            "trusted key signs it"))
    # The very bytes that were verified: nothing is read again.
    found = {f"{BOOK_DIR}/{name}": checked.files[name] for name in (RECORD_FILE, ENVELOPE_FILE)}
    return BookReproduction(found, reproducer=f"{checked.pinned_by}, key {keyid}")
