"""Verification of signed evidence, offline: signature, trust, statement, subjects, verdict.

A verifier decides from the envelope and a trust policy, never from a field the
producer wrote about itself:

- the signature is checked with ``dsse``; the signer is *trusted* only by a pin:
  a key given with ``--public-key``, or a publication key committed under
  ``keys/trusted/*.pub.pem`` at the tip of the default branch or named by
  ``LAB_TRUSTED_KEYS``; a key committed under ``keys/revoked/`` at that tip fails
  whatever pins it and whatever commit the evidence names (``trust``). Without a pin the
  evidence can prove its integrity only, and the verdict says ``UNPINNED``; a
  report that claims a publication key (``key_source``) without a pin fails.
  ``runtime.pub.pem`` beside the evidence is never a pin.
- the report is schema-checked (``report.validate``) before any field is read;
- ``runtime.json`` and ``tests.jsonl`` must be the signed subjects' bytes;
- every row of the report (tests, experiments, observations, skips, collection errors)
  must be what the signed ``tests.jsonl`` folds to (``rows.check``), and the verdict is
  recomputed from those rows with ``gate.decide``: every recorded summary of it (status,
  failures, missing, skips, exit status) must agree;
- with ``check_sources``, the tree id the files tracked in the working tree make is
  compared with the signed one (``lab.evidence.tree``), every recorded digest with its
  file, and the recorded expectation with the committed ``experiments/manifest.json``.

Every file is read through ``files.read_bytes``: bounded, regular files only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import files
from lab.errors import EvidenceError, InputError
from lab.evidence import compiler, dsse, gate, hermetic, rows, trust
from lab.evidence import tree as source_tree
from lab.evidence.report import Report
from lab.evidence.report import problems as schema_problems

MANIFEST = "experiments/manifest.json"
_MAX_GATE_LINES = 20


@dataclass
class Verdict:
    """The outcome of verifying evidence: ok only when ``problems`` is empty.

    ``pinned_by`` names the pin that vouched for the signer (None: UNPINNED, the
    signature proves integrity only). ``report`` is the signed, schema-checked
    report, or None when there is none to trust the shape of.
    """

    envelope: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    report: Report | None = None
    signer_keyid: str | None = None
    pinned_by: str | None = None
    sources_checked: bool = False
    # Set when there was nothing to verify: the path or the envelope file is unusable
    # as input (missing, not a regular file, too large); the CLI reports it as bad input.
    unreadable: str | None = None

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.problems

    @property
    def trusted(self) -> bool:
        """True when nothing failed and a pin vouches for the signer."""
        return self.ok and self.pinned_by is not None

    def unverified(self) -> list[str]:
        """What this verification could not establish, in words."""
        missing: list[str] = []
        if self.pinned_by is None:
            missing.append(
                "the signer's identity: no pin (--public-key, "
                f"{trust.TRUSTED_DIR}/{trust.TRUSTED_PATTERN} or {trust.TRUSTED_ENV}) "
                "vouches for its key"
            )
        if not self.sources_checked:
            missing.append("the sources against a working tree (use --check-sources)")
        return missing


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class Located:
    """The files of one evidence directory."""

    envelope: Path
    report: Path
    tests: Path


def locate(path: Path) -> Located:
    """The evidence files for an evidence directory or an envelope file."""
    directory = path if path.is_dir() else path.parent
    envelope = directory / compiler.ENVELOPE_FILE if path.is_dir() else path
    return Located(envelope, directory / compiler.REPORT_FILE, directory / compiler.TESTS_FILE)


def verify(
    path: Path,
    *,
    public_key: ed25519.Ed25519PublicKey | None = None,
    trusted: Sequence[trust.TrustedKey] = (),
    check_sources: bool = False,
    root: Path | None = None,
) -> Verdict:
    """Check an evidence envelope offline and name every failure.

    The signer is pinned by ``public_key`` when given (only that key is accepted),
    else by any of ``trusted``; otherwise the key the evidence carries checks the
    signature and the verdict is UNPINNED. With ``check_sources`` every recorded
    digest is compared with the files under ``root`` (default: the working directory).
    """
    if not path.exists() and not path.is_symlink():
        verdict = Verdict(path)
        verdict.unreadable = f"evidence {path}: no such file or directory"
        verdict.problems.append(verdict.unreadable)
        return verdict
    where = locate(path)
    verdict = Verdict(where.envelope)
    problems = verdict.problems
    try:
        envelope = files.read_json(where.envelope, files.ENVELOPE_LIMIT, "envelope")
    except InputError as exc:
        verdict.unreadable = str(exc)
        problems.append(verdict.unreadable)
        return verdict
    if not isinstance(envelope, dict):
        problems.append(f"envelope {where.envelope}: not a JSON object")
        return verdict
    payload_type = envelope.get("payloadType")
    if payload_type != dsse.PAYLOAD_TYPE:
        problems.append(f"payload type: {_short(payload_type)} is not {dsse.PAYLOAD_TYPE!r}")
    try:
        payload = dsse.b64decode(envelope.get("payload"))  # type: ignore[arg-type]
    except ValueError as exc:
        problems.append(f"payload: {exc}")
        return verdict
    try:
        parsed: Any = files.parse_json(payload, "payload")
    except InputError as exc:
        problems.append(str(exc))
        parsed = None
    predicate = parsed.get("predicate") if isinstance(parsed, dict) else None
    signer = check_signer(
        envelope, payload, predicate.get("signing") if isinstance(predicate, dict) else None,
        public_key, trusted,
    )
    problems += signer.problems
    verdict.notes += signer.notes
    verdict.signer_keyid, verdict.pinned_by = signer.keyid, signer.pinned_by
    if not isinstance(parsed, dict):
        problems.append("payload: not an in-toto statement (a JSON object)")
        return verdict
    found = schema_problems(predicate)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        problems.append(f"report: not a valid report: {'; '.join(found[:3])}{more}")
    sources = _check_statement(parsed, where, problems)
    if found:
        return verdict
    report: Report = predicate  # type: ignore[assignment]  # schema-checked just above
    verdict.report = report
    _check_gate(report, problems)
    if run_kind(report) == hermetic.LOCAL:
        reasons = hermetic.failures(report.get("run"))
        verdict.notes.append(f"LOCAL run, not publishable: {reasons[0]}")
    if report["dirty"] is True:
        verdict.notes.append("the run's working tree was DIRTY: not publishable")
    elif report["dirty"] is None:
        verdict.notes.append("the run's working tree state is unknown (no git)")
    if check_sources:
        verdict.sources_checked = True
        tree = root or Path.cwd()
        _check_sources(sources, report.get("tree"), tree, problems)
        _check_recorded_digests(report, tree, problems)
        _check_expected(report, tree, problems)
    return verdict


@dataclass
class SignerCheck:
    """Who signed one evidence file, judged by ``check_signer`` alone."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    keyid: str | None = None
    # The pin that vouched for the signer (None: UNPINNED).
    pinned_by: str | None = None
    # The key the signature was checked with (None: no usable key).
    key: ed25519.Ed25519PublicKey | None = None


