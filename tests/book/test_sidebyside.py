"""The findings and the side-by-side grid: built from the report alone, judged by the stated
rule, every outcome in words and in full, every piece of evidence through the one escaper."""

from __future__ import annotations

import re
from typing import Any

import pytest

from lab.book import findings, sidebyside, site


def _report() -> dict[str, Any]:
    return {
        "experiments": [
            {"chapter": "ch05_crashes",
             "name": "test_sigkill_non_idempotent_requires_manual_review",
             "outcome": "passed", "tests": ["ch05::a[after_tool]"]},
        ],
        "tests": [
            {"nodeid": "ch05::a[after_tool]", "outcome": "passed",
             "observations": [{"effects": 1, "state": "unknown", "window": "after_tool",
                               "review_reason": "non_idempotent_dispatched"}]},
            {"nodeid": "ch11::dbos[non_idempotent]", "outcome": "passed",
             "observations": [{"peer_window": "kill_after_effect_non_idempotent",
                               "system": "dbos", "effects": 2, "dbos_version": "9.9.9",
                               "dbos_status": [{"status": "SUCCESS"}],
                               "outcome": "step re-ran | <b>twice</b> after recovery: 2 tool "
                                          "calls, 2 effect(s), DBOS status SUCCESS"}]},
            {"nodeid": "ch11::dbos_lost", "outcome": "passed",
             "observations": [{"peer_window": "lost_reply", "system": "dbos", "effects": 1,
                               "dbos_status": [{"status": "ERROR"}],
                               "outcome": "DBOS status ERROR while the ledger holds 1"}]},
            {"nodeid": "ch12::lg", "outcome": "passed",
             "observations": [{"peer_window": "kill_after_effect_non_idempotent",
                               "system": "lab", "effects": 1, "via": "delegating",
                               "lab_state": "unknown",
                               "review_reason": "non_idempotent_dispatched",
                               "outcome": "one effect"},
                              {"peer_window": "not_a_window", "system": "dbos",
                               "outcome": "ignored"}]},
            {"nodeid": "ch12::lg_approval", "outcome": "passed",
             "observations": [{"peer_window": "approval_binding", "system": "langgraph",
                               "effects": 1, "approval_names_this_plan": False,
                               "outcome": "any resume value accepted"}]},
        ],
    }


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(("observation", "passed", "mark", "clause"), [
    ({"effects": 2}, True, findings.UNSAFE, findings.DUPLICATE),
    ({"effects": 1, "approval_names_this_plan": False}, True, findings.UNSAFE, findings.UNBOUND),
    ({"effects": 1, "resumed_seconds_after_expiry": 1.2}, True, findings.UNSAFE,
     findings.UNBOUND),
    ({"peer_window": "approval_binding", "effects": 1}, True, findings.UNSAFE,
     findings.UNBOUND),
    ({"peer_window": "approval_expiry", "effects": 1, "approval_names_this_plan": True}, True,
     findings.UNSAFE, findings.UNBOUND),
    ({"peer_window": "approval_binding", "effects": 0}, True, findings.SAFE, "no clause"),
    ({"effects": 1, "dbos_status": [{"status": "ERROR"}]}, True, findings.UNSAFE,
     findings.CONTRADICTED),
    ({"effects": 1, "dbos_status": [{"status": "CANCELLED"}]}, True, findings.UNSAFE,
     findings.CONTRADICTED),
    ({"effects": 0, "state": "succeeded"}, True, findings.UNSAFE, findings.UNREPORTED),
    ({"effects": 1, "state": "unknown", "review_reason": "non_idempotent_dispatched"}, True,
     findings.PERSON, "non_idempotent_dispatched"),
    ({"effects": 1, "state": "succeeded"}, True, findings.SAFE, "no clause"),
    ({"effects": 1, "dbos_status": [{"status": "SUCCESS"}]}, True, findings.SAFE, "no clause"),
    ({"effects": 1}, False, findings.UNSAFE, findings.FAILED),
])
def test_the_mark_follows_the_stated_rule(
    observation: dict[str, Any], passed: bool, mark: str, clause: str
) -> None:
    """Each clause of ``RULE`` marks its case unsafe; a stated wait for a person is its own
    mark; anything else is safe; every clause is written in the rule the page shows."""
    got, why = findings.judge(observation, passed)
    assert (got, clause in why) == (mark, True)
    for stated in (findings.DUPLICATE, findings.UNBOUND, findings.CONTRADICTED,
                   findings.UNREPORTED, findings.SAFE, findings.UNSAFE, findings.PERSON):
        assert stated in findings.RULE


