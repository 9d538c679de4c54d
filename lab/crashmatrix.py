"""The crash-point matrix as data: its file format, its verdict, and its book chapter.

Pure: no database, no processes. ``lab crashpoints`` (``lab.crashpoints``)
produces the matrix; ``lab book build`` renders it from the evidence directory
with ``book_section``. The file is signed with the run when an experiment of
the run observed its sha256 (``SIGNED_KEY``): the signed report then binds the
file's exact bytes, and the chapter says so; any other matrix is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lab import errors, figures

FORMAT = "lab-crashpoints/1"
OUTPUT_FILE = "crashpoints.json"
MAX_MATRIX_BYTES = 4 * 1024 * 1024
# The observation key an experiment records the matrix file's sha256 under.
SIGNED_KEY = "crashpoints_sha256"

AUTOMATIC = "automatic"  # settled without a person
PERSON = "person"  # waits for a person, with the recorded reason
VIOLATION = "violation"  # the invariant checker found a violation
NOT_REACHED = "not_reached"  # the run never got to the boundary: the cell proves nothing
NOT_APPLICABLE = "not_applicable"
STATUSES = (AUTOMATIC, PERSON, VIOLATION, NOT_REACHED, NOT_APPLICABLE)


def outcome(cell: Mapping[str, Any]) -> str:
    """A cell's outcome in a few words: final state, effects, who settles it."""
    status = cell.get("status")
    if status == NOT_APPLICABLE:
        return "n/a"
    if status == VIOLATION:
        kinds = sorted({str(v.get("kind")) for v in cell.get("violations", [])})
        return f"VIOLATION {', '.join(kinds)}"
    if status == NOT_REACHED:
        return "boundary not reached"
    who = f"person: {cell.get('why')}" if status == PERSON else "automatic"
    effects = int(cell.get("effects") or 0)
    return f"{cell.get('final_state')}, {effects} effect{'' if effects == 1 else 's'}, {who}"


def canonical_json(matrix: Mapping[str, Any]) -> bytes:
    """The matrix as the bytes written to the evidence directory (sorted, indented)."""
    return (json.dumps(matrix, indent=2, sort_keys=True) + "\n").encode("utf-8")


def digest(data: bytes) -> str:
    """sha256 of the matrix file's bytes, as an experiment observes it for the signature."""
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- rendering

_MARK = {AUTOMATIC: "🟩", PERSON: "🟨", VIOLATION: "🟥", NOT_REACHED: "🟥", NOT_APPLICABLE: "⬜"}


def load(data: bytes) -> dict[str, Any]:
    """Parse a matrix file, refusing anything that is not one (size- and shape-checked)."""
    if len(data) > MAX_MATRIX_BYTES:
        raise errors.InputError(f"crash-point matrix larger than {MAX_MATRIX_BYTES} bytes")
    try:
        matrix = json.loads(data)
    except ValueError as exc:
        raise errors.InputError(f"crash-point matrix is not JSON: {exc}") from exc
    if not isinstance(matrix, dict) or matrix.get("format") != FORMAT:
        raise errors.InputError(f"not a {FORMAT} matrix")
    for name in ("cells", "boundaries", "faults", "kinds"):
        if not isinstance(matrix.get(name), list):
            raise errors.InputError(f"crash-point matrix without a {name} list")
    for cell in matrix["cells"]:
        if not isinstance(cell, dict) or not all(
            isinstance(cell.get(k), str) for k in ("boundary", "fault", "kind", "status")
        ):
            raise errors.InputError("crash-point matrix with a malformed cell")
    return matrix


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
                text = outcome(cell) if cell["status"] != NOT_APPLICABLE else (
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


def passed(matrix: Mapping[str, Any]) -> bool:
    """True when no cell broke an invariant or missed its boundary, and coverage is full."""
    summary = matrix["summary"]
    coverage = matrix["coverage"]
    return (summary[VIOLATION] == 0 and summary[NOT_REACHED] == 0
            and matrix["violation_count"] == 0
            and (not matrix.get("complete") or coverage["reached"] == coverage["defined"]))


# --------------------------------------------------------------------------- command


# --------------------------------------------------------------------------- the book


def read(evidence_dir: Path) -> bytes | None:
    """The matrix file beside the evidence, size-limited and checked; None when absent."""
    path = evidence_dir / OUTPUT_FILE
    if not path.is_file():
        return None
    with path.open("rb") as handle:
        data = handle.read(MAX_MATRIX_BYTES + 1)
    load(data)
    return data


def signed_digests(report: Mapping[str, Any]) -> set[str]:
    """Every matrix sha256 an experiment of the signed report observed."""
    found = set()
    for test in report.get("tests", []):
        for observation in test.get("observations", []) if isinstance(test, dict) else []:
            if isinstance(observation, dict) and isinstance(observation.get(SIGNED_KEY), str):
                found.add(observation[SIGNED_KEY])
    return found


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
    if digest(data) not in signed_digests(report):
        raise errors.Refused(
            f"{OUTPUT_FILE}: sha256 {digest(data)} is not the matrix the signed run recorded"
        )
    note = (f"signed with the run (the signed report holds this file's sha256 "
            f"`{digest(data)}`)")
    matrix = load(data)
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
        text = outcome(cell)
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