def check_signer(
    envelope: Mapping[str, Any],
    payload: bytes,
    signing: Any,
    public_key: ed25519.Ed25519PublicKey | None,
    trusted: Sequence[trust.TrustedKey],
) -> SignerCheck:
    """The one decision of signer trust, for runtime and model evidence alike.

    The signature is checked against the pin (``public_key``: only that key), else
    against each ``trusted`` key, else against the key the evidence carries (UNPINNED:
    integrity, not identity; a carried key presented as a publication key fails). A
    signer that a revoked entry of ``trusted`` names (``keys/revoked/`` at the default
    branch's tip) fails, even when ``public_key`` is that key. The
    evidence's own ``signing`` section must name the signer's keyid and embed its key.
    Each evidence file is judged by its own signer: nothing carries over between calls.
    """
    result = SignerCheck()
    problems = result.problems
    signing = signing if isinstance(signing, Mapping) else {}
    embedded = _embedded_key(signing)
    if public_key is not None and (cut := trust.revoked(trusted, public_key)) is not None:
        result.keyid = dsse.keyid(public_key)
        problems.append(_revoked_line(result.keyid, cut))
        return result
    pins = ([trust.TrustedKey(public_key, "--public-key")] if public_key is not None
            else [pin for pin in trusted if not pin.revoked])
    for pin in pins:
        try:
            dsse.check_signature(envelope, payload, pin.key)
        except EvidenceError as exc:
            if public_key is not None:
                problems.append(str(exc))
                result.keyid = dsse.keyid(public_key)
                return result
            continue
        result.pinned_by = pin.origin
        result.keyid = dsse.keyid(pin.key)
        result.key = pin.key
        if embedded is None or dsse.raw_public_key(embedded) != dsse.raw_public_key(pin.key):
            problems.append("signing: the report's public_key is not the key that signed it")
        break
    else:
        if embedded is None:
            problems.append("signature: no pinned key signed it and the evidence carries none")
            return result
        result.keyid = dsse.keyid(embedded)
        result.key = embedded
        try:
            dsse.check_signature(envelope, payload, embedded)
        except EvidenceError as exc:
            problems.append(str(exc))
            return result
        _judge_carried_key(result, signing, len(pins))
    cut = trust.revoked(trusted, result.key) if result.key is not None else None
    if cut is not None:
        # Revoked at the tip of the default branch: refused for evidence of any age,
        # however the key was named (keys/trusted, LAB_TRUSTED_KEYS, or carried).
        problems.insert(0, _revoked_line(result.keyid or "?", cut))
        result.pinned_by = None
    if signing.get("keyid") != result.keyid:
        problems.append("signing: the report's keyid is not the signer's")
    if signing.get("key_source") == "ephemeral":
        result.notes.append(
            "signed with an EPHEMERAL key: not a publication signature "
            f"(set {dsse.KEY_ENV} to sign with a known key)"
        )
    return result


