"""``lab book build``: the book's tables and figures, from verified evidence only.

The build first verifies the signed evidence (signature, trust, statement, gate,
the source files and the manifest against the working tree) on a private copy of
it, and refuses anything but a verified PASS of a clean tree. From that copy it
then writes::

    <page>.md, <page>.html  one page per source in book/ (``lab.book.pages``): the
                          landing page (verdict, provenance, how to verify, chapters),
                          a page per chapter (results table, every observation, sequence
                          figures), the crash-point matrix, the side-by-side table and
                          the model results; directives expanded from the evidence
    style.css             the site's only style sheet (no script, nothing remote)
    figures/<name>.svg    one sequence figure per experiment result with an event history
    figures/<name>.png    with --png: each figure as cairosvg draws it, labels checked legible
    evidence/             the verified runtime.json, its envelope and public key, and the
                          signed model evidence (evidence/model/) when there is one,
                          verified like the runtime's (``modelbook``), and the crash-point
                          matrix (``crashmatrix``) when present
    MANIFEST.sha256       sha256sum lines for every file above

Every output is a function of the evidence alone: no clock, sorted keys, fixed
float formats, so two builds from the same evidence are byte-identical.

The evidence is untrusted input even when it verifies (anyone can sign with a
fresh key): names that become file names are reduced to a safe alphabet, every
path is proven inside ``--out`` before anything is written, and every string from
the evidence that reaches Markdown is escaped (a code span only holds text that
needs no escaping). The signer is called a publication key only when a pin
(``--public-key`` or a committed trusted key) vouches for it; ``runtime.pub.pem``
beside the evidence is never trusted, only checked to be the signer's key. A
reproduction is shown only when a trusted key other than the original's signer vouches
for it (``reproduction_evidence.book_files``); otherwise the page says why.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import errors, files
from lab.book import drawing, figures, pages, raster
from lab.evidence import bundle, crashmatrix, dsse, model_evidence, trust
from lab.evidence.report import Report
from lab.options import option

INDEX_FILE = f"{pages.INDEX}.html"
MANIFEST_FILE = "MANIFEST.sha256"
FIGURES_DIR = pages.FIGURES_DIR
SOURCES_DIR = "book"  # the book's committed sources, in the working tree
DEFAULT_OUT = "book/_site"
EVIDENCE_DIR = "evidence"

_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
_MAX_STEM = 120  # file names stay far below the file system's 255 bytes


Refused = errors.Refused


def build(
    evidence_dir: Path,
    out: Path,
    *,
    public_key: ed25519.Ed25519PublicKey | None = None,
    trusted: Sequence[trust.TrustedKey] = (),
    root: Path | None = None,
    png: bool = False,
    sources: Path | None = None,
    model_verifier: model_evidence.ModelVerifier | None = None,
) -> list[str]:
    """Verify the evidence in ``evidence_dir``, then write the book into ``out``.

    ``public_key`` pins the signer; otherwise ``trusted`` keys may vouch for it.
    ``root`` is the working tree whose sources and manifest must still match the
    evidence (default: the current directory). ``png`` also writes
    ``figures/<name>.png`` beside each SVG (needs the ``book`` extra). ``sources`` is the
    folder of the book's source pages (default: ``<root>/book``; a chapter without a
    page, or no folder at all, gets pages of directives alone). ``model_verifier``
    verifies model evidence (``lab.model.signed.verify``, handed down by the command:
    the book does not import the model); model evidence without one is refused. The
    evidence is opened once (``lab.evidence.bundle``), and the book is written from that
    bundle alone (``from_bundle``). Returns the paths written, relative to ``out`` and
    sorted; raises ``Refused`` with a one-line reason instead.
    """
    if not evidence_dir.is_dir():
        what = "not a directory" if evidence_dir.exists() else "no such directory"
        raise errors.InputError(f"evidence {evidence_dir}: {what}")
    root = root or Path.cwd()
    # The output and the sources are checked before the evidence is verified: a wrong
    # --out is refused without the cost of a verification.
    out, texts = _destination(evidence_dir.resolve(), out, root, sources)
    opened = bundle.open_bundle(
        evidence_dir.resolve(), public_key=public_key, trusted=trusted, root=root,
        model_verifier=model_verifier,
    )
    return _write_book(opened, out, texts, root=root, png=png)


def from_bundle(
    opened: bundle.Bundle, out: Path, *, root: Path, png: bool = False,
    sources: Path | None = None,
) -> list[str]:
    """Write the book into ``out`` from ``opened``, an evidence bundle already verified
    (``lab.evidence.bundle.open_bundle``): nothing of the evidence is read again.

    ``root``, ``png`` and ``sources`` as for ``build``; a part of the bundle that was
    refused refuses the book. Returns the paths written, relative to ``out`` and sorted.
    """
    out, texts = _destination(opened.directory.resolve(), out, root, sources)
    return _write_book(opened, out, texts, root=root, png=png)


def _destination(
    evidence_dir: Path, out: Path, root: Path, sources: Path | None
) -> tuple[Path, dict[str, str]]:
    """``out`` resolved and the book's source pages, once ``out`` is proven to overwrite
    neither the evidence nor the sources; ``Refused`` naming which otherwise."""
    out = out.resolve()
    if evidence_dir in (out, out / EVIDENCE_DIR):
        raise Refused(f"--out {out} would overwrite the evidence it is built from")
    sources = (sources or root / SOURCES_DIR).resolve()
    if out == sources:
        raise Refused(f"--out {out} would overwrite the book's sources: build into "
                      f"{DEFAULT_OUT} or another folder")
    return out, pages.load_sources(sources)


def _write_book(
    opened: bundle.Bundle, out: Path, texts: Mapping[str, str], *, root: Path, png: bool
) -> list[str]:
    """Render every page and figure from the verified ``opened`` and write them into
    ``out`` with the verified evidence beside them; the paths written, sorted."""
    if opened.refusals:
        raise Refused(opened.refusals[0])
    report = opened.report
    copies = {f"{EVIDENCE_DIR}/{name}": data for name, data in opened.verified_files.items()}
    files_out = dict(copies)
    reproduced = opened.part(bundle.REPRODUCTIONS)
    files_out.update(_render(report, copies, pinned_by=opened.pinned_by,
                             model_pinned_by=opened.part(bundle.MODEL).pinned_by,
                             reproduction=(reproduced.pinned_by, reproduced.withheld),
                             sources=texts, png=png,
                             code=experiment_sources(report, root)))
    if png:
        files_out.update(raster.pngs(files_out))
    files.write_tree(out, files_out, manifest=MANIFEST_FILE,
                     emptied=(FIGURES_DIR, EVIDENCE_DIR), what="previous book manifest")
    return sorted(files_out)


# --------------------------------------------------------------------------- rendering


def _render(
    report: Report,
    copies: Mapping[str, bytes],
    *,
    pinned_by: str | None,
    sources: Mapping[str, str],
    png: bool,
    model_pinned_by: str | None = None,
    reproduction: tuple[str | None, str | None] = (None, None),
    code: Mapping[str, str] | None = None,
) -> dict[str, bytes]:
    """Every page (Markdown and HTML), the style sheet and every figure, as
    ``{relative path: bytes}``."""
    tests = [t for t in report["tests"] if t["experiment"]]
    names = figure_names(tests)
    rendered: dict[str, bytes] = {}
    paths: dict[str, str] = {}
    for test in tests:
        nodeid = test["nodeid"]
        if nodeid not in names:
            continue
        figure = figures.sequence(test["events"], test["timeline"])
        path = f"{FIGURES_DIR}/{names[nodeid]}.svg"
        rendered[path] = drawing.svg(figure, pages.test_title(test), test["claim"]).encode()
        paths[str(nodeid)] = path
    evidence = pages.Evidence(
        report=report,
        copies=copies,
        pinned_by=pinned_by,
        figure_paths=paths,
        png=png,
        matrix=copies.get(f"{EVIDENCE_DIR}/{crashmatrix.OUTPUT_FILE}"),
        model_pinned_by=model_pinned_by,
        reproduction_by=reproduction[0],
        reproduction_withheld=reproduction[1],
        sources=code or {},
    )
    rendered.update(pages.build(sources, evidence))
    return rendered


def experiment_sources(report: Report, root: Path) -> dict[str, str]:
    """``{path: text}`` of each experiment's test file whose bytes under ``root`` are the
    ones the signed report's digest names: the book shows no code but the hashed source."""
    found: dict[str, str] = {}
    signed = report.get("sources") or {}
    for test in report["tests"]:
        path = str(test["nodeid"]).split("::", 1)[0]
        digest = signed.get(path)
        if path in found or not isinstance(digest, str):
            continue
        base = root.resolve()
        target = (base / path).resolve()
        if (os.path.isabs(path) or ".." in Path(path).parts or "\0" in path
                or not target.is_relative_to(base) or not target.is_file()):
            continue
        data = files.read_bytes(target, files.SOURCE_LIMIT, f"source {path}")
        if hashlib.sha256(data).hexdigest() == digest:
            found[path] = data.decode("utf-8", "replace")
    return found


