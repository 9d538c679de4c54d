"""The book's pages: sources in ``book/`` with directives, bound to verified evidence.

A source page is Markdown written by a person (``book/index.md``, one
``book/<chapter>.md`` per chapter, ``book/crashpoints.md``,
``book/side-by-side.md``, ``book/model.md``). Everything measured comes in
through a directive, ``{{ name args }}``, expanded from the verified report:

    {{ verdict }}                    inline: the gate's verdict and what it covers
    {{ value CH/EXP[param] KEY }}    inline: one observed value (``KEY`` may be a.b.c)
    {{ provenance }}                 commit, tree, signer (pinned or not), PostgreSQL, files
    {{ chapters }}                   the chapter list with each chapter's results
    {{ results CH }}                 a chapter's results table, observations kept short
    {{ details CH }}                 per experiment: claim, every observation, its figures
    {{ figure CH/EXP[param] }}       one experiment's sequence figure(s)
    {{ hosts CH/EXP[param] }}        the lab hosts one result recorded, drawn
    {{ crashpoints }}                the crash-point matrix, compact cells, details a click away
    {{ sidebyside }}                 the lab and each peer per failure window
    {{ model }}                      the signed model evidence's results
    {{ limits }}                     the run's stated limits
    {{ reproduction }}               a verified reproduction of this run, when there is one

A directive that names a chapter, experiment or observation the verified evidence
does not hold stops the build with one line naming the page, the line and the
directive (``Refused``). A chapter of the evidence without a source page gets a
page of its directives alone (``DEFAULTS``); ``tests/book/test_book_sources.py`` holds
the committed ``book/`` to a page per declared chapter.

Output: per page ``<name>.md`` (the expanded Markdown) and ``<name>.html`` (that
Markdown rendered by markdown-it-py, CommonMark with tables, in ``TEMPLATE``), plus
``style.css``. No script, no remote resource: the folder works offline.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lab import errors, escape, files
from lab.book import (
    chapter,
    crashpoints,
    model_chapter,
    quantities,
    reproduction,
    sidebyside,
    site,
    topology,
)
from lab.evidence import hermetic, reproduction_evidence, verification
from lab.evidence.report import Report

INDEX = "index"
CRASHPOINTS = "crashpoints"
SIDE_BY_SIDE = "side-by-side"
MODEL = "model"
STYLE_FILE = site.STYLE_FILE
SOURCE_LIMIT = 256 * files.KIB
FIGURES_DIR = "figures"
GLOSSARY = "glossary"
_PAGE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
_DIRECTIVE = re.compile(r"\{\{\s*([a-z]+)((?:\s+[^\s{}]+)*)\s*\}\}")
_EXPERIMENT_ARG = re.compile(r"([A-Za-z0-9_]+)/([A-Za-z0-9_]+)(?:\[([^\]\s]+)\])?")
_INLINE = frozenset({"verdict", "value"})
_BLOCK = frozenset({
    "provenance", "chapters", "results", "details", "figure", "crashpoints", "sidebyside",
    "model", "limits", "reproduction", "findings", "glossary", "hosts",
})

DEFAULTS = {
    INDEX: "# The durable agent workflow lab\n\n## What we found\n\n{{ findings }}\n\n"
           "## Verdict\n\n{{ verdict }}\n\n## Provenance\n\n"
           "{{ provenance }}\n\n## Chapters\n\n{{ chapters }}\n\n## Reproduction\n\n"
           "{{ reproduction }}\n\n## Limits\n\n{{ limits }}\n",
    CRASHPOINTS: "# Crash points\n\n{{ crashpoints }}\n",
    SIDE_BY_SIDE: "# Side by side\n\n{{ sidebyside }}\n",
    MODEL: "# Model experiment\n\n{{ model }}\n",
    GLOSSARY: "# Glossary of observed quantities\n\n{{ glossary }}\n",
}
_CHAPTER_DEFAULT = "# {chapter}\n\n{{{{ results {chapter} }}}}\n\n{{{{ details {chapter} }}}}\n"


Evidence = chapter.Evidence


class DirectiveError(errors.Refused):
    """A directive the verified evidence cannot answer (or cannot parse)."""


# --------------------------------------------------------------------------- sources


def load_sources(directory: Path | None) -> dict[str, str]:
    """``{page name: Markdown}`` of every ``*.md`` in ``directory`` (none when it is absent).

    Read through the bounded reader; a page name is ``[a-z0-9][a-z0-9_-]*``, so it is
    also a safe file name.
    """
    if directory is None or not directory.is_dir():
        return {}
    found: dict[str, str] = {}
    for path in sorted(directory.glob("*.md")):
        name = path.stem
        if not _PAGE_NAME.fullmatch(name):
            raise errors.InputError(f"{path}: a page name must match {_PAGE_NAME.pattern}")
        data = files.read_bytes(path, SOURCE_LIMIT, f"book page {path.name}")
        try:
            found[name] = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise errors.InputError(f"{path}: not UTF-8 ({exc.reason})") from exc
    return found


def page_order(names: Sequence[str]) -> list[str]:
    """Landing page first, then the chapters, then the matrix, side by side, model, others."""
    fixed = [CRASHPOINTS, SIDE_BY_SIDE, MODEL, GLOSSARY]

    def key(name: str) -> tuple[int, str]:
        if name == INDEX:
            return (0, name)
        if re.fullmatch(r"ch\d\d.*", name):
            return (1, name)
        if name in fixed:
            return (2, str(fixed.index(name)))
        return (3, name)

    return sorted(names, key=key)


def plan(sources: Mapping[str, str], evidence: Evidence) -> dict[str, str]:
    """The pages to build: every source page, plus a default page for each chapter of
    the evidence without one, and for the matrix and side by side when the evidence
    holds them."""
    pages = dict(sources)
    pages.setdefault(INDEX, DEFAULTS[INDEX])
    for each in chapters(evidence.report):
        pages.setdefault(each, _CHAPTER_DEFAULT.format(chapter=each))
    if evidence.matrix is not None:
        pages.setdefault(CRASHPOINTS, DEFAULTS[CRASHPOINTS])
    if sidebyside.peer_observations(evidence.report):
        pages.setdefault(SIDE_BY_SIDE, DEFAULTS[SIDE_BY_SIDE])
    if f"evidence/{model_chapter.MODEL_DIR}/model-experiment.json" in evidence.copies:
        pages.setdefault(MODEL, DEFAULTS[MODEL])
    pages.setdefault(GLOSSARY, DEFAULTS[GLOSSARY])
    return {name: pages[name] for name in page_order(list(pages))}


def chapters(report: Report) -> list[str]:
    """The chapters of the report's experiments, sorted."""
    return sorted({row["chapter"] for row in report["experiments"]})


