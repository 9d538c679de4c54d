"""Chapter 10: a durable record of intent before dispatch, verified whenever it is read."""

from __future__ import annotations

import dataclasses
import os
import signal
from datetime import timedelta
from typing import Any

import pytest

from lab import errors, harness
from lab.runtime import barrier, sealing, store

SECOND = timedelta(seconds=1)


def counts(lab: Any) -> dict[str, int]:
    """Row counts of every table a start or its completion could write."""
    row = lab.store.execute(
        "SELECT (SELECT count(*) FROM events) AS events, "
        "(SELECT count(*) FROM start_barriers) AS start_barriers, "
        "(SELECT count(*) FROM completions) AS completions, "
        "(SELECT count(*) FROM tool_effects) AS tool_effects"
    )[0]
    return {name: int(value) for name, value in row.items()}


def completions(lab: Any) -> int:
    return counts(lab)["completions"]


def claimed(lab: Any, idempotent: bool = True) -> store.Workflow:
    job = lab.approved(idempotent=idempotent)
    claim = lab.store.claim("owner", 3 * SECOND)
    assert claim is not None and claim.id == job.id
    return claim


def test_exact_replay_returns_the_existing_barrier(lab, observe):
    """Preparing the same start twice returns the barrier committed the first time and
    writes nothing more: a retried preparation cannot create a second intent."""
    claim = claimed(lab)
    first = lab.store.pre_dispatch(claim)
    assert first is not None
    before = counts(lab)
    again = lab.store.pre_dispatch(claim)
    after = counts(lab)
    assert again == first
    assert after == before
    assert first.start_id == barrier.start_id(claim.id, claim.fence)
    observe({"replay_returns_first": again == first,
             "start_id_derived_from": "workflow and fence",
             "rows_written_on_replay": sum(after.values()) - sum(before.values())},
            facts=("replay_returns_first", "start_id_derived_from", "rows_written_on_replay"))


def test_barrier_drift_is_a_conflict(lab, observe):
    """The same start (workflow and fence) with any different content, here another
    attempt number, is refused as a conflict, and nothing is written."""
    claim = claimed(lab)
    assert lab.store.pre_dispatch(claim) is not None
    before = counts(lab)
    drifted = dataclasses.replace(claim, attempt=claim.attempt + 1)
    with pytest.raises(errors.Conflict) as conflict:
        lab.store.pre_dispatch(drifted)
    after = counts(lab)
    assert after == before
    observe({"drift": "attempt", "refused_with": conflict.typename,
             "rows_written": sum(after.values()) - sum(before.values())},
            facts=("drift", "refused_with", "rows_written"))


def test_fence_moved_before_the_barrier_writes_nothing(lab, observe):
    """A claim whose fence moved (its lease expired and another worker claimed the work)
    cannot write a barrier, an audit event or anything else: the transaction rolls back."""
    rig = lab.credit_tool()
    old = claimed(lab)
    lab.expire_lease(old.id)
    lab.store.recover_expired()
    rig.worker.reconcile(old.id)
    new = lab.store.claim("new-owner", 3 * SECOND)
    assert new is not None and new.fence == old.fence + 1
    before = counts(lab)
    with pytest.raises(errors.Stale):
        lab.store.pre_dispatch(old)
    assert counts(lab) == before
    assert lab.store.barrier_for(old.id, old.fence) is None
    observe({"old_fence": old.fence, "new_fence": new.fence, "rows_written": 0,
             "result": "stale"},
            facts=("old_fence", "new_fence", "rows_written", "result"))


@pytest.mark.parametrize("corruption", ["digest", "binding"])
def test_corrupted_barrier_fails_closed(lab, observe, corruption):
    """A start barrier whose stored digest no longer matches, or that lost its audit-event
    binding, is never acted upon: the worker puts the workflow in manual review for
    integrity and reconciliation refuses it too."""
    rig = lab.credit_tool()
    job = lab.approved()

    def corrupt_after_tool(stage: str, claim: store.Workflow) -> None:
        if stage != "after_tool":
            return
        if corruption == "digest":
            lab.store.execute(
                "UPDATE start_barriers SET digest = repeat('0', 64) WHERE workflow_id = %s",
                (claim.id,),
            )
        else:
            lab.store.execute(
                "UPDATE start_barriers SET audit_event = NULL WHERE workflow_id = %s",
                (claim.id,),
            )

    rig.worker.hook = corrupt_after_tool
    rig.worker.run_one()
    held = lab.state(job.id)
    assert held.state == "unknown"
    assert held.review_reason == "integrity"
    with pytest.raises(errors.IntegrityFailure):
        lab.store.barrier_for(job.id, held.fence)
    with pytest.raises(errors.ManualReview):
        rig.worker.reconcile(job.id)
    assert lab.state(job.id).state == "unknown"
    assert completions(lab) == 0
    assert lab.effects() == 1 and rig.service.calls == 1
    observe({"corruption": corruption, "state": held.state, "review_reason": "integrity",
             "completions": 0, "effects": lab.effects()},
            facts=("corruption", "state", "review_reason", "completions", "effects"))


