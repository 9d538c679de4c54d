"""The invariant checker can fail: each kind of violation, hand-made, is found and named.

Plain data only, no database: a clean history that exercises every legitimate
path of the chaos run (a 429 retry of a non-idempotent plan, a reconciled
lease expiry, an effect awaiting review, a spent budget) gives zero
violations, and each corruption of it gives exactly the kind it breaks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from lab.faults import invariants
from lab.faults.invariants import (
    AbsenceFact,
    Acknowledged,
    BarrierFact,
    EffectFact,
    EventFact,
    History,
    Violation,
    WorkflowFact,
)


def _receipt(key: str, fp: str, receipt: str) -> dict[str, str]:
    return {"receipt_id": receipt, "effect_key": key, "fingerprint": fp}


class _Builder:
    """Appends events with increasing ``seq``, as the database's bigserial would."""

    def __init__(self) -> None:
        self.events: list[EventFact] = []

    def add(self, workflow_id: str, *kinds_and_fences: tuple[str, int]) -> None:
        for kind, fence in kinds_and_fences:
            self.events.append(EventFact(len(self.events) + 1, workflow_id, kind, fence))


def clean_history() -> History:
    """Every legitimate path the chaos run produces, with no violation."""
    b = _Builder()
    workflows = [
        # Claimed, dispatched, completed under its own fence.
        WorkflowFact("wf-ok", "succeeded", True, "k-ok", "fp-ok", 1, 1, 3,
                     result=_receipt("k-ok", "fp-ok", "r-ok")),
        # Reply lost on a non-idempotent tool: the effect happened, a person decides.
        WorkflowFact("wf-review", "unknown", False, "k-review", "fp-review", 1, 1, 3,
                     review_reason="non_idempotent"),
        # A 429 (definite non-effect), then a kill: lease expired, the lookup found it.
        WorkflowFact("wf-found", "succeeded", True, "k-found", "fp-found", 2, 2, 3,
                     result=_receipt("k-found", "fp-found", "r-found")),
        # Non-idempotent: a 429, then a second dispatch that completed.
        WorkflowFact("wf-429", "succeeded", False, "k-429", "fp-429", 2, 2, 3,
                     result=_receipt("k-429", "fp-429", "r-429")),
        # Three 429s: the persistent budget is spent, nothing happened.
        WorkflowFact("wf-spent", "failed", True, "k-spent", "fp-spent", 3, 3, 3,
                     review_reason="attempt_budget_spent"),
        # Killed three times before dispatch: every lookup absent, budget spent, review.
        WorkflowFact("wf-absent", "unknown", True, "k-absent", "fp-absent", 3, 3, 3,
                     review_reason="attempt_budget_spent"),
        WorkflowFact("wf-cancel", "cancelled", True, "k-cancel", "fp-cancel", 0, 0, 3),
    ]
    b.add("wf-ok", ("created", 0), ("approved", 0), ("claimed", 1), ("dispatching", 1),
          ("completed", 1))
    b.add("wf-review", ("created", 0), ("approved", 0), ("claimed", 1), ("dispatching", 1),
          ("unknown", 1), ("manual_review", 1))
    b.add("wf-found", ("created", 0), ("approved", 0), ("claimed", 1), ("dispatching", 1),
          ("retry_scheduled", 1), ("claimed", 2), ("dispatching", 2), ("lease_expired", 2),
          ("reconciled", 2))
    b.add("wf-429", ("created", 0), ("approved", 0), ("claimed", 1), ("dispatching", 1),
          ("retry_scheduled", 1), ("claimed", 2), ("dispatching", 2), ("completed", 2))
    b.add("wf-spent", ("created", 0), ("approved", 0))
    for fence in (1, 2, 3):
        b.add("wf-spent", ("claimed", fence), ("dispatching", fence))
        b.add("wf-spent", ("retry_scheduled" if fence < 3 else "failed", fence))
    b.add("wf-absent", ("created", 0), ("approved", 0))
    for fence in (1, 2, 3):
        b.add("wf-absent", ("claimed", fence), ("lease_expired", fence), ("reconciled", fence))
    b.add("wf-absent", ("manual_review", 3))
    b.add("wf-cancel", ("created", 0), ("approved", 0), ("cancel_requested", 0),
          ("cancelled", 0))
    effects = [
        EffectFact(1, "k-ok", "fp-ok", "r-ok", True, start_id="st-ok"),
        EffectFact(2, "k-review", "fp-review", "r-review", False, start_id="st-review"),
        EffectFact(3, "k-found", "fp-found", "r-found", True),
        EffectFact(4, "k-429", "fp-429", "r-429", False),
    ]
    barriers = [BarrierFact("st-ok", "wf-ok", 1), BarrierFact("st-review", "wf-review", 1)]
    # What workers printed after their commits returned: all of it is still there.
    acknowledged = [
        Acknowledged("wf-ok", "succeeded", 1),
        Acknowledged("wf-review", "unknown", 1),
        Acknowledged("wf-spent", "ready", 2),
    ]
    return History(workflows, b.events, effects, barriers, acknowledged)


