"""The book's findings: the landing page's summary and the side-by-side verdict grid.

Every cell comes from the verified report through ``lab.book.findings`` (the rule, the
windows, the entries); nothing measured is written by hand. A cell shows its mark in
words (safe, unsafe, needs a person, does not apply) as well as a symbol, and its
outcome in full, never cut; the experiment's own account and the clause of the rule
that decided the mark are one click away. Pure: report in, Markdown lines out, every
piece of evidence through ``lab.escape``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lab import escape
from lab.book import findings
from lab.book.findings import SYSTEMS, WINDOWS, Entry

SYSTEM_TITLES = findings.SYSTEM_TITLES
COLUMN_TITLES = {"lab": "The lab", "dbos": "DBOS", "langgraph": "LangGraph",
                 "temporal": "Temporal"}
Link = Callable[[str], str | None]  # nodeid -> a link to its experiment on its page


def peer_observations(report: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], dict[str, Any]]]:
    """``(test, observation)`` for every observation that names a known window and system."""
    return findings.peer_observations(report)


def configuration(report: Mapping[str, Any]) -> list[str]:
    """The peers' versions and settings as the observations recorded them, sorted."""
    seen: set[str] = set()
    for _, observation in peer_observations(report):
        if "dbos_version" in observation:
            seen.add(f"DBOS Transact {_text(observation['dbos_version'])}")
        if "dbos_config" in observation:
            seen.add(f"DBOS step settings: {_text(observation['dbos_config'])}")
        versions = observation.get("langgraph_versions")
        if isinstance(versions, dict):
            seen.add(", ".join(f"{k} {_text(v)}" for k, v in sorted(versions.items())))
        if "langgraph_config" in observation:
            seen.add(f"LangGraph settings: {_text(observation['langgraph_config'])}")
        if "temporal_config" in observation:
            seen.add(f"Temporal settings: {_text(observation['temporal_config'])}")
        temporal = observation.get("temporal_versions")
        if isinstance(temporal, dict):
            seen.add(f"temporalio {_text(temporal.get('temporalio'))}, Temporal Server "
                     f"{_text(temporal.get('server'))} (dev server, SQLite)")
    return sorted(seen)


def mark(word: str) -> str:
    """A mark as the page shows it: symbol and word, the word always there (not colour)."""
    return f"{findings.SYMBOLS[word]} {word}"


def _marked(word: str, text: str) -> str:
    """HTML: the mark (symbol and word, coloured by its class) and the outcome."""
    css = word.replace(" ", "-")
    return (f'<span class="mark {css}">{escape.html_text(mark(word))}</span>: '
            f"{escape.html_text(text)}")


def _grid(rows: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """The grid as one HTML block (no blank line inside, so Markdown leaves it whole):
    a row per window, a cell per system, each cell labelled with its system so that a
    narrow screen can show the rows as cards."""
    head = "".join(f'<th scope="col">{escape.xml(COLUMN_TITLES[s])}</th>' for s in SYSTEMS)
    lines = ['<div class="grid">', "<table>",
             f'<thead><tr><th scope="col">Failure window</th>{head}</tr></thead>', "<tbody>"]
    for window_html, cells in rows:
        tds = "".join(f'<td data-label="{escape.xml(COLUMN_TITLES[s])}">{cell}</td>'
                      for s, cell in zip(SYSTEMS, cells, strict=True))
        lines.append(f'<tr><th scope="row">{window_html}</th>{tds}</tr>')
    return [*lines, "</tbody>", "</table>", "</div>", ""]


def findings_section(report: Mapping[str, Any], *, side_by_side: str | None) -> list[str]:
    """The landing page's findings: per system a count of marks, then the grid of every
    window with each cell's mark and outcome, and the rule. ``side_by_side`` is the page
    with the details (None when the book has none)."""
    table = findings.grid(report)
    lines: list[str] = []
    for system in SYSTEMS:
        counts = findings.tally(table, system)
        said = ", ".join(f"{n} {word}" for word, n in counts.items() if n)
        lines.append(f"- **{escape.md(SYSTEM_TITLES[system])}** "
                     f"({len(WINDOWS)} windows): {escape.md(said)}.")
    lines.append("")
    lines += _grid([(escape.html_text(findings.WINDOW_TITLES[window]),
                     [_marked(*findings.overall(system, window, row[system]))
                      for system in SYSTEMS])
                    for window, row in table.items()])
    lines += [f"How a cell is marked: {findings.RULE}", ""]
    if side_by_side:
        lines += [f"Every cell's evidence, the experiment's own account and the clause of the "
                  f"rule that decided it: [Side by side]({side_by_side}).", ""]
    return lines


def _entry_text(entry: Entry) -> str:
    via = f"{entry.via}: " if entry.via else ""
    return f"{via}{entry.headline}"


def _cell(system: str, window: str, entries: Sequence[Entry], link: Link) -> str:
    word, text = findings.overall(system, window, entries)
    if not entries:
        return _marked(word, text)
    shown = [_marked(word, text)]
    more: list[str] = []
    for entry in entries:
        target = link(entry.nodeid)
        source = f' (<a href="{escape.xml(target)}">the experiment</a>)' if target else ""
        account = f" {escape.html_text(entry.detail)}." if entry.detail else ""
        more.append(f"{escape.html_text(mark(entry.mark))}: "
                    f"{escape.html_text(_entry_text(entry))}."
                    f"{account} Why: {escape.html_text(entry.why)}.{source}")
    shown.append("<details><summary>how we know</summary>" + "<br>".join(more) + "</details>")
    return "<br>".join(shown)


def section(report: Mapping[str, Any], link: Link = lambda nodeid: None) -> list[str]:
    """The side-by-side page's grid: every window for every system, each cell's mark and
    full outcome, the evidence one click away. None without peer observations (a run
    that did not include the peer chapters)."""
    if not peer_observations(report):
        return []
    lines = [findings.RULE, ""]
    lines += [f"- {escape.md(item)}" for item in configuration(report)]
    lines.append("")
    return lines + _grid([
        (f"{escape.html_text(findings.WINDOW_TITLES[window])}<br>"
         f"<code>{escape.html_text(window)}</code>",
         [_cell(system, window, row[system], link) for system in SYSTEMS])
        for window, row in findings.grid(report).items()])


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {_text(v)}" for k, v in sorted(value.items()))
    if isinstance(value, list):
        return ", ".join(_text(v) for v in value)
    return str(value)
