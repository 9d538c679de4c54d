"""Sealing a sandboxed run's evidence in the parent: the publication key never enters the run.

A hermetic run (``lab run --hermetic``) runs in a sandbox that is given no key: its
plugin signs with an ephemeral key, which proves only that the files were not changed
on their way out. Once the sandbox has ended, the parent (``seal``):

1. reads the run's four files (size-limited) and checks them against themselves: the
   ephemeral signature over the statement, the statement's digests of ``runtime.json``
   and ``tests.jsonl``, and that the run signed with an ephemeral key (a run that had a
   key was not sandboxed as this module expects);
2. rebuilds every row of the report from the signed ``tests.jsonl`` (``rows.check``) and
   refuses any difference, duplicate or missing node id;
3. records what the run trusted of the machine (``trusted_base``, from ``lab.sandbox``)
   and the signer, and signs the statement with the publication key.

So the key is read by one process, after the run's processes are gone, and what it
signs is what the parent rebuilt, not what the run claimed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lab import files
from lab.errors import EvidenceError, InputError
from lab.evidence import compiler, dsse, rows, verification

# Where the report says the sandbox's signature was replaced by the parent's.
SEALED_BY = "sealed_by"
PARENT = "parent, after the sandboxed run ended"


def _read(directory: Path) -> tuple[bytes, bytes, dict[str, Any], bytes]:
    try:
        report_bytes = files.read_bytes(directory / compiler.REPORT_FILE, files.REPORT_LIMIT,
                                        compiler.REPORT_FILE)
        tests_bytes = files.read_bytes(directory / compiler.TESTS_FILE, files.TESTS_LOG_LIMIT,
                                       compiler.TESTS_FILE)
        envelope_bytes = files.read_bytes(directory / compiler.ENVELOPE_FILE,
                                          files.ENVELOPE_LIMIT, compiler.ENVELOPE_FILE)
        pem = files.read_bytes(directory / compiler.PUBLIC_KEY_FILE, files.PUBLIC_KEY_LIMIT,
                               compiler.PUBLIC_KEY_FILE)
        envelope = json.loads(envelope_bytes)
    except InputError as exc:
        raise EvidenceError(f"sealing the sandboxed run's evidence: {exc}") from None
    except ValueError:
        raise EvidenceError(f"sealing: {compiler.ENVELOPE_FILE} is not JSON") from None
    if not isinstance(envelope, dict):
        raise EvidenceError(f"sealing: {compiler.ENVELOPE_FILE} is not a JSON object")
    return report_bytes, tests_bytes, envelope, pem


def _checked_report(report_bytes: bytes, tests_bytes: bytes, envelope: Mapping[str, Any],
                    pem: bytes) -> dict[str, Any]:
    """The run's report, once its files agree with the run's own signature and rows."""
    try:
        report = json.loads(report_bytes)
        key = dsse.load_public_key(pem)
        payload = dsse.b64decode(str(envelope.get("payload", "")))
    except (ValueError, EvidenceError) as exc:
        raise EvidenceError(f"sealing: the run's evidence does not check: {exc}") from None
    if not isinstance(report, dict):
        raise EvidenceError(f"sealing: {compiler.REPORT_FILE} is not a JSON object")
    signer = verification.check_signer(envelope, payload, report.get("signing"), key, ())
    if signer.problems:
        raise EvidenceError(f"sealing: the run's evidence does not check: {signer.problems[0]}")
    if json.loads(payload) != compiler.statement(report_bytes, report, tests_bytes):
        raise EvidenceError("sealing: the run's statement is not over its runtime.json and "
                            "tests.jsonl")
    if report.get("signing", {}).get("key_source") != "ephemeral":
        raise EvidenceError("sealing: the sandboxed run signed with a key of its own; the "
                            "publication key must never enter the run")
    problems: list[str] = []
    rows.check(tests_bytes, report, problems)
    if problems:
        raise EvidenceError(f"sealing: {problems[0]}"
                            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return report


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all."""
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def seal(directory: Path, signer: dsse.Signer, trusted_base: Mapping[str, Any]) -> dict[str, Any]:
    """Re-sign the sandboxed run's evidence in ``directory`` with ``signer``, recording
    ``trusted_base``; return the sealed report. Raises ``EvidenceError`` naming the first
    problem; nothing is written then."""
    report_bytes, tests_bytes, envelope, pem = _read(directory)
    report = _checked_report(report_bytes, tests_bytes, envelope, pem)
    signing = signer.describe()
    report["signing"] = {**signing, SEALED_BY: PARENT}
    report["trusted_base"] = dict(trusted_base)
    sealed_bytes = compiler.dumps_report(report)
    payload = json.dumps(compiler.statement(sealed_bytes, report, tests_bytes), sort_keys=True,
                         separators=(",", ":"), ensure_ascii=False).encode()
    sealed_envelope = dsse.sign_envelope(payload, signer)
    _write_atomic(directory / compiler.REPORT_FILE, sealed_bytes)
    _write_atomic(directory / compiler.ENVELOPE_FILE,
                       (json.dumps(sealed_envelope, indent=2) + "\n").encode())
    _write_atomic(directory / compiler.PUBLIC_KEY_FILE, signing["public_key"].encode())
    return report
