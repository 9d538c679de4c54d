"""The book reads anywhere: named quantities, navigation, crash-point figures that tell
the truth, and layout checks in headless Chromium at 1280 and 390 px.

No PostgreSQL here: pages are rendered from canned values and small sites written by the
test. Chromium is required (Debian: ``apt-get install chromium``; CI installs it).
"""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from lab.book import browser, chapter, crashpoints, quantities, site
from lab.evidence import crashmatrix

SVG = "{http://www.w3.org/2000/svg}"


# --------------------------------------------------------------------------- quantities


def test_an_observation_is_a_table_of_named_values_with_units() -> None:
    """Chapter 9's ``effects=119, workflows=120`` reads as named values with units; a
    measurement says it varies; nothing is JSON."""
    observation = {"effects": 119, "workflows": 120, "wall_s": 31.5, "lease_s": 1,
                   "states": {"succeeded": 119, "unknown": 1}, "violations": 0}
    lines = quantities.table(observation, {"effects": "measurement", "workflows": "fact"})
    text = "\n".join(lines)
    assert "| effects in the tool's ledger | 119 credits | measured: varies by run |" in text
    assert "| workflows | 120 workflows |  |" in text
    assert "| wall-clock time | 31.5 s |" in text
    assert "| lease | 1 s |" in text
    assert "| invariant violations | 0 violations |" in text
    assert "| workflows by final state | succeeded: 119; unknown: 1 |" in text
    rows = [line for line in lines if line.startswith("| ")]
    assert not any("{" in row or "=" in row for row in rows)


def test_an_undeclared_key_still_reads_in_words() -> None:
    """The fallback: the key's words, a unit from its suffix, values in words."""
    rows = quantities.rows({"time_to_drain_s": 2.25, "kept_order": True, "names": ["a", "b"],
                            "nested": {"inner_key": None}})
    assert rows == [
        ("kept order", "yes", ""),
        ("names", "a, b", ""),
        ("nested", "inner_key: none", ""),
        ("time to drain", "2.25 s", ""),
    ]
    assert quantities.brief({"effects": 1, "state": "succeeded", "outcome": "long prose"},
                            quantities.FIRST) == (
        "effects in the tool's ledger: 1 credit; final state: succeeded")


def test_the_glossary_lists_every_declared_quantity() -> None:
    lines = quantities.glossary()
    assert len(lines) == len(quantities.QUANTITIES) + 3
    assert any(line.startswith("| `effects` | effects in the tool's ledger | credit |")
               for line in lines)


# --------------------------------------------------------------------------- navigation


def test_navigation_numbers_chapters_by_their_names_and_lists_the_contents() -> None:
    """Sidebar and menu say ``9. Chaos``; each page opens with its own contents list; the
    narrow menu is there for a phone."""
    titles = {"index": "Home", "ch09_chaos": "Chaos", "ch10_x": "Ten", "side-by-side": "Side"}
    markdown = "# Chaos\n\n## Results\n\ntext\n\n## Every experiment\n\n### `test_a`\n\nx\n"
    html = site.html_page("ch09_chaos", markdown, titles, "PASS").decode()
    assert html.count('aria-current="page">9. Chaos</a>') == 2  # sidebar and menu
    assert ">10. Ten</a>" in html and ">Home</a>" in html and ">Side</a>" in html
    assert '<nav class="contents" aria-label="On this page">' in html
    assert '<li><a href="#s-results">Results</a></li>' in html
    assert '<li><a href="#s-test-a">test_a</a></li>' in html
    assert '<h2 id="s-results">Results</h2>' in html
    assert html.index('<nav class="contents"') > html.index("<h1>Chaos</h1>")
    assert '<header class="narrow">' in html and "@media (max-width: 800px)" in site.STYLE


def test_the_code_beside_the_result_is_the_function_at_its_line() -> None:
    source = "import x\n\n\n@mark\ndef test_a(lab):\n    '''Claim.'''\n    assert 1\n"
    evidence = chapter.Evidence(report={"tests": []}, copies={}, pinned_by=None,
                                figure_paths={}, sources={"experiments/t.py": source})
    lines = chapter.source({"name": "test_a"}, [{"nodeid": "experiments/t.py::test_a"}],
                           evidence)
    text = "\n".join(lines)
    assert "<summary>Code: experiments/t.py, line 5</summary>" in text
    assert "```python\n@mark\ndef test_a(lab):\n    '''Claim.'''\n    assert 1\n```" in text
    missing = chapter.source({"name": "test_a"}, [{"nodeid": "experiments/u.py::test_a"}],
                             evidence)
    assert "Code: experiments/u.py (function test_a)." in missing[0]


# --------------------------------------------------------------------------- crash points


