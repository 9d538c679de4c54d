"""Chapter 15: batching, throughput against blast radius.

A looping ``--fused`` worker with ``--batch N`` claims up to N workflows in one
transaction and has their N requests in flight together. One SIGKILL then meets all
N at once. These experiments measure what that costs: how many workflows one crash
leaves to recovery, and how many of them wait for a person.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from lab import errors, harness, protocol
from lab.faults import invariants

BATCH = 4
LEASE_NOTE = "elapsed PostgreSQL clock; 3s lease"
# The plugin's ``observe`` fixture: record one observation for the evidence.
Observe = Callable[..., None]


def _batch_worker(lab: harness.Harness, rig: harness.Rig, name: str, batch: int,
                  *extra: str) -> harness.WorkerProcess:
    """A looping fused worker process claiming up to ``batch`` workflows per step."""
    return lab.spawn_worker(rig, name, "--loop", "--fused", "--batch", str(batch),
                            "--idle-exit", "1", *extra)


def _crash(lab: harness.Harness, rig: harness.Rig, name: str, batch: int,
           boundary: str) -> harness.WorkerProcess:
    """Run a batch worker that SIGKILLs itself at the first ``boundary`` it reports."""
    crashed = _batch_worker(lab, rig, name, batch, "--crash-at", boundary)
    assert crashed.finish(expect_exit=None) == -signal.SIGKILL, crashed.tail()
    lab.mark(name, f"SIGKILLed itself at {boundary}")
    return crashed


def _stages(child: harness.WorkerProcess, boundary: str) -> int:
    """How many times the child reported ``boundary`` before it died."""
    return sum(1 for line in child.all_lines()
               if line.startswith(f"{protocol.STAGE} {boundary} "))


def _recover(lab: harness.Harness, ids: list[str]) -> int:
    """Let the dead worker's real leases run out on PostgreSQL's clock, then recover them."""
    lab.wait_until(lambda: all(lab.store.lease_expired(i) for i in ids), within=8.0,
                   what="every lease of the batch to expire on the PostgreSQL clock")
    lab.mark("postgresql", f"{len(ids)} leases expired (elapsed clock)")
    return lab.store.recover_expired()


def _reconcile(rig: harness.Rig, ids: list[str]) -> list[str]:
    """Reconcile every unknown of ``ids`` with the real worker; the review reasons raised."""
    reasons = []
    for workflow_id in ids:
        try:
            rig.worker.reconcile(workflow_id)
        except errors.ManualReview as review:
            reasons.append(review.reason)
    return reasons


def _dispatches(lab: harness.Harness, workflow_id: str) -> int:
    """How many start barriers (``dispatching`` events) the workflow committed."""
    return sum(1 for e in lab.store.events(workflow_id) if e["kind"] == "dispatching")


def _killed_with_requests_held(
    lab: harness.Harness, rig: harness.Rig, ids: list[str], holds: list[Any],
    crashed: harness.WorkerProcess, name: str, why: str,
    after_kill: Callable[[], None] | None = None,
) -> tuple[list[str], list[str]]:
    """SIGKILL ``crashed`` once the tool holds every request of ``holds``, then recover and
    reconcile ``ids``; the review reasons and the states after reconciling. The held
    requests are released (and finish) afterwards, whatever happened: the tool refuses or
    records them then. ``after_kill`` looks at the store right after the kill."""
    try:
        for hold in holds:
            hold.wait_held(timeout=60)
        lab.mark("tool", f"{len(holds)} requests held")
        crashed.kill()
        lab.mark(name, why)
        if after_kill is not None:
            after_kill()
        # Whether the worker saw its client time out first or not, every claim ends unknown.
        lab.wait_until(lambda: all(lab.state(i).state == "unknown" or lab.store.lease_expired(i)
                                   for i in ids),
                       within=30, what="every claim to be unknown or its lease over")
        lab.store.recover_expired()
        reasons = _reconcile(rig, ids)
        requeued = [lab.state(i).state for i in ids]
    finally:
        for hold in holds:
            hold.release()
    for hold in holds:
        hold.wait_finished(timeout=30)
    return reasons, requeued


def _violations(lab: harness.Harness) -> list[invariants.Violation]:
    """The invariant checker over this schema's whole history."""
    return invariants.check(invariants.load(lab.dsn, lab.schema, open_result=lab.store.keys.open))


