"""Chapter 2: approval is bound to tenant, role and fingerprint, and it expires."""

from __future__ import annotations

from datetime import timedelta

import pytest

from lab import errors, harness
from lab.runtime import store


def test_approval_binds_tenant_role_and_fingerprint(lab, observe):
    """Only an approver of the same tenant, naming the exact plan fingerprint, can approve;
    another tenant, the proposer, or a different fingerprint is denied and changes nothing."""
    created = lab.store.create(harness.PROPOSER, "approval-binding", harness.sample_plan(True))
    refusals: dict[str, str] = {}
    attempts = {
        "other_tenant": (lab.actor("tenant-b", "approver"), created.fingerprint),
        "proposer_role": (harness.PROPOSER, created.fingerprint),
        "other_fingerprint": (harness.APPROVER, "different-fingerprint"),
    }
    for case, (actor, fingerprint) in attempts.items():
        with pytest.raises(errors.Denied) as denied:
            lab.store.approve(actor, created.id, fingerprint, timedelta(minutes=1))
        refusals[case] = denied.typename
    assert lab.state(created.id).state == "waiting_approval"
    assert lab.count_events("approved") == 0, "a denied approval wrote an event"
    lab.store.approve(harness.APPROVER, created.id, created.fingerprint, timedelta(minutes=1))
    assert lab.state(created.id).state == "ready", "approval not persisted"
    observe({"refused": refusals, "state": lab.state(created.id).state},
            facts=("refused", "state"))


def test_approval_expires_while_queued(lab, observe):
    """Work whose approval lapsed while it waited in the queue goes back to waiting for
    approval at claim time, and the tool is never called."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    lab.expire_approval(job.id)
    rig.worker.run_one()
    assert lab.state(job.id).state == "waiting_approval", "expired approval dispatched"
    assert rig.service.calls == 0
    observe({
        "expiry": "SQL-injected before claim",
        "state": lab.state(job.id).state,
        "post_calls": rig.service.calls,
    }, facts=("expiry", "state", "post_calls"))


def test_approval_expires_after_claim(lab, observe):
    """An approval that lapses between claim and dispatch is caught by the fenced
    pre-dispatch check: the workflow waits for approval again and no effect happens."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)

    def expire_after_claim(stage: str, claim: store.Workflow) -> None:
        if stage == "after_claim":
            lab.expire_approval(claim.id)

    rig.worker.hook = expire_after_claim
    rig.worker.run_one()
    assert lab.state(job.id).state == "waiting_approval", "dispatch ignored approval expiry"
    assert rig.service.calls == 0
    observe({
        "expiry": "SQL-injected after claim",
        "state": lab.state(job.id).state,
        "effects": lab.effects(),
    }, facts=("expiry", "state", "effects"))
