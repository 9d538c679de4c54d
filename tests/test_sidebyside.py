"""The side-by-side table is built from the report's evidence alone, through the one escaper."""

from __future__ import annotations

from typing import Any

from lab.book import sidebyside


def _report() -> dict[str, Any]:
    return {
        "experiments": [
            {"chapter": "ch05_crashes",
             "name": "test_sigkill_non_idempotent_requires_manual_review",
             "outcome": "passed", "tests": ["ch05::a[after_tool]"]},
        ],
        "tests": [
            {"nodeid": "ch05::a[after_tool]", "outcome": "passed",
             "observations": [{"effects": 1, "state": "unknown", "window": "after_tool"}]},
            {"nodeid": "ch11::dbos[non_idempotent]", "outcome": "passed",
             "observations": [{"peer_window": "kill_after_effect_non_idempotent",
                               "system": "dbos", "effects": 2, "dbos_version": "9.9.9",
                               "outcome": "step re-ran | <b>twice</b>"}]},
            {"nodeid": "ch12::lg", "outcome": "passed",
             "observations": [{"peer_window": "kill_after_effect_non_idempotent",
                               "system": "lab", "effects": 1, "via": "delegating",
                               "outcome": "one effect"},
                              {"peer_window": "not_a_window", "system": "dbos",
                               "outcome": "ignored"}]},
        ],
    }


def test_cells_come_from_observations_and_lab_experiments() -> None:
    table = sidebyside.cells(_report())
    row = table["kill_after_effect_non_idempotent"]
    assert row["dbos"] == ["step re-ran | <b>twice</b> [effects=2; passed]"]
    assert row["langgraph"] == []
    assert row["lab"] == [
        "test_sigkill_non_idempotent_requires_manual_review: passed (effects=1, state=unknown)",
        "delegating: one effect [effects=1; passed]",
    ]
    assert set(table) == set(sidebyside.WINDOWS)
    assert all(cell == [] for cell in table["approval_expiry"].values())


def test_section_escapes_evidence_and_marks_windows_nothing_measured() -> None:
    lines = sidebyside.section(_report())
    text = "\n".join(lines)
    assert "<b>" not in text and "&lt;b&gt;twice&lt;/b&gt;" in text
    assert "step re-ran \\| " in text
    assert "- DBOS Transact 9.9.9" in lines
    expiry = next(line for line in lines if line.startswith("| `approval_expiry` |"))
    assert expiry.count(sidebyside.NOT_MEASURED) == len(sidebyside.SYSTEMS)
    assert "ignored" not in text


def test_long_cells_are_compact_with_the_whole_text_one_click_away() -> None:
    """A cell longer than ``COMPACT`` shows its start; the rest is in a <details>."""
    lines = sidebyside.section(_report())
    row = next(line for line in lines if line.startswith("| `kill_after_effect_non_idempotent`"))
    long = "test_sigkill_non_idempotent_requires_manual_review: passed (effects=1, state=unknown)"
    assert f"<details><summary>{long[: sidebyside.COMPACT - 1]}…</summary>{long}</details>" in row
    assert "<br>delegating: one effect \\[effects=1; passed\\]" in row


def test_no_section_without_peer_observations() -> None:
    report = _report()
    report["tests"] = report["tests"][:1]
    assert sidebyside.section(report) == []
