"""A figure's SVG as a PNG (cairosvg), and the check that every label shows in it.

PNGs are for print toolchains; the book refuses a figure whose PNG drops a label
(``Illegible``).
"""

from __future__ import annotations

import io
import math
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lab import errors
from lab.book.figures import text_width

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
