"""One escaper: every renderer of the book sends evidence through ``lab.escape``.

Two halves. The code: no module of ``lab/book`` or ``lab/faults`` but ``escape``
imports ``html``, calls an ``escape`` function of its own, defines an escaper or
writes an HTML entity by hand. The behaviour: hostile strings in model evidence
fields, crash-point names and observation values come out of every renderer, and
out of the HTML the site is rendered to, inert: no script, no ``javascript:`` link,
no remote image, no code span broken open by a backtick, no table cell split by a pipe.
"""

from __future__ import annotations

import ast
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from lab import escape
from lab.book import crashpoints, model_chapter, pages, sidebyside, site
from lab.evidence import crashmatrix

REPO = Path(__file__).resolve().parents[2]
RENDERERS = sorted([*(REPO / "lab" / "book").glob("*.py"), *(REPO / "lab" / "faults").glob("*.py")])
ESCAPER = REPO / "lab" / "escape.py"
HOSTILE = [
    "[click](javascript:alert(1))",
    "![x](http://evil.example/x.png)",
    "<img src=http://evil.example/y.png onerror=alert(2)>",
    "<script>alert(3)</script>",
    "`code` breaks `out",
    "a | b | c",
    "# heading\n- list",
    "<https://evil.example/autolink>",
    "&lt;already&gt; & \u202e reversed",
]
_ENTITY = re.compile(r"&(lt|gt|amp|quot|#x?[0-9a-f]+);")


def test_no_renderer_escapes_on_its_own() -> None:
    """Only lab/escape.py imports html, defines an escaper or spells an entity."""
    offenders: list[str] = []
    for path in RENDERERS:
        if path == ESCAPER:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        name = path.relative_to(REPO).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name == "html" for a in node.names):
                offenders.append(f"{name}:{node.lineno}: import html")
            if isinstance(node, ast.ImportFrom) and node.module == "html":
                offenders.append(f"{name}:{node.lineno}: from html import")
            if isinstance(node, ast.FunctionDef) and re.fullmatch(
                    r"_?(md|esc|escape\w*|\w*_escape|html|xml|mermaid_text)", node.name):
                offenders.append(f"{name}:{node.lineno}: defines {node.name}")
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and _ENTITY.search(node.value)):
                offenders.append(f"{name}:{node.lineno}: an entity by hand")
    assert offenders == []


def test_the_escaper_module_is_the_one_every_renderer_imports() -> None:
    """Each module that renders evidence into Markdown, HTML or SVG imports the escaper."""
    for module in ("builder", "pages", "crashpoints", "sidebyside", "model_chapter", "figures",
                   "site", "chapter", "quantities"):
        source = (REPO / "lab" / "book" / f"{module}.py").read_text(encoding="utf-8")
        assert re.search(r"^from lab import .*\bescape\b", source, re.M) or (
            module == "builder"), module
    for path in (REPO / "lab" / "faults").glob("*.py"):  # lab.faults sits below lab.book
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("lab.book"), path.name


def _inert(markdown: str) -> None:
    """``markdown`` and its HTML hold nothing a hostile string could have made active."""
    html = site.html_page("p", markdown, {"p": "page"}, "PASS").decode()
    body = html.split("<main>", 1)[1]
    for raw in ("<script", "<img src=http", 'href="javascript:', 'src="http',
                'href="https://evil'):
        assert raw not in body, raw
    assert not re.search(r"<[^>]*onerror", body)
    # No evidence text turned into a link, an image or a heading of its own.
    assert "evil.example" not in "".join(re.findall(r'(?:href|src)="([^"]*)"', body))
    assert "<h1>heading" not in body


def _inert_svg(svg: bytes) -> None:
    """Well-formed, and no element or link a string could have added."""
    root = ET.fromstring(svg)  # noqa: S314 - the renderer's own output
    tags = {element.tag.rsplit("}", 1)[-1] for element in root.iter()}
    assert tags <= {"svg", "title", "text", "rect", "line", "g", "defs", "marker", "path",
                    "polygon", "tspan", "desc", "circle"}, tags
    for element in root.iter():
        assert not any(k.endswith("href") or k.startswith("on") for k in element.attrib)


@pytest.mark.parametrize("text", HOSTILE)
def test_md_and_code_are_inert_for_hostile_text(text: str) -> None:
    """In prose, in a list, in a table cell and in a code span: still text."""
    cell = escape.md(text)
    assert "\n" not in cell
    markdown = "\n".join([
        f"Prose {escape.md(text)} and {escape.code(text)}.",
        "",
        f"- {escape.md(text)}",
        "",
        "| a | b |",
        "| --- | --- |",
        f"| {escape.md(text)} | {escape.code(text)} |",
        "",
    ])
    _inert(markdown)
    table = site.markdown_it().render(markdown)
    row = table.split("<tbody>")[1]
    assert row.count("<td>") == 2  # a pipe cannot add a cell