def title(name: str, text: str) -> str:
    """A page's title: its first level-one heading, else its name."""
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return name


# --------------------------------------------------------------------------- expansion


def expand(name: str, text: str, evidence: Evidence) -> str:
    """The page's Markdown with every directive replaced by what the evidence holds."""
    out: list[str] = []
    fence = False
    for number, line in enumerate(text.splitlines(), 1):
        where = f"book/{name}.md:{number}"
        if line.lstrip().startswith("```"):
            fence = not fence
        if fence or "{{" not in line:
            out.append(line)
            continue
        whole = _DIRECTIVE.fullmatch(line.strip())
        if whole and whole.group(1) in _BLOCK:
            out.append(_block(whole.group(1), whole.group(2).split(), evidence, where, whole))
            continue

        def inline(match: re.Match[str], where: str = where) -> str:
            if match.group(1) not in _INLINE:
                raise DirectiveError(f"{where}: {match.group(0)}: not an inline directive "
                                     f"(block directives stand alone on their line)")
            return _inline(match.group(1), match.group(2).split(), evidence, where, match)

        if "{{" in _DIRECTIVE.sub("", line):
            raise DirectiveError(f"{where}: an unreadable directive: {line.strip()[:80]}")
        out.append(_DIRECTIVE.sub(inline, line))
    return "\n".join(out).rstrip("\n") + "\n"


