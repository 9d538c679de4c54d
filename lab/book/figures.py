"""Sequence figures of one experiment, drawn from its evidence.

An experiment that used the ``lab`` fixture carries two histories in
``runtime.json``: the workflow's sanitised audit events (PostgreSQL's clock)
and the timeline of what the experiment did to its worker processes (the
experiment's monotonic clock). Both start at the experiment's start, so they
are merged into one ``Sequence`` of steps across lanes::

    experiment | each worker process | PostgreSQL | credit tool

and rendered twice from the same steps: as a Mermaid ``sequenceDiagram`` for
Markdown and as a self-contained SVG, so the figure shows without a Mermaid
renderer. Rendering is deterministic: same evidence, same bytes.

Who wrote an event is not recorded, so the lane is inferred, conservatively:

* a claim is drawn from its ``owner``; a fenced step (dispatch, completion,
  lost reply, retry, failure) from the owner of the claim with that fence;
* created, approved and review decisions come from the experiment (a person's
  actions in the lab are the experiment's calls);
* a lease expiry is a note over PostgreSQL: the lease ran out on its clock;
* anything else (a reconciliation, a manual review) comes from the only worker
  process alive at that moment, from the experiment when none is alive, and is
  a note over PostgreSQL when several are.

A dispatch implies the call to the tool that follows it, a reconciliation the
lookup by the original effect key, and a worker's ``after_tool`` stage the
tool's receipt; those tool arrows are drawn from the events that prove them.
"""

from __future__ import annotations

import io
import math
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lab import errors, escape, protocol

EXPERIMENT = "E"
POSTGRESQL = "DB"
TOOL = "T"

# Step styles: how an arrow or note is drawn.
CALL = "call"
REPLY = "reply"
KILL = "kill"
NOTE = "note"
ALERT = "alert"
RECONCILE = "reconcile"
FINAL = "final"

# The workflow state each event kind leaves behind (None: unchanged).
STATE_AFTER: dict[str, str | None] = {
    "created": "waiting_approval",
    "approved": "ready",
    "claimed": "running",
    "dispatching": "running",
    "completed": "succeeded",
    "lease_expired": "unknown",
    "unknown": "unknown",
    "retry_scheduled": "ready",
    "failed": "failed",
    "cancelled": "cancelled",
    "cancel_requested": None,
    "approval_expired": "waiting_approval",
    "incompatible": "incompatible",
    "integrity_failed": "failed",
    "manual_review": None,
    "requeue": "ready",
    "forced_requeue": "ready",
    "resolved_failed": "failed",
    "resolved_succeeded": "succeeded",
}
# Kinds a person (the experiment) performs, and kinds only a claim's owner can write.
_BY_EXPERIMENT = {"created", "approved", "cancel_requested", "requeue", "forced_requeue",
                  "resolved_failed", "resolved_succeeded"}
_BY_OWNER = {"dispatching", "completed", "unknown", "retry_scheduled", "failed"}
MAX_STEPS = 150
MAX_FINAL_STATES = 20
MAX_WORKER_LANES = 8


@dataclass(frozen=True)
class Lane:
    """One participant: its Mermaid id, its name and what it is."""

    key: str
    label: str
    role: str


@dataclass(frozen=True)
class Step:
    """An arrow from ``source`` to ``target``, or a note over ``source`` when they agree."""

    t: float | None
    source: str
    target: str
    text: str
    style: str

    @property
    def is_note(self) -> bool:
        """True for a note over one lane."""
        return self.source == self.target


@dataclass(frozen=True)
class Figure:
    """Lanes and steps in time order, ready to render."""

    lanes: tuple[Lane, ...]
    steps: tuple[Step, ...]
    omitted: int = 0


@dataclass
class _Build:
    lanes: dict[str, str]  # actor name -> lane key
    alive: dict[str, tuple[float, float]]
    owners: dict[tuple[str, int | None], str] = field(default_factory=dict)
    steps: list[tuple[float, int, int, Step]] = field(default_factory=list)

    def add(self, t: float | None, rank: int, step: Step) -> None:
        when = math.inf if t is None else t
        self.steps.append((when, rank, len(self.steps), step))


