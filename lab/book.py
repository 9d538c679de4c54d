"""``lab book build``: the book's tables and figures, from verified evidence only.

The build first verifies the signed evidence (signature, statement, gate and
the source files against the working tree) on a private copy of it, and
refuses anything but a verified PASS. From that copy it then writes::

    experiments.md        per chapter: claim, result, duration and key observations of
                          each experiment, its sequence figures (Mermaid), the run's
                          provenance and the lab's stated limits
    figures/<name>.svg    one sequence figure per experiment result with an event history
    figures/<name>.png    with --png: each figure as cairosvg draws it, labels checked legible
    evidence/             the verified runtime.json, its envelope and public key, and the
                          model experiment report when there is one
    MANIFEST.sha256       sha256sum lines for every file above

Every output is a function of the evidence alone: no clock, sorted keys, fixed
float formats, so two builds from the same evidence are byte-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import dsse, errors, evidence, figures, sidebyside, verification

MARKDOWN_FILE = "experiments.md"
MANIFEST_FILE = "MANIFEST.sha256"
FIGURES_DIR = "figures"
EVIDENCE_DIR = "evidence"
MODEL_REPORT = "model-experiment.json"
MODEL_PATTERN = "model-experiment*.json"

_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


Refused = errors.Refused


def build(
    evidence_dir: Path,
    out: Path,
    *,
    public_key: ed25519.Ed25519PublicKey | None = None,
    root: Path | None = None,
    png: bool = False,
) -> list[str]:
    """Verify the evidence in ``evidence_dir``, then write the book into ``out``.

    ``root`` is the working tree whose sources must still match the evidence
    (default: the current directory). ``png`` also writes ``figures/<name>.png``
    beside each SVG (needs the ``book`` extra). Returns the paths written, relative to
    ``out`` and sorted; raises ``Refused`` with a one-line reason instead.
    """
    evidence_dir, out = evidence_dir.resolve(), out.resolve()
    if evidence_dir in (out, out / EVIDENCE_DIR):
        raise Refused(f"--out {out} would overwrite the evidence it is built from")
    with tempfile.TemporaryDirectory(prefix="lab-book-") as scratch:
        # Verify a private copy and build from it: nothing can change between the check and use.
        staged = Path(scratch)
        for name in (evidence.REPORT_FILE, evidence.ENVELOPE_FILE, evidence.PUBLIC_KEY_FILE):
            if (evidence_dir / name).is_file():
                shutil.copyfile(evidence_dir / name, staged / name)
        verdict = verification.verify(
            staged, public_key=public_key, check_sources=True, root=root or Path.cwd()
        )
        if not verdict.ok or verdict.report is None:
            # Name the caller's files, not the private copy.
            problems = [p.replace(str(staged), str(evidence_dir)) for p in verdict.problems]
            problems = problems or ["no report"]
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise Refused(f"{evidence_dir}: {problems[0]}{more}")
        report = verdict.report
        files = {
            f"{EVIDENCE_DIR}/{evidence.REPORT_FILE}": (staged / evidence.REPORT_FILE).read_bytes(),
            f"{EVIDENCE_DIR}/{evidence.ENVELOPE_FILE}": (
                staged / evidence.ENVELOPE_FILE
            ).read_bytes(),
            f"{EVIDENCE_DIR}/{evidence.PUBLIC_KEY_FILE}": _public_key(
                staged / evidence.PUBLIC_KEY_FILE, report
            ),
        }
    for name, data in _model_reports(evidence_dir, out).items():
        files[f"{EVIDENCE_DIR}/{name}"] = data
    pinned = public_key is not None
    files.update(_render(report, files, pinned=pinned))
    if png:
        files.update(figures.pngs(files))
    _write(out, files)
    return sorted(files)


def _public_key(path: Path, report: Mapping[str, Any]) -> bytes:
    """The signer's PEM from the signed report; a key file beside it must be the same key."""
    pem = str(report.get("signing", {}).get("public_key", ""))
    try:
        signed = dsse.load_public_key(pem.encode())
    except errors.EvidenceError as exc:
        raise Refused(f"the signed report names no usable public key: {exc}") from exc
    if path.is_file():
        try:
            present = dsse.load_public_key(path.read_bytes())
        except errors.EvidenceError as exc:
            raise Refused(f"{evidence.PUBLIC_KEY_FILE}: {exc}") from exc
        if dsse.raw_public_key(present) != dsse.raw_public_key(signed):
            raise Refused(f"{evidence.PUBLIC_KEY_FILE} is not the key that signed the evidence")
    return pem.encode("ascii")


