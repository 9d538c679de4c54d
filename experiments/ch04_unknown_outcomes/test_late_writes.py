"""Chapter 4, late writes: a request that lands after its caller gave up cannot make the
lab report a wrong outcome, because the lookup that answers "absent" also closes the start.

Each experiment makes one of the three ways a write can arrive after the client's
timeout: held in the network between worker and tool, held inside a slow tool before its
ledger, held in the link between the tool and its database. In each, the worker's call
becomes ``unknown``; the reconciler's fenced lookup answers "absent" and records it; then
the held request is let go, the tool refuses it, and the workflow ends with the outcome
that really happened, with at most one effect.
"""

from __future__ import annotations

from lab import harness
from lab.faults import audit, invariants, proxy
from lab.runtime import tool

# Far below the tool's default 5 s, so each window costs about a second of waiting.
CLIENT_TIMEOUT_S = 1.0


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _checked(lab: harness.Harness) -> tuple[list[invariants.Violation], list[audit.Finding]]:
    """Both checkers over the whole history: the invariant checker and the SQL audit."""
    history = invariants.load(lab.dsn, lab.schema, open_result=lab.store.keys.open)
    return invariants.check(history), audit.run(lab.dsn, lab.schema)


def test_request_held_in_the_network_is_refused_after_a_fenced_absent(lab, observe):
    """A request held by a partition between worker and tool for longer than the client's
    timeout leaves the workflow unknown; the fenced lookup answers absent and closes its
    start; the owner then cancels the requeued workflow, and when the partition heals and
    delivers the old request the tool refuses it: the workflow ends cancelled with no
    effect, which is true."""
    rig = lab.credit_tool(idempotent=True)
    job = lab.approved(idempotent=True)
    link = proxy.Proxy("127.0.0.1", _port(rig.service.endpoint), "worker-tool").start()
    try:
        held = lab.worker_via(rig, endpoint=f"http://127.0.0.1:{link.port}",
                              timeout=CLIENT_TIMEOUT_S, name="held")
        link.partition(proxy.BLACKHOLE)
        held.run_one()
        unknown = lab.state(job.id)
        assert unknown.state == "unknown", unknown.state
        settled = rig.worker.reconcile(job.id)
        assert settled.state == "ready", settled.state
        cancelled = lab.store.cancel(harness.PROPOSER, job.id)
        assert cancelled.state == "cancelled", cancelled.state
        link.heal()
        lab.wait_until(lambda: rig.service.fenced == 1, within=15,
                       what="the healed link to deliver the held request and the tool to refuse it")
    finally:
        link.stop()
        held.client.close()
    final = lab.state(job.id)
    violations, findings = _checked(lab)
    observe({
        "late_path": "held in the network (worker to tool)",
        "after_timeout": unknown.state,
        "lookup": "absent, start closed",
        "late_request": "refused" if rig.service.fenced == 1 else "applied",
        "state": final.state,
        "effects": lab.effects(),
        "violations": len(violations) + len(findings),
    }, facts=("late_path", "after_timeout", "lookup", "late_request", "state", "effects",
              "violations"))
    assert final.state == "cancelled"
    assert lab.effects() == 0
    assert violations == [] and findings == [], (violations, findings)


def test_request_held_in_a_slow_tool_is_refused_and_the_budget_ends_failed(lab, observe):
    """A request held inside the tool before its ledger past the client's timeout leaves
    the workflow unknown; the fenced lookup answers absent and requeues it; its next
    attempts all get 429 until the budget is spent, so it ends failed; then the held
    request reaches the ledger and is refused: failed with no effect, which is true."""
    rig = lab.credit_tool(idempotent=True)
    job = lab.approved(idempotent=True)
    slow = lab.worker_via(rig, timeout=CLIENT_TIMEOUT_S, name="slow")
    hold = rig.service.hold_next(seconds=60, commit="before")
    try:
        slow.run_one()
        hold.wait_held()
        unknown = lab.state(job.id)
        assert unknown.state == "unknown", unknown.state
        rig.worker.reconcile(job.id)
        rig.service.reject_next(job.max_attempts)
        for _ in range(job.max_attempts):
            lab.make_due(job.id)
            rig.worker.run_one()
        ended = lab.state(job.id)
        assert ended.state == "failed", ended.state
        hold.release()
        hold.wait_finished()
    finally:
        hold.release()
        slow.client.close()
    violations, findings = _checked(lab)
    observe({
        "late_path": "held in the tool before its ledger",
        "after_timeout": unknown.state,
        "lookup": "absent, start closed",
        "requeued_attempts": "429 until the budget was spent",
        "late_request": "refused" if rig.service.fenced == 1 else "applied",
        "state": ended.state,
        "effects": lab.effects(),
        "violations": len(violations) + len(findings),
    }, facts=("late_path", "after_timeout", "lookup", "requeued_attempts", "late_request",
              "state", "effects", "violations"))
    assert rig.service.fenced == 1
    assert lab.effects() == 0
    assert lab.state(job.id).state == "failed"
    assert violations == [] and findings == [], (violations, findings)