def _non_idempotent_round(lab: harness.Harness, rig: harness.Rig, batch: int) -> dict[str, Any]:
    """Approve ``BATCH`` fresh non-idempotent workflows, SIGKILL a ``--batch batch`` worker
    at its first ``after_tool``, recover, reconcile, and let a restarted worker finish."""
    ids = [lab.approved(idempotent=False).id for _ in range(BATCH)]
    effects_before, calls_before = lab.effects(), rig.service.calls
    crashed = _crash(lab, rig, f"batch-{batch}", batch, protocol.AFTER_TOOL)
    claimed = [i for i in ids if lab.claims(i)]
    running = [i for i in ids if lab.state(i).state == "running"]
    effects_at_crash = lab.effects() - effects_before
    assert running == claimed and len(claimed) == batch, "the batch was not claimed whole"
    assert effects_at_crash == batch, "every request of the batch should have taken effect"
    assert _stages(crashed, protocol.AFTER_TOOL) == 1, "the worker did not die at the first reply"
    recovered = _recover(lab, claimed)
    reasons = _reconcile(rig, ids)
    _batch_worker(lab, rig, f"restarted-{batch}", batch).finish()
    finals = [lab.state(i) for i in ids]
    reviews = [w for w in finals if w.state == "unknown"
               and w.review_reason == "non_idempotent_dispatched"]
    return {
        "claimed": len(claimed),
        "effects_at_crash": effects_at_crash,
        "left_unknown": recovered,
        "raised": reasons,
        "reviews": len(reviews),
        "reviewed_were_claimed": sorted(w.id for w in reviews) == sorted(claimed),
        "completed_after_restart": sum(1 for w in finals if w.state == "succeeded"),
        "effects": lab.effects() - effects_before,
        "calls": rig.service.calls - calls_before,
        "replayed": sum(max(0, _dispatches(lab, i) - 1) for i in ids),
    }


def test_a_sigkill_after_a_non_idempotent_batch_leaves_every_workflow_for_a_person(
    lab: harness.Harness, observe: Observe
) -> None:
    """A worker with --batch 4 SIGKILLed at its first reply, with all 4 non-idempotent
    effects committed by the tool and none completed, leaves all 4 workflows to a person
    (non_idempotent_dispatched), never replayed; with --batch 1 the same SIGKILL leaves 1,
    and a restarted worker completes the other 3."""
    rig = lab.credit_tool(idempotent=False)
    batched = _non_idempotent_round(lab, rig, BATCH)
    single = _non_idempotent_round(lab, rig, 1)
    violations = _violations(lab)
    for measured, batch in ((batched, BATCH), (single, 1)):
        assert measured["left_unknown"] == batch
        assert measured["raised"] == ["non_idempotent_dispatched"] * batch
        assert measured["reviews"] == batch and measured["reviewed_were_claimed"]
        assert measured["completed_after_restart"] == BATCH - batch
        assert measured["effects"] == BATCH and measured["calls"] == BATCH
        assert measured["replayed"] == 0, "non-idempotent replay"
    assert violations == []
    observe({
        "signal": "SIGKILL",
        "window": "after_tool (first of the batch)",
        "lease_expiry": LEASE_NOTE,
        "batch": batched["claimed"],
        "left_unknown": batched["left_unknown"],
        "reviews_per_sigkill": batched["reviews"],
        "review_reason": ", ".join(sorted(set(batched["raised"]))),
        "effects": batched["effects"],
        "replayed": batched["replayed"],
        "baseline_batch": single["claimed"],
        "baseline_left_unknown": single["left_unknown"],
        "baseline_reviews_per_sigkill": single["reviews"],
        "baseline_completed_after_restart": single["completed_after_restart"],
        "baseline_effects": single["effects"],
        "baseline_replayed": single["replayed"],
        "violations": len(violations),
    }, facts=("signal", "window", "lease_expiry", "batch", "left_unknown", "reviews_per_sigkill",
              "review_reason", "effects", "replayed", "baseline_batch", "baseline_left_unknown",
              "baseline_reviews_per_sigkill", "baseline_completed_after_restart",
              "baseline_effects", "baseline_replayed", "violations"))


