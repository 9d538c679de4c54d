"""The crash-point matrix as a book page: the coloured table and one figure per outcome.

Renders only a matrix the signed run recorded (``crashmatrix.signed_digests``); the
data format, its loader and its verdict live in ``lab.evidence.crashmatrix``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lab import errors, escape
from lab.book import drawing, figures
from lab.evidence import crashmatrix
from lab.evidence.crashmatrix import (
    AUTOMATIC,
    NOT_APPLICABLE,
    NOT_REACHED,
    OUTPUT_FILE,
    PERSON,
    VIOLATION,
)

# Marks in DejaVu Sans (the site's first font), not emoji: a browser without a colour
# emoji font drew the squares as empty boxes.
_MARK = {AUTOMATIC: "✓", PERSON: "◐", VIOLATION: "✗", NOT_REACHED: "✗", NOT_APPLICABLE: "·"}


def _compact(cell: Mapping[str, Any] | None) -> str:
    """One cell: the mark and the final state in a word or two, the rest one click away."""
    if cell is None:
        return "missing"
    status = cell["status"]
    mark = _MARK.get(status, "?")
    if status == NOT_APPLICABLE:
        short, full = "n/a", f"cannot happen: {cell.get('why', '')}"
    elif status == VIOLATION:
        short, full = "VIOLATION", crashmatrix.outcome(cell)
    elif status == NOT_REACHED:
        short, full = "not reached", crashmatrix.outcome(cell)
    else:
        effects = int(cell.get("effects") or 0)
        short = f"{cell.get('final_state')} x{effects}"
        full = crashmatrix.outcome(cell)
    if "tool_calls" in cell:
        full += (f"; tool calls {cell.get('tool_calls')}, lookups {cell.get('lookups')}, "
                 f"recovered in {cell.get('recovery_s')} s")
    return (f"<details><summary>{mark} {escape.md(short)}</summary>{escape.md(full)}"
            "</details>")


def render_markdown(matrix: Mapping[str, Any], *, signed_note: str) -> list[str]:
    """The matrix as a page: one table per fault (boundary rows, a column per tool kind,
    narrow enough for a phone), coloured marks, compact cells whose full outcome is one
    click away, then the cells the fenced lookup moved from a person to automatic, with
    their proof. Every string from the matrix goes through ``escape``; ``signed_note``
    is the book's own Markdown."""
    cells = {(c["boundary"], c["fault"], c["kind"]): c for c in matrix["cells"]}
    kinds = [str(k) for k in matrix["kinds"]]
    coverage = matrix.get("coverage", {})
    summary = matrix.get("summary", {})
    lines = [
        f"Every named boundary, fault and tool kind, {signed_note}. Each cell: final state "
        "and effects in the tool's ledger (xN); open it for who settles it and how. Judged "
        "by the invariant checker.",
        "",
        f"Legend: {_MARK[AUTOMATIC]} settled automatically · {_MARK[PERSON]} needs a person "
        f"(reason) · {_MARK[VIOLATION]} violation or boundary not reached · "
        f"{_MARK[NOT_APPLICABLE]} cannot happen (reason).",
        "",
        "Coverage: " + escape.md(
            f"{coverage.get('reached')} of {coverage.get('defined')} boundaries reached; "
            f"seed {matrix.get('seed')}; lease {matrix.get('lease_s')} s; "
            + ", ".join(f"{k} {summary.get(k, 0)}" for k in
                        (AUTOMATIC, PERSON, VIOLATION, NOT_REACHED, NOT_APPLICABLE))
            + f"; violations {matrix.get('violation_count')}."),
        "",
    ]
    header = ["Boundary", *(escape.md(k) for k in kinds)]
    for number, fault in enumerate(matrix["faults"], 1):
        name = str(fault.get("name"))
        # Not a heading: a heading's id would be made from the evidence's string.
        lines += [f"**Fault {escape.code(name)}**: {escape.md(str(fault.get('meaning', '')))}",
                  "",
                  # A table a little wider than a phone scrolls inside its own box.
                  f'<div class="scroll" tabindex="0" role="region" '
                  f'aria-label="Crash points, fault {number}">', "",
                  "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for b in matrix["boundaries"]:
            row = str(b.get("name"))
            lines.append("| " + " | ".join(
                [f"{escape.code(row)}<br>{escape.md(str(b.get('meaning', '')))}",
                 *(_compact(cells.get((row, name, k))) for k in kinds)]) + " |")
        lines += ["", "</div>", ""]
    for omitted in matrix.get("omitted_faults", []):
        lines.append(f"- Fault {escape.code(str(omitted.get('name')))} not in this matrix: "
                     f"{escape.md(str(omitted.get('why')))}")
    return [*lines, "", *_moved(matrix)]


def _moved(matrix: Mapping[str, Any]) -> list[str]:
    """The cells the fenced lookup moved from a person to automatic, each with its proof."""
    moved = crashmatrix.moved_to_automatic(matrix)
    lines = ["### From a person to automatic", "",
             escape.md(f"{len(moved)} cells wait for a person with a non-idempotent tool that "
                       "cannot prove absence, and settle automatically with one that offers "
                       "the fenced lookup: its \"absent\" closes the start, so the requeued "
                       "attempt cannot double the effect. The proof is the reconciliation "
                       "each committed."), ""]
    for item in moved:
        proof = "; ".join(str(p) for p in item["proof"]) or "none recorded"
        lines.append(f"- {escape.code(str(item['boundary']))} · "
                     f"{escape.code(str(item['fault']))}: "
                     f"{escape.md(str(item['before']))} → {escape.md(str(item['after']))}; "
                     f"proof: {escape.md(proof)}")
    return [*lines, ""]


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
        lines += [f"- {escape.md(text)} (first seen at {escape.md(where)}):", "",
                  f"  ![{escape.md(text)}]({path})", ""]
    return lines, rendered


_STEP_LEGEND = (
    "Rows: the cell's audit events in commit order (the matrix records their kinds, not "
    "their times), then the final state."
)


def _step_number(t: float | None) -> str:
    return "end" if t is None else f"step {int(t)}"


def history(cell: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The cell's events as the figures read them, in commit order: from its ``history``
    (each event's real workflow id and detail, so a batch names each workflow and a manual
    review its reason) when the matrix records one; an older matrix has only the kinds,
    drawn on one unnamed workflow with the cell's recorded reason on a manual review."""
    recorded = [e for e in cell.get("history") or [] if isinstance(e, Mapping)]
    if recorded:
        return [{"t": float(index), "workflow": str(e.get("workflow", "")),
                 "kind": str(e.get("kind", "")), "fence": None,
                 "detail": str(e.get("detail", ""))}
                for index, e in enumerate(recorded, 1)]
    why = str(cell.get("why") or "")
    kinds = [str(k) for k in cell.get("events", []) if isinstance(k, str)]
    return [{"t": float(index), "workflow": "the workflow", "kind": kind, "fence": None,
             "detail": f"reason={why}" if kind == "manual_review" and why else ""}
            for index, kind in enumerate(kinds, 1)]


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
        events = history(cell)
        title = f"{cell.get('fault')} at {cell.get('boundary')} ({cell.get('kind')} tool)"
        svg = drawing.svg(figures.sequence(events, []), title, text, clock=_step_number,
                          legend=_STEP_LEGEND).encode()
        seen[text] = (cell, svg)
    return [(text, cell, svg) for text, (cell, svg) in seen.items()]
