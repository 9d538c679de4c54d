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

import html
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lab import protocol

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
    """Merge an experiment's events and process timeline into one figure."""
    processes: list[str] = []
    for mark in timeline:
        actor = str(mark.get("actor", ""))
        if actor not in ("experiment", "postgresql", "tool", "") and actor not in processes:
            processes.append(actor)
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
    for workflow, (state, last) in states.items():
        review = " (manual review)" if last == "manual_review" else ""
        ordered.append(
            Step(None, POSTGRESQL, POSTGRESQL, f"final state: {workflow} {state}{review}", FINAL)
        )
    return Figure(tuple(lanes), tuple(ordered), omitted)


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
        reason = detail.get("reason", "")
        add(actor, POSTGRESQL, f"{prefix}{workflow} stays {state}: manual review ({reason})",
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
        lines.append(f"    participant {lane.key} as {_mermaid_text(label)}")
    arrows = {CALL: "->>", REPLY: "-->>", KILL: "-x", ALERT: "->>", RECONCILE: "->>"}
    for step in figure.steps:
        text = _mermaid_text(step.text if step.t is None else f"{seconds(step.t)} · {step.text}")
        if step.is_note:
            lines.append(f"    Note over {step.source}: {text}")
        else:
            arrow = arrows.get(step.style, "->>")
            lines.append(f"    {step.source}{arrow}{step.target}: {text}")
    if figure.omitted:
        lines.append(f"    Note over {POSTGRESQL}: {figure.omitted} later steps omitted")
    return "\n".join(lines) + "\n"


# Mermaid ends a statement at ';' and at a line end, reads '#...;' as an entity code
# and '<...>' as markup: all are written as entity codes.
_MERMAID_ESCAPES = {"#": "#35;", ";": "#59;", "<": "#lt;", ">": "#gt;"}


def _mermaid_text(text: str) -> str:
    return "".join(_MERMAID_ESCAPES.get(c, c) for c in " ".join(text.split()))


# --------------------------------------------------------------------------- SVG

_FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
_CHAR = 7.0  # average advance of a 12px sans-serif character, rounded up
_LEFT = 96
_GAP = 210
_ROW = 32
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


def svg(figure: Figure, title: str, caption: str | None = None) -> str:
    """The figure as a standalone SVG document: lanes, arrows and notes in time order."""
    centers = {lane.key: _LEFT + _GAP // 2 + i * _GAP for i, lane in enumerate(figure.lanes)}
    wrapped = textwrap.wrap(caption or "", width=118)
    top = 50 + 18 * len(wrapped)
    first_row = top + 70
    rows = len(figure.steps) + (1 if figure.omitted else 0)
    bottom = first_row + rows * _ROW
    width = _LEFT + _GAP * len(figure.lanes) + 20
    for step in figure.steps:
        width = max(width, _extent(step, centers)[1] + 20)
    # Title, caption and legend are wider than three lanes: never clip them.
    texts = [(title, 16 * 0.62), (_LEGEND, 11 * 0.56)] + [(line, 13 * 0.56) for line in wrapped]
    width = max(width, *(int(len(text) * advance) + 32 for text, advance in texts))
    height = bottom + 56
    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="{_FONT}" font-size="12" role="img" '
        f'aria-label="{_esc(title)}">',
        f"<title>{_esc(title)}</title>",
        "<defs>",
    ]
    for style, (stroke, _) in sorted(_COLORS.items()):
        out.append(
            f'<marker id="head-{style}" viewBox="0 0 10 10" refX="10" refY="5" '
            f'markerUnits="userSpaceOnUse" markerWidth="11" markerHeight="11" '
            f'orient="auto-start-reverse">'
            f'<path d="M0,0 L10,5 L0,10 z" fill="{stroke}"/></marker>'
        )
    out += [
        "</defs>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text class="title" x="16" y="28" font-size="16" font-weight="bold">'
        f"{_esc(title)}</text>",
    ]
    for i, line in enumerate(wrapped):
        out.append(f'<text class="caption" x="16" y="{52 + 18 * i}" font-size="13" '
                   f'fill="#333333">{_esc(line)}</text>')
    out.append('<g class="lanes">')
    for lane in figure.lanes:
        x = centers[lane.key]
        out += [
            f'<line x1="{x}" y1="{top + 44}" x2="{x}" y2="{bottom}" stroke="#9e9e9e" '
            f'stroke-dasharray="4 4"/>',
            f'<rect x="{x - 80}" y="{top}" width="160" height="44" rx="6" fill="#eceff1" '
            f'stroke="#607d8b"/>',
            f'<text x="{x}" y="{top + 19}" text-anchor="middle" font-weight="bold">'
            f"{_esc(lane.label)}</text>",
            f'<text x="{x}" y="{top + 35}" text-anchor="middle" font-size="11" '
            f'fill="#546e7a">{_esc(lane.role)}</text>',
        ]
    out.append("</g>")
    out.append('<g class="steps">')
    for i, step in enumerate(figure.steps):
        out += _svg_step(step, centers, first_row + i * _ROW)
    if figure.omitted:
        y = first_row + len(figure.steps) * _ROW
        out.append(f'<text class="omitted" x="{_LEFT}" y="{y}" fill="#555555">'
                   f"{figure.omitted} later steps omitted (see runtime.json)</text>")
    out.append("</g>")
    out.append(
        f'<text class="legend" x="16" y="{bottom + 32}" font-size="11" fill="#555555">'
        f"{_esc(_LEGEND)}</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _extent(step: Step, centers: Mapping[str, int]) -> tuple[int, int]:
    """Left and right x of a step's label."""
    half = int(len(step.text) * _CHAR / 2) + 10
    if step.is_note:
        center = centers[step.source]
    else:
        center = (centers[step.source] + centers[step.target]) // 2
    left = max(_LEFT, center - half)
    return left, left + 2 * half


def _svg_step(step: Step, centers: Mapping[str, int], y: int) -> list[str]:
    stroke, fill = _COLORS.get(step.style, _COLORS[NOTE])
    time = (f'<text class="time" x="{_LEFT - 12}" y="{y + 4}" text-anchor="end" '
            f'font-size="11" fill="#757575">{_esc(seconds(step.t))}</text>')
    left, right = _extent(step, centers)
    label_x = (left + right) // 2
    weight = ' font-weight="bold"' if step.style in (KILL, FINAL) else ""
    if step.is_note:
        return [
            time,
            f'<rect x="{left}" y="{y - 12}" width="{right - left}" height="22" rx="4" '
            f'fill="{fill}" stroke="{stroke}"/>',
            f'<text class="step {step.style}" x="{label_x}" y="{y + 3}" text-anchor="middle" '
            f'fill="{stroke}"{weight}>{_esc(step.text)}</text>',
        ]
    x1, x2 = centers[step.source], centers[step.target]
    dash = ' stroke-dasharray="6 4"' if step.style == REPLY else ""
    thick = "2.5" if step.style == KILL else "1.5"
    return [
        time,
        f'<line x1="{x1}" y1="{y + 4}" x2="{x2}" y2="{y + 4}" stroke="{stroke}" '
        f'stroke-width="{thick}"{dash} marker-end="url(#head-{step.style})"/>',
        f'<text class="step {step.style}" x="{label_x}" y="{y - 2}" text-anchor="middle" '
        f'fill="{stroke}" stroke="#ffffff" stroke-width="4" paint-order="stroke"{weight}>'
        f"{_esc(step.text)}</text>",
    ]


def _esc(text: str) -> str:
    return html.escape(text, quote=True)
