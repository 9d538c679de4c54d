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
    {{ crashpoints }}                the crash-point matrix, compact cells, details a click away
    {{ sidebyside }}                 the lab, DBOS and LangGraph per failure window
    {{ model }}                      the signed model evidence's results
    {{ limits }}                     the run's stated limits
    {{ reproduction }}               a verified reproduction of this run, when there is one

A directive that names a chapter, experiment or observation the verified evidence
does not hold stops the build with one line naming the page, the line and the
directive (``Refused``). A chapter of the evidence without a source page gets a
page of its directives alone (``DEFAULTS``); ``tests/test_book_sources.py`` holds
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt

from lab import errors, escape, files
from lab.book import crashpoints, figures, model_chapter, reproduction, sidebyside
from lab.evidence import hermetic, reproduction_evidence, verification
from lab.evidence.report import Report

INDEX = "index"
CRASHPOINTS = "crashpoints"
SIDE_BY_SIDE = "side-by-side"
MODEL = "model"
STYLE_FILE = "style.css"
SOURCE_LIMIT = 256 * files.KIB
FIGURES_DIR = "figures"
SHORT = 72  # characters of a key observation in a results table
_PAGE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
_DIRECTIVE = re.compile(r"\{\{\s*([a-z]+)((?:\s+[^\s{}]+)*)\s*\}\}")
_EXPERIMENT_ARG = re.compile(r"([A-Za-z0-9_]+)/([A-Za-z0-9_]+)(?:\[([^\]\s]+)\])?")
_INLINE = frozenset({"verdict", "value"})
_BLOCK = frozenset({
    "provenance", "chapters", "results", "details", "figure", "crashpoints", "sidebyside",
    "model", "limits", "reproduction",
})

DEFAULTS = {
    INDEX: "# The durable agent workflow lab\n\n{{ verdict }}\n\n## Provenance\n\n"
           "{{ provenance }}\n\n## Chapters\n\n{{ chapters }}\n\n## Reproduction\n\n"
           "{{ reproduction }}\n\n## Limits\n\n{{ limits }}\n",
    CRASHPOINTS: "# Crash points\n\n{{ crashpoints }}\n",
    SIDE_BY_SIDE: "# Side by side\n\n{{ sidebyside }}\n",
    MODEL: "# Model experiment\n\n{{ model }}\n",
}
_CHAPTER_DEFAULT = "# {chapter}\n\n{{{{ results {chapter} }}}}\n\n{{{{ details {chapter} }}}}\n"


@dataclass
class Evidence:
    """What directives may draw from: the verified report and the verified copies."""

    report: Report
    copies: Mapping[str, bytes]
    pinned_by: str | None
    figure_paths: Mapping[str, str]  # nodeid -> figures/<stem>.svg
    png: bool = False
    matrix: bytes | None = None
    # The pin that vouched for the model evidence's own signer: never the runtime's pin.
    model_pinned_by: str | None = None
    rendered: dict[str, bytes] = field(default_factory=dict)  # figures directives drew
    titles: dict[str, str] = field(default_factory=dict)  # page name -> title


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
    fixed = [CRASHPOINTS, SIDE_BY_SIDE, MODEL]

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
    for chapter in chapters(evidence.report):
        pages.setdefault(chapter, _CHAPTER_DEFAULT.format(chapter=chapter))
    if evidence.matrix is not None:
        pages.setdefault(CRASHPOINTS, DEFAULTS[CRASHPOINTS])
    if sidebyside.peer_observations(evidence.report):
        pages.setdefault(SIDE_BY_SIDE, DEFAULTS[SIDE_BY_SIDE])
    if f"evidence/{model_chapter.MODEL_DIR}/model-experiment.json" in evidence.copies:
        pages.setdefault(MODEL, DEFAULTS[MODEL])
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


def _block(
    kind: str, args: list[str], evidence: Evidence, where: str, match: re.Match[str]
) -> str:
    takes_none = {"provenance", "chapters", "crashpoints", "sidebyside", "model", "limits",
                  "reproduction"}
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
        lines = _results(rows, evidence)
    elif kind == "details":
        _, rows = _chapter_rows(args, evidence, where, match)
        lines = []
        for row in rows:
            lines += _details(row, evidence)
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
            lines += _figure(test, evidence)
    elif kind == "crashpoints":
        if evidence.matrix is None:
            raise _fail(where, match, "the verified evidence holds no crash-point matrix")
        lines, drawn_files = crashpoints.book_section(report, evidence.matrix, FIGURES_DIR)
        evidence.rendered.update(drawn_files)
    elif kind == "sidebyside":
        if not sidebyside.peer_observations(report):
            raise _fail(where, match, "the verified evidence holds no peer observations")
        lines = sidebyside.section(report)
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
            f"evidence/{reproduction_evidence.BOOK_DIR}/{reproduction_evidence.RECORD_FILE}"))
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
        "- Evidence files (copies under `evidence/`):",
    ]
    for name, data in sorted(evidence.copies.items()):
        lines.append(f"  - {escape.code(name)} sha256 `{hashlib.sha256(data).hexdigest()}`")
    return [*lines, ""]


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
        lines.append(f"| [{escape.md(page_title)}]({name}.md) | {result} |")
    return [*lines, ""]