def test_cells_come_from_observations_and_lab_experiments() -> None:
    table = findings.grid(_report())
    row = table["kill_after_effect_non_idempotent"]
    (dbos,) = row["dbos"]
    assert (dbos.mark, dbos.headline) == (findings.UNSAFE, "2 credits, DBOS reports SUCCESS")
    assert row["langgraph"] == []
    assert [(e.mark, e.via) for e in row["lab"]] == [
        (findings.PERSON, "test_sigkill_non_idempotent_requires_manual_review"),
        (findings.PERSON, "delegating"),
    ]
    assert row["lab"][0].headline == "waits for a person: the effect may have happened (1 credit)"
    assert findings.overall("lab", "kill_after_effect_non_idempotent", row["lab"]) == (
        findings.PERSON, "waits for a person: the effect may have happened (1 credit)")
    assert set(table) == set(findings.WINDOWS)
    assert findings.overall("dbos", "lost_reply", table["lost_reply"]["dbos"])[0] == (
        findings.UNSAFE)
    assert findings.overall("dbos", "approval_expiry", []) == (
        findings.NOT_APPLICABLE, findings.DOES_NOT_APPLY[("dbos", "approval_expiry")])
    assert findings.overall("lab", "approval_expiry", [])[0] == findings.ABSENT


# --------------------------------------------------------------------------- the pages


def _cells(lines: list[str]) -> list[str]:
    """The text of every cell of the grid in ``lines``, as a reader sees it."""
    html = "\n".join(lines)
    cells = re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", html, flags=re.S)
    return [re.sub(r"<[^>]+>", " ", cell).strip() for cell in cells]


def _rows(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith('<tr><th scope="row">')]


def test_findings_name_each_system_and_mark_every_cell_in_words() -> None:
    """The landing page's findings: the rule, a line per system, and every window's cell for
    every system with its mark as a word; nothing cut with '…'."""
    lines = sidebyside.findings_section(_report(), side_by_side="side-by-side.md")
    text = "\n".join(lines)
    assert f"How a cell is marked: {findings.RULE}" in lines
    count = len(findings.WINDOWS)
    assert lines[0].startswith(f"- **the lab** ({count} windows): ")  # the findings come first
    for system in ("the lab", "DBOS", "LangGraph", "Temporal"):
        assert f"- **{system}** ({count} windows): " in text
    cells = _cells(lines)
    assert cells and not any(cell.endswith("…") or "…" in cell for cell in cells)
    rows = _rows(lines)
    assert len(rows) == len(findings.WINDOWS)
    marks = ("safe", "unsafe", "needs a person", "does not apply", "not in this run")
    for row in rows:
        assert sum(row.count(f"{findings.SYMBOLS[m]} {m}</span>") for m in marks) == len(
            findings.SYSTEMS), row
    assert "✗ unsafe</span>: 2 credits, DBOS reports SUCCESS" in text
    assert "◐ needs a person</span>: waits for a person" in text
    assert "[Side by side](side-by-side.md)" in text


def test_side_by_side_shows_every_outcome_whole_with_its_mark_and_evidence() -> None:
    """No cell is cut; each says safe or unsafe in words; the experiment's account and the
    deciding clause are one click away; a window that cannot apply says why."""
    lines = sidebyside.section(_report(), lambda nodeid: f"ch.html#{nodeid}")
    text = "\n".join(lines)
    assert "…" not in text
    assert "<b>" not in text and "&lt;b&gt;twice&lt;/b&gt;" in text
    assert all(f'data-label="{t}"' in row for row in _rows(lines)
               for t in ("The lab", "DBOS", "LangGraph"))
    assert "step re-ran &#124; &lt;b&gt;" in text
    assert "- DBOS Transact 9.9.9" in lines
    row = next(line for line in _rows(lines) if "<code>kill_after_effect_non_idempotent<" in line)
    assert "✗ unsafe</span>: 2 credits" in row
    assert "<details><summary>how we know</summary>" in row
    assert f"Why: {findings.DUPLICATE}." in row
    assert '<a href="ch.html#ch11::dbos[non_idempotent]">the experiment</a>' in row
    expiry = next(line for line in _rows(lines) if "<code>approval_expiry<" in line)
    assert "does not apply</span>: DBOS Transact has no approval of its own" in expiry
    assert "ignored" not in text
    assert "not measured" not in text


def test_no_section_without_peer_observations() -> None:
    report = _report()
    report["tests"] = report["tests"][:1]
    assert sidebyside.section(report) == []


def test_the_findings_render_as_a_table_in_html() -> None:
    """The grid survives Markdown: one table row per window, inside its own box."""
    markdown = "# Home\n\n" + "\n".join(sidebyside.findings_section(_report(), side_by_side=None))
    html = site.html_page("index", markdown, {"index": "Home"}, "PASS").decode()
    assert '<div class="grid">' in html
    body = html.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    assert body.count("<tr>") == len(findings.WINDOWS)
