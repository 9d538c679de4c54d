"""Bad input to the store or the worker raises a specific error and changes nothing."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest

from lab import errors, harness
from lab.pg import edge
from lab.runtime import store

SECOND = timedelta(seconds=1)


def snapshot(lab: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Every workflow row, every event and the ledger size: what must not change."""
    return (
        lab.store.execute("SELECT * FROM workflows ORDER BY id"),
        lab.store.execute("SELECT * FROM events ORDER BY seq"),
        lab.effects(),
    )


def test_unknown_plan_version_is_rejected_before_any_write(lab):
    before = snapshot(lab)
    future = dataclasses.replace(harness.sample_plan(), version=2)
    with pytest.raises(errors.Rejected, match="version"):
        lab.store.create(harness.PROPOSER, "op-v2", future)
    assert snapshot(lab) == before


def test_invalid_plan_fields_are_rejected_before_any_write(lab):
    before = snapshot(lab)
    for field, value in [("amount_minor", 0), ("currency", "USD"), ("account", "a b"),
                         ("action", "drop_tables")]:
        bad = dataclasses.replace(harness.sample_plan(), **{field: value})
        with pytest.raises(errors.Rejected):
            lab.store.create(harness.PROPOSER, f"op-{field}", bad)
    assert snapshot(lab) == before


def test_tampered_fingerprint_cannot_approve(lab):
    created = lab.store.create(harness.PROPOSER, "op", harness.sample_plan())
    before = snapshot(lab)
    tampered = created.fingerprint[:-1] + ("0" if created.fingerprint[-1] != "0" else "1")
    with pytest.raises(errors.Denied, match="fingerprint"):
        lab.store.approve(harness.APPROVER, created.id, tampered, timedelta(minutes=1))
    assert snapshot(lab) == before


def test_wrong_tenant_cannot_approve_or_cancel(lab):
    created = lab.store.create(harness.PROPOSER, "op", harness.sample_plan())
    before = snapshot(lab)
    stranger = store.Actor(tenant="tenant-b", subject="manager-b", role="approver")
    with pytest.raises(errors.Denied, match="tenant"):
        lab.store.approve(stranger, created.id, created.fingerprint, timedelta(minutes=1))
    with pytest.raises(errors.Denied, match="tenant"):
        lab.store.cancel(stranger, created.id)
    assert snapshot(lab) == before


def test_stale_fence_changes_nothing(lab):
    job = lab.approved()
    rig = lab.credit_tool()
    first = lab.store.claim("old", SECOND)
    assert first is not None
    lab.expire_lease(job.id)
    lab.store.recover_expired()
    rig.worker.reconcile(job.id)
    second = lab.store.claim("new", SECOND)
    assert second is not None
    receipt = rig.client.call(second)
    before = snapshot(lab)
    for transition in (
        lambda: lab.store.complete(first, receipt),
        lambda: lab.store.unknown(first),
        lambda: lab.store.retry_later(first, SECOND, "rate_limited"),
        lambda: lab.store.fail(first, "tool_refused"),
        lambda: lab.store.heartbeat(first, SECOND),
        lambda: lab.store.pre_dispatch(first),
    ):
        with pytest.raises(errors.Stale):
            transition()
    assert snapshot(lab) == before


def test_unknown_workflow_is_not_found(lab):
    before = snapshot(lab)
    with pytest.raises(errors.NotFound):
        lab.store.get("wf_missing")
    with pytest.raises(errors.NotFound):
        lab.store.approve(harness.APPROVER, "wf_missing", "f", timedelta(minutes=1))
    assert snapshot(lab) == before


def test_hostile_schema_names_are_refused_before_postgresql(lab_dsn):
    for name in ['x"; DROP SCHEMA public; --', "Upper", "a" * 64, "schéma", "", "1abc", "a-b"]:
        with pytest.raises(errors.Rejected, match="schema name"):
            store.Store.open(lab_dsn, name, create=True)


def test_proposer_cannot_approve_own_plan_even_with_approver_role(lab):
    created = lab.store.create(harness.PROPOSER, "op", harness.sample_plan())
    self_approver = store.Actor(tenant="tenant-a", subject="employee-a", role="approver")
    before = snapshot(lab)
    with pytest.raises(errors.Denied, match="proposer"):
        lab.store.approve(self_approver, created.id, created.fingerprint, timedelta(minutes=1))
    assert snapshot(lab) == before


