"""One evidence directory, opened and verified once: the bundle the book reads.

An evidence directory holds up to four declared parts, each verified on its own terms:

* ``runtime`` (required): ``runtime.json``, its envelope and ``tests.jsonl``, verified on a
  private copy (``verification.verify`` with the sources checked), and the signer's
  public key as the signed report names it;
* ``crashpoints`` (optional): the crash-point matrix ``crashpoints.json``, read and
  shape-checked (``crashmatrix``); the book binds it to the signed report's digest;
* ``model`` (optional): ``model/``, the signed model evidence, verified on a private copy
  by the ``ModelVerifier`` the caller hands down (``model_evidence``), under its own pin;
* ``reproductions`` (optional): ``reproduction/``, a verified reproduction of this run
  (``reproduction_evidence``), its files kept only when a trusted key other than the
  original's signer vouches for it, else ``withheld`` with the reason.

``open_bundle`` returns a ``Bundle`` of typed ``Part`` objects: each one's verified bytes
(by their path under ``evidence/`` in the book), or the reason it is absent, or the reason
it was refused, and says why the runtime evidence is not of a hermetic run when it is not
(``not_hermetic``: a publication refuses it). Nothing is read twice: what the bundle
holds is what was verified.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import errors, files
from lab.evidence import (
    compiler,
    crashmatrix,
    dsse,
    hermetic,
    model_evidence,
    reproduction_evidence,
    trust,
    verification,
)
from lab.evidence.report import Report

RUNTIME = "runtime"
CRASHPOINTS = "crashpoints"
MODEL = "model"
REPRODUCTIONS = "reproductions"
PARTS = (RUNTIME, MODEL, REPRODUCTIONS, CRASHPOINTS)
"""Every part an evidence directory may hold, in the order they are listed and refused."""

MAX_MODEL_DIR_BYTES = 256 << 20
_STAGED = (
    (compiler.REPORT_FILE, files.REPORT_LIMIT),
    (compiler.ENVELOPE_FILE, files.ENVELOPE_LIMIT),
    (compiler.TESTS_FILE, files.TESTS_LOG_LIMIT),
)


@dataclass(frozen=True)
class Part:
    """One declared part of the evidence: verified files, or why there are none.

    ``files`` maps each verified file's path relative to the evidence directory to its
    bytes. ``absent`` says why a part has nothing (not a failure); ``refused`` why what
    was there did not verify. ``pinned_by`` names the pin that vouched for the part's
    signer (None: unpinned, or unsigned).
    """

    name: str
    files: Mapping[str, bytes] = field(default_factory=dict)
    absent: str | None = None
    refused: str | None = None
    pinned_by: str | None = None
    # Verified, but not shown, and why (a reproduction that is not independent).
    withheld: str | None = None

    @property
    def present(self) -> bool:
        """True when the part is there and verified."""
        return self.absent is None and self.refused is None


@dataclass(frozen=True)
class Bundle:
    """An evidence directory, opened and verified: the runtime report and every part."""

    directory: Path
    report: Report
    parts: Mapping[str, Part]
    # Why the runtime evidence is not of a hermetic run (None: it is). Such evidence
    # verifies and a local book may show it; a publication refuses it with this reason.
    not_hermetic: str | None = None

    def part(self, name: str) -> Part:
        """The declared part ``name`` (one of ``PARTS``)."""
        return self.parts[name]

    @property
    def pinned_by(self) -> str | None:
        """The pin that vouched for the runtime evidence's signer (None: unpinned)."""
        return self.parts[RUNTIME].pinned_by

    @property
    def refusals(self) -> list[str]:
        """Every refused part's reason, in ``PARTS`` order."""
        return [p.refused for n in PARTS if (p := self.parts[n]).refused is not None]

    @property
    def verified_files(self) -> dict[str, bytes]:
        """Every verified file of every present part, by its path in the evidence."""
        return {name: data for n in PARTS for name, data in self.parts[n].files.items()}

    @property
    def matrix(self) -> bytes | None:
        """The crash-point matrix's bytes, when present."""
        return self.parts[CRASHPOINTS].files.get(crashmatrix.OUTPUT_FILE)


