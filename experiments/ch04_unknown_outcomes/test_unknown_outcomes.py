"""Chapter 4: a lost reply is an unknown outcome, settled only by the tool's own lookup."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from lab import errors

SECOND = timedelta(seconds=1)


def test_commit_reply_lost_becomes_unknown_then_reconciled(lab, observe):
    """When the tool commits the effect but the reply is lost, the workflow becomes
    unknown; the lookup by effect key then finds the effect and completes it, once."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    rig.service.drop_next_reply()
    rig.worker.run_one()
    unknown = lab.state(job.id)
    assert unknown.state == "unknown"
    assert lab.effects() == 1
    rig.worker.reconcile(job.id)
    final = lab.state(job.id)
    assert final.state == "succeeded"
    assert lab.effects() == 1
    observe({
        "replies_dropped": rig.service.dropped,
        "after_reply_loss": unknown.state,
        "after_lookup": final.state,
        "effects": lab.effects(),
        "post_calls": rig.service.calls,
    }, facts=("replies_dropped", "after_reply_loss", "after_lookup", "effects", "post_calls"))


def test_non_idempotent_unknown_never_automatically_replays(lab, observe):
    """A non-idempotent tool whose reply was lost is never called again automatically:
    reconciliation demands manual review and later runs leave the single effect alone."""
    job = lab.approved(idempotent=False)
    rig = lab.credit_tool(idempotent=False)
    rig.service.drop_next_reply()
    rig.worker.run_one()
    assert lab.state(job.id).state == "unknown"
    assert lab.effects() == 1, "missing unknown effect"
    with pytest.raises(errors.ManualReview):
        rig.worker.reconcile(job.id)
    for _ in range(3):
        rig.worker.run_one()
    assert lab.effects() == 1 and rig.service.calls == 1, "unknown replayed"
    observe({
        "state": lab.state(job.id).state,
        "effects": lab.effects(),
        "post_calls": rig.service.calls,
    }, facts=("state", "effects", "post_calls"))


def test_unknown_404_uses_original_key_and_stops_at_budget(lab, observe):
    """Each lost claim is looked up over HTTP with the original effect key and its start's
    fence; the fenced "absent" proves no request of it can land, so it requeues the work
    while the persistent attempt budget lasts, then ends it failed, with that proof, and
    nothing is ever dispatched past the budget."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    key = job.effect_key
    for attempt in range(1, 4):
        claimed = lab.store.claim("lost", SECOND)
        assert claimed is not None, "missing claim"
        lab.store.unknown(claimed)
        settled = rig.worker.reconcile(job.id)
        assert settled.effect_key == key, "key changed"
        assert settled.state == ("ready" if attempt < 3 else "failed"), settled.state
    for _ in range(4):
        rig.worker.run_one()
    final = lab.state(job.id)
    assert final.state == "failed"
    assert final.review_reason == "attempt_budget_spent"
    assert final.attempt == 3
    assert lab.effects() == 0
    assert rig.service.lookups == 3
    assert rig.service.calls == 0
    observe({
        "lookup": "HTTP 404, start closed",
        "original_key_preserved": final.effect_key == key,
        "attempts": final.attempt,
        "persistent_budget": final.max_attempts,
        "state": final.state,
        "effects": lab.effects(),
    }, facts=("lookup", "original_key_preserved", "attempts", "persistent_budget", "state",
              "effects"))


def test_terminal_transaction_rolls_back_but_effect_can_be_reconciled(lab, observe):
    """If the transaction that records success fails, nothing of it is kept (no state, no
    result, no event), and the effect that did happen is later found by reconciliation."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    lab.store.execute(
        "ALTER TABLE events ADD CONSTRAINT reject_completed CHECK (kind <> 'completed')"
    )
    with pytest.raises(errors.StoreError):
        rig.worker.run_one()
    completed = lab.count_events("completed")
    before = lab.state(job.id)
    assert before.state == "running"
    assert before.result is None
    assert completed == 0
    assert lab.effects() == 1, "terminal update not atomic"
    lab.store.execute("ALTER TABLE events DROP CONSTRAINT reject_completed")
    lab.expire_lease(job.id)
    lab.store.recover_expired()
    rig.worker.reconcile(job.id)
    after = lab.state(job.id)
    assert after.state == "succeeded"
    assert lab.effects() == 1 and rig.service.calls == 1, "reconciliation replayed effect"
    observe({
        "fault": "events CHECK rejects completed",
        "after_rollback": before.state,
        "result_rolled_back": before.result is None,
        "completed_events": completed,
        "lease_expiry": "SQL-injected",
        "after_reconcile": after.state,
        "effects": lab.effects(),
        "post_calls": rig.service.calls,
    }, facts=("fault", "after_rollback", "result_rolled_back", "completed_events",
              "lease_expiry", "after_reconcile", "effects", "post_calls"))


def test_receipt_fingerprint_mismatch_cannot_complete_or_reconcile(lab, observe):
    """A receipt whose fingerprint does not match the approved plan can neither complete
    the workflow nor settle it during reconciliation; the state and the effect stay as they were."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    claimed = lab.store.claim("owner", SECOND)
    assert claimed is not None
    receipt = rig.client.call(claimed)
    forged = dataclasses.replace(receipt, fingerprint="wrong")
    events_before = len(lab.store.events())
    with pytest.raises(errors.ReceiptMismatch) as completion:
        lab.store.complete(claimed, forged)
    lab.store.unknown(claimed)
    unknown = lab.state(job.id)
    with pytest.raises(errors.ReceiptMismatch) as reconciliation:
        lab.store.settle_found(unknown, forged)
    assert lab.state(job.id).state == "unknown"
    assert lab.effects() == 1, "invalid proof changed state"
    assert len(lab.store.events()) == events_before + 1  # only the 'unknown' event
    observe({
        "completion_refused_with": completion.typename,
        "reconciliation_refused_with": reconciliation.typename,
        "state": lab.state(job.id).state,
        "effects": lab.effects(),
    }, facts=("completion_refused_with", "reconciliation_refused_with", "state", "effects"))
