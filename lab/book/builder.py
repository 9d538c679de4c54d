"""``lab book build``: the book's tables and figures, from verified evidence only.

The build first verifies the signed evidence (signature, trust, statement, gate,
the source files and the manifest against the working tree) on a private copy of
it, and refuses anything but a verified PASS of a clean tree. From that copy it
then writes::

    experiments.md        per chapter: claim, result, duration and key observations of
                          each experiment, its sequence figures (Mermaid), the run's
                          provenance and the lab's stated limits
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
beside the evidence is never trusted, only checked to be the signer's key.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import errors, files
from lab.book import crashpoint_chapter, figures, model_chapter, sidebyside
from lab.evidence import compiler, dsse, hermetic, verification
from lab.evidence.report import Report
from lab.faults import crashmatrix

MARKDOWN_FILE = "experiments.md"
MANIFEST_FILE = "MANIFEST.sha256"
FIGURES_DIR = "figures"
EVIDENCE_DIR = "evidence"

_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
_MAX_STEM = 120  # file names stay far below the file system's 255 bytes
# Text that may stand in a Markdown code span as it is: nothing to escape, no backtick.
_CODE_SAFE = re.compile(r"[A-Za-z0-9_.:/=@+,%~#() -]{1,300}")
_STAGED = (
    (compiler.REPORT_FILE, files.REPORT_LIMIT),
    (compiler.ENVELOPE_FILE, files.ENVELOPE_LIMIT),
    (compiler.TESTS_FILE, files.TESTS_LOG_LIMIT),
)


Refused = errors.Refused


def build(
    evidence_dir: Path,
    out: Path,
    *,
    public_key: ed25519.Ed25519PublicKey | None = None,
    trusted: Sequence[verification.TrustedKey] = (),
    root: Path | None = None,
    png: bool = False,
) -> list[str]:
    """Verify the evidence in ``evidence_dir``, then write the book into ``out``.

    ``public_key`` pins the signer; otherwise ``trusted`` keys may vouch for it.
    ``root`` is the working tree whose sources and manifest must still match the
    evidence (default: the current directory). ``png`` also writes
    ``figures/<name>.png`` beside each SVG (needs the ``book`` extra). Returns the
    paths written, relative to ``out`` and sorted; raises ``Refused`` with a one-line
    reason instead.
    """
    if not evidence_dir.is_dir():
        what = "not a directory" if evidence_dir.exists() else "no such directory"
        raise errors.InputError(f"evidence {evidence_dir}: {what}")
    evidence_dir, out = evidence_dir.resolve(), out.resolve()
    if evidence_dir in (out, out / EVIDENCE_DIR):
        raise Refused(f"--out {out} would overwrite the evidence it is built from")
    copies: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="lab-book-") as scratch:
        # Verify a private copy and build from it: nothing can change between the check and use.
        staged = Path(scratch)
        for name, limit in _STAGED:
            source = evidence_dir / name
            if source.exists() or source.is_symlink():
                data = files.read_bytes(source, limit, name)
                (staged / name).write_bytes(data)
                copies[f"{EVIDENCE_DIR}/{name}"] = data
        verdict = verification.verify(
            staged,
            public_key=public_key,
            trusted=trusted,
            check_sources=True,
            root=root or Path.cwd(),
        )
    if verdict.report is not None and verdict.report["dirty"] is True:
        # Said first: whatever else failed, a dirty tree is never published.
        raise Refused(
            f"{evidence_dir}: the run's working tree had uncommitted changes: "
            "dirty evidence is not publishable"
        )
    if not verdict.ok or verdict.report is None:
        # Name the caller's files, not the private copy.
        problems = [p.replace(str(staged), str(evidence_dir)) for p in verdict.problems]
        problems = problems or ["no report"]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise Refused(verification.printable(f"{evidence_dir}: {problems[0]}{more}"))
    report = verdict.report
    copies[f"{EVIDENCE_DIR}/{compiler.PUBLIC_KEY_FILE}"] = _public_key(
        evidence_dir / compiler.PUBLIC_KEY_FILE, report
    )
    model_files, model_pinned_by = model_chapter.verified_files(
        evidence_dir, public_key=public_key, trusted=trusted
    )
    for name, data in model_files.items():
        copies[f"{EVIDENCE_DIR}/{name}"] = data
    try:
        matrix = crashmatrix.read(evidence_dir)
    except errors.InputError as exc:
        raise Refused(f"{evidence_dir / crashmatrix.OUTPUT_FILE}: {exc}") from exc
    if matrix is not None:
        copies[f"{EVIDENCE_DIR}/{crashmatrix.OUTPUT_FILE}"] = matrix
    files_out = dict(copies)
    files_out.update(_render(report, copies, pinned_by=verdict.pinned_by,
                             model_pinned_by=model_pinned_by))
    if png:
        files_out.update(figures.pngs(files_out))
    _write(out, files_out)
    return sorted(files_out)


def _public_key(path: Path, report: Report) -> bytes:
    """The signer's PEM from the signed report; a key file beside it must be the same key.

    The file beside the evidence is never a source of trust: it is only refused
    when it names another key, since the book would publish it.
    """
    pem = report["signing"]["public_key"]
    try:
        signed = dsse.load_public_key(pem.encode())
    except errors.EvidenceError as exc:
        raise Refused(f"the signed report names no usable public key: {exc}") from exc
    if path.exists() or path.is_symlink():
        present = verification.load_public_key_file(path, compiler.PUBLIC_KEY_FILE)
        if dsse.raw_public_key(present) != dsse.raw_public_key(signed):
            raise Refused(f"{compiler.PUBLIC_KEY_FILE} is not the key that signed the evidence")
    return dsse.public_pem(signed).encode("ascii")


def _inside(out: Path, name: str) -> Path:
    """``out / name``, proven to stay inside ``out`` once symbolic links are resolved."""
    target = out / name
    resolved = target.resolve()
    if os.path.isabs(name) or ".." in Path(name).parts or not resolved.is_relative_to(out):
        raise Refused(f"{name!r} would be written outside --out {out}")
    return target


def _write(out: Path, files_out: Mapping[str, bytes]) -> None:
    """Remove what the previous build wrote (per its manifest), then write ``files_out``.

    Every target is proven inside ``out`` before anything is removed or written.
    """
    targets = {name: _inside(out, name) for name in sorted(files_out)}
    _inside(out, MANIFEST_FILE)
    manifest = out / MANIFEST_FILE
    if manifest.is_file():
        old = files.read_bytes(manifest, files.MANIFEST_LIMIT, "previous book manifest")
        for line in old.decode("utf-8", "replace").splitlines():
            _, _, name = line.partition("  ")
            target = (out / name).resolve()
            if name and target.is_relative_to(out) and target.is_file():
                target.unlink()
    for directory in (out / FIGURES_DIR, out / EVIDENCE_DIR):
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
    for name, data in sorted(files_out.items()):
        path = targets[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        _inside(out, name)  # a directory made above cannot lead outside either
        path.write_bytes(data)
    lines = [
        f"{hashlib.sha256(data).hexdigest()}  {name}\n"
        for name, data in sorted(files_out.items())
    ]
    manifest.write_text("".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------- rendering


def _render(
    report: Report,
    copies: Mapping[str, bytes],
    *,
    pinned_by: str | None,
    model_pinned_by: str | None = None,
) -> dict[str, bytes]:
    """experiments.md and every figure, as ``{relative path: bytes}``."""
    tests = [t for t in report["tests"] if t["experiment"]]
    names = figure_names(tests)
    rendered: dict[str, bytes] = {}
    figures_md: dict[tuple[str, str], list[str]] = {}
    for test in tests:
        nodeid = test["nodeid"]
        if nodeid not in names:
            continue
        figure = figures.sequence(test["events"], test["timeline"])
        path = f"{FIGURES_DIR}/{names[nodeid]}.svg"
        title = _title(test)
        rendered[path] = figures.svg(figure, title, test["claim"]).encode()
        key = (str(test["chapter"]), str(test["experiment"]))
        figures_md.setdefault(key, []).append(_figure_section(test, title, path, figure))
    lines = _header(report, copies, pinned_by=pinned_by)
    for chapter, rows in _chapters(report):
        lines += [f"## {_md(chapter)}", ""]
        lines += [
            "| Experiment | Claim | Result | Duration | Key observations |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row in rows:
            lines.append(_table_row(row, tests))
        lines.append("")
        for row in rows:
            for section in figures_md.get((chapter, row["name"]), []):
                lines.append(section)
    matrix = copies.get(f"{EVIDENCE_DIR}/{crashmatrix.OUTPUT_FILE}")
    matrix_lines, matrix_figures = crashpoint_chapter.book_section(report, matrix, FIGURES_DIR)
    lines += matrix_lines
    rendered.update(matrix_figures)
    lines += sidebyside.section(report, _md)
    model_lines, model_figures = model_chapter.section(
        copies, f"{EVIDENCE_DIR}/", pinned=model_pinned_by is not None
    )
    lines += model_lines
    rendered.update(model_figures)
    lines += ["## Limits", ""]
    lines += [f"- {_md(limit)}" for limit in report["limits"]]
    rendered[MARKDOWN_FILE] = ("\n".join(lines).rstrip("\n") + "\n").encode()
    return rendered


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


def _title(test: Mapping[str, Any]) -> str:
    param = _param(str(test["nodeid"]))
    return f"{test['experiment']}[{param}]" if param is not None else str(test["experiment"])


def _chapters(report: Report) -> list[tuple[str, list[Any]]]:
    """Experiment rows grouped by chapter, chapters sorted, rows in manifest order."""
    grouped: dict[str, list[Any]] = {}
    for row in report["experiments"]:
        grouped.setdefault(row["chapter"], []).append(row)
    return sorted(grouped.items())


def _run_kind_note(report: Report) -> str:
    """Hermetic or local, as the verifier judges the report's ``run`` facts."""
    if verification.run_kind(report) == hermetic.HERMETIC:
        run: Any = report.get("run") or {}
        lock: Any = run.get("lock") or {}
        return (f"**hermetic** (a fresh clone of the commit, the locked environment "
                f"{_code(str(lock.get('path')))} sha256 `{_md(str(lock.get('sha256')))}`, "
                "an allowlisted environment, isolated interpreters)")
    return ("**local** (run in an author's working tree and environment: not publishable; "
            "`lab publish` runs hermetically)")