def _model_reports(evidence_dir: Path, out: Path) -> dict[str, bytes]:
    """Model experiment reports beside the evidence, else ``<out>/model-experiment.json``."""
    found = {path.name: path for path in sorted(evidence_dir.glob(MODEL_PATTERN))}
    if not found and (out / MODEL_REPORT).is_file():
        found[MODEL_REPORT] = out / MODEL_REPORT
    reports: dict[str, bytes] = {}
    for name, path in sorted(found.items()):
        data = path.read_bytes()
        try:
            parsed = json.loads(data)
        except ValueError as exc:
            raise Refused(f"{path}: not a JSON model experiment report ({exc})") from exc
        if not isinstance(parsed, dict):
            raise Refused(f"{path}: not a JSON model experiment report")
        reports[name] = data
    return reports


def _write(out: Path, files: Mapping[str, bytes]) -> None:
    """Remove what the previous build wrote (per its manifest), then write ``files``."""
    manifest = out / MANIFEST_FILE
    if manifest.is_file():
        for line in manifest.read_text(encoding="utf-8").splitlines():
            _, _, name = line.partition("  ")
            target = (out / name).resolve()
            if name and target.is_relative_to(out) and target.is_file():
                target.unlink()
    for directory in (out / FIGURES_DIR, out / EVIDENCE_DIR):
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
    for name, data in sorted(files.items()):
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    lines = [
        f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in sorted(files.items())
    ]
    manifest.write_text("".join(lines), encoding="utf-8")


# --------------------------------------------------------------------------- rendering


