"""The book's side-by-side table: per failure window, what the lab, DBOS, LangGraph and
Temporal did.

Every cell comes from the verified report, nothing is written by hand: the peer
columns from the observations the peer chapters (``ch13_peer_dbos``,
``ch14_peer_langgraph``, ``ch16_peer_temporal``) record with ``peer_window``,
``system``, ``effects`` and a measured ``outcome``; the lab column from the lab's own
experiments for that window (``OWN_EXPERIMENTS``: their result and observed facts) plus
any observation a peer chapter records with ``system: "lab"`` (a LangGraph node
delegating to the lab). A window nothing measured says so. Pure: report in, Markdown
lines out, every piece of evidence through ``lab.escape``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lab import escape

SYSTEMS = ("lab", "dbos", "langgraph", "temporal")
SYSTEM_TITLES = {"lab": "lab", "dbos": "DBOS", "langgraph": "LangGraph", "temporal": "Temporal"}
WINDOWS: tuple[str, ...] = (
    "kill_after_effect_idempotent",
    "kill_after_effect_non_idempotent",
    "retry_budget_across_crash",
    "lost_reply",
    "new_version_left_behind",
    "cancel_during_call",
    "postgres_restart_during_recovery",
    "server_restart_during_call",
    "approval_binding",
    "approval_expiry",
    "concurrent_resume",
)
# The lab's own experiments for each window: (chapter, experiment).
OWN_EXPERIMENTS: dict[str, tuple[tuple[str, str], ...]] = {
    "kill_after_effect_idempotent": (
        ("ch05_crashes", "test_sigkill_after_tool_reconciles_existing_effect"),
    ),
    "kill_after_effect_non_idempotent": (
        ("ch05_crashes", "test_sigkill_non_idempotent_requires_manual_review"),
    ),
    "retry_budget_across_crash": (
        ("ch07_retries_and_versions", "test_trusted_429_exhausts_persistent_budget"),
        ("ch04_unknown_outcomes", "test_unknown_404_uses_original_key_and_stops_at_budget"),
    ),
    "lost_reply": (
        ("ch04_unknown_outcomes", "test_commit_reply_lost_becomes_unknown_then_reconciled"),
        ("ch04_unknown_outcomes", "test_non_idempotent_unknown_never_automatically_replays"),
    ),
    "new_version_left_behind": (
        ("ch07_retries_and_versions", "test_persisted_version_two_rejected_by_old_worker"),
    ),
    "cancel_during_call": (
        ("ch06_cancellation", "test_cancel_after_effect_preserves_succeeded_fact"),
        ("ch06_cancellation", "test_cancellation_during_lookup_cannot_requeue"),
    ),
    "postgres_restart_during_recovery": (
        ("ch11_database_faults", "test_postgres_killed_mid_window_recovers_without_violation"),
    ),
    # Temporal's durable store is its server: the lab's is its PostgreSQL server.
    "server_restart_during_call": (
        ("ch11_database_faults", "test_postgres_killed_mid_window_recovers_without_violation"),
    ),
    "approval_binding": (
        ("ch02_approval", "test_approval_binds_tenant_role_and_fingerprint"),
    ),
    "approval_expiry": (
        ("ch02_approval", "test_approval_expires_while_queued"),
        ("ch02_approval", "test_approval_expires_after_claim"),
    ),
    "concurrent_resume": (
        ("ch05_crashes", "test_two_worker_processes_claim_exactly_one"),
        ("ch03_leases", "test_two_claimers_cannot_own_one_workflow"),
    ),
}
# Facts of a lab experiment's observations worth a cell, in this order.
LAB_FACTS = ("effects", "state", "review_reason", "attempts", "claims", "manual_review")
NOT_MEASURED = "not measured in this run"


def peer_observations(report: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], dict[str, Any]]]:
    """``(test, observation)`` for every observation that names a known window and system."""
    found: list[tuple[Mapping[str, Any], dict[str, Any]]] = []
    for test in report.get("tests", []):
        for observation in test.get("observations") or []:
            if (isinstance(observation, dict)
                    and observation.get("peer_window") in WINDOWS
                    and observation.get("system") in SYSTEMS):
                found.append((test, observation))
    return sorted(found, key=lambda pair: str(pair[0].get("nodeid")))


def _lab_cells(report: Mapping[str, Any], window: str) -> list[str]:
    rows = {(str(r.get("chapter")), str(r.get("name"))): r for r in report.get("experiments", [])}
    tests = report.get("tests", [])
    cells: list[str] = []
    for key in OWN_EXPERIMENTS[window]:
        row = rows.get(key)
        if row is None:
            continue
        facts: list[str] = []
        ran = [t for t in tests if t.get("nodeid") in set(row.get("tests") or [])]
        for test in sorted(ran, key=lambda t: str(t.get("nodeid"))):
            for observation in test.get("observations") or []:
                if isinstance(observation, dict):
                    shown = [f"{k}={_text(observation[k])}" for k in LAB_FACTS if k in observation]
                    if shown:
                        facts.append(", ".join(shown))
        detail = f" ({'; '.join(facts)})" if facts else ""
        cells.append(f"{key[1]}: {row.get('outcome')}{detail}")
    return cells


def _peer_cell(test: Mapping[str, Any], observation: Mapping[str, Any]) -> str:
    via = observation.get("via")
    prefix = f"{via}: " if via else ""
    return (f"{prefix}{_text(observation.get('outcome'))} "
            f"[effects={_text(observation.get('effects'))}; {test.get('outcome')}]")


def cells(report: Mapping[str, Any]) -> dict[str, dict[str, list[str]]]:
    """``{window: {system: [cell text, ...]}}``: unescaped text, every piece from ``report``."""
    table: dict[str, dict[str, list[str]]] = {
        window: {system: [] for system in SYSTEMS} for window in WINDOWS
    }
    for window in WINDOWS:
        table[window]["lab"].extend(_lab_cells(report, window))
    for test, observation in peer_observations(report):
        cell = _peer_cell(test, observation)
        table[str(observation["peer_window"])][str(observation["system"])].append(cell)
    return table


def configuration(report: Mapping[str, Any]) -> list[str]:
    """The peers' versions and settings as the observations recorded them, sorted."""
    seen: set[str] = set()
    for _, observation in peer_observations(report):
        if "dbos_version" in observation:
            seen.add(f"DBOS Transact {_text(observation['dbos_version'])}")
        if "dbos_config" in observation:
            seen.add(f"DBOS step settings {_text(observation['dbos_config'])}")
        if "langgraph_config" in observation:
            seen.add(f"LangGraph settings {_text(observation['langgraph_config'])}")
        if "temporal_config" in observation:
            seen.add(f"Temporal settings {_text(observation['temporal_config'])}")
        temporal = observation.get("temporal_versions")
        if isinstance(temporal, dict):
            seen.add(f"temporalio {_text(temporal.get('temporalio'))}, Temporal Server "
                     f"{_text(temporal.get('server'))} (dev server, SQLite)")
        versions = observation.get("langgraph_versions")
        if isinstance(versions, dict):
            seen.add(", ".join(f"{k} {_text(v)}" for k, v in sorted(versions.items())))
    return sorted(seen)