def _embedded_key(signing: Mapping[str, Any]) -> ed25519.Ed25519PublicKey | None:
    """The public key the evidence's ``signing`` section carries, if it is a readable one."""
    embedded_pem = signing.get("public_key")
    if not isinstance(embedded_pem, str) or len(embedded_pem) > files.PUBLIC_KEY_LIMIT:
        return None
    try:
        return dsse.load_public_key(embedded_pem.encode())
    except EvidenceError:
        return None


def _judge_carried_key(result: SignerCheck, signing: Mapping[str, Any], pins: int) -> None:
    """No pin signed, the carried key did (UNPINNED): what that means, into ``result``."""
    source = signing.get("key_source")
    if source != "ephemeral":
        result.problems.append(
            f"signer: UNPINNED key {result.keyid} is presented as a publication "
            f"key (key_source {_short(source)}); pin it with --public-key or commit it "
            f"under {trust.TRUSTED_DIR}/"
        )
    elif pins:
        result.notes.append(f"the signer is not among the {pins} trusted publication keys")
    result.notes.append(
        "UNPINNED: verified with the key the evidence carries; this proves integrity, "
        "not identity (pin the signer with --public-key or a committed trusted key)"
    )


def _revoked_line(keyid: str, revocation: trust.TrustedKey) -> str:
    return (f"signer: key {keyid[:16]} is REVOKED by {revocation.origin}: no evidence it "
            "signed is trusted, whatever its commit")


def _check_statement(
    statement_: Mapping[str, Any], where: Located, problems: list[str]
) -> dict[str, str]:
    """Check the statement against the files beside it; return the source subjects."""
    if statement_.get("_type") != compiler.STATEMENT_TYPE:
        problems.append(
            f"statement: _type {_short(statement_.get('_type'))} is not "
            f"{compiler.STATEMENT_TYPE!r}"
        )
    if statement_.get("predicateType") != compiler.PREDICATE_TYPE:
        problems.append(f"statement: predicateType {_short(statement_.get('predicateType'))} "
                        "unknown")
    signed = subjects(statement_, problems)
    predicate = statement_.get("predicate")
    for name, path in ((compiler.REPORT_FILE, where.report), (compiler.TESTS_FILE, where.tests)):
        if name not in signed:
            problems.append(f"subjects: {name} is not a signed subject")
            continue
        limit = files.REPORT_LIMIT if name == compiler.REPORT_FILE else files.TESTS_LOG_LIMIT
        try:
            data = files.read_bytes(path, limit, name)
        except InputError as exc:
            problems.append(str(exc))
            continue
        if hashlib.sha256(data).hexdigest() != signed[name]:
            problems.append(f"{name}: its sha256 does not match the signed subject")
        elif name == compiler.TESTS_FILE:
            rows.check(data, predicate, problems)
        elif name == compiler.REPORT_FILE:
            try:
                if files.parse_json(data, name) != predicate:
                    problems.append(f"{name}: differs from the signed predicate")
            except InputError as exc:
                problems.append(str(exc))
    sources = predicate.get("sources") if isinstance(predicate, dict) else None
    declared = {
        k: v for k, v in signed.items() if k not in (compiler.REPORT_FILE, compiler.TESTS_FILE)
    }
    if sources != declared:
        problems.append("subjects: the source subjects differ from the report's sources")
    return declared