def _workflow(history: History, workflow_id: str) -> WorkflowFact:
    return next(wf for wf in history.workflows if wf.id == workflow_id)


def _with_workflow(history: History, changed: WorkflowFact) -> History:
    workflows = [changed if wf.id == changed.id else wf for wf in history.workflows]
    return replace(history, workflows=workflows)


def _with_events(history: History, workflow_id: str, *kinds: tuple[str, int]) -> History:
    """Replace one workflow's events with ``kinds``, appended after all others."""
    others = [e for e in history.events if e.workflow_id != workflow_id]
    start = max(e.seq for e in history.events) + 1
    mine = [EventFact(start + i, workflow_id, k, f) for i, (k, f) in enumerate(kinds)]
    return replace(history, events=[*others, *mine])


def _named(found: list[Violation], kind: str, workflow_id: str, effect_key: str) -> bool:
    return any(
        v.kind == kind and v.workflow_id == workflow_id and v.effect_key == effect_key
        for v in found
    )


def test_clean_history_has_no_violation() -> None:
    found = invariants.check(clean_history())
    assert found == []
    assert invariants.count_by_kind(found) == dict.fromkeys(invariants.KINDS, 0)


def test_duplicate_effect_is_named() -> None:
    history = clean_history()
    history = replace(
        history, effects=[*history.effects, EffectFact(9, "k-found", "fp-found", "r-2", True)]
    )
    found = invariants.check(history)
    assert _named(found, invariants.DUPLICATE_EFFECT, "wf-found", "k-found")
    # Two rows of one key also mean the succeeded workflow has no single matching effect.
    assert {v.kind for v in found} == {
        invariants.DUPLICATE_EFFECT,
        invariants.SUCCEEDED_WITHOUT_EFFECT,
    }


def test_stale_fence_completion_is_named() -> None:
    # The first owner's lease expired, a second claim took fence 2, then the first
    # owner's completion landed under fence 1.
    history = _with_events(
        clean_history(), "wf-ok",
        ("created", 0), ("approved", 0), ("claimed", 1), ("dispatching", 1),
        ("lease_expired", 1), ("reconciled", 1), ("claimed", 2), ("completed", 1),
    )
    history = _with_workflow(history, replace(_workflow(history, "wf-ok"), fence=2, attempt=2))
    found = invariants.check(history)
    assert [v.kind for v in found] == [invariants.STALE_COMPLETION]
    assert _named(found, invariants.STALE_COMPLETION, "wf-ok", "k-ok")


def test_completion_after_the_claim_ended_is_stale_even_at_the_same_fence() -> None:
    history = _with_events(
        clean_history(), "wf-ok",
        ("created", 0), ("approved", 0), ("claimed", 1), ("dispatching", 1),
        ("lease_expired", 1), ("completed", 1),
    )
    found = invariants.check(history)
    assert [v.kind for v in found] == [invariants.STALE_COMPLETION]


@pytest.mark.parametrize(
    ("state", "reason"),
    [("running", ""), ("ready", ""), ("waiting_approval", ""), ("unknown", ""), ("unknown", " ")],
)
def test_lost_workflow_is_named(state: str, reason: str) -> None:
    history = clean_history()
    lost = replace(_workflow(history, "wf-review"), state=state, review_reason=reason)
    found = invariants.check(_with_workflow(history, lost))
    assert _named(found, invariants.LOST_WORKFLOW, "wf-review", "k-review")
    if state != "unknown":
        # Its effect now sits under a workflow that neither succeeded nor awaits review.
        assert _named(found, invariants.EFFECT_WITHOUT_OWNER, "wf-review", "k-review")


def test_replayed_non_idempotent_dispatch_is_named() -> None:
    # Reply lost, then (wrongly) requeued and dispatched again: the event history shows it
    # even though the tool happened to record only one effect.
    history = _with_events(
        clean_history(), "wf-review",
        ("created", 0), ("approved", 0), ("claimed", 1), ("dispatching", 1),
        ("unknown", 1), ("reconciled", 1), ("claimed", 2), ("dispatching", 2),
        ("unknown", 2), ("manual_review", 2),
    )
    history = _with_workflow(
        history, replace(_workflow(history, "wf-review"), fence=2, attempt=2)
    )
    found = invariants.check(history)
    assert [v.kind for v in found] == [invariants.REPLAYED_DISPATCH]
    assert _named(found, invariants.REPLAYED_DISPATCH, "wf-review", "k-review")