def sequence(events: Sequence[Mapping[str, Any]], timeline: Sequence[Mapping[str, Any]]) -> Figure:
    """Merge an experiment's events and process timeline into one figure.

    Entries that are not objects are left out: the evidence is signed, not trusted.
    """
    events, timeline = _entries(events), _entries(timeline)
    processes: list[str] = []
    for mark in timeline:
        actor = str(mark.get("actor", ""))
        if actor not in ("experiment", "postgresql", "tool", "") and actor not in processes:
            processes.append(actor)
    # Marks of any further process are drawn on the experiment's lane.
    processes = processes[:MAX_WORKER_LANES]
    lanes = [Lane(EXPERIMENT, "experiment", "pytest process")]
    lanes += [Lane(f"P{i}", name, "worker process") for i, name in enumerate(processes, 1)]
    lanes += [Lane(POSTGRESQL, "PostgreSQL", "workflow store"), Lane(TOOL, "credit tool", "HTTP")]
    build = _Build(
        lanes={lane.label: lane.key for lane in lanes[1:-2]},
        alive={name: _lifetime(name, timeline) for name in processes},
    )
    for mark in timeline:
        _timeline_step(build, mark)
    states: dict[str, tuple[str, str]] = {}
    for event in events:
        _event_steps(build, event, states)
    ordered = [step for *_, step in sorted(build.steps, key=lambda item: item[:3])]
    omitted = max(0, len(ordered) - MAX_STEPS)
    ordered = ordered[:MAX_STEPS]
    finals = list(states.items())
    omitted += max(0, len(finals) - MAX_FINAL_STATES)
    for workflow, (state, last) in finals[:MAX_FINAL_STATES]:
        review = " (manual review)" if last == "manual_review" else ""
        ordered.append(
            Step(None, POSTGRESQL, POSTGRESQL, f"final state: {workflow} {state}{review}", FINAL)
        )
    return Figure(tuple(lanes), tuple(ordered), omitted)


def _entries(items: Any) -> list[Mapping[str, Any]]:
    if not isinstance(items, list | tuple):
        return []
    return [item for item in items if isinstance(item, Mapping)]


