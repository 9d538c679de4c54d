"""A sequence figure drawn as a standalone SVG: lanes, arrows and notes in time order.

The same steps as the Mermaid text of ``figures``; every string passes through
``figures.shown`` and is escaped, and the bytes are deterministic.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Mapping

from lab import escape
from lab.book.figures import (
    ALERT,
    CALL,
    FINAL,
    KILL,
    MAX_CAPTION,
    MAX_LANE,
    MAX_TITLE,
    NOTE,
    RECONCILE,
    REPLY,
    Figure,
    Step,
    seconds,
    shown,
    text_width,
)

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
