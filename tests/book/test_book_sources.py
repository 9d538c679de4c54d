"""The book's committed sources: a page per chapter, no number typed by hand, and
directives the build holds to the verified evidence.

The rule for numbers: in ``book/*.md`` a digit may stand only inside a directive
(``{{ ... }}``, where the evidence supplies the value), in a heading line, in a
chapter or experiment identifier (``ch05_crashes``, ``test_..._429_...``), or in one of
the names in ``NAMES_WITH_DIGITS`` (algorithm and tool names, not measurements).
Anywhere else (prose, lists, code spans, code blocks) a digit is a number typed by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_book import small  # noqa: F401 - the fixture: a genuine small PASS run

from lab import cli
from lab.book import builder, pages

REPO = Path(__file__).resolve().parents[2]
BOOK = REPO / "book"
NAMES_WITH_DIGITS = ("Ed25519", "sha256sum", "sha256", "SHA-256")
_IDENTIFIER = re.compile(r"\b(?:ch\d\d|test)_\w*")


def _hand_typed_numbers(text: str) -> list[str]:
    found: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            continue
        rest = re.sub(r"\{\{[^{}]*\}\}", "", line)
        rest = _IDENTIFIER.sub("", rest)
        for name in NAMES_WITH_DIGITS:
            rest = rest.replace(name, "")
        if re.search(r"\d", rest):
            found.append(f"{number}: {line.strip()}")
    return found


def test_the_sources_are_committed_pages() -> None:
    """book/ holds the landing page, a page per declared chapter and the three tables' pages."""
    manifest = json.loads((REPO / "experiments" / "manifest.json").read_text())
    chapters = {entry["chapter"] for entry in manifest["experiments"]}
    names = {path.stem for path in BOOK.glob("*.md")}
    assert {pages.INDEX, pages.CRASHPOINTS, pages.SIDE_BY_SIDE, pages.MODEL} <= names
    assert chapters <= names, sorted(chapters - names)
    for path in BOOK.glob("*.md"):
        text = path.read_text(encoding="utf-8")
        assert text.startswith("# "), path.name  # the title
        if path.stem in chapters:
            assert f"{{{{ results {path.stem} }}}}" in text, path.name
            intro = text.split("{{", 1)[0]
            assert len(intro.split()) > 60, f"{path.name}: no introduction"


@pytest.mark.parametrize("path", sorted(BOOK.glob("*.md")), ids=lambda p: p.name)
def test_no_number_is_typed_by_hand(path: Path) -> None:
    """Every measured number in a page comes through a directive."""
    assert _hand_typed_numbers(path.read_text(encoding="utf-8")) == []


def test_the_number_rule_sees_a_typed_number() -> None:
    """The control: a number in prose or a code span is caught; the exempt places are not."""
    assert _hand_typed_numbers("It took 3 s.\n") == ["1: It took 3 s."]
    assert _hand_typed_numbers("Run `lab run -n 2`.\n") == ["1: Run `lab run -n 2`."]
    assert _hand_typed_numbers(
        "# Chapter 12\n\nSee ch05_crashes and test_trusted_429_uses_timed_retry, "
        "{{ value ch05_crashes/test_x effects }} effects, an Ed25519 key, sha256sum.\n") == []


def _sources(tmp_path: Path, text: str) -> Path:
    directory = tmp_path / "sources"
    directory.mkdir()
    (directory / "index.md").write_text("# Home\n\n{{ verdict }}.\n\n{{ chapters }}\n")
    (directory / "ch01_x.md").write_text(text)
    return directory


def test_directives_pull_the_evidence_into_the_page(
    small: tuple[Path, Path], tmp_path: Path  # noqa: F811
) -> None:
    """results, details, figure and value come from the signed report, per page, in both forms."""
    root, evidence = small
    text = ("# Chapter x\n\nThe state was {{ value ch01_x/test_a state }}.\n\n"
            "{{ results ch01_x }}\n\n{{ figure ch01_x/test_a }}\n\n{{ details ch01_x }}\n")
    out = tmp_path / "site"
    builder.build(evidence, out, root=root, sources=_sources(tmp_path, text))
    page = (out / "ch01_x.md").read_text()
    assert "The state was succeeded." in page
    assert ('<tr><td data-label="Experiment"><a href="#x-test_a"><code>test_a</code></a></td>'
            '<td data-label="Claim">A claim.</td><td data-label="Result">passed</td>') in page
    assert page.count("![Sequence of test_a](figures/test_a.svg)") == 1  # once per page
    assert "The sequence of `test_a` is drawn above." in page
    html = (out / "ch01_x.html").read_text()
    assert "<p>The state was succeeded.</p>" in html
    assert '<img src="figures/test_a.svg" alt="Sequence of test_a"' in html
    assert '<a href="index.html">Home</a>' in html
    rows = json.loads((evidence / "runtime.json").read_text())["experiments"]
    assert f"**PASS**: {len(rows)} of {len(rows)} experiments passed" in (
        out / "index.md").read_text()
    assert "[1. Chapter x](ch01_x.md)" in (out / "index.md").read_text()
    assert '<a href="ch01_x.html">1. Chapter x</a>' in (out / "index.html").read_text()


@pytest.mark.parametrize(
    ("directive", "message"),
    [
        pytest.param("{{ value ch01_x/test_a effects }}",
                     "the verified evidence holds no observation effects for ch01_x/test_a",
                     id="missing-observation"),
        pytest.param("{{ value ch01_x/test_gone state }}",
                     "the verified evidence holds no experiment ch01_x/test_gone",
                     id="missing-experiment"),
        pytest.param("{{ results ch09_none }}",
                     "the verified evidence holds no chapter ch09_none", id="missing-chapter"),
        pytest.param("{{ figure ch01_x/test_a[p] }}",
                     "the verified evidence holds no result [p] of ch01_x/test_a",
                     id="missing-result"),
        pytest.param("{{ crashpoints }}",
                     "the verified evidence holds no crash-point matrix", id="missing-matrix"),
        pytest.param("{{ nonsense }}", "not an inline directive", id="unknown"),
        pytest.param("{{ value }} {{", "an unreadable directive: {{ value }} {{", id="malformed"),
        pytest.param("Seen {{ value ch01_x/test_a }}.", "needs CHAPTER/EXPERIMENT[param] and an "
                     "observation KEY", id="no-key"),
    ],
)
def test_a_directive_the_evidence_cannot_answer_fails_the_build(
    small: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    directive: str,
    message: str,
) -> None:
    """Exit 1, one line naming the page, the line and the directive; nothing written."""
    root, evidence = small
    sources = _sources(tmp_path, f"# Chapter x\n\nIntro.\n\n{directive}\n")
    (root / "book").symlink_to(sources)  # the default: <working tree>/book
    monkeypatch.chdir(root)
    out = tmp_path / "site"
    code = cli.main(["book", "build", "--evidence", str(evidence), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("lab book build: refused: book/ch01_x.md:5: "), lines[0]
    assert message in lines[0]
    assert not out.exists()


def test_the_sources_folder_is_never_the_output(
    small: tuple[Path, Path], tmp_path: Path  # noqa: F811
) -> None:
    """--out book would overwrite the pages it is built from: refused before any write."""
    root, evidence = small
    sources = _sources(tmp_path, "# Chapter x\n\n{{ results ch01_x }}\n")
    before = sorted(p.name for p in sources.iterdir())
    with pytest.raises(builder.Refused, match="would overwrite the book's sources"):
        builder.build(evidence, sources, root=root, sources=sources)
    assert sorted(p.name for p in sources.iterdir()) == before