def _header(report: Report, copies: Mapping[str, bytes], *, pinned_by: str | None) -> list[str]:
    signing = report["signing"]
    database = report["postgresql"] or {}
    commit = report["commit"] or "unknown"
    dirty = report["dirty"]
    if dirty is True:
        tree = "the working tree had uncommitted changes"
    elif dirty is False:
        tree = "clean working tree"
    else:
        tree = "working tree state unknown"
    if pinned_by is not None:
        # A pin vouches for the signer; what the report says about its key is not asked.
        key_note = f"a publication key, pinned by {_code(pinned_by)}"
        verified = f"against the pinned public key ({_code(pinned_by)})"
    else:
        # Unpinned: whatever ``key_source`` claims, this key proves integrity only.
        key_note = (
            "an **ephemeral** key: it proves the evidence was not altered after signing, "
            "not who produced it"
        )
        verified = "with the public key the evidence carries (UNPINNED: integrity, not identity)"
    details = database.get("details") or {}
    detail_text = ", ".join(f"{k} {_value(v)}" for k, v in sorted(details.items()))
    versions = ", ".join(
        f"{name} {version}" for name, version in sorted(report["versions"].items())
    )
    lines = [
        "# Experiments",
        "",
        "Built by `lab book build` from signed evidence that verified: its signature, its",
        "gate verdict and the digests of the source files it covers. Do not edit; rebuild.",
        "",
        "## Provenance",
        "",
        f"- Gate: **{report['status']}**: every declared experiment ran and passed "
        "against a real PostgreSQL server, nothing skipped, nothing narrowed.",
        f"- Commit: {_code(commit)} ({tree}).",
        f"- Kind of run: {_run_kind_note(report)}.",
        f"- Run finished: {_md(report['timestamp_utc'])} (UTC).",
    ]
    if report["run_url"]:
        lines.append(f"- Run: {_md(report['run_url'])}")
    lines += [
        f"- PostgreSQL: {_md(str(database.get('server_version')))}, provided by "
        f"{_code(str(database.get('provider')))}"
        + (f" ({_md(detail_text)})." if detail_text else "."),
        f"- Signer: key id {_code(signing['keyid'])}, {key_note}.",
        f"- Verified: the signature {verified}; every source file matches its signed digest.",
        f"- Versions: {_md(versions)}.",
        f"- Command: {_code(' '.join(report['command']))}.",
        "- Evidence files (copies under `evidence/`):",
    ]
    for name, data in sorted(copies.items()):
        lines.append(f"  - {_code(name)} sha256 `{hashlib.sha256(data).hexdigest()}`")
    lines += [
        "",
        "Figures: arrows and notes in time order across the experiment, each worker process,",
        "PostgreSQL and the credit tool. Times are seconds since the experiment started",
        "(events on PostgreSQL's clock, process marks on the experiment's clock); they and",
        "the trace ids differ between runs. Which process wrote an event is inferred from",
        "the claim's owner and fence, or from the only worker process alive at the time.",
        "",
    ]
    return lines