def _batch_matrix(history: bool) -> dict[str, Any]:
    events = ["created", "approved", "claimed", "manual_review"] * 3
    cell: dict[str, Any] = {
        "id": "b/kill/non_idempotent", "boundary": "after_batch_dispatch", "fault": "kill",
        "kind": "non_idempotent", "status": crashmatrix.PERSON, "final_state": "unknown",
        "effects": 3, "why": "non_idempotent_dispatched", "workflows": 3,
        "waiting_for_person": 3, "events": events}
    if history:
        cell["history"] = [
            {"workflow": f"wf_{n}", "kind": kind,
             "detail": "reason=non_idempotent_dispatched" if kind == "manual_review" else ""}
            for n in ("a1", "b2", "c3") for kind in events[:4]]
    return {"format": crashmatrix.FORMAT, "cells": [cell], "kinds": ["non_idempotent"],
            "boundaries": [{"name": "after_batch_dispatch", "meaning": "m"}],
            "faults": [{"name": "kill"}], "coverage": {}, "summary": {}}


def _labels(svg: bytes) -> str:
    root = ET.fromstring(svg)  # noqa: S314 - the renderer's own output
    return "\n".join(t.text or "" for t in root.iter(f"{SVG}text"))


def test_a_batch_figure_names_each_workflow_and_the_review_reason() -> None:
    (_, _, svg), = crashpoints.outcome_figures(_batch_matrix(history=True))
    labels = _labels(svg)
    for workflow in ("wf_a1", "wf_b2", "wf_c3"):
        assert re.search(rf"{workflow} stays \w+: manual review \(non_idempotent_dispatched\)",
                         labels), workflow
    assert "wf-1" not in labels and "manual review ()" not in labels


def test_an_older_matrix_still_shows_the_recorded_reason() -> None:
    (_, _, svg), = crashpoints.outcome_figures(_batch_matrix(history=False))
    labels = _labels(svg)
    assert "manual review (non_idempotent_dispatched)" in labels
    assert "manual review ()" not in labels and "wf-1" not in labels


def test_the_matrix_scrolls_in_its_own_box() -> None:
    lines = crashpoints.render_markdown(_batch_matrix(history=True), signed_note="signed")
    html = site.markdown_it().render("\n".join(lines))
    assert re.search(r'<div class="scroll"[^>]*>\s*<table>', html)


# --------------------------------------------------------------------------- in Chromium

GOOD = """<!DOCTYPE html><html><head><meta name="viewport"
content="width=device-width, initial-scale=1"><link rel="stylesheet" href="style.css"></head>
<body><main><h1>A readable page</h1><p>{text}</p>
<div class="grid"><table><tr><td>✗ unsafe: 2 credits</td><td>✓ safe: 1 credit</td></tr></table>
</div><div class="scroll"><table><tr>{wide}</tr></table></div>
<p><img src="figure.svg" alt="figure"></p></main></body></html>"""
BAD = """<!DOCTYPE html><html><head><meta name="viewport"
content="width=device-width, initial-scale=1"></head><body><main><h1>A broken page</h1>
<p>{text}</p><div style="width: 1600px">too wide for any window here</div>
<table><tr><td>step re-ran after recovery: 2 tool calls, 1…</td></tr></table>
<p><img src="figure.svg" alt="figure" style="width: 300px"></p></main></body></html>"""
FIGURE = """<svg xmlns="http://www.w3.org/2000/svg" width="900" height="120" font-size="12">
<rect width="900" height="120" fill="#fff"/><text x="10" y="40" font-size="11">a label</text>
<text x="10" y="80">another label</text></svg>"""


def _site(root: Path) -> Path:
    root.mkdir()
    text = "Words a reader reads on the page. " * 8
    wide = "".join(f"<td>cell {n}</td>" for n in range(30))
    (root / "good.html").write_text(GOOD.format(text=text, wide=wide), encoding="utf-8")
    (root / "bad.html").write_text(BAD.format(text=text), encoding="utf-8")
    (root / "figure.svg").write_text(FIGURE, encoding="utf-8")
    (root / "style.css").write_text(site.STYLE, encoding="utf-8")
    return root


def test_the_layout_checks_pass_a_good_page_and_fail_a_bad_one(tmp_path: Path) -> None:
    """At 1280 and 390 px: a page whose wide table and figure scroll in their own boxes
    passes; a page wider than the window, a cell ending in '…' and a figure shrunk until
    its labels are under 10 px are each reported, at each width."""
    assert shutil.which("chromium") or browser.find_chromium()
    results = browser.check(_site(tmp_path / "site"), ["good.html", "bad.html"],
                            tmp_path / "shots", widths=browser.WIDTHS)
    assert [(r.page, r.width) for r in results] == [
        ("good.html", 1280), ("good.html", 390), ("bad.html", 1280), ("bad.html", 390)]
    good = [r for r in results if r.page == "good.html"]
    assert [r.problems for r in good] == [[], []]
    for result in results:
        if result.page != "bad.html":
            continue
        found = " | ".join(result.problems)
        assert f"bad.html at {result.width} px: the page is " in found
        assert "(horizontal overflow)" in found
        assert "a table cell ends in '…': step re-ran after recovery: 2 tool calls, 1…" in found
        assert "figure text drawn at 3.7 px (under 10)" in found
    assert (tmp_path / "shots" / "bad-390.png").is_file()
    assert (tmp_path / "shots" / "bad.png").is_file()
