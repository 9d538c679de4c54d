"""Sequence figures of one experiment, drawn from its evidence.

An experiment that used the ``lab`` fixture carries two histories in
``runtime.json``: the workflow's sanitised audit events (PostgreSQL's clock)
and the timeline of what the experiment did to its worker processes (the
experiment's monotonic clock). Both start at the experiment's start, so they
are merged into one ``Sequence`` of steps across lanes::

    experiment | each worker process | PostgreSQL | credit tool

and rendered twice from the same steps: as a Mermaid ``sequenceDiagram`` for
Markdown (here) and as a self-contained SVG (``lab.book.drawing``; its PNG and the
legibility check are ``lab.book.raster``), so the figure shows without a Mermaid
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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lab import escape, protocol

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