def test_success_and_failure_completions_exclude_each_other(lab, observe):
    """A start has one completion: once it succeeded, a failure for the same start is a
    conflict, and the database's constraint refuses it even from raw SQL."""
    rig = lab.credit_tool()
    job = lab.approved()
    rig.worker.run_one()
    final = lab.state(job.id)
    assert final.state == "succeeded"
    start = lab.store.barrier_for(job.id, final.fence)
    assert start is not None
    completion = lab.store.completion_for(start.start_id)
    assert completion is not None
    assert completion.outcome == "succeeded"
    assert completion.receipt_id == lab.store.receipt_of(final).receipt_id
    failure = barrier.Completion.failure(start, "rejected")
    with pytest.raises(errors.StoreError):
        lab.store.execute(
            "INSERT INTO completions (start_id, barrier_digest, outcome, summary, digest) "
            "VALUES (%s, %s, %s, %s, %s)",
            (failure.start_id, failure.barrier_digest, failure.outcome, failure.summary,
             failure.digest()),
        )
    assert completions(lab) == 1
    observe({"first": "succeeded", "second": "rejected by primary key",
             "completions": completions(lab)},
            facts=("first", "second", "completions"))


def test_failure_completion_carries_fixed_facts(lab, observe):
    """When 429s spend the attempt budget, each start ends in a failure completion whose
    summary is a fixed fact of the lab, never the tool's own text."""
    rig = lab.credit_tool()
    job = lab.approved()
    rig.worker.backoff = timedelta(0)
    rig.service.reject_next(10)
    for _ in range(4):
        rig.worker.run_one()
    assert lab.state(job.id).state == "failed"
    rows = lab.store.execute("SELECT outcome, summary FROM completions ORDER BY start_id")
    outcomes = sorted(row["outcome"] for row in rows)
    assert outcomes == ["rate_limited", "rate_limited", "rate_limited_budget_spent"]
    for row in rows:
        assert row["summary"] == barrier.FAILURE_FACTS[row["outcome"]]
    observe({"outcomes": outcomes, "summaries": "fixed facts", "effects": lab.effects()},
            facts=("outcomes", "summaries", "effects"))


def test_crash_before_barrier_is_proved_undispatched_and_requeued_once(lab, observe):
    """A non-idempotent worker SIGKILLed before its start barrier still waits for a person,
    but the database proves it was never dispatched; the reviewer requeues it with that
    proof through `lab review`, and it then succeeds with exactly one effect."""
    rig = lab.credit_tool(idempotent=False)
    job = lab.approved(idempotent=False)
    crashed = lab.spawn_worker(rig, "crashed", "--pause", "after_claim")
    crashed.wait_for("BOOK_STAGE after_claim")
    assert crashed.kill() == -signal.SIGKILL
    lab.recover_by_elapsed_lease(job.id)
    with pytest.raises(errors.ManualReview):
        rig.worker.reconcile(job.id)
    held = lab.state(job.id)
    assert held.review_reason == "not_dispatched_no_start_barrier"
    assert lab.store.barrier_for(job.id, held.fence) is None
    review = ("review", "--schema", lab.schema, "--reviewer", harness.REVIEWER.subject)
    listed = lab.run_cli(*review, "list")
    assert listed.returncode == 0, listed.stderr
    assert job.id in listed.stdout and "not_dispatched_no_start_barrier" in listed.stdout
    requeued = lab.run_cli(*review, "requeue", job.id)
    assert requeued.returncode == 0, requeued.stderr
    lab.mark("reviewer", "requeue (proof: no start barrier)")
    restarted = lab.spawn_worker(rig, "restarted")
    restarted.finish()
    final = lab.state(job.id)
    assert final.state == "succeeded"
    assert lab.effects() == 1 and rig.service.calls == 1
    decision = lab.store.execute("SELECT decision, proof FROM reviews")
    assert decision == [{"decision": "requeue", "proof": "no start barrier"}]
    observe({"review_reason": held.review_reason, "proof": "no start barrier",
             "requeue": "allowed", "state": final.state, "effects": lab.effects(),
             "post_calls": rig.service.calls},
            facts=("review_reason", "proof", "requeue", "state", "effects", "post_calls"))