def _table_row(row: Mapping[str, Any], tests: Sequence[Mapping[str, Any]]) -> str:
    members = set(row["tests"])
    ran = sorted((t for t in tests if t["nodeid"] in members), key=lambda t: str(t["nodeid"]))
    results = int(row["results"])
    outcome = _md(str(row["outcome"]))
    result = outcome if results == 1 else f"{outcome} ({results} results)"
    observed: list[str] = []
    for test in ran:
        param = _param(str(test["nodeid"]))
        for observation in test["observations"]:
            text = _md(_observation(observation))
            observed.append(f"[{_md(param)}] {text}" if param is not None else text)
    cells = [
        _code(str(row["name"])),
        _md(str(row["claim"] or "")),
        result,
        f"{float(row['duration']):.2f} s",
        "<br>".join(observed),
    ]
    return "| " + " | ".join(cells) + " |"


def _figure_section(
    test: Mapping[str, Any], title: str, path: str, figure: figures.Figure
) -> str:
    traces = ", ".join(_code(t) for t in test["trace_ids"])
    alt = _md(title)
    lines = [
        f"### Sequence: {_code(title)}",
        "",
        _md(str(test["claim"] or "")),
        "",
        f"![Sequence of {alt}]({path})",
        "",
        "```mermaid",
        figures.mermaid(figure).rstrip("\n"),
        "```",
        "",
    ]
    if traces:
        lines += [f"Trace ids: {traces}", ""]
    return "\n".join(lines)


