"""What the lab found, per system and failure window, judged safe or unsafe by one stated rule.

The landing page and the side-by-side page show the same findings: for the lab and each
peer (DBOS, LangGraph, Temporal) and each failure window, the outcome in words and
numbers ("2 credits", "waits for a person: the effect may have happened") and a mark
that ``judge`` applies to the verified observations by ``RULE``. Nothing here is typed
about a run: the numbers, states and reasons come from the report; what is declared is
the rule, the windows' names in words and, per system, why a window cannot apply to it
(``DOES_NOT_APPLY``).

Where the entries come from: a peer chapter's observation names its ``peer_window`` and
``system`` (``ch13_peer_dbos``, ``ch14_peer_langgraph``); the lab's own experiments for a
window are ``OWN_EXPERIMENTS`` (their observations), plus any peer-chapter observation
with ``system: "lab"`` (a LangGraph node or a Temporal activity delegating to the lab).
Pure: report in, entries and unescaped text out; callers escape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SYSTEMS = ("lab", "dbos", "langgraph", "temporal")
SYSTEM_TITLES = {"lab": "the lab", "dbos": "DBOS", "langgraph": "LangGraph",
                 "temporal": "Temporal"}
# Each failure window, in words a reader knows without the chapters.
WINDOW_TITLES: dict[str, str] = {
    "kill_after_effect_idempotent": "Process killed after the effect, idempotent tool",
    "kill_after_effect_non_idempotent": "Process killed after the effect, non-idempotent tool",
    "retry_budget_across_crash": "Retry budget across a crash",
    "lost_reply": "The tool's reply is lost after the effect",
    "new_version_left_behind": "A new version deployed while a workflow waits",
    "cancel_during_call": "Cancelled during the tool call",
    "postgres_restart_during_recovery": "PostgreSQL restarted between effect and checkpoint",
    "server_restart_during_call": "The durable server restarted during the call",
    "approval_binding": "Approval bound to the plan, tenant and role",
    "approval_expiry": "Approval used after it expired",
    "concurrent_resume": "Two processes resume one workflow",
}
WINDOWS: tuple[str, ...] = tuple(WINDOW_TITLES)
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
    # Temporal's durable store is its server; the lab's is its PostgreSQL server.
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
# Why a window cannot be run against a system: the system has nothing the window acts on.
# Declared, not measured; a window listed here and also measured shows the measurement.
DOES_NOT_APPLY: dict[tuple[str, str], str] = {
    ("dbos", "approval_binding"): (
        "DBOS Transact has no approval of its own: a wait for a person is a message the "
        "application sends (DBOS.send/recv), so what binds it is application code"),
    ("dbos", "approval_expiry"): (
        "DBOS Transact has no approval of its own, so nothing of DBOS can expire; an "
        "expiry would be application code"),
    ("dbos", "concurrent_resume"): (
        "DBOS Transact has no resume of a waiting workflow by a caller: recovery of a "
        "workflow is DBOS's own, by the executor that ran it"),
    ("langgraph", "retry_budget_across_crash"): (
        "LangGraph keeps no retry budget in its checkpoints: a RetryPolicy counts "
        "attempts inside one invoke, and nothing persists across a process"),
    ("langgraph", "new_version_left_behind"): (
        "LangGraph checkpoints carry no application version: whichever graph code loads "
        "a thread runs it, so no workflow can be left to an older version"),
    ("dbos", "server_restart_during_call"): (
        "DBOS Transact's durable store is its PostgreSQL system database: its restart is "
        "the PostgreSQL window"),
    ("langgraph", "server_restart_during_call"): (
        "LangGraph's durable store is its PostgreSQL checkpointer: its restart is the "
        "PostgreSQL window"),
    ("temporal", "postgres_restart_during_recovery"): (
        "The Temporal dev server keeps its state in SQLite, not PostgreSQL: its restart "
        "is the durable-server window"),
    ("temporal", "approval_expiry"): (
        "Temporal has no approval of its own: a wait for a person is a signal the "
        "workflow code handles, so an expiry would be application code"),
    ("temporal", "concurrent_resume"): (
        "Temporal has no resume by a caller: the server hands each task to one worker, "
        "and a second worker only gets it after a timeout"),
    ("langgraph", "cancel_during_call"): (
        "LangGraph (the library with its PostgreSQL checkpointer) has no cancel "
        "operation on a thread: stopping one means stopping its process"),
}

SAFE = "safe"
UNSAFE = "unsafe"
PERSON = "needs a person"
NOT_APPLICABLE = "does not apply"
ABSENT = "not in this run"
MARKS = (UNSAFE, PERSON, SAFE, NOT_APPLICABLE, ABSENT)  # worst first
SYMBOLS = {SAFE: "✓", UNSAFE: "✗", PERSON: "◐", NOT_APPLICABLE: "·", ABSENT: "?"}

WAITS = "waits for a person: the effect may have happened"
# The rule's clauses, each the reason an outcome is unsafe.
DUPLICATE = "more than one effect for one approved intent"
UNBOUND = "an effect without a binding approval"
CONTRADICTED = "an outcome claimed that the ledger contradicts"
UNREPORTED = "a loss that is not reported"
FAILED = "the experiment's claim did not hold"
RULE = (
    f"A cell is **{UNSAFE}** when the credit tool's ledger and the system's own record "
    f"show any of: {DUPLICATE}; {UNBOUND} (any resume value accepted, or an approval used "
    f"after it expired); {CONTRADICTED} (failure or cancellation reported while the effect "
    f"happened); {UNREPORTED} (success reported with no effect). In the approval windows"
    " a credit whose result does not say what the approval named, or when it expired, "
    f"counts as {UNBOUND}. It **{PERSON}** when"
    " the effect may have happened and the system says so and waits for a person "
    f"(nothing is hidden: this counts as safe). Otherwise it is **{SAFE}**."
)
# What a peer's result in an approval window must say of the approval before a credit in
# it can be judged bound: without it the rule fails closed.
APPROVAL_EVIDENCE = {"approval_binding": "approval_names_this_plan",
                     "approval_expiry": "resumed_seconds_after_expiry"}
# A peer's own status words that claim the effect did not (or need not) happen.
_CLAIMS_NO_EFFECT = frozenset({"ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED",
                               "cancelled", "failed"})
_CLAIMS_SUCCESS = frozenset({"SUCCESS", "succeeded"})


@dataclass(frozen=True)
class Entry:
    """One judged result: a system in a window, from one observation of one test."""

    system: str
    window: str
    mark: str
    headline: str  # outcome in words and numbers
    why: str  # the rule's clause that decided the mark, or why it is safe
    detail: str  # the experiment's own account of the outcome
    nodeid: str
    via: str = ""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def credits(effects: int) -> str:
    """``1 credit``, ``2 credits``: effects in the tool's ledger, in the tool's words."""
    return f"{effects} credit" if effects == 1 else f"{effects} credits"


def claimed_status(observation: Mapping[str, Any]) -> str | None:
    """What the system itself says became of the workflow: DBOS's last status row, or the
    lab's state; None when the observation holds neither."""
    rows = observation.get("dbos_status")
    if isinstance(rows, list) and rows and isinstance(rows[-1], Mapping):
        status = rows[-1].get("status")
        return str(status) if status is not None else None
    for key in ("lab_state", "state", "final_state"):
        if isinstance(observation.get(key), str):
            return str(observation[key])
    return None