def test_proved_undispatched_work_leaves_review_by_itself(lab, observe):
    """The recoverer takes work out of review only with the database's proof that it was
    never dispatched: a non-idempotent worker SIGKILLed before its start barrier is
    requeued within its budget with an audit event naming the proof, and succeeds with
    exactly one effect; with its budget spent it fails, nothing dispatched; a workflow
    whose barrier shows it may have been dispatched stays for a person."""
    rig = lab.credit_tool(idempotent=False)
    undispatched = lab.approved(idempotent=False)
    spent = lab.approved(idempotent=False)
    for job in (undispatched, spent):
        crashed = lab.spawn_worker(rig, "crashed", "--pause", "after_claim")
        crashed.wait_for("BOOK_STAGE after_claim")
        assert crashed.kill() == -signal.SIGKILL
        assert lab.state(job.id).state == "running"  # the oldest due work is claimed first
        lab.recover_by_elapsed_lease(job.id)
        with pytest.raises(errors.ManualReview):
            rig.worker.reconcile(job.id)
        assert lab.state(job.id).review_reason == store.UNDISPATCHED_REVIEW
    lab.store.execute("UPDATE workflows SET max_attempts = attempt WHERE id = %s", (spent.id,))
    lab.mark("experiment", "attempt budget of the second workflow spent (SQL-injected)")
    requeued = lab.store.settle_undispatched(undispatched.id)
    failed = lab.store.settle_undispatched(spent.id)
    assert requeued is not None and requeued.state == "ready"
    assert requeued.review_reason == "" and requeued.attempt < requeued.max_attempts
    assert failed is not None and failed.state == "failed"
    assert failed.review_reason == "attempt_budget_spent"
    audit = {e["kind"]: e["detail"] for e in lab.store.events(undispatched.id)}
    assert audit["requeued_undispatched"] == "proof=no_start_barrier"
    assert lab.store.events(spent.id)[-1]["detail"] == (
        "cause=attempt_budget_spent proof=no_start_barrier")
    by_a_person = lab.store.execute("SELECT count(*) AS n FROM reviews")[0]["n"]
    assert by_a_person == 0
    listed = lab.run_cli("review", "--schema", lab.schema, "list")
    assert listed.returncode == 0, listed.stderr
    assert undispatched.id not in listed.stdout and spent.id not in listed.stdout
    restarted = lab.spawn_worker(rig, "restarted")
    restarted.finish()
    assert lab.state(undispatched.id).state == "succeeded"
    assert lab.effects() == 1 and rig.service.calls == 1
    dispatched = lab.approved(idempotent=False)
    rig.service.drop_responses = True
    rig.worker.run_one()
    with pytest.raises(errors.ManualReview):
        rig.worker.reconcile(dispatched.id)
    assert lab.store.settle_undispatched(dispatched.id) is None
    held = lab.state(dispatched.id)
    assert (held.state, held.review_reason) == ("unknown", "non_idempotent_dispatched")
    observe({"undispatched": requeued.state, "proof": audit["requeued_undispatched"],
             "budget_spent": failed.state, "dispatched": held.review_reason,
             "reviews_by_a_person": by_a_person, "effects": lab.effects(),
             "final": lab.state(undispatched.id).state},
            facts=("undispatched", "proof", "budget_spent", "dispatched", "reviews_by_a_person",
                   "effects", "final"))


