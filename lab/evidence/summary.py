"""The summary of a run's report, as ``lab run`` and ``lab evidence show`` print it.

Every string from the report is rendered as plain ``Text`` with control characters
escaped: a name or message in the evidence can neither inject rich markup (or raise
``MarkupError``) nor move the terminal's cursor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from lab.evidence import compiler, gate
from lab.evidence.verification import printable

_STYLE = {
    gate.PASS: "bold green",
    gate.PARTIAL: "bold yellow",
    gate.FAIL: "bold red",
    gate.PASSED: "green",
    gate.MISSING: "red",
}


def _text(value: Any, style: str = "") -> Text:
    """Evidence text as plain rich Text: no markup, no control characters."""
    return Text(printable(str(value)), style=style)


def console_for_output() -> Console:
    """A console for summaries: the terminal's, or 200 columns off a terminal."""
    # Experiment names are long: off a terminal (CI logs) use a wide page, not 80 columns.
    probe = Console()
    return probe if probe.is_terminal else Console(width=200)


def shorten(value: Any, width: int = 60) -> str:
    """Compact JSON of an observation, cut to ``width`` characters."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= width else text[: width - 1] + "…"


def _observation(report: Mapping[str, Any], row: Mapping[str, Any]) -> str:
    by_node = {t["nodeid"]: t for t in report.get("tests", [])}
    for nodeid in row.get("tests", []):
        test = by_node.get(nodeid, {})
        if test.get("observations"):
            return shorten(test["observations"][0])
        if test.get("message"):
            return shorten(test["message"])
    return ""


def print_summary(
    report: Mapping[str, Any], directory: Path, console: Console | None = None
) -> None:
    """Render a report, the verdict last: counts per chapter and every experiment that did
    not pass (a chapter run: each of its experiments), then PostgreSQL, the signer, the
    commit and where the evidence is, then the gate and its reasons."""
    out = console or console_for_output()
    narrowed = bool(report.get("gate", {}).get("narrowed"))
    rows = [row for row in report.get("experiments", [])
            if not (narrowed and str(row.get("outcome")) == gate.MISSING)]
    if narrowed:
        # A chapter run is small: every row, then one verdict per chapter.
        _experiment_table(report, rows, "Experiments", out)
        for line in chapter_verdicts(report):
            out.print(_text(line, style="bold"))
    else:
        out.print(_chapter_table(rows))
        failed = [row for row in rows if str(row.get("outcome")) != gate.PASSED]
        if failed:
            _experiment_table(report, failed, "Did not pass", out)
    _print_provenance(report, directory, out)
    status = str(report.get("status"))
    verdict = report.get("gate", {})
    out.print(_text(f"Gate: {status}", style=_STYLE.get(status, "bold red")))
    for reason in verdict.get("narrowed", []):
        out.print(_text(f"  narrowed: {reason}"))
    for failure in verdict.get("failures", []):
        out.print(_text(f"  failed: {failure}", style="red"))


def _experiment_table(report: Mapping[str, Any], rows: list[Mapping[str, Any]], title: str,
                      out: Console) -> None:
    table = Table(title=title, show_lines=False)
    # Result and time must stay legible; the observation gives way on narrow screens.
    table.add_column("chapter", overflow="fold")
    table.add_column("experiment", overflow="fold")
    table.add_column("result", no_wrap=True)
    table.add_column("seconds", justify="right", no_wrap=True)
    table.add_column("key observation", overflow="fold", max_width=60)
    for row in rows:
        outcome = str(row.get("outcome"))
        expected = row.get("expected_results")
        count = f" {row.get('results')}/{expected}" if expected and expected != 1 else ""
        table.add_row(
            _text(row.get("chapter")),
            _text(row.get("name")),
            _text(outcome + count, style=_STYLE.get(outcome, "red")),
            f"{float(row.get('duration') or 0.0):.2f}",
            _text(_observation(report, row)),
        )
    out.print(table)


def _chapter_table(rows: list[Mapping[str, Any]]) -> Table:
    """Per chapter: experiments passed of declared, and the seconds they took."""
    table = Table(title="Chapters", show_lines=False)
    table.add_column("chapter", overflow="fold")
    table.add_column("passed", justify="right", no_wrap=True)
    table.add_column("seconds", justify="right", no_wrap=True)
    chapters: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        chapters.setdefault(str(row.get("chapter")), []).append(row)
    for chapter, members in sorted(chapters.items()):
        passed = sum(str(row.get("outcome")) == gate.PASSED for row in members)
        seconds = sum(float(row.get("duration") or 0.0) for row in members)
        style = "green" if passed == len(members) else "bold red"
        table.add_row(_text(chapter), _text(f"{passed} of {len(members)}", style=style),
                      f"{seconds:.1f}")
    return table


def _print_provenance(report: Mapping[str, Any], directory: Path, out: Console) -> None:
    database = report.get("postgresql")
    if database:
        out.print(
            _text(f"PostgreSQL: {database.get('provider', '?')}, "
                  f"{database.get('server_version', '?')}")
        )
        details = database.get("details") or {}
        # Provenance: the binaries path, the image digest or the DSN's host, as recorded.
        for name in ("binaries", "method", "image", "image_digest", "host", "port"):
            if details.get(name):
                out.print(_text(f"  {name}: {details[name]}"))
    else:
        out.print(Text("PostgreSQL: none reached", style="red"))

    signing = report.get("signing", {})
    source = signing.get("key_source", "?")
    label = "EPHEMERAL key: integrity only, not identity" if source == "ephemeral" else source
    out.print(_text(f"Signer: ed25519 key {signing.get('keyid', '?')} ({label})"))
    commit = report.get("commit") or "unknown commit"
    dirty = " (dirty tree)" if report.get("dirty") else ""
    out.print(_text(f"Commit: {commit}{dirty}"))
    out.print(
        _text(f"Evidence: {directory / compiler.ENVELOPE_FILE} "
              f"(check with: lab evidence verify {directory})")
    )


def chapter_verdicts(report: Mapping[str, Any]) -> list[str]:
    """A narrowed run's verdict per chapter that ran, and one line for the rest.

    ("chapter ch20_outsider: 5 of 5 passed; a chapter run is never publishable", then
    "not run: 55 experiments of 13 other chapters ...").
    """
    by_chapter: dict[str, list[str]] = {}
    for row in report.get("experiments", []):
        by_chapter.setdefault(str(row.get("chapter")), []).append(str(row.get("outcome")))
    ran = {c: o for c, o in by_chapter.items() if any(x != gate.MISSING for x in o)}
    lines = [
        f"chapter {chapter}: {outcomes.count(gate.PASSED)} of {len(outcomes)} passed; "
        "a chapter run is never publishable"
        for chapter, outcomes in sorted(ran.items())
    ]
    rest = {c: o for c, o in by_chapter.items() if c not in ran}
    if rest:
        count = sum(len(o) for o in rest.values())
        lines.append(f"not run: {count} experiments of {len(rest)} other chapters "
                     "(only a full `lab run` can PASS)")
    return lines
