"""Figures that survive print toolchains, and evidence that cannot add markup to them.

The legibility tests render every figure of a real run (``tree`` from
``test_book``: an inner pytest of a small experiment tree, including the real
chapter 5 SIGKILL experiment, against the run's PostgreSQL) through cairosvg,
the renderer the book's ``--png`` uses. cairosvg ignores ``paint-order``, so
the old white-stroke halos painted every arrow label out: the checker must see
that, and the figures must pass it.
"""

from __future__ import annotations

import hashlib
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_book import SIGKILL, tree  # noqa: F401 - ``tree``: the real run, a module fixture

from lab import cli
from lab.book import builder, drawing, figures, raster

SVG = "{http://www.w3.org/2000/svg}"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def png_books(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:  # noqa: F811
    """The book built twice with ``lab book build --png``, into two directories."""
    outs = tuple(tmp_path_factory.mktemp(f"png-{n}") / "book" for n in ("one", "two"))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tree)  # the working tree the evidence's sources are checked against
        for out in outs:
            code = cli.main(["book", "build", "--evidence", "evidence", "--out", str(out), "--png"])
            assert code == 0
    return outs[0], outs[1]


def _files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _svgs(directory: Path) -> Iterator[tuple[Path, str]]:
    for path in sorted((directory / builder.FIGURES_DIR).glob("*.svg")):
        yield path, path.read_text(encoding="utf-8")


def _step_texts(document: str) -> list[str]:
    root = ET.fromstring(document.encode())  # noqa: S314 - the build's own output
    return [
        t.text or ""
        for t in root.iter(f"{SVG}text")
        if (t.get("class") or "").startswith("step ")
    ]


# --------------------------------------------------------------------------- a real run


def test_two_png_builds_are_byte_identical(png_books: tuple[Path, Path]) -> None:
    """``--png`` writes a PNG beside each SVG, lists it in the manifest, and a second
    build from the same evidence writes the same bytes."""
    one, two = (_files(out) for out in png_books)
    assert one == two
    svgs = sorted(n for n in one if n.endswith(".svg"))
    pngs = sorted(n for n in one if n.endswith(".png"))
    assert len(svgs) == 3
    assert pngs == [n.removesuffix(".svg") + ".png" for n in svgs]
    for name in pngs:
        assert one[name].startswith(PNG_MAGIC), name
    listed = dict(
        reversed(line.split("  ", 1))  # type: ignore[misc]
        for line in one[builder.MANIFEST_FILE].decode().splitlines()
    )
    for name in svgs + pngs:
        assert listed[name] == hashlib.sha256(one[name]).hexdigest()


def test_every_label_of_every_figure_shows_in_cairosvg(png_books: tuple[Path, Path]) -> None:
    """Rendered by cairosvg, every step label of every figure puts ink inside its box,
    each arrow label's halo alone paints its box white, and no label ink falls outside;
    the PNG the build wrote is that rendering."""
    out = png_books[0]
    seen = 0
    for path, document in _svgs(out):
        labels = raster.labels(document)
        # Every label is checked: one box per step text the figure draws.
        assert [label.text for label in labels] == _step_texts(document), path.name
        assert any(label.halo for label in labels), path.name  # arrows, not notes only
        written = path.with_suffix(".png").read_bytes()
        assert written == raster.png(document)
        assert raster.legibility(document, written) == [], path.name
        seen += 1
    assert seen == 3


