"""Chapter 5: real worker OS processes, SIGKILLed mid-window, recovered on the database clock."""

from __future__ import annotations

import signal

import pytest

from lab import errors

LEASE_NOTE = "elapsed PostgreSQL clock; 3s lease"


def test_two_worker_processes_claim_exactly_one(lab, observe):
    """Two worker processes released at the same moment race for one workflow: one claims
    and completes it, the other finds nothing, and the tool is called exactly once."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    a = lab.spawn_worker(rig, "process-a", "--start-gate", "--pause", "after_claim")
    b = lab.spawn_worker(rig, "process-b", "--start-gate", "--pause", "after_claim")
    a.wait_for("BOOK_READY")
    b.wait_for("BOOK_READY")
    a.release()
    b.release()
    lab.wait_until(lambda: lab.state(job.id).state == "running", what="a claim")
    winner, loser = (b, a) if lab.state(job.id).owner == "process-b" else (a, b)
    winner.wait_for("BOOK_STAGE after_claim")
    loser.finish()
    winner.release()
    winner.finish()
    claims = lab.count_events("claimed")
    owners = [claim.owner for claim in lab.claims(job.id)]
    # The loser never passed a claim: it found nothing due and exited without a stage.
    loser_claimed = [line for line in loser.all_lines() if line.startswith("BOOK_STAGE")]
    assert claims == 1
    assert owners == [winner.name]
    assert loser_claimed == []
    assert lab.effects() == 1
    assert rig.service.calls == 1
    assert lab.state(job.id).state == "succeeded", "duplicate process execution"
    # Which of the two wins is the race's to decide: a measurement. What every run
    # observes is that one of the two claimed and the other was refused.
    observe({
        "os_processes": 2,
        "claims": claims,
        "claimed_by_one_of_the_two": len(owners) == 1 and owners[0] in {a.name, b.name},
        "loser_stages": loser_claimed,
        "effects": lab.effects(),
        "state": lab.state(job.id).state,
        "winner": winner.name,
    }, measurements=("winner",), facts=("os_processes", "claims", "claimed_by_one_of_the_two",
                                        "loser_stages", "effects", "state"))


def test_sigkill_after_claim_queries_404_and_restarts(lab, observe):
    """A worker SIGKILLed after claiming but before calling the tool leaves no effect; once
    its real lease expires the workflow is unknown, the lookup answers 404, and a restarted
    worker completes it on a second attempt."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    crashed = lab.spawn_worker(rig, "crashed", "--pause", "after_claim")
    crashed.wait_for("BOOK_STAGE after_claim")
    assert crashed.kill() == -signal.SIGKILL
    assert lab.effects() == 0, "effect before dispatch"
    lab.recover_by_elapsed_lease(job.id)
    restarted = lab.spawn_worker(rig, "restarted", "--reconcile", job.id)
    restarted.finish()
    final = lab.state(job.id)
    assert final.state == "succeeded"
    assert final.attempt == 2
    assert lab.effects() == 1
    observe({
        "signal": "SIGKILL",
        "window": "after_claim",
        "lease_expiry": LEASE_NOTE,
        "state": final.state,
        "attempts": final.attempt,
        "effects": lab.effects(),
        "post_calls": rig.service.calls,
    }, facts=("signal", "window", "lease_expiry", "state", "attempts", "effects", "post_calls"))


def test_sigkill_after_tool_reconciles_existing_effect(lab, observe):
    """A worker SIGKILLed after the tool committed the effect but before recording it: the
    lookup finds the effect and the workflow succeeds without a second call."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    crashed = lab.spawn_worker(rig, "crashed", "--pause", "after_tool")
    crashed.wait_for("BOOK_STAGE after_tool")
    assert crashed.kill() == -signal.SIGKILL
    assert lab.effects() == 1 and lab.state(job.id).state == "running", "wrong crash window"
    lab.recover_by_elapsed_lease(job.id)
    restarted = lab.spawn_worker(rig, "restarted", "--reconcile", job.id)
    restarted.finish()
    final = lab.state(job.id)
    assert final.state == "succeeded"
    assert final.attempt == 1
    assert lab.effects() == 1
    assert rig.service.calls == 1
    observe({
        "signal": "SIGKILL",
        "window": "after_tool",
        "lease_expiry": LEASE_NOTE,
        "state": final.state,
        "attempts": final.attempt,
        "effects": lab.effects(),
        "post_calls": rig.service.calls,
    }, facts=("signal", "window", "lease_expiry", "state", "attempts", "effects", "post_calls"))


@pytest.mark.parametrize("window", ["after_claim", "after_tool"])
def test_sigkill_non_idempotent_requires_manual_review(lab, observe, window):
    """A non-idempotent worker SIGKILLed in either window is never retried or replayed:
    it waits for a person, with zero or one effect exactly as the crash left it."""
    job = lab.approved(idempotent=False)
    rig = lab.credit_tool(idempotent=False)
    crashed = lab.spawn_worker(rig, "crashed", "--pause", window)
    crashed.wait_for(f"BOOK_STAGE {window}")
    assert crashed.kill() == -signal.SIGKILL
    lab.recover_by_elapsed_lease(job.id)
    with pytest.raises(errors.ManualReview):
        rig.worker.reconcile(job.id)
    restarted = lab.spawn_worker(rig, "restarted")
    restarted.finish()
    want = 1 if window == "after_tool" else 0
    final = lab.state(job.id)
    assert final.state == "unknown"
    assert final.review_reason == (
        "non_idempotent_dispatched" if want else "not_dispatched_no_start_barrier"
    )
    assert lab.effects() == want
    assert rig.service.calls == want, "non-idempotent replay"
    observe({
        "signal": "SIGKILL",
        "window": window,
        "lease_expiry": LEASE_NOTE,
        "state": final.state,
        "effects": lab.effects(),
        "post_calls": rig.service.calls,
        "review_reason": final.review_reason,
    }, facts=("signal", "window", "lease_expiry", "state", "effects", "post_calls",
              "review_reason"))