def test_tampered_stored_plan_fails_closed_at_claim(lab):
    job = lab.approved()
    rig = lab.credit_tool()
    lab.store.execute(
        "UPDATE workflows SET plan = jsonb_set(plan, '{amount_minor}', '9999') WHERE id = %s",
        (job.id,),
    )
    assert rig.worker.run_one() is None
    final = lab.state(job.id)
    assert final.state == "failed"
    assert final.review_reason == "integrity"
    assert rig.service.calls == 0


def test_worker_process_is_killed_at_teardown_even_when_paused(lab):
    job = lab.approved()
    rig = lab.credit_tool()
    child = lab.spawn_worker(rig, "paused", "--pause", "after_claim")
    child.wait_for("BOOK_STAGE after_claim")
    assert child.alive()
    lab.close()
    assert not child.alive()
    assert lab.state(job.id).state == "running"  # the lease, not cleanup, ends the claim


def _reviewed_undispatched(lab: Any, job: store.Workflow) -> store.Workflow:
    """Claim ``job``, let the claim die before any barrier, reconcile: in review with proof."""
    claim = lab.store.claim("crashed", SECOND)
    assert claim is not None and claim.id == job.id
    lab.expire_lease(job.id)
    assert lab.store.recover_expired() == 1
    with pytest.raises(errors.ManualReview):
        lab.store.require_review(lab.state(job.id), "non_idempotent")
    held = lab.state(job.id)
    assert held.review_reason == store.UNDISPATCHED_REVIEW
    return held


def test_undispatched_proof_counts_earlier_fences(lab):
    """An earlier start that ended in a 429 proves nothing happened there either."""
    after_429 = lab.approved(idempotent=False)
    claim = lab.store.claim("w", SECOND)
    assert claim is not None and lab.store.pre_dispatch(claim) is not None
    lab.store.retry_later(claim, timedelta(0), "rate_limited")
    _reviewed_undispatched(lab, after_429)
    moved = lab.store.settle_undispatched(after_429.id)
    assert moved is not None and moved.state == "ready" and moved.fence == 2


def test_a_start_that_may_have_reached_the_tool_keeps_review(lab):
    """An earlier start with no completion may have acted: the workflow stays for a person,
    however its latest claim ended."""
    maybe = lab.approved(idempotent=False)
    claim = lab.store.claim("w", SECOND)
    assert claim is not None and claim.id == maybe.id
    assert lab.store.pre_dispatch(claim) is not None
    lab.store.unknown(claim)  # the tool may have acted: a person forces a requeue
    lab.store.requeue_reviewed(harness.REVIEWER, maybe.id, force=True, reason="checked")
    _reviewed_undispatched(lab, maybe)
    before = snapshot(lab)
    assert lab.store.settle_undispatched(maybe.id) is None
    assert snapshot(lab) == before


def test_undispatched_work_asked_to_cancel_is_cancelled(lab):
    job = lab.approved(idempotent=False)
    _reviewed_undispatched(lab, job)
    lab.store.cancel(harness.PROPOSER, job.id)
    moved = lab.store.settle_undispatched(job.id)
    assert moved is not None and moved.state == "cancelled"
    assert lab.store.events(job.id)[-1]["detail"] == "at=review proof=no_start_barrier"
    assert lab.store.settle_undispatched(job.id) is None  # no longer in review: nothing


def test_history_rows_carry_barriers_and_start_ids(lab):
    rig = lab.credit_tool()
    job = lab.approved()
    rig.worker.run_one()
    rows = store.history_rows(lab.dsn, lab.schema)
    (barrier,) = rows["barriers"]
    (effect,) = rows["effects"]
    assert barrier["workflow_id"] == job.id and effect["start_id"] == barrier["start_id"]
    assert [w["state"] for w in rows["workflows"]] == ["succeeded"]
    assert lab.store.open_counts() == {"ready": 0, "running": 0, "unreviewed_unknown": 0}


def test_dsn_can_be_redirected_to_a_proxy_port(lab):
    host, port = edge.dsn_address(lab.dsn)
    moved = edge.dsn_via(lab.dsn, host, port + 1)
    assert edge.dsn_address(moved) == (host, port + 1)
    with pytest.raises(errors.BoundaryViolation):
        edge.dsn_address("host=10.1.2.3 port=5432 dbname=x")