def test_an_idempotent_batch_lost_to_a_sigkill_settles_itself(
    lab: harness.Harness, observe: Observe
) -> None:
    """A worker with --batch 4 SIGKILLed at its first reply, with all 4 idempotent effects
    committed by the tool and none completed, leaves 4 workflows unknown; each is settled
    by the tool's lookup to succeeded, with no person and no second call."""
    ids = [lab.approved(idempotent=True).id for _ in range(BATCH)]
    rig = lab.credit_tool(idempotent=True)
    crashed = _crash(lab, rig, "batch", BATCH, protocol.AFTER_TOOL)
    effects_at_crash = lab.effects()
    running = sum(1 for i in ids if lab.state(i).state == "running")
    assert running == BATCH and effects_at_crash == BATCH, "wrong crash window"
    assert _stages(crashed, protocol.AFTER_CLAIM_BARRIER) == BATCH
    assert _stages(crashed, protocol.AFTER_TOOL) == 1
    recovered = _recover(lab, ids)
    reasons = _reconcile(rig, ids)
    finals = [lab.state(i) for i in ids]
    states = sorted({w.state for w in finals})
    violations = _violations(lab)
    assert recovered == BATCH
    assert reasons == []
    assert states == ["succeeded"] and all(w.attempt == 1 for w in finals)
    assert lab.effects() == BATCH
    assert rig.service.calls == BATCH, "a second call"
    assert rig.service.lookups == BATCH
    assert lab.count_events("manual_review") == 0
    assert violations == []
    observe({
        "signal": "SIGKILL",
        "window": "after_tool (first of the batch)",
        "lease_expiry": LEASE_NOTE,
        "batch": running,
        "left_unknown": recovered,
        "reconciled": lab.count_events("reconciled"),
        "reviews_per_sigkill": lab.count_events("manual_review"),
        "state": ", ".join(states),
        "effects": lab.effects(),
        "calls": rig.service.calls,
        "lookups": rig.service.lookups,
        "violations": len(violations),
    }, facts=("signal", "window", "lease_expiry", "batch", "left_unknown", "reconciled",
              "reviews_per_sigkill", "state", "effects", "calls", "lookups", "violations"))


def test_a_sigkill_at_after_batch_leaves_reviews_that_prove_nothing_was_dispatched(
    lab: harness.Harness, observe: Observe
) -> None:
    """A non-idempotent --batch 4 worker SIGKILLed at after_batch, its 4 claims committed
    and no start barrier yet, leaves 4 workflows for review, each with the database's
    proof that nothing was dispatched (not_dispatched_no_start_barrier) and no effect;
    that proof lets them be requeued without --force and completed once each."""
    ids = [lab.approved(idempotent=False).id for _ in range(BATCH)]
    rig = lab.credit_tool(idempotent=False)
    crashed = _crash(lab, rig, "batch", BATCH, protocol.AFTER_BATCH)
    claimed = sum(1 for i in ids if lab.claims(i))
    barriers = sum(1 for i in ids if lab.store.barrier_for(i, lab.state(i).fence) is not None)
    assert claimed == BATCH and barriers == 0
    assert _stages(crashed, protocol.AFTER_CLAIM) == 0, "died after the batch boundary"
    effects_at_crash = lab.effects()
    assert effects_at_crash == 0 and rig.service.calls == 0
    recovered = _recover(lab, ids)
    reasons = _reconcile(rig, ids)
    assert recovered == BATCH
    assert reasons == ["not_dispatched_no_start_barrier"] * BATCH
    assert lab.effects() == 0
    requeued = [lab.store.settle_undispatched(i) for i in ids]
    requeued_states = sorted({w.state if w else "kept for a person" for w in requeued})
    assert requeued_states == ["ready"]
    _batch_worker(lab, rig, "restarted", BATCH).finish()
    states = sorted({lab.state(i).state for i in ids})
    violations = _violations(lab)
    assert states == ["succeeded"]
    assert lab.effects() == BATCH and rig.service.calls == BATCH
    assert violations == []
    observe({
        "signal": "SIGKILL",
        "window": "after_batch",
        "lease_expiry": LEASE_NOTE,
        "batch": claimed,
        "start_barriers": barriers,
        "effects_at_crash": effects_at_crash,
        "left_unknown": recovered,
        "reviews_per_sigkill": len(reasons),
        "review_reason": ", ".join(sorted(set(reasons))),
        "requeued_with_proof": ", ".join(requeued_states),
        "final_state": ", ".join(states),
        "effects": lab.effects(),
        "calls": rig.service.calls,
        "violations": len(violations),
    }, facts=("signal", "window", "lease_expiry", "batch", "start_barriers", "effects_at_crash",
              "left_unknown", "reviews_per_sigkill", "review_reason", "requeued_with_proof",
              "final_state", "effects", "calls", "violations"))