def judge(observation: Mapping[str, Any], passed: bool = True) -> tuple[str, str]:
    """``(mark, why)`` for one observation by ``RULE``: the first unsafe clause that holds,
    else waits for a person, else safe. ``passed`` is the test's outcome: a claim that did
    not hold is unsafe whatever it observed."""
    if not passed:
        return UNSAFE, FAILED
    effects = _int(observation.get("effects"))
    if effects is not None and effects > 1:
        return UNSAFE, DUPLICATE
    if effects and observation.get("approval_names_this_plan") is False:
        return UNSAFE, f"{UNBOUND}: the approval does not name this plan"
    required = APPROVAL_EVIDENCE.get(str(observation.get("peer_window")))
    if effects and required is not None and required not in observation:
        return UNSAFE, f"{UNBOUND}: the result does not say {required}"
    late = observation.get("resumed_seconds_after_expiry")
    if effects and isinstance(late, int | float) and late > 0:
        return UNSAFE, f"{UNBOUND}: the approval had expired"
    status = claimed_status(observation)
    if effects and status in _CLAIMS_NO_EFFECT:
        return UNSAFE, f"{CONTRADICTED}: {status} while the ledger holds {credits(effects)}"
    if effects == 0 and status in _CLAIMS_SUCCESS:
        return UNSAFE, f"{UNREPORTED}: {status} with no credit in the ledger"
    if status == "unknown" and observation.get("review_reason"):
        return PERSON, f"held for a person: {observation['review_reason']}"
    return SAFE, "no clause of the rule holds"