def anchor(row: Mapping[str, Any]) -> str:
    """The HTML id of an experiment's details on its chapter page."""
    return "x-" + re.sub(r"[^a-z0-9_-]+", "-", str(row["name"]).lower())[:120]


def _results(rows: Sequence[Mapping[str, Any]], evidence: Evidence) -> list[str]:
    lines = ["| Experiment | Claim | Result | Duration | Key observations |",
             "| --- | --- | --- | --- | --- |"]
    for row in rows:
        observed = [text for _, text in _observations(row, evidence)]
        joined = "; ".join(observed)
        short = joined if len(joined) <= SHORT else joined[: SHORT - 1] + "…"
        results = int(row["results"])
        outcome = escape.md(row["outcome"])
        result = outcome if results == 1 else f"{outcome} ({results} results)"
        cells = [
            f"[{escape.code(row['name'])}](#{anchor(row)})",
            escape.md(row["claim"] or ""),
            result,
            f"{float(row['duration']):.2f} s",
            escape.md(short),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _observations(
    row: Mapping[str, Any], evidence: Evidence
) -> list[tuple[str | None, str]]:
    members = set(row["tests"])
    ran = sorted((t for t in evidence.report["tests"] if t["nodeid"] in members),
                 key=lambda t: str(t["nodeid"]))
    found: list[tuple[str | None, str]] = []
    for test in ran:
        param = _param(str(test["nodeid"]))
        for observation in test["observations"]:
            text = _observation(observation)
            found.append((param, f"[{param}] {text}" if param is not None else text))
    return found


def _details(row: Mapping[str, Any], evidence: Evidence) -> list[str]:
    lines = [
        f'<a id="{anchor(row)}"></a>',
        "",
        f"### {escape.code(row['name'])}",
        "",
        escape.md(row["claim"] or ""),
        "",
        f"Result: {escape.md(row['outcome'])}, {int(row['results'])} result(s), "
        f"{float(row['duration']):.2f} s.",
        "",
    ]
    observed = _observations(row, evidence)
    if observed:
        lines += ["Observations:", ""]
        lines += [f"- {escape.md(text)}" for _, text in observed]
        lines.append("")
    members = set(row["tests"])
    for test in sorted(evidence.report["tests"], key=lambda t: str(t["nodeid"])):
        if test["nodeid"] in members and test["nodeid"] in evidence.figure_paths:
            lines += _figure(test, evidence)
    return lines


def _figure(test: Mapping[str, Any], evidence: Evidence) -> list[str]:
    path = evidence.figure_paths[str(test["nodeid"])]
    figure = figures.sequence(test["events"], test["timeline"])
    name = test_title(test)
    lines = [
        f"#### Sequence: {escape.code(name)}",
        "",
        escape.md(test["claim"] or ""),
        "",
        f"![Sequence of {escape.md(name)}]({path})",
        "",
    ]
    if evidence.png:
        lines += [f"[The same figure as PNG]({path[:-4]}.png)", ""]
    traces = ", ".join(escape.code(t) for t in test["trace_ids"])
    if traces:
        lines += [f"Trace ids: {traces}", ""]
    lines += [
        "<details><summary>Mermaid source</summary>",
        "",
        "```mermaid",
        figures.mermaid(figure).rstrip("\n"),
        "```",
        "",
        "</details>",
        "",
    ]
    return lines


def test_title(test: Mapping[str, Any]) -> str:
    """``experiment`` or ``experiment[param]``: how the book names one result."""
    param = _param(str(test["nodeid"]))
    return f"{test['experiment']}[{param}]" if param is not None else str(test["experiment"])


def _param(nodeid: str) -> str | None:
    name = nodeid.rsplit("::", 1)[-1]
    if "[" in name and name.endswith("]"):
        return name.split("[", 1)[1][:-1]
    return None


def _observation(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_value(v)}" for k, v in sorted(value.items()))
    return _value(value)


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# --------------------------------------------------------------------------- HTML

STYLE = """\
body { margin: 0; font: 15px/1.5 "DejaVu Sans", Helvetica, Arial, sans-serif; color: #1b1f23; }
nav { position: fixed; top: 0; bottom: 0; left: 0; width: 15rem; overflow-y: auto;
      padding: 1rem; background: #f4f6f8; border-right: 1px solid #d8dee4; box-sizing: border-box; }
nav ol { padding-left: 1.2rem; margin: 0.5rem 0; }
nav a[aria-current] { font-weight: bold; color: #1b1f23; }
nav .verdict { font-weight: bold; padding: 0.2rem 0.5rem; border-radius: 4px;
               display: inline-block; }
nav .PASS { background: #dcffe4; color: #0b5a1d; }
nav .FAIL, nav .PARTIAL { background: #ffdce0; color: #86181d; }
main { margin-left: 15rem; padding: 1rem 2rem 4rem; max-width: 72rem; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 13px; display: block;
        max-width: 100%; overflow-x: auto; }
th, td { border: 1px solid #d8dee4; padding: 0.25rem 0.5rem; vertical-align: top;
         text-align: left; }
th { background: #f4f6f8; }
code { font-family: "DejaVu Sans Mono", monospace; font-size: 90%; background: #f4f6f8;
       padding: 0 0.2rem; }
pre { background: #f4f6f8; padding: 0.5rem; overflow-x: auto; }
img { max-width: 100%; border: 1px solid #d8dee4; }
details summary { cursor: pointer; }
.pager { margin-top: 3rem; display: flex; justify-content: space-between; }
"""

TEMPLATE = """\
<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="stylesheet" href="{style}">
</head>
<body>
<nav>
<p><a href="index.html">The durable agent workflow lab</a></p>
<p class="verdict {status}">Gate: {status}</p>
<ol>
{links}
</ol>
</nav>
<main>
{body}
<p class="pager">{pager}</p>
</main>
</body>
</html>
"""


def _markdown_it() -> MarkdownIt:
    # CommonMark with tables; raw HTML on, since the only HTML in a page is the book's own
    # (evidence reaches it only through escape.md, which leaves no '<'). markdown-it's link
    # validation still drops javascript:, vbscript:, file: and data: URLs.
    return MarkdownIt("commonmark", {"html": True}).enable("table")


def _page_href(href: str) -> str:
    """A link to another page's Markdown becomes a link to its HTML."""
    target, hash_mark, fragment = href.partition("#")
    if target.endswith(".md") and "/" not in target and ":" not in target:
        return f"{target[:-3]}.html{hash_mark}{fragment}"
    return href


def html_page(name: str, markdown: str, titles: Mapping[str, str], status: str) -> bytes:
    """One page of the site: the Markdown rendered, inside the template with navigation."""
    engine = _markdown_it()
    tokens = engine.parse(markdown)
    for token in tokens:
        for child in token.children or []:
            if child.type == "link_open":
                child.attrSet("href", _page_href(str(child.attrGet("href") or "")))
    body = engine.renderer.render(tokens, engine.options, {})
    names = list(titles)
    links = "\n".join(
        f'<li><a href="{escape.xml(n)}.html"'
        + (' aria-current="page"' if n == name else "")
        + f">{escape.xml(titles[n])}</a></li>"
        for n in names
    )
    at = names.index(name)
    pager = []
    if at > 0:
        pager.append(f'<a href="{escape.xml(names[at - 1])}.html">← '
                     f"{escape.xml(titles[names[at - 1]])}</a>")
    if at + 1 < len(names):
        pager.append(f'<a href="{escape.xml(names[at + 1])}.html">'
                     f"{escape.xml(titles[names[at + 1]])} →</a>")
    document = TEMPLATE.format(
        title=escape.xml(f"{titles[name]} · durable agent workflow lab"),
        style=STYLE_FILE,
        status=escape.xml(status),
        links=links,
        body=body.rstrip("\n"),
        pager=" ".join(pager),
    )
    return document.encode("utf-8")


def build(sources: Mapping[str, str], evidence: Evidence) -> dict[str, bytes]:
    """Every page as ``<name>.md`` and ``<name>.html``, the style sheet, and the figures the
    directives drew (``{relative path: bytes}``)."""
    pages = plan(sources, evidence)
    evidence.titles.update({name: title(name, text) for name, text in pages.items()})
    out: dict[str, bytes] = {STYLE_FILE: STYLE.encode("utf-8")}
    expanded: dict[str, str] = {}
    for name, text in pages.items():
        expanded[name] = expand(name, text, evidence)
    for name, markdown in expanded.items():
        out[f"{name}.md"] = markdown.encode("utf-8")
        out[f"{name}.html"] = html_page(name, markdown, evidence.titles,
                                        evidence.report["status"])
    out.update(evidence.rendered)
    return out