def _lifetime(name: str, timeline: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    start, end = math.inf, math.inf
    for mark in timeline:
        if mark.get("actor") != name or not isinstance(mark.get("t"), int | float):
            continue
        what, t = str(mark.get("what", "")), float(mark["t"])
        if what == "started" and start == math.inf:
            start = t
        elif what.startswith(("killed", "exited")) and end == math.inf:
            end = t
    return start, end


def _timeline_step(build: _Build, mark: Mapping[str, Any]) -> None:
    t = _time(mark.get("t"))
    actor, what = str(mark.get("actor", "")), str(mark.get("what", ""))
    lane = {"experiment": EXPERIMENT, "postgresql": POSTGRESQL, "tool": TOOL}.get(actor)
    lane = lane or build.lanes.get(actor, EXPERIMENT)
    verb, _, rest = what.partition(" ")
    if what == "started":
        build.add(t, 0, Step(t, EXPERIMENT, lane, "start the worker process", CALL))
    elif actor == "experiment" and verb == "SIGKILL" and rest in build.lanes:
        build.add(t, 0, Step(t, EXPERIMENT, build.lanes[rest], "SIGKILL", KILL))
    elif actor == "experiment" and verb == "release" and rest in build.lanes:
        build.add(t, 0, Step(t, EXPERIMENT, build.lanes[rest], "release (newline on stdin)", CALL))
    elif actor == "experiment" and "(SQL-injected)" in what:
        build.add(t, 0, Step(t, EXPERIMENT, POSTGRESQL, what, ALERT))
    elif what == f"{protocol.STAGE} {protocol.AFTER_TOOL}":
        build.add(t, 0, Step(t, TOOL, lane, "receipt: the effect is committed", REPLY))
        build.add(t, 0, Step(t, lane, lane, "paused after_tool, before recording it", NOTE))
    elif verb == protocol.STAGE:
        build.add(t, 0, Step(t, lane, lane, f"paused {rest}", NOTE))
    elif what == protocol.READY:
        build.add(t, 0, Step(t, lane, lane, "waiting at its start gate", NOTE))
    elif verb == "killed":
        build.add(t, 0, Step(t, lane, lane, what, KILL))
    elif "lease expired" in what:
        build.add(t, 0, Step(t, lane, lane, f"{what}", ALERT))
    else:
        build.add(t, 0, Step(t, lane, lane, what, NOTE))


def _event_steps(
    build: _Build, event: Mapping[str, Any], states: dict[str, tuple[str, str]]
) -> None:
    t = _time(event.get("t"))
    kind, workflow = str(event.get("kind", "")), str(event.get("workflow", ""))
    fence = event.get("fence") if isinstance(event.get("fence"), int) else None
    detail = _detail(event.get("detail"))
    previous = states.get(workflow, ("", ""))[0]
    state = STATE_AFTER.get(kind) or previous
    if kind == "reconciled":
        state = "succeeded" if detail.get("lookup") == "found" else "ready"
    states[workflow] = (state, kind)
    arrow = f" → {state}" if state and state != previous else ""
    fenced = f" (fence {fence})" if fence is not None else ""
    actor, prefix = _actor(build, kind, workflow, fence, detail, t)

    def add(source: str, target: str, text: str, style: str) -> None:
        build.add(t, 1, Step(t, source, target, text, style))

    if kind == "created":
        add(actor, POSTGRESQL, f"create {workflow}{arrow}", CALL)
    elif kind == "approved":
        by = f" ({detail['by']})" if "by" in detail else ""
        add(actor, POSTGRESQL, f"approve {workflow}{by}{arrow}", CALL)
    elif kind == "claimed":
        build.owners[(workflow, fence)] = detail.get("owner", "")
        add(actor, POSTGRESQL, f"{prefix}claim {workflow}{fenced}{arrow}", CALL)
    elif kind == "dispatching":
        start = detail.get("start", "")
        add(actor, POSTGRESQL, f"{prefix}start barrier {start} for {workflow}{fenced}", CALL)
        add(actor, TOOL, f"{prefix}call the tool with the effect key", CALL)
    elif kind == "completed":
        add(actor, POSTGRESQL, f"{prefix}complete {workflow} with the receipt{arrow}", CALL)
    elif kind == "lease_expired":
        add(POSTGRESQL, POSTGRESQL, f"{workflow} lease expired{fenced}{arrow}", ALERT)
    elif kind == "unknown":
        cause = detail.get("cause", "outcome unknown")
        add(actor, POSTGRESQL, f"{prefix}{workflow} {cause}{arrow}", ALERT)
    elif kind == "reconciled":
        found = detail.get("lookup") == "found"
        answer = "found: the effect exists" if found else "404: no effect"
        verdict = "effect found" if found else "no effect, requeued"
        if actor == POSTGRESQL:
            add(POSTGRESQL, POSTGRESQL, f"reconciled {workflow}: {verdict}{arrow}", RECONCILE)
            return
        add(actor, TOOL, f"{prefix}look up the original effect key", CALL)
        add(TOOL, actor, answer, REPLY)
        add(actor, POSTGRESQL, f"{prefix}reconciled {workflow}: {verdict}{arrow}", RECONCILE)
    elif kind == "manual_review":
        reason = f" ({detail['reason']})" if detail.get("reason") else ""
        add(actor, POSTGRESQL, f"{prefix}{workflow} stays {state}: manual review{reason}",
            ALERT)
    else:
        by = f" by {detail['by']}" if "by" in detail else ""
        rest = " ".join(f"{k}={v}" for k, v in detail.items() if k != "by")
        extra = f" ({rest})" if rest else ""
        style = ALERT if state in ("unknown", "failed") else CALL
        add(actor, POSTGRESQL, f"{prefix}{kind} {workflow}{by}{extra}{fenced}{arrow}", style)


def _actor(
    build: _Build,
    kind: str,
    workflow: str,
    fence: int | None,
    detail: Mapping[str, str],
    t: float | None,
) -> tuple[str, str]:
    """The lane that wrote an event, and a name prefix when it is an in-process worker."""
    if kind in _BY_EXPERIMENT:
        return EXPERIMENT, ""
    if kind == "lease_expired":
        return POSTGRESQL, ""
    owner = detail.get("owner") if kind == "claimed" else None
    if kind in _BY_OWNER:
        owner = build.owners.get((workflow, fence))
    if owner:
        if owner in build.lanes:
            return build.lanes[owner], ""
        return EXPERIMENT, f"{owner}: "
    when = math.inf if t is None else t
    alive = [name for name, (start, end) in build.alive.items() if start <= when < end]
    if len(alive) == 1:
        return build.lanes[alive[0]], ""
    return (EXPERIMENT, "") if not alive else (POSTGRESQL, "")


def _detail(value: Any) -> dict[str, str]:
    found: dict[str, str] = {}
    for token in str(value or "").split():
        key, sep, rest = token.partition("=")
        if sep:
            found[key] = rest
    return found


def _time(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def seconds(t: float | None) -> str:
    """A time as the figures print it: three decimals, or ``end`` for the final notes."""
    return "end" if t is None else f"{t:.3f} s"


# --------------------------------------------------------------------------- Mermaid


def mermaid(figure: Figure) -> str:
    """The figure as a Mermaid ``sequenceDiagram`` (without the code fence)."""
    lines = ["sequenceDiagram"]
    for lane in figure.lanes:
        label = lane.label if lane.key in (EXPERIMENT, POSTGRESQL, TOOL) else (
            f"{lane.label} ({lane.role})"
        )
        lines.append(f"    participant {lane.key} as {escape.mermaid(shown(label))}")
    arrows = {CALL: "->>", REPLY: "-->>", KILL: "-x", ALERT: "->>", RECONCILE: "->>"}
    for step in figure.steps:
        label = step.text if step.t is None else f"{seconds(step.t)} · {step.text}"
        text = escape.mermaid(shown(label))
        if step.is_note:
            lines.append(f"    Note over {step.source}: {text}")
        else:
            arrow = arrows.get(step.style, "->>")
            lines.append(f"    {step.source}{arrow}{step.target}: {text}")
    if figure.omitted:
        lines.append(f"    Note over {POSTGRESQL}: {figure.omitted} later steps omitted")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- text

MAX_LABEL = 200  # characters of one step label; a longer one ends in "…"
MAX_TITLE = 160
MAX_CAPTION = 1200
MAX_LANE = 24  # characters; a lane's box is 160 px wide, and a name is cut to fit it


def shown(text: str, limit: int = MAX_LABEL) -> str:
    """Text as a figure shows it: one line, at most ``limit`` characters.

    Evidence is untrusted text. Control, format (bidi overrides), surrogate,
    private-use and unassigned characters are written as visible escapes
    (``\\x07``, ``\\u202e``): XML 1.0 cannot carry most of them even as
    character references, and a hidden one could make a label read otherwise.
    """
    joined = escape.visible(text[: 8 * limit])
    return joined if len(joined) <= limit else joined[: limit - 1] + "…"


# Advance widths of DejaVu Sans and DejaVu Sans Bold for U+0020..U+007E, in font units
# (2048 per em), read from the fonts' hmtx tables with fontTools. DejaVu Sans is the
# first family the figures ask for, and it is wider than Helvetica and Arial: a halo
# sized with it holds the label in any of them. Fixed numbers, not the installed font,
# so a figure's bytes do not depend on the machine that built it.
_ADVANCES = {
    False: (
        651, 821, 942, 1716, 1303, 1946, 1597, 563, 799, 799, 1024, 1716, 651, 739, 651, 690,
        1303, 1303, 1303, 1303, 1303, 1303, 1303, 1303, 1303, 1303, 690, 690, 1716, 1716,
        1716, 1087, 2048, 1401, 1405, 1430, 1577, 1294, 1178, 1587, 1540, 604, 604, 1343,
        1141, 1767, 1532, 1612, 1235, 1612, 1423, 1300, 1251, 1499, 1401, 2025, 1403, 1251,
        1403, 799, 690, 799, 1716, 1024, 1024, 1255, 1300, 1126, 1300, 1260, 721, 1300, 1298,
        569, 569, 1186, 569, 1995, 1298, 1253, 1300, 1300, 842, 1067, 803, 1298, 1212, 1675,
        1212, 1212, 1075, 1303, 690, 1303, 1716,
    ),
    True: (
        713, 934, 1067, 1716, 1425, 2052, 1786, 627, 936, 936, 1071, 1716, 778, 850, 778, 748,
        1425, 1425, 1425, 1425, 1425, 1425, 1425, 1425, 1425, 1425, 819, 819, 1716, 1716,
        1716, 1188, 2048, 1585, 1561, 1503, 1700, 1399, 1399, 1681, 1714, 762, 762, 1587,
        1305, 2038, 1714, 1741, 1501, 1741, 1577, 1475, 1397, 1663, 1585, 2259, 1579, 1483,
        1485, 936, 748, 936, 1716, 1024, 1024, 1382, 1466, 1214, 1466, 1389, 891, 1466, 1458,
        702, 702, 1362, 702, 2134, 1458, 1407, 1466, 1466, 1010, 1219, 979, 1458, 1335, 1892,
        1321, 1335, 1192, 1458, 748, 1458, 1716,
    ),
}
_ADVANCE_MORE = {"→": (1716, 1716), "·": (651, 778), "…": (2048, 2048)}
_ADVANCE_WIDEST = 2280  # any other character: wider than any DejaVu Sans draws
_UNITS_PER_EM = 2048


def text_width(text: str, size: float = 12.0, *, bold: bool = False) -> float:
    """The width in px of ``text`` set in DejaVu Sans (an upper bound for other fonts).

    Renderers that hint round each advance to a whole device pixel (cairo does), so
    half a pixel per character is added: a run of one wide letter still fits.
    """
    table = _ADVANCES[bold]
    units = 0
    for c in text:
        code = ord(c)
        if 0x20 <= code < 0x7F:
            units += table[code - 0x20]
        elif c in _ADVANCE_MORE:
            units += _ADVANCE_MORE[c][bold]
        else:
            units += _ADVANCE_WIDEST
    return units * size / _UNITS_PER_EM + 0.5 * len(text)


# --------------------------------------------------------------------------- SVG

# Only presentation attributes that every SVG renderer paints: no CSS, no classes that
# style (they are hooks for tests), no paint-order, no web fonts. A label's halo is a
# white rectangle sized to the text and drawn before it, so the label reads over lane
# lines in a browser and in a print converter alike.
_FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
_LEFT = 96
_GAP = 210
_ROW = 32
_HALO_PAD = 3  # px of halo left and right of an arrow label
_NOTE_PAD = 10  # px between a note's text and its box
_LEGEND = (
    "Times: seconds since the experiment started; events on PostgreSQL's clock, process "
    "marks on the experiment's clock. Both differ between runs."
)
_COLORS = {
    CALL: ("#1f4e79", "#ffffff"),
    REPLY: ("#1f4e79", "#ffffff"),
    KILL: ("#b71c1c", "#fdecea"),
    NOTE: ("#455a64", "#f5f7f8"),
    ALERT: ("#8a5a00", "#fff4d6"),
    RECONCILE: ("#1b5e20", "#e8f5e9"),
    FINAL: ("#0d47a1", "#e3f2fd"),
}


def svg(
    figure: Figure,
    title: str,
    caption: str | None = None,
    *,
    clock: Callable[[float | None], str] = seconds,
    legend: str = _LEGEND,
) -> str:
    """The figure as a standalone SVG document: lanes, arrows and notes in time order.

    ``clock`` labels each row (seconds by default) and ``legend`` says what the labels
    are, for figures whose steps carry an order rather than a time. Every string is
    passed through ``shown`` and escaped, so evidence cannot add markup or characters
    XML cannot carry.
    """
    title = shown(str(title), MAX_TITLE)
    centers = {lane.key: _LEFT + _GAP // 2 + i * _GAP for i, lane in enumerate(figure.lanes)}
    wrapped = textwrap.wrap(shown("" if caption is None else str(caption), MAX_CAPTION),
                            width=118)
    top = 50 + 18 * len(wrapped)
    first_row = top + 70
    rows = len(figure.steps) + (1 if figure.omitted else 0)
    bottom = first_row + rows * _ROW
    width = _LEFT + _GAP * len(figure.lanes) + 20
    for step in figure.steps:
        width = max(width, _extent(step, centers)[1] + 20)
    # Title, caption and legend are wider than three lanes: never clip them.
    texts = [(title, 16.0, True), (legend, 11.0, False)] + [(line, 13.0, False)
                                                            for line in wrapped]
    width = max(width, *(math.ceil(text_width(t, s, bold=b)) + 32 for t, s, b in texts))
    height = bottom + 56
    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="{_FONT}" font-size="12" role="img" '
        f'aria-label="{escape.xml(title)}">',
        f"<title>{escape.xml(title)}</title>",
        "<defs>",
    ]
    for style, (stroke, _) in sorted(_COLORS.items()):
        out.append(
            f'<marker id="head-{style}" viewBox="0 0 10 10" refX="10" refY="5" '
            f'markerUnits="userSpaceOnUse" markerWidth="11" markerHeight="11" orient="auto">'
            f'<path d="M0,0 L10,5 L0,10 z" fill="{stroke}"/></marker>'
        )
    out += [
        "</defs>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text class="title" x="16" y="28" font-size="16" font-weight="bold">'
        f"{escape.xml(title)}</text>",
    ]
    for i, line in enumerate(wrapped):
        out.append(f'<text class="caption" x="16" y="{52 + 18 * i}" font-size="13" '
                   f'fill="#333333">{escape.xml(line)}</text>')
    out += _svg_lanes(figure, centers, top, bottom)
    out.append('<g class="steps">')
    for i, step in enumerate(figure.steps):
        out += _svg_step(step, centers, first_row + i * _ROW, clock)
    if figure.omitted:
        y = first_row + len(figure.steps) * _ROW
        out.append(f'<text class="omitted" x="{_LEFT}" y="{y}" fill="#555555">'
                   f"{figure.omitted} later steps omitted (see runtime.json)</text>")
    out.append("</g>")
    out.append(
        f'<text class="legend" x="16" y="{bottom + 32}" font-size="11" fill="#555555">'
        f"{escape.xml(legend)}</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _svg_lanes(figure: Figure, centers: Mapping[str, int], top: int, bottom: int) -> list[str]:
    """The lanes' group: each lane's header box (label and role) and its dashed line."""
    out = ['<g class="lanes">']
    for lane in figure.lanes:
        x = centers[lane.key]
        out += [
            f'<line x1="{x}" y1="{top + 44}" x2="{x}" y2="{bottom}" stroke="#9e9e9e" '
            f'stroke-dasharray="4 4"/>',
            f'<rect x="{x - 80}" y="{top}" width="160" height="44" rx="6" fill="#eceff1" '
            f'stroke="#607d8b"/>',
            f'<text x="{x}" y="{top + 19}" text-anchor="middle" font-weight="bold">'
            f"{escape.xml(_fit(lane.label, 150, 12.0, bold=True))}</text>",
            f'<text x="{x}" y="{top + 35}" text-anchor="middle" font-size="11" '
            f'fill="#546e7a">{escape.xml(_fit(lane.role, 150, 11.0))}</text>',
        ]
    out.append("</g>")
    return out


def _fit(text: str, width: float, size: float, *, bold: bool = False) -> str:
    """``shown(text)`` cut (with "…") until it is at most ``width`` px wide."""
    fitted = shown(text, MAX_LANE)
    while len(fitted) > 1 and text_width(fitted, size, bold=bold) > width:
        fitted = fitted[:-2] + "…"
    return fitted


def _bold(step: Step) -> bool:
    return step.style in (KILL, FINAL)


def _extent(step: Step, centers: Mapping[str, int]) -> tuple[int, int]:
    """Left and right x of a step's label box (a note's box, or room around a label)."""
    half = math.ceil(text_width(shown(step.text), bold=_bold(step)) / 2) + _NOTE_PAD
    if step.is_note:
        center = centers[step.source]
    else:
        center = (centers[step.source] + centers[step.target]) // 2
    left = max(_LEFT, center - half)
    return left, left + 2 * half


def _svg_step(
    step: Step, centers: Mapping[str, int], y: int, clock: Callable[[float | None], str]
) -> list[str]:
    """One row: its time, then its arrow and haloed label, or its note box and text."""
    text = shown(step.text)
    stroke, fill = _COLORS.get(step.style, _COLORS[NOTE])
    time = (f'<text class="time" x="{_LEFT - 12}" y="{y + 4}" text-anchor="end" '
            f'font-size="11" fill="#757575">{escape.xml(clock(step.t))}</text>')
    left, right = _extent(step, centers)
    label_x = (left + right) // 2
    weight = ' font-weight="bold"' if _bold(step) else ""
    if step.is_note:
        return [
            '<g class="row">',
            time,
            f'<rect class="note" x="{left}" y="{y - 12}" width="{right - left}" height="22" '
            f'rx="4" fill="{fill}" stroke="{stroke}"/>',
            f'<text class="step {step.style}" x="{label_x}" y="{y + 3}" text-anchor="middle" '
            f'fill="{stroke}"{weight}>{escape.xml(text)}</text>',
            "</g>",
        ]
    x1, x2 = centers[step.source], centers[step.target]
    dash = ' stroke-dasharray="6 4"' if step.style == REPLY else ""
    thick = "2.5" if step.style == KILL else "1.5"
    # The halo runs from 12 px above the baseline to 4 below: DejaVu Sans' ink at 12 px
    # (9.6 above, 2.9 below) with room to spare. The arrow's line is 6 px lower and its
    # head (5.5 px each side) stays clear of the halo, even under a label wider than it.
    half = math.ceil(text_width(text, bold=_bold(step)) / 2) + _HALO_PAD
    return [
        '<g class="row">',
        time,
        f'<line x1="{x1}" y1="{y + 7}" x2="{x2}" y2="{y + 7}" stroke="{stroke}" '
        f'stroke-width="{thick}"{dash} marker-end="url(#head-{step.style})"/>',
        f'<rect class="halo" x="{label_x - half}" y="{y - 15}" width="{2 * half}" '
        f'height="16" fill="#ffffff"/>',
        f'<text class="step {step.style}" x="{label_x}" y="{y - 3}" text-anchor="middle" '
        f'fill="{stroke}"{weight}>{escape.xml(text)}</text>',
        "</g>",
    ]


# --------------------------------------------------------------------------- PNG

PNG_SCALE = 2.0  # 192 dpi: a bitmap for print toolchains, twice the SVG's pixel size
_SVG_NS = "http://www.w3.org/2000/svg"
_DARK = 160  # a luminance below this is ink; every label colour is below 100


class RendererMissing(errors.MissingExtra):
    """PNG figures need cairosvg and the cairo library: pip install '.[book]'."""


class Illegible(errors.Refused):
    """A figure's PNG does not show one of its labels: the book will not publish it."""


def png(document: str, *, scale: float = PNG_SCALE) -> bytes:
    """``document`` rendered by cairosvg: the same bytes for the same cairosvg and cairo."""
    try:
        import cairosvg  # imported here: an optional extra, and cairo is a system library
    except (ImportError, OSError) as exc:
        raise RendererMissing(
            f"PNG figures need cairosvg on the cairo library ({exc}): "
            "pip install '.[book]' and apt-get install libcairo2"
        ) from exc
    data: bytes = cairosvg.svg2png(bytestring=document.encode("utf-8"), scale=scale)
    return data


def pngs(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """A PNG beside each ``*.svg`` of ``files``; raises ``Illegible`` if a label does not show."""
    out: dict[str, bytes] = {}
    for name, data in sorted(files.items()):
        if not name.endswith(".svg"):
            continue
        document = data.decode("utf-8")
        rendered = png(document)
        problems = legibility(document, rendered)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise Illegible(f"{name}: {problems[0]}{more}")
        out[name.removesuffix(".svg") + ".png"] = rendered
    return out


@dataclass(frozen=True)
class Label:
    """A step label of a rendered figure and the box it must show in (user units)."""

    text: str
    box: tuple[float, float, float, float]  # left, top, right, bottom
    halo: bool  # True for an arrow label's halo, False for a note's box


def labels(document: str) -> list[Label]:
    """Every step label of a figure ``svg`` wrote, with its halo or note box."""
    found: list[Label] = []
    root = ET.fromstring(document.encode("utf-8"))  # noqa: S314 - a figure svg() wrote
    for row in root.iter(f"{{{_SVG_NS}}}g"):
        if row.get("class") != "row":
            continue
        rect = next(r for r in row.iter(f"{{{_SVG_NS}}}rect") if r.get("class") in ("halo", "note"))
        text = next(t for t in row.iter(f"{{{_SVG_NS}}}text")
                    if (t.get("class") or "").startswith("step "))
        x, y = float(rect.get("x", 0)), float(rect.get("y", 0))
        box = (x, y, x + float(rect.get("width", 0)), y + float(rect.get("height", 0)))
        found.append(Label(text.text or "", box, rect.get("class") == "halo"))
    return found


def without_labels(document: str) -> str:
    """``document`` with every step label removed: what its halos and boxes draw alone."""
    ET.register_namespace("", _SVG_NS)
    root = ET.fromstring(document.encode("utf-8"))  # noqa: S314 - a figure svg() wrote
    for row in root.iter(f"{{{_SVG_NS}}}g"):
        if row.get("class") == "row":
            for text in list(row):
                if (text.get("class") or "").startswith("step "):
                    row.remove(text)
    return ET.tostring(root, encoding="unicode")


def legibility(
    document: str,
    rendered: bytes | None = None,
    *,
    scale: float = PNG_SCALE,
    render: Callable[[str, float], bytes] | None = None,
) -> list[str]:
    """What keeps a reader of the rendered figure from reading each step label.

    ``render(document, scale)`` draws a PNG (default: ``png``, cairosvg; the
    screenshot script passes headless Chromium); ``rendered`` is its result for
    ``document`` if already made. The figure is
    rendered again without its labels (halos and note boxes alone); the pixels that
    are dark only with the labels are the labels' ink. Each label must put ink in
    its box across at least half its width, an arrow label's halo alone must paint
    its box plain white (lane lines hidden under the label), and no label ink may
    fall outside the boxes. Returns one line per problem, none when all are legible.
    """
    from PIL import Image, ImageChops, ImageDraw

    def cairo(text: str, factor: float) -> bytes:
        return png(text, scale=factor)

    draw = render or cairo
    full = Image.open(io.BytesIO(rendered or draw(document, scale))).convert("L")
    bare = Image.open(io.BytesIO(draw(without_labels(document), scale))).convert("L")

    def dark(image: Image.Image) -> Image.Image:
        return image.point(lambda v: 255 if v < _DARK else 0)

    ink = ImageChops.subtract(dark(full), dark(bare))
    outside = ink.copy()
    pencil = ImageDraw.Draw(outside)
    problems: list[str] = []
    for label in labels(document):
        left, top, right, bottom = (
            math.floor(label.box[0] * scale), math.floor(label.box[1] * scale),
            math.ceil(label.box[2] * scale), math.ceil(label.box[3] * scale),
        )
        where = f"label {label.text!r} at y={label.box[1]:g}"
        drawn = ink.crop((left, top, right, bottom)).getbbox()
        wanted = (text_width(label.text) - 0.5 * len(label.text)) * scale / 2
        if drawn is None:
            problems.append(f"{where}: no ink in its box")
        elif drawn[2] - drawn[0] < wanted:
            problems.append(f"{where}: ink spans {drawn[2] - drawn[0]} px, want {wanted:.0f}")
        if label.halo:
            inner = bare.crop((left + 1, top + 1, right - 1, bottom - 1)).getextrema()
            if inner != (255, 255):
                problems.append(f"{where}: its halo alone does not paint its box white")
        spill = math.ceil(scale)  # anti-aliased edges
        pencil.rectangle((left - spill, top - spill, right + spill, bottom + spill), fill=0)
    stray = outside.getbbox()
    if stray is not None:
        problems.append(f"label ink outside every label box, around px {stray[:2]}")
    return problems