def _fail(where: str, match: re.Match[str], why: str) -> DirectiveError:
    return DirectiveError(f"{where}: {match.group(0)}: {why}")


def _inline(
    kind: str, args: list[str], evidence: Evidence, where: str, match: re.Match[str]
) -> str:
    report = evidence.report
    if kind == "verdict":
        if args:
            raise _fail(where, match, "takes no argument")
        rows = report["experiments"]
        passed = sum(1 for r in rows if r["outcome"] == "passed")
        return (f"**{escape.md(report['status'])}**: {passed} of {len(rows)} experiments "
                f"passed in {len(chapters(report))} chapters")
    if len(args) != 2:
        raise _fail(where, match, "needs CHAPTER/EXPERIMENT[param] and an observation KEY")
    tests = _tests(args[0], evidence, where, match)
    values: dict[str, None] = {}
    for test in tests:
        for observation in test["observations"]:
            found = _lookup(observation, args[1])
            if found is not _MISSING:
                values[_value(found)] = None
    if not values:
        raise _fail(where, match, f"the verified evidence holds no observation {args[1]} "
                                  f"for {args[0]}")
    if len(values) > 1:
        raise _fail(where, match, f"{args[1]} differs between the results of {args[0]}: "
                                  "name one with [param]")
    return escape.md(next(iter(values)))


_MISSING = object()


def _lookup(observation: Any, key: str) -> Any:
    value = observation
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _tests(
    arg: str, evidence: Evidence, where: str, match: re.Match[str]
) -> list[Mapping[str, Any]]:
    parsed = _EXPERIMENT_ARG.fullmatch(arg)
    if parsed is None:
        raise _fail(where, match, "name an experiment as CHAPTER/EXPERIMENT[param]")
    chapter, name, param = parsed.groups()
    row = _row(chapter, name, evidence, where, match)
    members = set(row["tests"])
    tests = [t for t in evidence.report["tests"] if t["nodeid"] in members]
    if param is not None:
        tests = [t for t in tests if _param(str(t["nodeid"])) == param]
        if not tests:
            raise _fail(where, match, f"the verified evidence holds no result [{param}] "
                                      f"of {chapter}/{name}")
    return sorted(tests, key=lambda t: str(t["nodeid"]))


def _row(
    chapter: str, name: str, evidence: Evidence, where: str, match: re.Match[str]
) -> Mapping[str, Any]:
    for row in evidence.report["experiments"]:
        if row["chapter"] == chapter and row["name"] == name:
            return row
    raise _fail(where, match, f"the verified evidence holds no experiment {chapter}/{name}")


def _chapter_rows(
    args: list[str], evidence: Evidence, where: str, match: re.Match[str]
) -> tuple[str, list[Any]]:
    if len(args) != 1:
        raise _fail(where, match, "needs one CHAPTER")
    rows = [r for r in evidence.report["experiments"] if r["chapter"] == args[0]]
    if not rows:
        raise _fail(where, match, f"the verified evidence holds no chapter {args[0]}")
    return args[0], rows