def test_figure_uses_no_feature_print_converters_drop(png_books: tuple[Path, Path]) -> None:
    """No paint-order, no CSS (style elements or attributes), no web fonts, no scripts,
    no external references: only presentation attributes."""
    for path, document in _svgs(png_books[0]):
        for banned in ("paint-order", "<style", "style=", "@font-face", "@import", "href",
                       "<script", "<foreignObject"):
            assert banned not in document, (path.name, banned)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        pytest.param(
            lambda d: d.replace('text-anchor="middle" fill=', 'text-anchor="middle" '
                                'stroke="#ffffff" stroke-width="4" paint-order="stroke" fill='),
            "no ink in its box",
            id="white-stroke-halo-under-paint-order",
        ),
        pytest.param(
            lambda d: re.sub(r'(<rect class="halo"[^>]*/>)\n(<text class="step[^\n]*</text>)',
                             r"\2\n\1", d),
            "no ink in its box",
            id="halo-painted-over-the-label",
        ),
        pytest.param(
            lambda d: re.sub(r'(<rect class="halo" x=")(\d+)(" y="\d+" width=")(\d+)',
                             lambda m: f"{m[1]}{int(m[2]) + int(m[4]) // 2 - 4}{m[3]}8", d),
            "label ink outside every label box",
            id="halo-narrower-than-its-label",
        ),
        pytest.param(
            lambda d: d.replace('height="16" fill="#ffffff"', 'height="16" fill="none"'),
            "its halo alone does not paint its box white",
            id="halo-that-does-not-hide-lane-lines",
        ),
    ],
)
def test_checker_sees_a_label_that_does_not_show(
    png_books: tuple[Path, Path], damage: Any, problem: str
) -> None:
    """The legibility check fails the SIGKILL figure drawn the way that broke in print
    (a white stroke under ``paint-order``), or with a halo painted over, narrower than,
    or not hiding the lines under its label; and ``--png`` refuses such a figure."""
    document = (png_books[0] / builder.FIGURES_DIR / f"{SIGKILL}.svg").read_text()
    broken = damage(document)
    assert broken != document
    problems = raster.legibility(broken)
    assert any(problem in p for p in problems), problems
    with pytest.raises(raster.Illegible, match=r"^figures/x\.svg: label"):
        raster.pngs({"figures/x.svg": broken.encode()})


# --------------------------------------------------------------------------- hostile evidence

HOSTILE = [
    "<script>alert(1)</script>",
    "a & b &amp; &#60; &lt;",
    "\"double\" 'single' `back`",
    "]]><![CDATA[x]]>",
    "</text><text onload='x'>",
    "ctl \x00\x01\x07\x08\x0b\x0c\x1b[31m\x7f\x85\x9b end",
    "bidi \u202ereversed\u202c zw\u200bsp",
    "surrogate \ud800 nonchar \ufffe\uffff private \ue000",
    "tabs\tand\nnew\r\nlines",
]


def _hostile_figure(text: str) -> tuple[figures.Figure, str]:
    events = [
        {"t": 0.1, "workflow": text, "kind": "created", "fence": 0, "detail": f"x={text}"},
        {"t": 0.2, "workflow": text, "kind": "claimed", "fence": 1, "detail": f"owner={text}"},
        {"t": 0.3, "workflow": text, "kind": "unknown", "fence": 1, "detail": f"cause={text}"},
        {"t": 0.4, "workflow": "w1", "kind": text, "fence": 1, "detail": f"by={text} {text}"},
        {"t": 0.5, "workflow": "w1", "kind": "manual_review", "fence": 1,
         "detail": f"reason={text}"},
    ]
    timeline = [
        {"t": 0.05, "actor": text, "what": "started"},
        {"t": 0.06, "actor": text, "what": f"BOOK_STAGE {text}"},
        {"t": 0.07, "actor": "experiment", "what": text},
        {"t": 0.08, "actor": "experiment", "what": f"SIGKILL {text}"},
    ]
    figure = figures.sequence(events, timeline)
    return figure, drawing.svg(figure, f"test_{text}[{text}]", f"A claim: {text}")


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_evidence_strings_cannot_add_markup_to_a_figure(text: str) -> None:
    """Experiment names, claims, event kinds and details, worker names and stages from
    signed (so attacker-writable) evidence reach the SVG escaped: it parses as XML 1.0
    with only the figure's own elements and attributes, and every label still shows."""
    figure, document = _hostile_figure(text)
    data = document.encode("utf-8")  # no lone surrogate survives
    root = ET.fromstring(data)  # noqa: S314 - strict: rejects control characters and markup
    tags = {element.tag.removeprefix(SVG) for element in root.iter()}
    assert tags <= {"svg", "title", "defs", "marker", "path", "rect", "text", "g", "line"}
    attributes = {name for element in root.iter() for name in element.attrib}
    assert not [name for name in attributes if name.startswith("on")]
    assert "]]>" not in document and "<script" not in document and "<![CDATA[" not in document
    visible = figures.shown(text)
    assert any(visible in (t.text or "") for t in root.iter(f"{SVG}text"))
    assert root.get("aria-label", "").startswith(f"test_{visible}")
    for t in root.iter(f"{SVG}text"):
        assert not re.search("[\x00-\x1f\x7f-\x9f\u202a-\u202e\ud800-\udfff\ufffe\uffff]",
                             t.text or "")
    lanes = root.find(f"{SVG}g[@class='lanes']")
    assert lanes is not None
    for lane in lanes.iter(f"{SVG}text"):  # a worker's name stays inside its 160 px box
        assert figures.text_width(lane.text or "", bold=True) <= 150, lane.text
    # The Mermaid form: one statement a line, no markup.
    diagram = figures.mermaid(figure)
    assert diagram.count("\n") == len(figure.lanes) + len(figure.steps) + 1
    assert "<" not in diagram and "\r" not in diagram
    assert raster.legibility(document) == []