def _observation(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_value(v)}" for k, v in sorted(value.items()))
    return _value(value)


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


_MD_SPECIAL = re.compile(r"([\\`*\[\]!])")


def _md(text: str) -> str:
    """Evidence text made inert in Markdown (and HTML): one line, entities for ``& < >``,
    backslash escapes for the characters that start markup (code, emphasis, links,
    images), and no table-breaking pipe."""
    text = " ".join(text.split())
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = text.replace('"', "&quot;")
    text = _MD_SPECIAL.sub(r"\\\1", text)
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    """A code span when ``text`` needs no escaping at all, else the escaped plain text."""
    return f"`{text}`" if _CODE_SAFE.fullmatch(text) else _md(text)


# --------------------------------------------------------------------------- command


def cli_main(args: argparse.Namespace) -> int:
    """``lab book build``: 0 when the book was written; a refusal is raised as ``Refused``.

    The signer is pinned by ``--public-key`` when given, else trusted when it is one of
    the committed publication keys (``keys/trusted/*.pub.pem``, ``LAB_TRUSTED_KEYS``).
    """
    root = Path.cwd()
    pinned: ed25519.Ed25519PublicKey | None = None
    if args.public_key:
        pinned = verification.load_public_key_file(Path(args.public_key), "--public-key")
    trusted = [] if pinned is not None else verification.trusted_keys(root)
    try:
        written = build(
            Path(args.evidence), Path(args.out), public_key=pinned, trusted=trusted, root=root,
            png=bool(getattr(args, "png", False)),
        )
    except OSError as exc:
        raise Refused(f"{exc.filename or args.out}: {exc.strerror or exc}") from exc
    figures_count = sum(1 for name in written
                        if name.startswith(f"{FIGURES_DIR}/") and name.endswith(".svg"))
    print(
        f"wrote {len(written)} files to {args.out} ({figures_count} figures); "
        f"digests in {Path(args.out) / MANIFEST_FILE}"
    )
    return 0