def _safe(text: str) -> str:
    """A file-name component: a safe alphabet, no leading dot, bounded length."""
    return _SAFE_NAME.sub("_", text).lstrip(".")[:_MAX_STEM] or "_"


def figure_names(tests: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """``{nodeid: file stem}`` for every test with an event history.

    ``<experiment>`` alone, ``<experiment>--<parameter id>`` for a parametrised result,
    prefixed with ``<chapter>--`` when two chapters share an experiment name. Every
    part is reduced to ``[A-Za-z0-9_.-]`` without a leading dot: a name from the
    evidence can never become a path.
    """
    chapters: dict[str, set[str]] = {}
    for test in tests:
        chapters.setdefault(str(test["experiment"]), set()).add(str(test["chapter"]))
    names: dict[str, str] = {}
    taken: set[str] = set()
    for test in sorted(tests, key=lambda t: str(t["nodeid"])):
        if not test.get("events"):
            continue
        experiment = str(test["experiment"])
        stem = _safe(experiment)
        if len(chapters[experiment]) > 1:
            stem = f"{_safe(str(test['chapter']))}--{stem}"
        param = _param(str(test["nodeid"]))
        if param is not None:
            stem = f"{stem}--{_safe(param)}"
        stem = stem[: 2 * _MAX_STEM]
        unique, n = stem, 1
        while unique in taken:
            n += 1
            unique = f"{stem}-{n}"
        taken.add(unique)
        names[str(test["nodeid"])] = unique
    return names


def _param(nodeid: str) -> str | None:
    name = nodeid.rsplit("::", 1)[-1]
    if "[" in name and name.endswith("]"):
        return name.split("[", 1)[1][:-1]
    return None


# --------------------------------------------------------------------------- command


@dataclass(frozen=True)
class BuildOptions:
    """What ``lab book build`` is asked to do: its flags, declared here."""

    evidence: str = option(EVIDENCE_DIR, help="the verified evidence to draw from")
    out: str = option(DEFAULT_OUT,
                      help="output folder (default book/_site; book/ holds the sources)")
    public_key: str | None = option(
        None, help="PEM of the expected signer (the only key accepted)")
    png: bool = option(False, help="also write a PNG beside each SVG figure (the book extra)")


def cli_main(
    options: BuildOptions, *, model_verifier: model_evidence.ModelVerifier | None = None
) -> int:
    """``lab book build``: 0 when the book was written; a refusal is raised as ``Refused``.

    The signer is pinned by ``--public-key`` when given, else trusted when it is one of
    the publication keys (``keys/trusted/*.pub.pem`` at the default branch's tip,
    ``LAB_TRUSTED_KEYS``); a key under ``keys/revoked/`` there is refused either way.
    """
    root = Path.cwd()
    pinned: ed25519.Ed25519PublicKey | None = None
    if options.public_key:
        pinned = dsse.load_public_key_file(Path(options.public_key), "--public-key")
    # Always the default branch's keys and revocations: a revoked key is refused even
    # as --public-key, and a reproduction is vouched for by a trusted key, never the pin.
    trusted = trust.trusted_keys(root)
    out = Path(options.out)
    try:
        written = build(
            Path(options.evidence), out, public_key=pinned, trusted=trusted, root=root,
            png=options.png, model_verifier=model_verifier,
        )
    except OSError as exc:
        raise Refused(f"{exc.filename or options.out}: {exc.strerror or exc}") from exc
    figures_count = sum(1 for name in written
                        if name.startswith(f"{FIGURES_DIR}/") and name.endswith(".svg"))
    page_count = sum(1 for name in written if "/" not in name and name.endswith(".html"))
    print(
        f"wrote {len(written)} files to {options.out} ({page_count} pages, {figures_count} "
        f"figures; open {out / INDEX_FILE}); digests in {out / MANIFEST_FILE}"
    )
    return 0