def open_bundle(
    evidence_dir: Path,
    *,
    public_key: ed25519.Ed25519PublicKey | None = None,
    trusted: Sequence[trust.TrustedKey] = (),
    root: Path,
    model_verifier: model_evidence.ModelVerifier | None = None,
) -> Bundle:
    """Open and verify ``evidence_dir``: its runtime evidence, then each optional part.

    ``public_key`` pins the signers; otherwise ``trusted`` keys may vouch for them.
    ``root`` is the working tree the runtime evidence's sources must match. The runtime
    part is required: ``errors.Refused`` names every reason it fails (a dirty run first
    of all). An optional part that does not verify is kept, refused, with its reason.
    """
    report, runtime = _runtime(evidence_dir, public_key=public_key, trusted=trusted, root=root)
    not_hermetic = _not_hermetic(report)
    envelope = runtime.files[compiler.ENVELOPE_FILE]
    # The parts that stand on their own first; then the reproduction, which is judged
    # against the runtime's envelope. Their refusals are listed in ``PARTS`` order.
    opened = {
        RUNTIME: runtime,
        MODEL: _guarded(MODEL, lambda: _model(evidence_dir, public_key, trusted,
                                              model_verifier)),
        CRASHPOINTS: _guarded(CRASHPOINTS, lambda: _crashpoints(evidence_dir)),
        REPRODUCTIONS: _guarded(REPRODUCTIONS, lambda: _reproductions(
            evidence_dir, envelope, report["signing"]["keyid"], trusted)),
    }
    return Bundle(evidence_dir, report, {name: opened[name] for name in PARTS}, not_hermetic)


def _not_hermetic(report: Report) -> str | None:
    """Why ``report`` is not of a hermetic run (``verification.run_kind``), or None."""
    if verification.run_kind(report) == hermetic.HERMETIC:
        return None
    reasons = hermetic.failures(report.get("run"))
    return reasons[0] if reasons else "not hermetic"


def _guarded(name: str, opening: Callable[[], Part]) -> Part:
    """The part ``opening`` opens, or the part refused with the reason it raised."""
    try:
        return opening()
    except errors.Refused as exc:
        return Part(name, refused=str(exc))


def _runtime(
    evidence_dir: Path,
    *,
    public_key: ed25519.Ed25519PublicKey | None,
    trusted: Sequence[trust.TrustedKey],
    root: Path,
) -> tuple[Report, Part]:
    """Copy the run's evidence files privately and verify the copy: its report and the
    part (the copies and the signer's key, the pin that vouched for it), or ``Refused``
    naming every problem (a dirty run first of all)."""
    copies: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="lab-book-") as scratch:
        # Verify a private copy and build from it: nothing can change between the check and use.
        staged = Path(scratch)
        for name, limit in _STAGED:
            source = evidence_dir / name
            if source.exists() or source.is_symlink():
                data = files.read_bytes(source, limit, name)
                (staged / name).write_bytes(data)
                copies[name] = data
        verdict = verification.verify(
            staged, public_key=public_key, trusted=trusted, check_sources=True, root=root,
        )
    if verdict.report is not None and verdict.report["dirty"] is True:
        # Said first: whatever else failed, a dirty tree is never published.
        raise errors.Refused(
            f"{evidence_dir}: the run's working tree had uncommitted changes: "
            "dirty evidence is not publishable"
        )
    if not verdict.ok or verdict.report is None:
        # Name the caller's files, not the private copy.
        problems = [p.replace(str(staged), str(evidence_dir)) for p in verdict.problems]
        problems = problems or ["no report"]
        # Every reason, on one line: the reader fixes them all at once, not one per build.
        listed = problems[0] if len(problems) == 1 else "; ".join(
            f"({n}) {problem}" for n, problem in enumerate(problems, 1))
        raise errors.Refused(verification.printable(f"{evidence_dir}: {listed}"))
    copies[compiler.PUBLIC_KEY_FILE] = _public_key(
        evidence_dir / compiler.PUBLIC_KEY_FILE, verdict.report)
    return verdict.report, Part(RUNTIME, copies, pinned_by=verdict.pinned_by)