def _hosts(args: list[str], evidence: Evidence, where: str, match: re.Match[str]) -> list[str]:
    """One figure of the hosts a result of a run beyond one host recorded."""
    if len(args) != 1:
        raise _fail(where, match, "needs one CHAPTER/EXPERIMENT[param]")
    tests = _tests(args[0], evidence, where, match)
    found = [o for t in tests for o in t["observations"] if topology.drawable(o)]
    if len(tests) != 1 or not found:
        raise _fail(where, match, "needs one result that recorded its hosts: name it "
                                  "with [param]")
    # The file's name comes from evidence: only a safe, short form of it.
    param = _param(str(tests[0]["nodeid"]))
    stem = re.sub(r"[^a-z0-9_-]", "-", (param or "run").lower())[:40]
    path = f"{FIGURES_DIR}/hosts-{stem}.svg"
    title = f"The lab hosts of {args[0].split('/', 1)[0]}" + (f", [{param}]" if param else "")
    evidence.rendered[path] = topology.svg(found[0], title)
    return [f"![{escape.md(title)}]({path})", ""]


def _block(
    kind: str, args: list[str], evidence: Evidence, where: str, match: re.Match[str]
) -> str:
    takes_none = {"provenance", "chapters", "crashpoints", "sidebyside", "model", "limits",
                  "reproduction", "findings", "glossary"}
    if kind in takes_none and args:
        raise _fail(where, match, "takes no argument")
    report = evidence.report
    lines: list[str]
    if kind == "provenance":
        lines = provenance(evidence)
    elif kind == "chapters":
        lines = _chapter_list(evidence)
    elif kind == "results":
        _, rows = _chapter_rows(args, evidence, where, match)
        lines = chapter.results(rows, evidence)
    elif kind == "details":
        _, rows = _chapter_rows(args, evidence, where, match)
        lines = []
        for row in rows:
            lines += chapter.details(row, evidence)
    elif kind == "figure":
        if len(args) != 1:
            raise _fail(where, match, "needs one CHAPTER/EXPERIMENT[param]")
        drawn = [t for t in _tests(args[0], evidence, where, match)
                 if t["nodeid"] in evidence.figure_paths]
        if not drawn:
            raise _fail(where, match, f"the verified evidence holds no event history "
                                      f"to draw for {args[0]}")
        lines = []
        for test in drawn:
            lines += chapter.figure(test, evidence)
    elif kind == "hosts":
        lines = _hosts(args, evidence, where, match)
    elif kind == "crashpoints":
        if evidence.matrix is None:
            raise _fail(where, match, "the verified evidence holds no crash-point matrix")
        lines, drawn_files = crashpoints.book_section(report, evidence.matrix, FIGURES_DIR)
        evidence.rendered.update(drawn_files)
    elif kind == "sidebyside":
        if not sidebyside.peer_observations(report):
            raise _fail(where, match, "the verified evidence holds no peer observations")
        lines = sidebyside.section(report, lambda nodeid: _link(nodeid, evidence))
    elif kind == "findings":
        other = SIDE_BY_SIDE if SIDE_BY_SIDE in evidence.titles else None
        lines = sidebyside.findings_section(report, side_by_side=other and f"{other}.md")
    elif kind == "glossary":
        lines = quantities.glossary()
    elif kind == "model":
        lines, drawn_files = model_chapter.section(
            evidence.copies, "evidence/", pinned=evidence.model_pinned_by is not None
        )
        if not lines:
            lines = ["This build holds no signed model evidence (`lab model run` writes it "
                     "into `evidence/model/`).", ""]
        evidence.rendered.update(drawn_files)
    elif kind == "reproduction":
        lines = reproduction.lines(evidence.copies.get(
            f"evidence/{reproduction_evidence.BOOK_DIR}/{reproduction_evidence.RECORD_FILE}"),
            by=evidence.reproduction_by, withheld=evidence.reproduction_withheld)
        if not lines:
            lines = ["This build holds no reproduction of the run (`lab reproduce EVIDENCE "
                     "--out EVIDENCE/reproduction` writes one).", ""]
    else:  # limits
        lines = [f"- {escape.md(limit)}" for limit in report["limits"]]
    return "\n".join(lines).rstrip("\n") + "\n"


# --------------------------------------------------------------------------- blocks