def _render(
    report: Mapping[str, Any], copies: Mapping[str, bytes], *, pinned: bool
) -> dict[str, bytes]:
    """experiments.md and every figure, as ``{relative path: bytes}``."""
    tests = [t for t in report.get("tests", []) if t.get("experiment")]
    names = figure_names(tests)
    rendered: dict[str, bytes] = {}
    figures_md: dict[tuple[str, str], list[str]] = {}
    for test in tests:
        nodeid = str(test["nodeid"])
        if nodeid not in names:
            continue
        figure = figures.sequence(test.get("events") or [], test.get("timeline") or [])
        path = f"{FIGURES_DIR}/{names[nodeid]}.svg"
        title = _title(test)
        rendered[path] = figures.svg(figure, title, test.get("claim")).encode()
        key = (str(test["chapter"]), str(test["experiment"]))
        figures_md.setdefault(key, []).append(_figure_section(test, title, path, figure))
    lines = _header(report, copies, pinned=pinned)
    for chapter, rows in _chapters(report):
        lines += [f"## {chapter}", ""]
        lines += [
            "| Experiment | Claim | Result | Duration | Key observations |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row in rows:
            lines.append(_table_row(row, tests))
        lines.append("")
        for row in rows:
            for section in figures_md.get((chapter, str(row["name"])), []):
                lines.append(section)
    lines += sidebyside.section(report, _md)
    lines += _model_section(copies)
    lines += ["## Limits", ""]
    lines += [f"- {_md(str(limit))}" for limit in report.get("limits", [])]
    rendered[MARKDOWN_FILE] = ("\n".join(lines).rstrip("\n") + "\n").encode()
    return rendered


def figure_names(tests: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """``{nodeid: file stem}`` for every test with an event history.

    ``<experiment>`` alone, ``<experiment>--<parameter id>`` for a parametrised result,
    prefixed with ``<chapter>--`` when two chapters share an experiment name.
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
        stem = experiment
        if len(chapters[experiment]) > 1:
            stem = f"{test['chapter']}--{stem}"
        param = _param(str(test["nodeid"]))
        if param is not None:
            stem = f"{stem}--{_SAFE_NAME.sub('_', param) or '_'}"
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


def _chapters(report: Mapping[str, Any]) -> list[tuple[str, list[Mapping[str, Any]]]]:
    """Experiment rows grouped by chapter, chapters sorted, rows in manifest order."""
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for row in report.get("experiments", []):
        grouped.setdefault(str(row["chapter"]), []).append(row)
    return sorted(grouped.items())


def _header(
    report: Mapping[str, Any], copies: Mapping[str, bytes], *, pinned: bool
) -> list[str]:
    signing = report.get("signing", {})
    database = report.get("postgresql") or {}
    ephemeral = signing.get("key_source") == "ephemeral"
    commit = report.get("commit") or "unknown"
    dirty = report.get("dirty")
    if dirty is True:
        tree = "the working tree had uncommitted changes"
    elif dirty is False:
        tree = "clean working tree"
    else:
        tree = "working tree state unknown"
    if ephemeral:
        key_note = (
            "an **ephemeral** key: it proves the evidence was not altered after signing, "
            "not who produced it"
        )
    else:
        key_note = f"a publication key ({dsse.KEY_ENV})"
    verified = (
        "against the pinned public key (--public-key)"
        if pinned
        else "with the public key the evidence carries (integrity, not identity)"
    )
    details = database.get("details") or {}
    detail_text = ", ".join(f"{k} {_value(v)}" for k, v in sorted(details.items()))
    versions = ", ".join(
        f"{name} {version}" for name, version in sorted((report.get("versions") or {}).items())
    )
    lines = [
        "# Experiments",
        "",
        "Built by `lab book build` from signed evidence that verified: its signature, its",
        "gate verdict and the digests of the source files it covers. Do not edit; rebuild.",
        "",
        "## Provenance",
        "",
        f"- Gate: **{report.get('status')}**: every declared experiment ran and passed "
        "against a real PostgreSQL server, nothing skipped, nothing narrowed.",
        f"- Commit: `{commit}` ({tree}).",
        f"- Run finished: {report.get('timestamp_utc')} (UTC).",
    ]
    if report.get("run_url"):
        lines.append(f"- Run: {report['run_url']}")
    lines += [
        f"- PostgreSQL: {_md(str(database.get('server_version')))}, provided by "
        f"`{database.get('provider')}`" + (f" ({_md(detail_text)})." if detail_text else "."),
        f"- Signer: key id `{signing.get('keyid')}`, {key_note}.",
        f"- Verified: the signature {verified}; every source file matches its signed digest.",
        f"- Versions: {_md(versions)}.",
        f"- Command: `{' '.join(str(a) for a in report.get('command') or [])}`.",
        "- Evidence files (copies under `evidence/`):",
    ]
    for name, data in sorted(copies.items()):
        lines.append(f"  - `{name}` sha256 `{hashlib.sha256(data).hexdigest()}`")
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
    ran = [t for t in tests if t["nodeid"] in set(row.get("tests", []))]
    ran.sort(key=lambda t: str(t["nodeid"]))
    results = int(row.get("results", 0))
    outcome = str(row.get("outcome"))
    result = outcome if results == 1 else f"{outcome} ({results} results)"
    observed: list[str] = []
    for test in ran:
        param = _param(str(test["nodeid"]))
        for observation in test.get("observations", []):
            text = _observation(observation)
            observed.append(f"[{param}] {text}" if param is not None else text)
    cells = [
        f"`{row['name']}`",
        _md(str(row.get("claim") or "")),
        result,
        f"{float(row.get('duration') or 0.0):.2f} s",
        "<br>".join(_md(o) for o in observed),
    ]
    return "| " + " | ".join(cells) + " |"


def _figure_section(
    test: Mapping[str, Any], title: str, path: str, figure: figures.Figure
) -> str:
    traces = ", ".join(f"`{t}`" for t in test.get("trace_ids", []))
    alt = _md(title).replace("[", "\\[").replace("]", "\\]")
    lines = [
        f"### Sequence: `{title}`",
        "",
        _md(str(test.get("claim") or "")),
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


def _model_section(copies: Mapping[str, bytes]) -> list[str]:
    names = sorted(n for n in copies if Path(n).name.startswith("model-experiment"))
    if not names:
        return []
    lines = [
        "## Model experiment",
        "",
        "Copied beside the evidence; the run's signature does not cover it.",
        "",
    ]
    for name in names:
        report = json.loads(copies[name])
        model = report.get("model", "unknown model")
        digest = report.get("model_sha256", "unknown")
        lines.append(f"- `{name}`: {_md(str(model))} (model sha256 `{digest}`)")
        summary = report.get("summary")
        if isinstance(summary, dict):
            for mode, counts in sorted(summary.items()):
                if isinstance(counts, dict):
                    text = ", ".join(f"{k} {_value(v)}" for k, v in sorted(counts.items()))
                    lines.append(f"  - {_md(str(mode))}: {_md(text)}")
    return [*lines, ""]


def _observation(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_value(v)}" for k, v in sorted(value.items()))
    return _value(value)


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _md(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, no pipes, no markup."""
    text = " ".join(text.split())
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace(
        "|", "\\|"
    )


# --------------------------------------------------------------------------- command


def cli_main(args: argparse.Namespace) -> int:
    """``lab book build``: 0 when the book was written; a refusal is raised as ``Refused``."""
    pinned: ed25519.Ed25519PublicKey | None = None
    if args.public_key:
        try:
            pinned = dsse.load_public_key(Path(args.public_key).read_bytes())
        except (OSError, errors.EvidenceError) as exc:
            raise Refused(f"cannot use --public-key {args.public_key}: {exc}") from exc
    try:
        written = build(
            Path(args.evidence), Path(args.out), public_key=pinned,
            png=bool(getattr(args, "png", False)),
        )
    except OSError as exc:
        raise Refused(str(exc)) from exc
    figures_count = sum(1 for name in written
                        if name.startswith(f"{FIGURES_DIR}/") and name.endswith(".svg"))
    print(
        f"wrote {len(written)} files to {args.out} ({figures_count} figures); "
        f"digests in {Path(args.out) / MANIFEST_FILE}"
    )
    return 0