def test_dispatch_after_a_forced_requeue_is_the_persons_decision_not_a_replay() -> None:
    # Found by tests/runtime/test_store_stateful.py: a reviewer forced the requeue of a dispatch
    # that left no effect; the second dispatch is audited, not an automatic replay.
    history = _with_events(
        clean_history(), "wf-review",
        ("created", 0), ("approved", 0), ("claimed", 1), ("dispatching", 1),
        ("lease_expired", 1), ("manual_review", 1), ("forced_requeue", 1), ("claimed", 2),
        ("dispatching", 2), ("unknown", 2), ("manual_review", 2),
    )
    history = _with_workflow(
        history, replace(_workflow(history, "wf-review"), fence=2, attempt=2)
    )
    assert invariants.check(history) == []
    # Had the first dispatch taken effect after all, the ledger still names the replay.
    history = replace(
        history, effects=[*history.effects, EffectFact(9, "k-review", "fp-review", "r-x", False)]
    )
    assert _named(invariants.check(history), invariants.REPLAYED_DISPATCH, "wf-review",
                  "k-review")


def test_replayed_dispatch_seen_in_the_ledger_is_named() -> None:
    history = clean_history()
    history = replace(
        history, effects=[*history.effects, EffectFact(9, "k-review", "fp-review", "r-x", False)]
    )
    found = invariants.check(history)
    assert _named(found, invariants.REPLAYED_DISPATCH, "wf-review", "k-review")
    assert _named(found, invariants.DUPLICATE_EFFECT, "wf-review", "k-review")


def test_budget_overrun_is_named() -> None:
    history = clean_history()
    over = replace(_workflow(history, "wf-spent"), attempt=4)
    found = invariants.check(_with_workflow(history, over))
    assert [v.kind for v in found] == [invariants.BUDGET_OVERRUN]
    assert _named(found, invariants.BUDGET_OVERRUN, "wf-spent", "k-spent")


def test_budget_overrun_counted_in_claims_is_named() -> None:
    # The stored attempt may be rewritten; the claims in the history may not.
    history = clean_history()
    extra = EventFact(999, "wf-spent", "claimed", 4)
    found = invariants.check(replace(history, events=[*history.events, extra]))
    assert _named(found, invariants.BUDGET_OVERRUN, "wf-spent", "k-spent")


def test_succeeded_without_matching_effect_is_named() -> None:
    history = clean_history()
    missing = replace(history, effects=[e for e in history.effects if e.effect_key != "k-ok"])
    found = invariants.check(missing)
    assert [v.kind for v in found] == [invariants.SUCCEEDED_WITHOUT_EFFECT]
    assert _named(found, invariants.SUCCEEDED_WITHOUT_EFFECT, "wf-ok", "k-ok")


def test_succeeded_with_a_foreign_receipt_is_named() -> None:
    history = clean_history()
    wrong = replace(_workflow(history, "wf-ok"), result=_receipt("k-ok", "fp-ok", "r-other"))
    found = invariants.check(_with_workflow(history, wrong))
    assert [v.kind for v in found] == [invariants.SUCCEEDED_WITHOUT_EFFECT]


def test_effect_of_a_failed_workflow_is_named() -> None:
    history = clean_history()
    history = replace(
        history, effects=[*history.effects, EffectFact(9, "k-spent", "fp-spent", "r-9", True)]
    )
    found = invariants.check(history)
    assert [v.kind for v in found] == [invariants.EFFECT_WITHOUT_OWNER,
                                       invariants.FALSE_OUTCOME]
    assert _named(found, invariants.EFFECT_WITHOUT_OWNER, "wf-spent", "k-spent")
    assert _named(found, invariants.FALSE_OUTCOME, "wf-spent", "k-spent")


def test_a_write_at_a_fence_a_lookup_closed_is_named() -> None:
    """An effect from a start at or below the fence a lookup answered "absent" for."""
    history = replace(clean_history(), absences=[AbsenceFact("k-ok", 1)])
    found = invariants.check(history)
    assert [v.kind for v in found] == [invariants.WRITE_AFTER_ABSENT]
    assert _named(found, invariants.WRITE_AFTER_ABSENT, "wf-ok", "k-ok")


