"""scripts/check-findings: the landing page's peer marks, judged a second time from the run.

CI runs the script on the newcomer's genuine run; here each way it must fail is shown on
a page drawn by the book's own code from a small report, then altered.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from lab.book import findings
from tests.support import scripts

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check-findings"


def _script() -> ModuleType:
    """scripts/check-findings, imported as a module."""
    return scripts.load(SCRIPT)


def _report() -> dict[str, Any]:
    """One passed result for every peer window and system, each a single clean credit (its
    approval names the plan and was used before it expired), except DBOS's non-idempotent
    kill: two credits."""
    tests = []
    for window in findings.WINDOWS:
        for system in ("dbos", "langgraph", "temporal"):
            effects = 2 if (system, window) == ("dbos", "kill_after_effect_non_idempotent") \
                else 1
            tests.append({"nodeid": f"experiments/x/test_{system}.py::test_{window}",
                          "outcome": "passed",
                          "observations": [{"peer_window": window, "system": system,
                                            "effects": effects,
                                            "approval_names_this_plan": True,
                                            "resumed_seconds_after_expiry": -1.0}]})
    return {"tests": tests}


def _page(report: dict[str, Any]) -> str:
    """The grid as the landing page draws it, from the book's own code."""
    table = findings.grid(report)
    rows = []
    for window in findings.WINDOWS:
        cells = []
        for system in findings.SYSTEMS:
            mark, words = findings.overall(system, window, table[window][system])
            label = findings.SYSTEM_TITLES[system]
            label = label[0].upper() + label[1:]
            cells.append(f'<td data-label="{label}"><span class="mark '
                         f'{mark.replace(" ", "-")}">{mark}</span>: {words}</td>')
        rows.append(f'<tr><th scope="row">{findings.WINDOW_TITLES[window]}</th>'
                    f'{"".join(cells)}</tr>')
    return "\n".join(rows)


def test_a_page_whose_marks_follow_the_rule_passes() -> None:
    report = _report()
    assert _script().problems(report, _page(report), findings.WINDOW_TITLES) == []


def test_each_way_a_page_can_be_wrong_is_named() -> None:
    check = _script()
    report = _report()
    page = _page(report)
    dbos_kill = '<td data-label="DBOS"><span class="mark unsafe">'
    assert page.count(dbos_kill) == 1
    title = findings.WINDOW_TITLES["kill_after_effect_non_idempotent"]

    softened = page.replace(dbos_kill, '<td data-label="DBOS"><span class="mark safe">')
    assert check.problems(report, softened, findings.WINDOW_TITLES) == [
        f"{title} / DBOS: the page marks it 'safe', the rule says 'unsafe'"]

    unmeasured = page.replace(dbos_kill,
                              '<td data-label="DBOS"><span class="mark not-in-this-run">')
    assert f"{title} / DBOS: not measured in this run" in check.problems(
        report, unmeasured, findings.WINDOW_TITLES)

    dropped = page.replace(dbos_kill, '<td data-label="Somebody"><span class="mark unsafe">')
    assert f"{title} / DBOS: no cell on the page" in check.problems(
        report, dropped, findings.WINDOW_TITLES)

    assert "the run holds no peer result: nothing to check" in check.problems(
        {"tests": []}, page, findings.WINDOW_TITLES)


def test_the_rule_read_twice_agrees_with_the_book_on_each_clause() -> None:
    """The script's reading and ``findings.judge`` agree on one case of each clause."""
    check = _script()
    cases = [
        ({"effects": 2}, True), ({"effects": 1}, False),
        ({"effects": 1, "approval_names_this_plan": False}, True),
        ({"effects": 1, "resumed_seconds_after_expiry": 3}, True),
        ({"peer_window": "approval_binding", "effects": 1}, True),
        ({"peer_window": "approval_expiry", "effects": 1}, True),
        ({"peer_window": "approval_binding", "effects": 1, "approval_names_this_plan": True},
         True),
        ({"effects": 1, "dbos_status": [{"status": "ERROR"}]}, True),
        ({"effects": 0, "state": "succeeded"}, True),
        ({"effects": 1, "state": "unknown", "review_reason": "non_idempotent_dispatched"}, True),
        ({"effects": 1, "state": "succeeded"}, True),
    ]
    for observation, passed in cases:
        mark, _ = findings.judge(observation, passed)
        assert check.expected_mark(observation, passed) == mark.replace(" ", "-"), observation


def test_the_command_exits_1_naming_the_cell(tmp_path: Path) -> None:
    report = _report()
    evidence, site = tmp_path / "evidence", tmp_path / "site"
    evidence.mkdir()
    site.mkdir()
    (evidence / "runtime.json").write_text(json.dumps(report), encoding="utf-8")
    page = _page(report).replace('<td data-label="DBOS"><span class="mark unsafe">',
                                 '<td data-label="DBOS"><span class="mark safe">')
    (site / "index.html").write_text(page, encoding="utf-8")
    ran = subprocess.run([sys.executable, str(SCRIPT), str(evidence), str(site)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 1
    assert "the page marks it 'safe', the rule says 'unsafe'" in ran.stderr
    (site / "index.html").write_text(_page(report), encoding="utf-8")
    ran = subprocess.run([sys.executable, str(SCRIPT), str(evidence), str(site)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert (ran.returncode, ran.stdout.startswith("findings: 33 peer cells")) == (0, True)