def test_a_sigkill_with_a_non_idempotent_batch_in_flight_needs_no_person_when_absence_is_proven(
    lab: harness.Harness, observe: Observe
) -> None:
    """A worker with --batch 4 SIGKILLed while its 4 non-idempotent requests are held in a
    tool that offers the fenced lookup: each lookup answers absent and closes its start, so
    all 4 are requeued with that proof and none waits for a person; the held requests are
    refused when they reach the ledger, and a restarted worker performs each effect once."""
    rig = lab.credit_tool(idempotent=False, fenced_lookup=True)
    ids = [lab.approved(idempotent=False).id for _ in range(BATCH)]
    holds = [rig.service.hold_next(seconds=120) for _ in range(BATCH)]
    crashed = _batch_worker(lab, rig, "held-batch", BATCH)
    reasons, requeued = _killed_with_requests_held(
        lab, rig, ids, holds, crashed, "held-batch", "SIGKILL with its batch in flight")
    _batch_worker(lab, rig, "restarted", BATCH).finish()
    finals = [lab.state(i) for i in ids]
    violations = _violations(lab)
    observe({
        "batch": BATCH,
        "tool": "non-idempotent, fenced lookup",
        "requests_in_flight_at_kill": BATCH,
        "reviews": len(reasons),
        "requeued_with_proof": requeued.count("ready"),
        "late_requests_refused": rig.service.fenced,
        "completed_after_restart": sum(1 for w in finals if w.state == "succeeded"),
        "effects": lab.effects(),
        "violations": len(violations),
    }, facts=("batch", "tool", "requests_in_flight_at_kill", "reviews", "requeued_with_proof",
              "late_requests_refused", "completed_after_restart", "effects", "violations"))
    assert reasons == [], reasons
    assert requeued == ["ready"] * BATCH
    assert rig.service.fenced == BATCH
    assert [w.state for w in finals] == ["succeeded"] * BATCH
    assert lab.effects() == BATCH
    assert violations == [], [v.to_json() for v in violations]


# The batch sizes chapter 15's before-and-after table is measured at (issue 40).
REVIEW_BATCHES = (1, 8, 32)


def _reviews_per_sigkill(lab: harness.Harness, rig: harness.Rig, batch: int,
                         name: str) -> dict[str, int]:
    """Approve ``batch`` non-idempotent workflows, SIGKILL a ``--batch batch`` worker while
    the tool holds every request of its batch, recover and reconcile: how many wait for
    a person and how many were requeued; a restarted worker then finishes the requeued."""
    ids = [lab.approved(idempotent=False).id for _ in range(batch)]
    holds = [rig.service.hold_next(seconds=120) for _ in range(batch)]
    crashed = _batch_worker(lab, rig, name, batch)
    reasons, requeued = _killed_with_requests_held(
        lab, rig, ids, holds, crashed, name, f"SIGKILL with {batch} requests in flight")
    if "ready" in requeued:
        _batch_worker(lab, rig, f"{name}-restarted", batch).finish()
    return {"reviews": len(reasons), "requeued_with_proof": requeued.count("ready"),
            "succeeded": sum(1 for i in ids if lab.state(i).state == "succeeded")}


def test_reviews_per_sigkill_before_and_after_the_fenced_lookup_at_batch_1_8_32(
    lab: harness.Harness, observe: Observe
) -> None:
    """One SIGKILL of a batch worker with every non-idempotent request of its batch held in
    the tool, at batch 1, 8 and 32. Before (a tool without the fenced lookup) each
    workflow of the batch waits for a person: the reviews per SIGKILL grow with the
    batch. After (the same tool offering the fenced lookup) each lookup answers absent
    and closes its start, so none waits for a person and each is requeued with that
    proof and completed once."""
    before_rig = lab.credit_tool(idempotent=False)
    after_rig = lab.credit_tool(idempotent=False, fenced_lookup=True)
    table: dict[str, dict[str, dict[str, int]]] = {}
    for batch in REVIEW_BATCHES:
        table[str(batch)] = {
            "before": _reviews_per_sigkill(lab, before_rig, batch, f"before-{batch}"),
            "after": _reviews_per_sigkill(lab, after_rig, batch, f"after-{batch}"),
        }
    violations = _violations(lab)
    observe({
        "batches": list(REVIEW_BATCHES),
        "reviews_per_sigkill": {b: {"before": row["before"]["reviews"],
                                    "after": row["after"]["reviews"]}
                                for b, row in table.items()},
        "requeued_with_proof": {b: row["after"]["requeued_with_proof"]
                                for b, row in table.items()},
        "completed_after": {b: row["after"]["succeeded"] for b, row in table.items()},
        "late_requests_refused": after_rig.service.fenced,
        "violations": len(violations),
    }, facts=("batches", "reviews_per_sigkill", "requeued_with_proof", "completed_after",
              "late_requests_refused", "violations"))
    for batch in REVIEW_BATCHES:
        row = table[str(batch)]
        assert row["before"] == {"reviews": batch, "requeued_with_proof": 0, "succeeded": 0}
        assert row["after"] == {"reviews": 0, "requeued_with_proof": batch, "succeeded": batch}
    assert after_rig.service.fenced == sum(REVIEW_BATCHES)
    assert violations == [], [v.to_json() for v in violations]