def test_a_write_from_a_newer_start_than_the_tombstone_is_clean() -> None:
    """The requeued attempt's start (fence 2) may write after "absent" at fence 1."""
    history = clean_history()
    effects = [replace(e, fence=2) if e.effect_key == "k-ok" else e for e in history.effects]
    history = replace(history, effects=effects, absences=[AbsenceFact("k-ok", 1)])
    assert invariants.check(history) == []


def test_a_proven_absence_lets_a_non_idempotent_dispatch_be_retried() -> None:
    """A non-idempotent dispatch at fence 1, a fenced "absent" under fence 1, then a second
    dispatch: not a replay. The same history without the proof is one."""
    def history_with(detail: str) -> History:
        events = [EventFact(1, "wf-n", "claimed", 1), EventFact(2, "wf-n", "dispatching", 1),
                  EventFact(3, "wf-n", "lease_expired", 1),
                  EventFact(4, "wf-n", "reconciled", 1, detail),
                  EventFact(5, "wf-n", "claimed", 2), EventFact(6, "wf-n", "dispatching", 2),
                  EventFact(7, "wf-n", "completed", 2)]
        workflow = WorkflowFact("wf-n", "succeeded", False, "k-n", "fp-n", 2, 2, 3,
                                result=_receipt("k-n", "fp-n", "r-n"))
        return History([workflow], events, [EffectFact(1, "k-n", "fp-n", "r-n", False, fence=2)],
                       absences=[AbsenceFact("k-n", 1)])

    assert invariants.replayed_dispatches(history_with("lookup=absent closed_through=1")) == []
    unproven = invariants.replayed_dispatches(history_with("lookup=absent"))
    assert [v.kind for v in unproven] == [invariants.REPLAYED_DISPATCH]


@pytest.mark.parametrize(
    ("key", "fingerprint", "owner"),
    [("k-nobody", "fp-x", ""), ("k-absent", "fp-other-plan", "wf-absent")],
)
def test_effect_without_owning_workflow_is_named(key: str, fingerprint: str, owner: str) -> None:
    history = clean_history()
    history = replace(
        history, effects=[*history.effects, EffectFact(9, key, fingerprint, "r-9", True)]
    )
    found = invariants.check(history)
    assert [v.kind for v in found] == [invariants.EFFECT_WITHOUT_OWNER]
    assert _named(found, invariants.EFFECT_WITHOUT_OWNER, owner, key)


def test_effect_from_a_tool_of_the_wrong_mode_is_named() -> None:
    history = clean_history()
    effects = [
        replace(e, idempotent=True) if e.effect_key == "k-429" else e for e in history.effects
    ]
    found = invariants.check(replace(history, effects=effects))
    assert [v.kind for v in found] == [invariants.TOOL_MODE_MISMATCH]
    assert _named(found, invariants.TOOL_MODE_MISMATCH, "wf-429", "k-429")


def test_every_kind_is_exercised_above() -> None:
    """Guards the list: a new rule without a failing example here would go unproven."""
    assert set(invariants.KINDS) == {
        "duplicate_effect",
        "effect_without_owner",
        "tool_mode_mismatch",
        "replayed_dispatch",
        "stale_completion",
        "lost_workflow",
        "budget_overrun",
        "succeeded_without_effect",
        "lost_after_restart",
        "write_after_absent",
        "false_outcome",
    }


def test_acknowledged_success_missing_after_a_restart_is_named() -> None:
    """A worker saw its completion commit; the database came back without it."""
    history = clean_history()
    rolled_back = replace(_workflow(history, "wf-ok"), state="running", result=None)
    found = invariants.check(_with_workflow(history, rolled_back))
    assert invariants.LOST_AFTER_RESTART in [v.kind for v in found]
    assert _named(found, invariants.LOST_AFTER_RESTART, "wf-ok", "k-ok")


def test_acknowledged_fence_newer_than_the_row_is_named() -> None:
    history = clean_history()
    history = replace(history, acknowledged=[*history.acknowledged,
                                             Acknowledged("wf-cancel", "ready", 4)])
    found = invariants.check(history)
    assert [v.kind for v in found] == [invariants.LOST_AFTER_RESTART]
    assert _named(found, invariants.LOST_AFTER_RESTART, "wf-cancel", "k-cancel")


def test_effect_whose_start_barrier_was_lost_is_named() -> None:
    """The barrier is committed before the dispatch; an effect naming a missing one means
    the database lost a committed write."""
    history = clean_history()
    barriers = [b for b in history.barriers if b.start_id != "st-review"]
    found = invariants.check(replace(history, barriers=barriers))
    assert [v.kind for v in found] == [invariants.LOST_AFTER_RESTART]
    assert _named(found, invariants.LOST_AFTER_RESTART, "wf-review", "k-review")