def provenance(evidence: Evidence) -> list[str]:
    """The run's provenance: verdict, commit, tree, PostgreSQL, signer, versions, files."""
    report = evidence.report
    signing = report["signing"]
    database = report["postgresql"] or {}
    dirty = report["dirty"]
    tree = ("the working tree had uncommitted changes" if dirty is True
            else "clean working tree" if dirty is False else "working tree state unknown")
    pinned_by = evidence.pinned_by
    if pinned_by is not None:
        # A pin vouches for the signer; what the report says about its key is not asked.
        key_note = f"a publication key, pinned by {escape.code(pinned_by)}"
        verified = f"against the pinned public key ({escape.code(pinned_by)})"
    else:
        # Unpinned: whatever ``key_source`` claims, this key proves integrity only.
        key_note = ("an **ephemeral** key: it proves the evidence was not altered after "
                    "signing, not who produced it")
        verified = "with the public key the evidence carries (UNPINNED: integrity, not identity)"
    details = database.get("details") or {}
    detail_text = ", ".join(f"{k} {_value(v)}" for k, v in sorted(details.items()))
    versions = ", ".join(f"{n} {v}" for n, v in sorted(report["versions"].items()))
    lines = [
        f"- Gate: **{escape.md(report['status'])}**: every declared experiment ran and "
        "passed against a real PostgreSQL server, nothing skipped, nothing narrowed.",
        f"- Commit: {escape.code(report['commit'] or 'unknown')} ({tree}).",
        f"- Kind of run: {_run_kind_note(report)}.",
        f"- Run finished: {escape.md(report['timestamp_utc'])} (UTC).",
    ]
    if report["run_url"]:
        lines.append(f"- Run: {escape.md(report['run_url'])}")
    lines += [
        f"- PostgreSQL: {escape.md(str(database.get('server_version')))}, provided by "
        f"{escape.code(str(database.get('provider')))}"
        + (f" ({escape.md(detail_text)})." if detail_text else "."),
        f"- Signer: key id {escape.code(signing['keyid'])}, {key_note}.",
        f"- Verified: the signature {verified}; every source file matches its signed digest.",
        f"- Versions: {escape.md(versions)}.",
        f"- Command: {escape.code(' '.join(report['command']))}.",
        *trusted_base_lines(report),
        "- Evidence files: copies under `evidence/`, their digests below.",
        "",
        "<details><summary>sha256 of every evidence file</summary>",
        "",
    ]
    for name, data in sorted(evidence.copies.items()):
        lines.append(f"- {escape.code(name)} sha256 `{hashlib.sha256(data).hexdigest()}`")
    return [*lines, "", "</details>", ""]


def _link(nodeid: str, evidence: Evidence) -> str | None:
    """A link to the experiment of ``nodeid`` on its chapter page, when the book has one."""
    for row in evidence.report["experiments"]:
        if nodeid in row["tests"] and row["chapter"] in evidence.titles:
            return f"{row['chapter']}.html#{anchor(row)}"
    return None


def trusted_base_lines(report: Mapping[str, Any]) -> list[str]:
    """What a sandboxed run trusted of the machine (``trusted_base``, recorded by the
    parent that sealed it), or nothing for a run that was not sandboxed."""
    base: Any = report.get("trusted_base")
    if not isinstance(base, dict):
        return []
    interpreter: Any = base.get("interpreter") or {}
    sandbox: Any = base.get("sandbox") or {}
    packages: Any = base.get("packages") or {}
    binaries: Any = base.get("postgresql_binaries") or {}
    lines = [
        "- Trusted base (what the sandboxed run had to trust of the machine): kernel "
        f"{escape.code(str(base.get('kernel')))}, {escape.md(str(base.get('distribution')))}; "
        f"sandbox {escape.code(str(sandbox.get('tool')))} sha256 "
        f"{escape.code(str(sandbox.get('sha256')))}; interpreter "
        f"{escape.code(str(interpreter.get('path')))} sha256 "
        f"{escape.code(str(interpreter.get('sha256')))}.",
    ]
    if isinstance(packages, dict) and packages:
        listed = ", ".join(f"{escape.code(str(n))} {escape.md(str(v))}"
                           for n, v in sorted(packages.items()))
        lines.append(f"  Distribution packages: {listed}.")
    if isinstance(binaries, dict) and binaries:
        listed = ", ".join(f"{escape.code(str(n))} sha256 {escape.code(str(v))}"
                           for n, v in sorted(binaries.items()))
        lines.append(f"  PostgreSQL programs: {listed}.")
    return lines