def subjects(statement_: Mapping[str, Any], problems: list[str]) -> dict[str, str]:
    """``{name: sha256}`` of a statement's subjects; malformed or duplicate ones are problems."""
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
            problems.append(f"statement: malformed or duplicate subject {_short(item)}")
            continue
        found[name] = sha
    return found


def _check_gate(report: Report, problems: list[str]) -> None:
    """The verdict is recomputed from the signed rows; no recorded summary is trusted."""
    recomputed = gate.decide(report)
    status = report["status"]
    if status != recomputed.status:
        problems.append(
            f"gate: the report says {status} but its rows give {recomputed.status}"
        )
    if report["gate"]["failures"] != recomputed.failures:
        problems.append("gate: the recorded failures differ from those its rows give")
    if report["missing"] != recomputed.missing:
        problems.append("gate: the recorded missing experiments differ from those its rows give")
    # Every skipped experiment must be recorded as a skip, and every recorded skip must
    # be a skipped row (the producer may record skipped unit tests too).
    skipped = {
        (t["nodeid"], t["outcome"])
        for t in report["tests"]
        if t["outcome"] in (gate.SKIPPED, gate.XFAILED)
    }
    recorded_skips = {(s["nodeid"], s["outcome"]) for s in report["skips"]}
    skipped_experiments = {
        (t["nodeid"], t["outcome"])
        for t in report["tests"]
        if t["experiment"] is not None and t["outcome"] in (gate.SKIPPED, gate.XFAILED)
    }
    if not skipped_experiments <= recorded_skips <= skipped:
        problems.append("gate: the recorded skips differ from the skipped rows")
    recorded_publishable = report.get("publishable")
    if recorded_publishable is not None and recorded_publishable != recomputed.publishable:
        problems.append(
            f"gate: the report says publishable {recorded_publishable} but its rows give "
            f"{recomputed.publishable}"
        )
    exitstatus = report["exitstatus"]
    if status == gate.PASS and exitstatus != 0:
        problems.append(f"gate: the report says PASS but pytest exited with status {exitstatus}")
    if recomputed.status != gate.PASS:
        problems.append(f"gate: status is {recomputed.status}, not PASS")
        problems += [f"gate: {failure}" for failure in recomputed.failures[:_MAX_GATE_LINES]]
        problems += [f"gate: narrowed: {reason}" for reason in recomputed.narrowed]
    if skipped_experiments or recorded_skips:
        names = ", ".join(sorted(n for n, _ in skipped_experiments | recorded_skips))
        problems.append(f"gate: skipped or xfailed: {names}")


def _repo_path(root: Path, name: str) -> Path | None:
    """``root / name`` when ``name`` is a relative posix path that stays inside ``root``."""
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or ".." in pure.parts or "\\" in name or "\0" in name:
        return None
    return root / pure


def _digest(path: Path, what: str) -> str:
    return hashlib.sha256(files.read_bytes(path, files.SOURCE_LIMIT, what)).hexdigest()


def _compare(root: Path, name: str, digest: str, what: str, problems: list[str]) -> None:
    path = _repo_path(root, name)
    if path is None:
        problems.append(f"{what} {_short(name)}: not a path inside the repository")
        return
    if not path.exists():
        problems.append(f"{what} {name}: missing from {root}")
        return
    try:
        if _digest(path, f"{what} {name}:") != digest:
            problems.append(f"{what} {name}: differs from the signed digest")
    except InputError as exc:
        problems.append(str(exc))


def _check_sources(
    sources: Mapping[str, str], recorded_tree: Any, root: Path, problems: list[str]
) -> None:
    """The files git tracks under ``root`` must make the tree the evidence names (so every
    tracked file is covered, whatever its name), and each signed digest must match."""
    snapshot = source_tree.sources(root)
    if snapshot is None:
        problems.append(f"sources: {root} is not a git checkout whose files can be listed")
    elif not isinstance(recorded_tree, str):
        problems.append("sources: the evidence names no tree id, so its sources cannot be "
                        "compared as a whole")
    elif snapshot.tree != recorded_tree:
        problems.append(f"sources: the files tracked in {root} make tree {snapshot.tree[:12]}, "
                        f"not the signed {recorded_tree[:12]}")
    for name, digest in sorted(sources.items()):
        _compare(root, name, digest, "source", problems)
    for name in sorted(snapshot.sha256 if snapshot is not None else ()):
        if name not in sources:
            problems.append(f"source {name}: present in {root} but not covered by the evidence")