def test_statement_held_between_tool_and_database_is_refused(lab, observe):
    """A tool whose link to its database is partitioned holds the write's statement past
    the client's timeout; a second replica of the tool answers the fenced lookup (absent)
    and the workflow is requeued and succeeds through it; when the link heals, the held
    statement reaches PostgreSQL and is refused by the tombstone: one effect, succeeded."""
    rig = lab.credit_tool(idempotent=True)
    job = lab.approved(idempotent=True)
    link, via = proxy.for_database(lab.dsn, "tool-database")
    partitioned = tool.ToolService(via, lab.schema,
                                   idempotent=True, token=rig.service.token).start()
    try:
        held = lab.worker_via(rig, endpoint=partitioned.endpoint, timeout=CLIENT_TIMEOUT_S,
                              name="held")
        link.partition(proxy.BLACKHOLE)
        held.run_one()
        unknown = lab.state(job.id)
        assert unknown.state == "unknown", unknown.state
        rig.worker.reconcile(job.id)
        done = rig.worker.run_one()
        assert done is not None and done.state == "succeeded", done
        link.heal()
        lab.wait_until(lambda: partitioned.fenced == 1, within=15,
                       what="the held INSERT to arrive and the ledger to refuse it")
    finally:
        link.heal()
        partitioned.stop()
        link.stop()
        held.client.close()
    final = lab.state(job.id)
    violations, findings = _checked(lab)
    observe({
        "late_path": "held between the tool and its database",
        "after_timeout": unknown.state,
        "lookup": "absent, start closed (another replica)",
        "late_request": "refused" if partitioned.fenced == 1 else "applied",
        "state": final.state,
        "effects": lab.effects(),
        "violations": len(violations) + len(findings),
    }, facts=("late_path", "after_timeout", "lookup", "late_request", "state", "effects",
              "violations"))
    assert final.state == "succeeded"
    assert lab.effects() == 1
    assert violations == [] and findings == [], (violations, findings)


def test_non_idempotent_absent_is_proven_and_requeued_without_a_person(lab, observe):
    """A non-idempotent tool that offers the fenced lookup lets the runtime settle an
    unknown without a person: the lookup proves the held request will never apply, the
    workflow is requeued automatically with that proof in its audit trail, the held
    request is refused when it arrives, and the retry performs the effect exactly once."""
    rig = lab.credit_tool(idempotent=False, fenced_lookup=True)
    job = lab.approved(idempotent=False)
    slow = lab.worker_via(rig, timeout=CLIENT_TIMEOUT_S, name="slow")
    hold = rig.service.hold_next(seconds=60, commit="before")
    try:
        slow.run_one()
        hold.wait_held()
        assert lab.state(job.id).state == "unknown"
        requeued = rig.worker.reconcile(job.id)
        hold.release()
        hold.wait_finished()
        lab.make_due(job.id)
        done = rig.worker.run_one()
    finally:
        hold.release()
        slow.client.close()
    proofs = [row["detail"] for row in lab.store.execute(
        "SELECT detail FROM events WHERE workflow_id = %s AND kind = 'reconciled'", (job.id,))]
    violations, findings = _checked(lab)
    observe({
        "tool": "non-idempotent, fenced lookup",
        "after_lookup": requeued.state,
        "proof_recorded": proofs == [f"lookup=absent closed_through={requeued.fence}"],
        "late_request": "refused" if rig.service.fenced == 1 else "applied",
        "state": done.state if done else "none",
        "effects": lab.effects(),
        "manual_reviews": lab.count_events("manual_review"),
        "violations": len(violations) + len(findings),
    }, facts=("tool", "after_lookup", "proof_recorded", "late_request", "state", "effects",
              "manual_reviews", "violations"))
    assert requeued.state == "ready"
    assert rig.service.fenced == 1
    assert done is not None and done.state == "succeeded"
    assert lab.effects() == 1
    assert lab.count_events("manual_review") == 0
    assert violations == [] and findings == [], (violations, findings)


def test_lookup_that_finds_the_effect_completes_it_and_closes_nothing(lab, observe):
    """A fenced lookup that finds the effect does not close the start: the same key is
    still deduplicated, and the workflow completes with the one effect it has."""
    rig = lab.credit_tool(idempotent=True)
    job = lab.approved(idempotent=True)
    rig.service.drop_next_reply()
    rig.worker.run_one()
    assert lab.state(job.id).state == "unknown"
    settled = rig.worker.reconcile(job.id)
    tombstone = lab.store.execute(
        "SELECT closed_through FROM tool_fences WHERE effect_key = %s", (job.effect_key,))
    observe({
        "lookup": "found",
        "state": settled.state,
        "closed_through": tombstone[0]["closed_through"] if tombstone else None,
        "effects": lab.effects(),
    }, facts=("lookup", "state", "closed_through", "effects"))
    assert settled.state == "succeeded"
    assert tombstone and tombstone[0]["closed_through"] == -1
    assert lab.effects() == 1

