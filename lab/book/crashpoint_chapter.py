"""The crash-point matrix as a book chapter: the coloured table and one figure per outcome.

Renders only a matrix the signed run recorded (``crashmatrix.signed_digests``); the
data format, its loader and its verdict live in ``lab.faults.crashmatrix``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lab import errors
from lab.book import figures
from lab.faults import crashmatrix
from lab.faults.crashmatrix import (
    AUTOMATIC,
    NOT_APPLICABLE,
    NOT_REACHED,
    OUTPUT_FILE,
    PERSON,
    VIOLATION,
)

_MARK = {AUTOMATIC: "🟩", PERSON: "🟨", VIOLATION: "🟥", NOT_REACHED: "🟥", NOT_APPLICABLE: "⬜"}


def render_markdown(matrix: Mapping[str, Any], *, signed_note: str) -> list[str]:
    """The matrix as a book chapter: boundary rows, fault by tool-kind columns, coloured."""
    cells = {(c["boundary"], c["fault"], c["kind"]): c for c in matrix["cells"]}
    faults = [str(f["name"]) for f in matrix["faults"]]
    kinds = [str(k) for k in matrix["kinds"]]
    coverage = matrix.get("coverage", {})
    summary = matrix.get("summary", {})
    lines = [
        "## Crash points",
        "",
        f"Every named boundary, fault and tool kind, {signed_note}. Each cell: final state, "
        "effects in the tool's ledger, and who settles it; judged by the invariant checker.",
        "",
        f"Legend: {_MARK[AUTOMATIC]} settled automatically · {_MARK[PERSON]} needs a person "
        f"(reason) · {_MARK[VIOLATION]} violation or boundary not reached · "
        f"{_MARK[NOT_APPLICABLE]} cannot happen (reason).",
        "",
        f"Coverage: {coverage.get('reached')} of {coverage.get('defined')} boundaries reached; "
        f"seed {matrix.get('seed')}; lease {matrix.get('lease_s')} s; "
        + ", ".join(f"{k} {summary.get(k, 0)}" for k in
                    (AUTOMATIC, PERSON, VIOLATION, NOT_REACHED, NOT_APPLICABLE))
        + f"; violations {matrix.get('violation_count')}.",
        "",
    ]
    header = ["Boundary"] + [f"{_md(f)} · {_md(k)}" for f in faults for k in kinds]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for b in matrix["boundaries"]:
        name = str(b.get("name"))
        row = [f"`{_md(name)}`<br>{_md(str(b.get('meaning', '')))}"]
        for f in faults:
            for k in kinds:
                cell = cells.get((name, f, k))
                if cell is None:
                    row.append("missing")
                    continue
                text = (crashmatrix.outcome(cell) if cell["status"] != NOT_APPLICABLE else
                        f"n/a: {cell.get('why', '')}")
                calls = (f"<br>calls {cell.get('tool_calls')}, lookups {cell.get('lookups')}, "
                         f"{cell.get('recovery_s')} s" if "tool_calls" in cell else "")
                row.append(f"{_MARK.get(cell['status'], '?')} {_md(text)}{calls}")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for omitted in matrix.get("omitted_faults", []):
        lines.append(f"- Fault `{_md(str(omitted.get('name')))}` not in this matrix: "
                     f"{_md(str(omitted.get('why')))}")
    return [*lines, ""]


def _md(text: str) -> str:
    text = " ".join(text.split())
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace(
        "|", "\\|")


def book_section(
    report: Mapping[str, Any], data: bytes | None, figures_dir: str = "figures"
) -> tuple[list[str], dict[str, bytes]]:
    """The chapter for ``data`` (the matrix file's bytes), checked against the signed report,
    and one sequence figure per distinct outcome (``{path: svg bytes}``).

    A matrix the signed run did not record is refused, not published with a caveat:
    the book publishes from verified evidence only.
    """
    if data is None:
        return [], {}
    if crashmatrix.digest(data) not in crashmatrix.signed_digests(report):
        raise errors.Refused(
            f"{OUTPUT_FILE}: sha256 {crashmatrix.digest(data)} "
            "is not the matrix the signed run recorded"
        )
    note = (f"signed with the run (the signed report holds this file's sha256 "
            f"`{crashmatrix.digest(data)}`)")
    matrix = crashmatrix.load(data)
    lines = render_markdown(matrix, signed_note=note)
    drawn = outcome_figures(matrix)
    if drawn:
        lines += ["### One run of each distinct outcome", ""]
    rendered: dict[str, bytes] = {}
    for index, (text, cell, svg) in enumerate(drawn, 1):
        path = f"{figures_dir}/crashpoint-outcome-{index:02d}.svg"
        rendered[path] = svg
        where = f"{cell.get('boundary')} · {cell.get('fault')} · {cell.get('kind')}"
        lines += [f"- {_md(text)} (first seen at {_md(where)}): ![{_md(text)}]({path})", ""]
    return lines, rendered


_STEP_LEGEND = (
    "Rows: the cell's audit events in commit order (the matrix records their kinds, not "
    "their times), then the final state."
)


def _step_number(t: float | None) -> str:
    return "end" if t is None else f"step {int(t)}"


def outcome_figures(matrix: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], bytes]]:
    """For each distinct outcome, its first cell in table order drawn as a sequence figure.

    The figure is the cell's recorded event history (kinds in commit order) with the fault
    named in its title; cells that cannot happen draw nothing.
    """
    seen: dict[str, tuple[Mapping[str, Any], bytes]] = {}
    for cell in matrix["cells"]:
        if cell.get("status") == NOT_APPLICABLE:
            continue
        text = crashmatrix.outcome(cell)
        if text in seen:
            continue
        kinds = [str(k) for k in cell.get("events", []) if isinstance(k, str)]
        events = [
            {"t": float(index), "workflow": "wf-1", "kind": kind, "fence": None, "detail": ""}
            for index, kind in enumerate(kinds, 1)
        ]
        title = f"{cell.get('fault')} at {cell.get('boundary')} ({cell.get('kind')} tool)"
        svg = figures.svg(figures.sequence(events, []), title, text, clock=_step_number,
                          legend=_STEP_LEGEND).encode()
        seen[text] = (cell, svg)
    return [(text, cell, svg) for text, (cell, svg) in seen.items()]