COMPACT = 44  # characters a side-by-side cell shows before "open for the rest"


def section(report: Mapping[str, Any]) -> list[str]:
    """The Markdown section, every piece of evidence through ``escape``; compact cells, each
    with its full text one click away. None without peer observations (a run that did
    not include the peer chapters)."""
    if not peer_observations(report):
        return []
    lines = [
        "Each peer cell is the outcome its chapter measured and asserted (effects counted in "
        "the credit tool's ledger); each lab cell names the lab's experiments for that "
        "window, their result and observed facts. Open a cell for its full text.",
        "",
    ]
    lines += [f"- {escape.md(item)}" for item in configuration(report)]
    lines += [
        "",
        "| Window | " + " | ".join(SYSTEM_TITLES[s] for s in SYSTEMS) + " |",
        "| --- |" + " --- |" * len(SYSTEMS),
    ]
    for window, row in cells(report).items():
        rendered = [_join(row[system]) for system in SYSTEMS]
        lines.append(f"| {escape.code(window)} | " + " | ".join(rendered) + " |")
    return [*lines, ""]


def compact(text: str) -> str:
    """A cell's text cut to ``COMPACT`` characters, the whole of it one click away."""
    if len(text) <= COMPACT:
        return escape.md(text)
    return (f"<details><summary>{escape.md(text[: COMPACT - 1] + '…')}</summary>"
            f"{escape.md(text)}</details>")


def _join(texts: Sequence[str]) -> str:
    return "<br>".join(compact(text) for text in texts) if texts else escape.md(NOT_MEASURED)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={_text(v)}" for k, v in sorted(value.items()))
    if isinstance(value, list):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    return str(value)