def _public_key(path: Path, report: Report) -> bytes:
    """The signer's PEM from the signed report; a key file beside it must be the same key.

    The file beside the evidence is never a source of trust: it is only refused
    when it names another key, since the book would publish it.
    """
    pem = report["signing"]["public_key"]
    try:
        signed = dsse.load_public_key(pem.encode())
    except errors.EvidenceError as exc:
        raise errors.Refused(f"the signed report names no usable public key: {exc}") from exc
    if path.exists() or path.is_symlink():
        present = dsse.load_public_key_file(path, compiler.PUBLIC_KEY_FILE)
        if dsse.raw_public_key(present) != dsse.raw_public_key(signed):
            raise errors.Refused(
                f"{compiler.PUBLIC_KEY_FILE} is not the key that signed the evidence")
    return dsse.public_pem(signed).encode("ascii")


def _model(
    evidence_dir: Path,
    public_key: ed25519.Ed25519PublicKey | None,
    trusted: Sequence[trust.TrustedKey],
    verifier: model_evidence.ModelVerifier | None,
) -> Part:
    """``model/<name>`` of the verified model evidence, under the pin that vouched for
    *its* signer: the runtime evidence's pin never carries over to it."""
    stray = sorted(evidence_dir.glob("model-experiment*.json"))
    if stray:
        raise errors.Refused(
            f"{stray[0]}: an unsigned model report; lab model run signs its report into "
            f"{evidence_dir / model_evidence.MODEL_DIR}"
        )
    source = evidence_dir / model_evidence.MODEL_DIR
    if not source.exists():
        return Part(MODEL, absent=f"no {model_evidence.MODEL_DIR}/ beside the evidence")
    if verifier is None:
        raise errors.Refused(f"{source}: model evidence, but no model verifier was given")
    paths = sorted(source.rglob("*"))
    links = [p for p in paths if p.is_symlink()]
    if links:
        raise errors.Refused(f"{links[0]}: a symbolic link in the model evidence")
    if sum(p.stat().st_size for p in paths if p.is_file()) > MAX_MODEL_DIR_BYTES:
        raise errors.Refused(f"{source}: larger than {MAX_MODEL_DIR_BYTES} bytes")
    with tempfile.TemporaryDirectory(prefix="lab-book-model-") as scratch:
        # Verify a private copy and publish from it: nothing can change in between.
        staged = Path(scratch) / model_evidence.MODEL_DIR
        shutil.copytree(source, staged)
        verdict = verifier(staged, public_key=public_key, trusted=trusted)
        if not verdict.ok:
            more = f" (and {len(verdict.problems) - 1} more)" if len(verdict.problems) > 1 else ""
            raise errors.Refused(f"{source}: {verdict.problems[0]}{more}")
        found = {
            f"{model_evidence.MODEL_DIR}/{path.relative_to(staged).as_posix()}":
                path.read_bytes()
            for path in sorted(staged.rglob("*"))
            if path.is_file()
        }
    return Part(MODEL, found, pinned_by=verdict.pinned_by)


def _reproductions(
    evidence_dir: Path,
    envelope: bytes,
    original_keyid: str,
    trusted: Sequence[trust.TrustedKey],
) -> Part:
    """The verified reproduction of this run, when there is one: its files only when an
    independent trusted key vouches for it (``pinned_by``), else ``withheld`` and why.
    The original's ``--public-key`` never pins it: that is the original's signer."""
    found = reproduction_evidence.book_files(
        evidence_dir, envelope, original_keyid=original_keyid, trusted=trusted)
    if found is None:
        return Part(REPRODUCTIONS, absent=f"no {reproduction_evidence.BOOK_DIR}/ of this run")
    return Part(REPRODUCTIONS, found.files, pinned_by=found.reproducer,
                withheld=found.withheld)


def _crashpoints(evidence_dir: Path) -> Part:
    """The crash-point matrix beside the evidence, read and shape-checked."""
    try:
        matrix = crashmatrix.read(evidence_dir)
    except errors.InputError as exc:
        raise errors.Refused(f"{evidence_dir / crashmatrix.OUTPUT_FILE}: {exc}") from exc
    if matrix is None:
        return Part(CRASHPOINTS, absent=f"no {crashmatrix.OUTPUT_FILE} beside the evidence")
    return Part(CRASHPOINTS, {crashmatrix.OUTPUT_FILE: matrix})