def headline(observation: Mapping[str, Any], mark: str) -> str:
    """The outcome in words and numbers: credits in the ledger, a person's wait, the state."""
    effects = _int(observation.get("effects"))
    status = claimed_status(observation)
    parts: list[str] = []
    if effects is not None:
        parts.append(credits(effects))
    calls, budget = _int(observation.get("tool_calls")), _int(observation.get("budget"))
    if calls is not None and budget is not None:
        parts.append(f"{calls} tool calls for a budget of {budget}")
    if status and mark != PERSON:
        rows = observation.get("dbos_status")
        parts.append(f"DBOS reports {status}" if isinstance(rows, list) and rows
                     else f"ends {status}")
    said = ", ".join(parts)
    if mark == PERSON:
        return f"{WAITS} ({said})" if said else WAITS
    return said or "the claim held"


def _entry(system: str, window: str, test: Mapping[str, Any],
           observation: Mapping[str, Any]) -> Entry:
    mark, why = judge(observation, test.get("outcome") == "passed")
    detail = observation.get("outcome")
    return Entry(system=system, window=window, mark=mark,
                 headline=headline(observation, mark), why=why,
                 detail=detail if isinstance(detail, str) else "",
                 nodeid=str(test.get("nodeid")), via=str(observation.get("via") or ""))


def peer_observations(report: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], dict[str, Any]]]:
    """``(test, observation)`` for every observation that names a known window and system."""
    found: list[tuple[Mapping[str, Any], dict[str, Any]]] = []
    for test in report.get("tests", []):
        for observation in test.get("observations") or []:
            if (isinstance(observation, dict)
                    and observation.get("peer_window") in WINDOW_TITLES
                    and observation.get("system") in SYSTEMS):
                found.append((test, observation))
    return sorted(found, key=lambda pair: str(pair[0].get("nodeid")))


def _lab_entries(report: Mapping[str, Any], window: str) -> list[Entry]:
    rows = {(str(r.get("chapter")), str(r.get("name"))): r for r in report.get("experiments", [])}
    found: list[Entry] = []
    for key in OWN_EXPERIMENTS[window]:
        row = rows.get(key)
        if row is None:
            continue
        members = set(row.get("tests") or [])
        ran = sorted((t for t in report.get("tests", []) if t.get("nodeid") in members),
                     key=lambda t: str(t.get("nodeid")))
        for test in ran:
            tables = [o for o in test.get("observations") or [] if isinstance(o, dict)]
            for observation in tables or [{}]:
                entry = _entry("lab", window, test, observation)
                found.append(Entry(**{**entry.__dict__, "via": key[1]}))
    return found


def grid(report: Mapping[str, Any]) -> dict[str, dict[str, list[Entry]]]:
    """``{window: {system: [entries]}}`` for every window and system, from ``report``."""
    table: dict[str, dict[str, list[Entry]]] = {
        window: {system: [] for system in SYSTEMS} for window in WINDOWS}
    for window in WINDOWS:
        table[window]["lab"].extend(_lab_entries(report, window))
    for test, observation in peer_observations(report):
        window, system = str(observation["peer_window"]), str(observation["system"])
        table[window][system].append(_entry(system, window, test, observation))
    return table


def overall(system: str, window: str, entries: Sequence[Entry]) -> tuple[str, str]:
    """One cell's mark and its words: the worst mark of its entries with their outcomes,
    else why the window does not apply, else that this run did not measure it."""
    if entries:
        mark = min((e.mark for e in entries), key=MARKS.index)
        shown = sorted({e.headline for e in entries if e.mark == mark})
        if mark == PERSON:  # one "waits for a person", then what each result holds
            held = [h.removeprefix(WAITS).strip(" ()") for h in shown]
            return mark, f"{WAITS} ({'; '.join(h for h in held if h)})"
        return mark, "; ".join(shown)
    if (system, window) in DOES_NOT_APPLY:
        return NOT_APPLICABLE, DOES_NOT_APPLY[(system, window)]
    return ABSENT, "this run holds no experiment of this window"


def tally(table: Mapping[str, Mapping[str, Sequence[Entry]]], system: str) -> dict[str, int]:
    """How many windows of ``system`` carry each mark."""
    counts = dict.fromkeys(MARKS, 0)
    for window, row in table.items():
        counts[overall(system, window, row[system])[0]] += 1
    return counts
