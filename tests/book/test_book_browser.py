"""The built site in a real browser: headless Chromium opens the landing page, a chapter
and the crash-point matrix page of a book built from genuine evidence.

The evidence comes from a real inner run (against the outer run's PostgreSQL): the
chapter 5 SIGKILL experiment, copied from ``experiments/``, and a slice of the
crash-point matrix (the ``after_claim`` boundary against every fault a shared server
allows, on real worker and tool processes), signed with the run as chapter 12 does.

A page fails when it is blank, an image does not load, a link inside the site is
broken, the console shows an error, a request leaves the machine, or (at 1280 or 390 px)
it is wider than the window, a table cell ends in "…" or figure text is under 10 px.
The screenshots land next to the build (``<book>/_screenshots/``). Chromium is
required, not optional: without it this test fails (Debian: ``apt-get install
chromium``; CI installs it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_book import SIGKILL, SIGKILL_SOURCE, _inner, _only

from lab.book import browser, builder, pages
from tests.support import labtree

MATRIX_SLICE = '''
import os
from pathlib import Path

from lab import pytest_plugin, recorder
from lab.evidence import crashmatrix
from lab.faults import crashpoints


def test_crash_point_slice(request, observe):
    """Every fault at the after_claim boundary, both tool kinds: no violation."""
    matrix = crashpoints.run(os.environ["BOOK_LAB_DSN"], seed=17, jobs=2, only=("after_claim/",))
    pytest_plugin.reached_database(request.node)
    data = crashmatrix.canonical_json(matrix)
    given = request.config.getoption("lab_evidence", None) or recorder.DEFAULT_DIRECTORY
    directory = Path(request.config.invocation_params.dir) / str(given)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / crashmatrix.OUTPUT_FILE).write_bytes(data)
    observe({crashmatrix.SIGNED_KEY: crashmatrix.digest(data), "cells": len(matrix["cells"])},
            measurements=(crashmatrix.SIGNED_KEY, "cells"))
    assert matrix["violation_count"] == 0
'''
PAGES = ("index.html", "ch05_crashes.html", "crashpoints.html")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, lab_dsn: str) -> Path:
    """``<tmp>/book/_site``: the site built from a genuine run with a signed matrix slice."""
    root = tmp_path_factory.mktemp("browser-tree")
    (root / "pytest.ini").write_text("[pytest]\nxfail_strict = false\n")
    entries = [{"chapter": "ch05_crashes", "name": SIGKILL, "results": 1},
               {"chapter": "ch12_crashpoints", "name": "test_crash_point_slice", "results": 1}]
    for chapter, name, text in (
        ("ch05_crashes", "test_crashes.py", _only(SIGKILL_SOURCE, SIGKILL)),
        ("ch12_crashpoints", "test_slice.py", MATRIX_SLICE),
    ):
        (root / "experiments" / chapter).mkdir(parents=True)
        (root / "experiments" / chapter / name).write_text(text)
    labtree.publishable(root, entries)
    run = _inner(root, lab_dsn, "--lab-evidence", "evidence")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path_factory.mktemp("browser-book") / "book" / "_site"
    builder.build(root / "evidence", out, root=root)
    return out


def test_the_site_works_offline_in_chromium(site: Path) -> None:
    """Landing page, a chapter, the matrix, at 1280 and 390 px: text, loaded images, working
    links, no errors, no page wider than its window, no cell cut with '…', no figure text
    under 10 px."""
    screenshots = site.parent / "_screenshots"
    results = browser.check(site, PAGES, screenshots, widths=browser.WIDTHS)
    assert [(r.page, r.width) for r in results] == [
        (page, width) for page in PAGES for width in browser.WIDTHS]
    problems = [problem for result in results for problem in result.problems]
    assert problems == []
    by_page = {r.page: r for r in results if r.width == browser.WIDTH}
    assert by_page["ch05_crashes.html"].images >= 1  # the SIGKILL figure, loaded
    assert by_page["crashpoints.html"].images >= 1  # one figure per distinct outcome
    assert all(r.links > len(PAGES) for r in results)  # navigation on every page
    for result in results:
        assert result.screenshot.is_file() and result.screenshot.parent == screenshots
    matrix = (site / "crashpoints.html").read_text()
    assert "<details><summary>" in matrix and "after_claim" in matrix


def test_the_browser_check_sees_what_a_reader_would(site: Path, tmp_path: Path) -> None:
    """The control: a missing image, a broken link, a script error and a blank page are
    each reported, on a copy of the site."""
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    figure = next((broken / "figures").glob(f"{SIGKILL}*.svg"))
    figure.unlink()
    index = broken / "index.html"
    index.write_text(index.read_text().replace(
        "</main>", '<p><a href="gone.html">gone</a> <a href="ch05_crashes.html#nowhere">x</a>'
        "</p><script>undefined_function()</script></main>"))
    (broken / "blank.html").write_text("<!DOCTYPE html><html><body></body></html>")
    results = browser.check(broken, ["index.html", "ch05_crashes.html", "blank.html"],
                            tmp_path / "shots")
    found = {r.page: " | ".join(r.problems) for r in results}
    assert "broken link: gone.html" in found["index.html"]
    assert "broken anchor: ch05_crashes.html#nowhere" in found["index.html"]
    assert "uncaught exception" in found["index.html"]
    assert f"image did not load: {figure.as_uri()}" in found["ch05_crashes.html"]
    assert "blank page" in found["blank.html"]
    assert "single colour" in found["blank.html"]
    assert pages.INDEX == "index"
