"""A chapter's blocks: its results table, each experiment's details, figures and source.

Each experiment's claim is shown once on its page (in the results table); its details
hold the result, every observation as a table of named values (``lab.book.quantities``),
the code that produced it (the test function from the hashed source at the evidence's
commit, collapsed, with its path and line) and its sequence figures, each figure drawn
once per page. Every string from the evidence goes through ``lab.escape``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lab import escape
from lab.book import figures, quantities
from lab.evidence.report import Report


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
    # Who vouches for the reproduction the copies hold (an independent trusted key), or
    # why a verified reproduction is not shown.
    reproduction_by: str | None = None
    reproduction_withheld: str | None = None
    rendered: dict[str, bytes] = field(default_factory=dict)  # figures directives drew
    titles: dict[str, str] = field(default_factory=dict)  # page name -> title
    # Experiment source files whose bytes match the report's signed digests: path -> text.
    sources: Mapping[str, str] = field(default_factory=dict)
    drawn: set[str] = field(default_factory=set)  # nodeids whose figure this page shows


def anchor(row: Mapping[str, Any]) -> str:
    """The HTML id of an experiment's details on its chapter page."""
    return "x-" + re.sub(r"[^a-z0-9_-]+", "-", str(row["name"]).lower())[:120]


def param(nodeid: str) -> str | None:
    """The parameter id of a parametrised result's node id, else None."""
    name = nodeid.rsplit("::", 1)[-1]
    if "[" in name and name.endswith("]"):
        return name.split("[", 1)[1][:-1]
    return None


def test_title(test: Mapping[str, Any]) -> str:
    """``experiment`` or ``experiment[param]``: how the book names one result."""
    found = param(str(test["nodeid"]))
    return f"{test['experiment']}[{found}]" if found is not None else str(test["experiment"])


def _ran(row: Mapping[str, Any], report: Report) -> list[Mapping[str, Any]]:
    members = set(row["tests"])
    return sorted((t for t in report["tests"] if t["nodeid"] in members),
                  key=lambda t: str(t["nodeid"]))


RESULT_COLUMNS = ("Experiment", "Claim", "Result", "Key observations")


def results(rows: Sequence[Mapping[str, Any]], evidence: Evidence) -> list[str]:
    """A chapter's results table: name (a link to its details), claim, result, and a few
    key observations by name and unit; everything else is in the details. One HTML block
    (no blank line inside), each cell labelled with its column, so that a narrow screen
    shows each experiment as a card."""
    head = "".join(f'<th scope="col">{name}</th>' for name in RESULT_COLUMNS)
    lines = ['<div class="cards">', "<table>", f"<thead><tr>{head}</tr></thead>", "<tbody>"]
    for row in rows:
        briefs: list[str] = []
        for test in _ran(row, evidence.report):
            found = param(str(test["nodeid"]))
            for observation in test["observations"]:
                text = quantities.brief(observation, quantities.FIRST)
                if text:
                    briefs.append(f"[{found}] {text}" if found is not None else text)
        results_n = int(row["results"])
        outcome = str(row["outcome"])
        result = outcome if results_n == 1 else f"{outcome} ({results_n} results)"
        cells = [
            f'<a href="#{anchor(row)}"><code>{escape.html_text(row["name"])}</code></a>',
            escape.html_text(row["claim"] or ""),
            escape.html_text(result),
            "<br>".join(escape.html_text(text) for text in briefs),
        ]
        tds = "".join(f'<td data-label="{name}">{cell}</td>'
                      for name, cell in zip(RESULT_COLUMNS, cells, strict=True))
        lines.append(f"<tr>{tds}</tr>")
    return [*lines, "</tbody>", "</table>", "</div>", ""]


def details(row: Mapping[str, Any], evidence: Evidence) -> list[str]:
    """One experiment's details: result, observations as named values, its source, its
    figures (those not already shown on the page)."""
    lines = [
        f'<a id="{anchor(row)}"></a>',
        "",
        f"### {escape.code(row['name'])}",
        "",
        f"Result: {escape.md(row['outcome'])}, {int(row['results'])} result(s), "
        f"{float(row['duration']):.2f} s.",
        "",
    ]
    ran = _ran(row, evidence.report)
    for test in ran:
        found = param(str(test["nodeid"]))
        kinds = test.get("observation_kinds") or []
        for index, observation in enumerate(test["observations"]):
            table_kinds = kinds[index] if index < len(kinds) and isinstance(
                kinds[index], dict) else None
            lines += quantities.table(observation, table_kinds, found)
    lines += source(row, ran, evidence)
    for test in ran:
        nodeid = str(test["nodeid"])
        if nodeid not in evidence.figure_paths:
            continue
        if nodeid in evidence.drawn:
            lines += [f"The sequence of {escape.code(test_title(test))} is drawn above.", ""]
            continue
        lines += figure(test, evidence)
    return lines


def source(row: Mapping[str, Any], ran: Sequence[Mapping[str, Any]],
           evidence: Evidence) -> list[str]:
    """Where the experiment's code is (path and line) and the function itself, collapsed;
    only from a file whose bytes match the signed digest (``evidence.sources``)."""
    if not ran:
        return []
    path = str(ran[0]["nodeid"]).split("::", 1)[0]
    text = evidence.sources.get(path)
    name = str(row["name"])
    if text is None:
        return [f'<p class="source">Code: {escape.html_text(path)} (function '
                f"{escape.html_text(name)}).</p>", ""]
    found = _function(text, name)
    if found is None:
        return [f'<p class="source">Code: {escape.html_text(path)}.</p>', ""]
    line, body = found
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", body)), default=0))
    return [
        f'<details class="source"><summary>Code: {escape.html_text(path)}, line {line}'
        "</summary>",
        "",
        f"{fence}python",
        body,
        fence,
        "",
        "</details>",
        "",
    ]


def _function(text: str, name: str) -> tuple[int, str] | None:
    """``(first line, source)`` of the top-level function ``name`` (with its decorators)."""
    try:
        module = ast.parse(text)
    except SyntaxError:
        return None
    lines = text.splitlines()
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            last = node.end_lineno or node.lineno
            return node.lineno, "\n".join(lines[first - 1:last])
    return None


def figure(test: Mapping[str, Any], evidence: Evidence) -> list[str]:
    """One result's sequence figure, its PNG link, trace ids and Mermaid source; the figure
    is remembered as drawn on this page."""
    path = evidence.figure_paths[str(test["nodeid"])]
    evidence.drawn.add(str(test["nodeid"]))
    drawn = figures.sequence(test["events"], test["timeline"])
    name = test_title(test)
    lines = [
        f"#### Sequence: {escape.code(name)}",
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
        figures.mermaid(drawn).rstrip("\n"),
        "```",
        "",
        "</details>",
        "",
    ]
    return lines