def _concurrent_worker(lab: harness.Harness, rig: harness.Rig, name: str, slots: int,
                       *extra: str) -> harness.WorkerProcess:
    """A looping fused worker process with ``slots`` workflows in flight, each its own."""
    return lab.spawn_worker(rig, name, "--loop", "--fused", "--concurrency", str(slots),
                            "--idle-exit", "1", *extra)


def _claim_transactions(lab: harness.Harness, ids: list[str]) -> int:
    """How many distinct transactions committed the claims of ``ids`` (their events' xmin)."""
    rows = lab.store.execute(
        "SELECT count(DISTINCT xmin::text) AS n FROM events "
        "WHERE kind = 'claimed' AND workflow_id = ANY(%s)", (ids,))
    return int(rows[0]["n"])


def test_a_sigkill_with_a_concurrency_worker_in_flight_loses_each_workflow_alone(
    lab: harness.Harness, observe: Observe
) -> None:
    """A worker with --concurrency 4 SIGKILLed while its 4 non-idempotent requests are held
    in a tool with the fenced lookup had claimed them in 4 transactions, one per slot (a
    --batch 4 worker claims them in one); each lookup answers absent, all 4 are requeued
    with that proof, none waits for a person, the held requests are refused at the ledger,
    and a restarted --concurrency worker performs each effect once."""
    rig = lab.credit_tool(idempotent=False, fenced_lookup=True)
    ids = [lab.approved(idempotent=False).id for _ in range(BATCH)]
    holds = [rig.service.hold_next(seconds=120) for _ in range(BATCH)]
    crashed = _concurrent_worker(lab, rig, "held-slots", BATCH)
    seen: dict[str, Any] = {}

    def claims_at_kill() -> None:
        seen["owners"] = sorted({c.owner for c in lab.claims() if c.workflow_id in ids})
        seen["transactions"] = _claim_transactions(lab, ids)

    reasons, requeued = _killed_with_requests_held(
        lab, rig, ids, holds, crashed, "held-slots",
        "SIGKILL with every slot's workflow in flight", after_kill=claims_at_kill)
    owners, transactions = seen["owners"], seen["transactions"]
    _concurrent_worker(lab, rig, "restarted-slots", BATCH).finish()
    finals = [lab.state(i) for i in ids]
    violations = _violations(lab)
    observe({
        "concurrency": BATCH,
        "tool": "non-idempotent, fenced lookup",
        "requests_in_flight_at_kill": BATCH,
        "claim_transactions": transactions,
        "slot_owners": len(owners),
        "reviews": len(reasons),
        "requeued_with_proof": requeued.count("ready"),
        "late_requests_refused": rig.service.fenced,
        "completed_after_restart": sum(1 for w in finals if w.state == "succeeded"),
        "effects": lab.effects(),
        "violations": len(violations),
    }, facts=("concurrency", "tool", "requests_in_flight_at_kill", "claim_transactions",
              "slot_owners", "reviews", "requeued_with_proof", "late_requests_refused",
              "completed_after_restart", "effects", "violations"))
    assert transactions == BATCH, "the slots shared a claim transaction"
    assert owners == [f"held-slots.{slot}" for slot in range(BATCH)]
    assert reasons == [], reasons
    assert requeued == ["ready"] * BATCH
    assert rig.service.fenced == BATCH
    assert [w.state for w in finals] == ["succeeded"] * BATCH
    assert lab.effects() == BATCH
    assert violations == [], [v.to_json() for v in violations]