def _run_kind_note(report: Report) -> str:
    """Hermetic or local, as the verifier judges the report's ``run`` facts."""
    if verification.run_kind(report) == hermetic.HERMETIC:
        run: Any = report.get("run") or {}
        lock: Any = run.get("lock") or {}
        tree = report.get("tree")
        return (f"**hermetic** (the commit's files exported from git's objects, tree "
                f"{escape.code(str(tree))}, the lock's verified wheels "
                f"{escape.code(str(lock.get('path')))} sha256 "
                f"{escape.code(str(lock.get('sha256')))}, an allowlisted environment, "
                "isolated interpreters)")
    return ("**local** (run in an author's working tree and environment: not publishable; "
            "`lab publish` runs hermetically)")


def _chapter_list(evidence: Evidence) -> list[str]:
    rows_by = {c: [r for r in evidence.report["experiments"] if r["chapter"] == c]
               for c in chapters(evidence.report)}
    lines = ["| Page | Results |", "| --- | --- |"]
    for name, page_title in evidence.titles.items():
        if name == INDEX:
            continue
        rows = rows_by.get(name)
        result = (f"{sum(1 for r in rows if r['outcome'] == 'passed')} of {len(rows)} "
                  "experiments passed" if rows else "")
        number = site.nav_title(name, "")  # "9. " for a chapter: the book's own text
        lines.append(f"| [{number}{escape.md(page_title)}]({name}.md) | {result} |")
    missing = [why for page, why in _PRODUCED_BY.items() if page not in evidence.titles]
    if missing:
        lines += ["", "Not in this book, and how to produce it:", ""]
        lines += [f"- {why}" for why in missing]
    return [*lines, ""]


# What a page needs that a run may not hold, and the command that produces it.
_PRODUCED_BY = {
    CRASHPOINTS: "the crash-point matrix: chapter 12 "
                 "(`test_every_crash_point_keeps_every_invariant`) signs it with the run",
    SIDE_BY_SIDE: "the side by side of the lab and its peers: the peer chapters "
                  "`ch13_peer_dbos`, `ch14_peer_langgraph` and `ch16_peer_temporal` in the run",
    MODEL: "the model experiment: `lab model run` writes signed evidence into "
           "`evidence/model/`",
}


anchor = chapter.anchor
test_title = chapter.test_title
_param = chapter.param


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# --------------------------------------------------------------------------- site


def build(sources: Mapping[str, str], evidence: Evidence) -> dict[str, bytes]:
    """Every page as ``<name>.md`` and ``<name>.html``, the style sheet, and the figures the
    directives drew (``{relative path: bytes}``)."""
    pages = plan(sources, evidence)
    evidence.titles.update({name: title(name, text) for name, text in pages.items()})
    out: dict[str, bytes] = {STYLE_FILE: site.STYLE.encode("utf-8")}
    expanded: dict[str, str] = {}
    for name, text in pages.items():
        evidence.drawn.clear()  # a figure is drawn once per page
        expanded[name] = expand(name, text, evidence)
    for name, markdown in expanded.items():
        out[f"{name}.md"] = markdown.encode("utf-8")
        out[f"{name}.html"] = site.html_page(name, markdown, evidence.titles,
                                             evidence.report["status"])
    out.update(evidence.rendered)
    return out

