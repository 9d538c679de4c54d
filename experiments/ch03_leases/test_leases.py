"""Chapter 3: one owner at a time, enforced by leases on the database clock and fences."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from lab import errors
from lab.runtime import store

SECOND = timedelta(seconds=1)


def test_two_claimers_cannot_own_one_workflow(lab, observe):
    """Two claimers racing for the same ready workflow: exactly one gets it, the other
    gets nothing, and neither sees an error."""
    job = lab.approved(idempotent=True)
    start = threading.Barrier(2)
    claims: list[store.Workflow] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def claimer(owner: str) -> None:
        start.wait()
        try:
            claimed = lab.store.claim(owner, SECOND)
        except BaseException as exc:  # collected and asserted below
            with lock:
                failures.append(exc)
            return
        if claimed is not None:
            with lock:
                claims.append(claimed)

    threads = [threading.Thread(target=claimer, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    # A claimer still blocked after the join would never be reported, and an error it
    # raised later would be lost: the experiment waits for both, like the seed.
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"claimers still running after 10 s: {stuck}"
    assert not failures, failures
    assert len(claims) == 1 and claims[0].id == job.id, claims
    observe({"concurrent_claimers": 2, "successful_claims": len(claims), "fence": claims[0].fence},
            facts=("concurrent_claimers", "successful_claims", "fence"))


def test_heartbeat_cannot_revive_an_expired_lease(lab, observe):
    """A heartbeat extends a live lease, but once the lease has expired the old owner's
    heartbeat is refused as stale."""
    job = lab.approved(idempotent=True)
    claimed = lab.store.claim("owner", SECOND)
    assert claimed is not None
    assert claimed.lease_until is not None
    lab.store.heartbeat(claimed, 2 * SECOND)
    after = lab.state(job.id).lease_until
    assert after is not None and after > claimed.lease_until, "heartbeat did not extend lease"
    lab.expire_lease(job.id)
    with pytest.raises(errors.Stale) as stale:
        lab.store.heartbeat(claimed, SECOND)
    observe({
        "live_lease_extended_s": round((after - claimed.lease_until).total_seconds(), 3),
        "expired_heartbeat_refused_with": stale.typename,
        "lease_expiry": "SQL-injected",
    }, facts=("expired_heartbeat_refused_with", "lease_expiry"))


def test_expired_owner_cannot_commit_an_old_result(lab, observe):
    """After its lease expired and a new owner claimed the work, the old owner's completion
    is refused by the fence, and the new owner's call reuses the single effect."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    first = lab.store.claim("old", SECOND)
    assert first is not None
    lab.expire_lease(job.id)
    assert lab.store.recover_expired() == 1
    rig.worker.reconcile(job.id)
    second = lab.store.claim("new", SECOND)
    assert second is not None
    receipt = rig.client.call(second)
    with pytest.raises(errors.Stale):
        lab.store.complete(first, receipt)
    again = rig.client.call(second)
    lab.store.complete(second, again)
    assert again.receipt_id == receipt.receipt_id, "duplicate effect"
    assert lab.effects() == 1
    observe({
        "old_fence": first.fence,
        "new_fence": second.fence,
        "effects": lab.effects(),
        "state": lab.state(job.id).state,
    }, facts=("old_fence", "new_fence", "effects", "state"))