def test_requeue_of_a_dispatched_workflow_needs_force(lab, observe):
    """A non-idempotent workflow whose barrier proves it may have been dispatched cannot be
    requeued without --force and a reason, which the audit keeps."""
    rig = lab.credit_tool(idempotent=False)
    job = lab.approved(idempotent=False)
    rig.service.drop_responses = True
    rig.worker.run_one()
    with pytest.raises(errors.ManualReview):
        rig.worker.reconcile(job.id)
    reviewer = harness.REVIEWER
    with pytest.raises(errors.Denied, match="force"):
        lab.store.requeue_reviewed(reviewer, job.id)
    assert lab.state(job.id).state == "unknown"
    forced = lab.store.requeue_reviewed(reviewer, job.id, force=True,
                                        reason="ledger checked by hand: no credit issued")
    assert forced.state == "ready"
    assert lab.count_events("forced_requeue") == 1
    observe({"without_force": "denied", "with_force": forced.state,
             "audited": lab.count_events("forced_requeue")},
            facts=("without_force", "with_force", "audited"))


def test_key_rotation_keeps_old_results_readable(lab, observe):
    """Results are sealed with AES-256-GCM under the active key; after rotating to a new
    key, results sealed before stay readable, and a key id missing from the catalog fails
    closed."""
    rig = lab.credit_tool()
    old = lab.approved()
    rig.worker.run_one()
    old_result = lab.state(old.id)
    old_kid = old_result.result["key_id"]
    rotated = lab.store.keys.rotated("rotated-key", os.urandom(32))
    with store.Store.open(lab.dsn, lab.schema, keys=rotated) as reopened:
        rig.worker.db = reopened
        new = lab.approved()
        rig.worker.run_one()
        new_result = reopened.get(new.id)
        assert new_result.result is not None and new_result.result["key_id"] == "rotated-key"
        old_receipt = reopened.receipt_of(old_result)
        assert old_receipt is not None
        assert reopened.receipt_of(new_result) is not None
        forgetful = sealing.KeyCatalog({"rotated-key": rotated.keys["rotated-key"]},
                                       "rotated-key")
        with pytest.raises(errors.IntegrityFailure, match="unknown key id") as unknown_key:
            forgetful.open(old_result.result, old.id)
        rig.worker.db = lab.store
    assert "account" not in str(old_result.result)
    observe({"old_key_id": "development" if old_kid.startswith("dev-") else "configured",
             "new_key_id": new_result.result["key_id"],
             "old_result_opens_to_its_effect": old_receipt.effect_key == old.effect_key,
             "unknown_key_id_refused_with": unknown_key.typename, "cipher": "AES-256-GCM"},
            facts=("old_result_opens_to_its_effect", "unknown_key_id_refused_with", "cipher"))


def test_one_trace_id_links_proposal_barrier_effect_and_completion(lab, observe):
    """The workflow's W3C trace id is carried in the start barrier, in the tool request's
    traceparent and in the tool's ledger, so one id links proposal to effect."""
    rig = lab.credit_tool()
    job = lab.approved()
    rig.worker.run_one()
    final = lab.state(job.id)
    start = lab.store.barrier_for(job.id, final.fence)
    assert start is not None
    ledger = lab.store.execute("SELECT trace_id, start_id FROM tool_effects")
    assert ledger == [{"trace_id": job.trace_id, "start_id": start.start_id}]
    assert start.trace_id == job.trace_id
    completion = lab.store.completion_for(start.start_id)
    assert completion is not None
    linked = {"workflow": job.trace_id, "start_barrier": start.trace_id,
              "ledger": ledger[0]["trace_id"]}
    observe({"distinct_trace_ids": len(set(linked.values())), "trace_linked": sorted(linked),
             "ledger_start_id_is_barrier": ledger[0]["start_id"] == start.start_id,
             "completion_recorded": completion is not None,
             "traceparent": "W3C 00-<trace>-<span>-01"},
            facts=("ledger_start_id_is_barrier", "completion_recorded"))


def test_sealed_result_is_bound_to_its_workflow(lab, observe):
    """A sealed receipt copied onto another workflow does not open: the workflow id is
    authenticated data of the seal, so results cannot be swapped at rest."""
    rig = lab.credit_tool()
    first = lab.approved()
    second = lab.approved()
    rig.worker.run_one()
    rig.worker.run_one()
    a, b = lab.state(first.id), lab.state(second.id)
    assert a.state == b.state == "succeeded"
    moved = dataclasses.replace(b, result=a.result)
    with pytest.raises(errors.IntegrityFailure) as swapped:
        lab.store.receipt_of(moved)
    observe({"swapped_result_refused_with": swapped.typename, "bound_to": "workflow id"},
            facts=("swapped_result_refused_with", "bound_to"))
