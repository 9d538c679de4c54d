"""Chapter 6: cancellation stops what has not happened and never erases what has."""

from __future__ import annotations

from datetime import timedelta

from lab import harness
from lab.runtime import store


def test_cancel_before_dispatch(lab, observe):
    """A cancellation that arrives after the claim but before the tool call stops the
    dispatch, and a cancelled queued workflow is never claimed to run."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)

    def cancel_after_claim(stage: str, claim: store.Workflow) -> None:
        if stage == "after_claim":
            lab.store.cancel(harness.PROPOSER, claim.id)

    rig.worker.hook = cancel_after_claim
    rig.worker.run_one()
    assert lab.state(job.id).state == "cancelled"
    assert rig.service.calls == 0, "cancelled work dispatched"
    rig.worker.hook = None
    queued = lab.approved(idempotent=True)
    lab.store.cancel(harness.PROPOSER, queued.id)
    rig.worker.run_one()
    assert lab.state(queued.id).state == "cancelled"
    assert rig.service.calls == 0, "queued cancellation ignored"
    observe({"before_dispatch": "cancelled", "queued": "cancelled", "effects": lab.effects()},
            facts=("before_dispatch", "queued", "effects"))


def test_cancel_after_effect_preserves_succeeded_fact(lab, observe):
    """A cancellation that arrives after the tool acted does not erase the fact: the
    workflow succeeds with the request recorded, and nothing is compensated silently."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)

    def cancel_after_tool(stage: str, claim: store.Workflow) -> None:
        if stage == "after_tool":
            lab.store.cancel(harness.PROPOSER, claim.id)

    rig.worker.hook = cancel_after_tool
    rig.worker.run_one()
    final = lab.state(job.id)
    assert final.state == "succeeded"
    assert final.cancel_requested is True
    assert lab.effects() == 1, "cancellation erased an effect"
    observe({
        "state": final.state,
        "cancel_requested": final.cancel_requested,
        "effects": lab.effects(),
        "events": [event["kind"] for event in lab.store.events(job.id)],
    }, facts=("state", "cancel_requested", "effects", "events"))


def test_cancellation_during_lookup_cannot_requeue(lab, observe):
    """A cancellation that lands while the authoritative lookup is in flight is seen at
    write time: the empty lookup does not requeue the work. The lookup was fenced, so its
    "absent" proves no request of the lost attempt can land: the workflow ends cancelled,
    truthfully, with no effect and no person needed."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    claimed = lab.store.claim("owner", timedelta(seconds=1))
    assert claimed is not None
    lab.store.unknown(claimed)
    seen_keys: list[str] = []

    def cancel_during_lookup(effect_key: str) -> None:
        # The request was authenticated by the tool before this runs.
        seen_keys.append(effect_key)
        lab.store.cancel(harness.PROPOSER, job.id)

    rig.service.on_lookup = cancel_during_lookup
    rig.worker.reconcile(job.id)
    for _ in range(2):
        rig.worker.run_one()
    final = lab.state(job.id)
    assert seen_keys == [job.effect_key]
    assert final.state == "cancelled"
    assert final.cancel_requested is True
    assert lab.effects() == 0 and rig.service.calls == 0
    observe({
        "cancel_during": "HTTP lookup",
        "lookup": "404, start closed",
        "state": final.state,
        "cancel_requested": final.cancel_requested,
        "effects": lab.effects(),
    }, facts=("cancel_during", "lookup", "state", "cancel_requested", "effects"))