def test_shown_makes_hidden_characters_visible_and_bounds_length() -> None:
    """Control and format characters become escapes a reader can see; whitespace runs
    become one space; a long text is cut with an ellipsis."""
    assert figures.shown("a\x07b\u202ec\ud800d") == "a\\x07b\\u202ec\\ud800d"
    assert figures.shown("  tab\there\n\nnext  ") == "tab here next"
    assert figures.shown("\U000e0001") == "\\U000e0001"
    long = figures.shown("x" * 10_000)
    assert len(long) == figures.MAX_LABEL and long.endswith("…")
    assert figures.shown("ok → w1 · done") == "ok → w1 · done"


def test_long_evidence_strings_keep_the_figure_bounded() -> None:
    """A megabyte of text in an event cannot make a megapixel-wide figure."""
    _, document = _hostile_figure("W" * 1_000_000)
    root = ET.fromstring(document.encode())  # noqa: S314 - the figure just drawn
    assert int(root.get("width", "0")) < 4000
    assert max(len(t.text or "") for t in root.iter(f"{SVG}text")) <= figures.MAX_CAPTION
    assert raster.legibility(document) == []


def test_png_without_cairosvg_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the book extra, ``--png`` names what to install instead of a traceback."""
    monkeypatch.setitem(sys.modules, "cairosvg", None)  # import cairosvg -> ImportError
    with pytest.raises(raster.RendererMissing, match=r"pip install '\.\[book\]'"):
        raster.pngs({"figures/x.svg": b"<svg/>"})


def test_damaged_evidence_draws_what_it_can_without_a_traceback() -> None:
    """Entries that are not objects, a claim that is not text, a thousand worker names
    and a thousand workflows: a bounded figure, never an exception."""
    events: list[Any] = ["not an event", 7, None, [1, 2]]
    events += [{"t": i / 1000, "workflow": f"w{i}", "kind": "created", "fence": 0}
               for i in range(1000)]
    timeline: list[Any] = ["oops", {"t": 0.0, "actor": "experiment", "what": "started"}]
    timeline += [{"t": i / 1000, "actor": f"worker-{i}", "what": "started"} for i in range(1000)]
    figure = figures.sequence(events, timeline)
    assert len(figure.lanes) == 3 + figures.MAX_WORKER_LANES
    assert len(figure.steps) == figures.MAX_STEPS + figures.MAX_FINAL_STATES
    # 1000 events and 1001 marks (the experiment's own "started" too), 1000 final states
    assert figure.omitted == 2001 - figures.MAX_STEPS + 1000 - figures.MAX_FINAL_STATES
    document = drawing.svg(figure, {"title": 1}, 12345)  # type: ignore[arg-type]
    root = ET.fromstring(document.encode())  # noqa: S314 - the figure just drawn
    assert root.findtext(f"{SVG}title") == "{'title': 1}"
    assert figures.sequence("not a list", 5) == figures.sequence([], [])  # type: ignore[arg-type]


def test_cli_png_without_cairosvg_exits_3(
    tree: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``lab book build --png`` without the extra: exit 3 (the environment), one line,
    and no book written."""
    monkeypatch.setitem(sys.modules, "cairosvg", None)
    monkeypatch.chdir(tree)
    out = tmp_path / "book"
    assert cli.main(["book", "build", "--evidence", "evidence", "--out", str(out), "--png"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lab book build: PNG figures need cairosvg")
    assert not out.exists()
