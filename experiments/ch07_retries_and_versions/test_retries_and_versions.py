"""Chapter 7: timed retries with a persistent budget; old workers refuse new plan versions."""

from __future__ import annotations

from datetime import timedelta


def test_trusted_429_uses_timed_retry(lab, observe):
    """A trusted 429 means nothing happened: the workflow is queued again with a ready time
    on the database clock, is not retried before it, and succeeds on the second attempt."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    rig.worker.backoff = timedelta(milliseconds=250)
    rig.service.reject_next(1)
    rig.worker.run_one()
    assert lab.state(job.id).state == "ready"
    assert lab.effects() == 0, "429 not safely queued"
    rig.worker.run_one()
    assert rig.service.calls == 1, "backoff ignored"
    lab.wait_until(
        lambda: bool(
            lab.store.execute(
                "SELECT ready_at <= clock_timestamp() AS due FROM workflows WHERE id = %s",
                (job.id,),
            )[0]["due"]
        ),
        within=2.0,
        what="the persisted ready time",
    )
    rig.worker.run_one()
    final = lab.state(job.id)
    assert final.state == "succeeded"
    assert final.attempt == 2
    assert lab.effects() == 1
    observe({
        "backoff_ms": 250,
        "timer": "elapsed PostgreSQL clock",
        "attempts": final.attempt,
        "post_calls": rig.service.calls,
        "effects": lab.effects(),
    }, facts=("timer", "attempts", "post_calls", "effects"))


def test_trusted_429_exhausts_persistent_budget(lab, observe):
    """Repeated 429s spend the persistent attempt budget: after three calls the workflow
    fails, and further runs call the tool no more."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    rig.worker.backoff = timedelta(0)
    rig.service.reject_next(20)
    for _ in range(8):
        rig.worker.run_one()
    final = lab.state(job.id)
    assert final.state == "failed"
    assert final.attempt == 3
    assert final.max_attempts == 3
    assert rig.service.calls == 3
    assert lab.effects() == 0
    observe({
        "state": final.state,
        "persistent_budget": final.max_attempts,
        "attempts": final.attempt,
        "post_calls": rig.service.calls,
        "effects": lab.effects(),
    }, facts=("state", "persistent_budget", "attempts", "post_calls", "effects"))


def test_persisted_version_two_rejected_by_old_worker(lab, observe):
    """A worker that only knows plan version 1 finds a persisted version 2 plan: it marks it
    incompatible without spending an attempt or calling the tool."""
    job = lab.approved(idempotent=True)
    rig = lab.credit_tool(idempotent=True)
    lab.store.execute(
        "UPDATE workflows SET plan_version = 2, plan = jsonb_set(plan, '{version}', '2') "
        "WHERE id = %s",
        (job.id,),
    )
    old = lab.spawn_worker(rig, "old-worker")
    old.finish()
    final = lab.state(job.id)
    assert final.state == "incompatible"
    assert final.attempt == 0
    assert rig.service.calls == 0, "unsupported version executed"
    observe({
        "persisted_version": 2,
        "worker_version": 1,
        "state": final.state,
        "post_calls": rig.service.calls,
    }, facts=("persisted_version", "worker_version", "state", "post_calls"))