@pytest.mark.parametrize("text", HOSTILE)
def test_html_text_is_inert_in_html_and_in_markdown(text: str) -> None:
    """Inside a raw HTML block: no markup for HTML, no link, image or code for Markdown."""
    out = escape.html_text(text)
    assert not any(c in out for c in '<>"[]!`|\n')
    _inert(f'<div class="grid">\n<table><tr><td>{out}</td></tr></table>\n</div>\n')


@pytest.mark.parametrize("text", HOSTILE)
def test_xml_is_inert_in_svg_and_html(text: str) -> None:
    out = escape.xml(text)
    assert "<" not in out and ">" not in out and '"' not in out


def _matrix(name: str) -> dict[str, Any]:
    cells = [
        {"id": f"{name}/kill/{kind}", "boundary": name, "fault": f"kill {name}", "kind": kind,
         "status": crashmatrix.PERSON, "final_state": name, "effects": 1, "why": name,
         "tool_calls": 1, "lookups": 0, "recovery_s": 1.5, "events": ["created", name]}
        for kind in ("idempotent", "non_idempotent")
    ]
    return {"format": crashmatrix.FORMAT, "cells": cells, "kinds": ["idempotent", "non_idempotent"],
            "boundaries": [{"name": name, "meaning": name}],
            "faults": [{"name": f"kill {name}"}], "coverage": {"reached": 1, "defined": 1},
            "summary": {}, "seed": name, "lease_s": name, "violation_count": 0,
            "omitted_faults": [{"name": name, "why": name}]}


@pytest.mark.parametrize("text", HOSTILE)
def test_crash_point_names_are_inert(text: str) -> None:
    """Boundary, fault, state and reason strings of a matrix: the page and its figures."""
    matrix = _matrix(text)
    markdown = "\n".join(crashpoints.render_markdown(matrix, signed_note="signed"))
    _inert(markdown)
    header = next(line for line in markdown.splitlines() if line.startswith("| Boundary"))
    rows = [line for line in markdown.splitlines()
            if line.startswith("| ") and line != header and not line.startswith("| ---")]
    assert len(rows) == 1
    for _, _, svg in crashpoints.outcome_figures(matrix):
        _inert_svg(svg)


@pytest.mark.parametrize("text", HOSTILE)
def test_model_evidence_fields_are_inert(text: str) -> None:
    """Every string field of a model report, hostile: the model page stays text."""
    report = {
        "model": text, "model_file": text, "model_sha256": text, "license": text,
        "engine": text, "engine_version": text, "threads": text, "temperature": text,
        "seed": text, "max_tokens": text, "total_seconds": 1.0,
        "case_set": {"version": text, "cases": text, "sha256": text},
        "summary": {"constrained": {
            "outcomes": {"rejected": 1}, "generations": 1, "schema_valid": 1, "as_expected": 1,
            "unsafe": 0, "rejected_by_reason": {text: 1}}},
        "performance": {}, "limitations": [text],
        "cases": [{"case": text, "mode": "constrained", "expect": text, "outcome": text}],
    }
    copies = {f"evidence/{model_chapter.MODEL_DIR}/model-experiment.json":
              json.dumps(report).encode()}
    lines, charts = model_chapter.section(copies, "evidence/", pinned=False)
    _inert("\n".join(lines))
    for svg in charts.values():
        _inert_svg(svg)


@pytest.mark.parametrize("text", HOSTILE)
def test_observation_values_are_inert_in_a_page(text: str) -> None:
    """An observation value, a claim and a peer outcome through the page directives."""
    report: dict[str, Any] = {
        "status": "PASS", "limits": [text],
        "experiments": [{"chapter": "ch01_x", "name": "test_a", "outcome": "passed",
                         "results": 1, "duration": 0.5, "claim": text,
                         "tests": ["x.py::test_a"]}],
        "tests": [{"nodeid": "x.py::test_a", "chapter": "ch01_x", "experiment": "test_a",
                   "outcome": "passed", "claim": text, "events": [], "timeline": [],
                   "trace_ids": [text],
                   "observations": [{"value": text, "peer_window": "lost_reply",
                                     "system": "dbos", "outcome": text, "effects": text}]}],
    }
    code = f"def test_a():\n    {text!r}\n    # {text}\n"
    evidence = pages.Evidence(report=report, copies={}, pinned_by=None,  # type: ignore[arg-type]
                              figure_paths={}, sources={"x.py": code})
    source = ("# Page\n\nSeen: {{ value ch01_x/test_a value }}.\n\n{{ results ch01_x }}\n\n"
              "{{ details ch01_x }}\n\n{{ sidebyside }}\n\n{{ findings }}\n\n{{ limits }}\n")
    markdown = pages.expand("p", source, evidence)
    _inert(markdown)
    assert "\n".join(sidebyside.section(report)) in markdown