def _file_digests(value: Any) -> Iterator[tuple[str, str]]:
    """Every ``{"path": ..., "sha256": ...}`` recorded anywhere in the report."""
    if isinstance(value, dict):
        path, digest = value.get("path"), value.get("sha256")
        if isinstance(path, str) and isinstance(digest, str):
            yield path, digest
        for item in value.values():
            yield from _file_digests(item)
    elif isinstance(value, list):
        for item in value:
            yield from _file_digests(item)


def _check_recorded_digests(report: Report, root: Path, problems: list[str]) -> None:
    """Each file digest the producer recorded with a repo-relative path matches the tree."""
    for name, digest in sorted(set(_file_digests(dict(report)))):
        if PurePosixPath(name).is_absolute():
            continue  # outside the repository (an installed distribution): nothing to compare
        _compare(root, name, digest, "recorded file", problems)


def _check_expected(report: Report, root: Path, problems: list[str]) -> None:
    """The experiments the run expected are those the committed manifest declares."""
    path = root / MANIFEST
    try:
        files.read_bytes(path, files.MANIFEST_LIMIT, "manifest")
        declared = compiler.load_manifest(path)
    except (InputError, EvidenceError) as exc:
        problems.append(f"expected: cannot compare with the committed manifest: {exc}")
        return
    committed = sorted((e.chapter, e.name, e.results, e.database) for e in declared)
    recorded = sorted(
        (e["chapter"], e["name"], e["results"], e["database"]) for e in report["expected"]
    )
    if committed != recorded:
        dropped = sorted({e[:2] for e in committed} - {e[:2] for e in recorded})
        names = ", ".join(f"{chapter}/{name}" for chapter, name in dropped[:5])
        detail = f": not expected: {names}" if dropped else ""
        problems.append(f"expected: differs from the committed {MANIFEST}{detail}")


def _short(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def format_verdict(verdict: Verdict) -> str:
    """The verdict: one line (OK, UNPINNED or FAIL first), then each failure and note."""
    report = verdict.report
    head = "FAIL" if not verdict.ok else ("OK" if verdict.pinned_by else "UNPINNED")
    status = report["status"] if report else "?"
    commit = (report["commit"] if report else None) or "?"
    dirty = ""
    if report and report["dirty"] is True:
        dirty = " (DIRTY tree)"
    elif report and report["dirty"] is None:
        dirty = " (tree state unknown)"
    trust = f"pinned by {verdict.pinned_by}" if verdict.pinned_by else "UNPINNED"
    lines = [
        f"{head} {verdict.envelope}: status {status}, {run_kind(report)} run, "
        f"{environment_note(report)}, commit {commit}{dirty}, "
        f"signer {verdict.signer_keyid or '?'} {trust}"
    ]
    lines += [f"  failed: {p}" for p in verdict.problems]
    lines += [f"  note: {n}" for n in verdict.notes]
    return "\n".join(printable(line) for line in lines)


def environment_note(report: Mapping[str, Any] | None) -> str:
    """``environment = uv.lock``, ``environment DIFFERS from uv.lock`` or ``environment
    not checked``, from the report's signed ``environment`` record."""
    recorded = report.get("environment") if report is not None else None
    if not isinstance(recorded, Mapping):
        return "environment not checked against a lock"
    if recorded.get("matches") is True:
        return "environment = uv.lock"
    return "environment DIFFERS from uv.lock"


def run_kind(report: Mapping[str, Any] | None) -> str:
    """``hermetic`` when the report's facts make the run hermetic, else ``local``."""
    if report is None or hermetic.failures(report.get("run")) or hermetic.source_failures(
            report):
        return hermetic.LOCAL
    return hermetic.HERMETIC


def printable(text: str) -> str:
    """``text`` safe for a terminal: control and format characters (newlines, escape
    sequences, bidirectional overrides) from the evidence shown as ``\\xNN`` escapes."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
