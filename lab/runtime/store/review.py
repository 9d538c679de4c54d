"""Work waiting for a person, over the caller's connection: recording why (with the
database's proof for non-idempotent work), taking proven-undispatched work out of
review, a reviewer's requeue or resolution, and what an operator's recoverer reads."""

from __future__ import annotations

from psycopg.types.json import Jsonb

from lab import errors
from lab.runtime import sealing
from lab.runtime.store import queries
from lab.runtime.store.records import NON_EFFECT_OUTCOMES, UNDISPATCHED_REVIEW, Actor, Workflow
from lab.runtime.store.transitions import Connection, barrier_at, event_seq, fenced, locked


def require_review(conn: Connection, unknown: Workflow, reason: str) -> str:
    """Record why an unknown workflow waits for a person; the reason recorded (see
    ``Store.require_review``, which raises ``ManualReview`` once this commits)."""
    if reason == "non_idempotent":
        barrier = barrier_at(conn, unknown.id, unknown.fence)
        reason = (
            UNDISPATCHED_REVIEW
            if barrier is None
            else "non_idempotent_dispatched"
        )
    fenced(
        conn, unknown, "unknown", "review_reason = %s", (reason,),
        refusal="workflow changed during reconciliation",
        event=("manual_review", f"reason={reason}"),
    )
    return reason


def settle_undispatched(conn: Connection, workflow_id: str) -> Workflow | None:
    """Take proven-undispatched work out of manual review (see ``Store.settle_undispatched``)."""
    row = locked(conn, workflow_id)
    if row["state"] != "unknown" or row["review_reason"] != UNDISPATCHED_REVIEW:
        return None
    if not never_dispatched(conn, workflow_id, row["fence"]):
        return None
    current = Workflow.from_row(row)
    if row["cancel_requested"]:
        outcome = fenced(
            conn, current, "unknown", "state = 'cancelled'", (),
            refusal="workflow changed during recovery",
            event=("cancelled", "at=review proof=no_start_barrier"),
        )
    elif row["attempt"] >= row["max_attempts"]:
        outcome = fenced(
            conn, current, "unknown",
            "state = 'failed', review_reason = 'attempt_budget_spent'", (),
            refusal="workflow changed during recovery",
            event=("failed", "cause=attempt_budget_spent proof=no_start_barrier"),
        )
    else:
        outcome = fenced(
            conn, current, "unknown",
            "state = 'ready', ready_at = clock_timestamp(), review_reason = ''", (),
            refusal="workflow changed during recovery",
            event=("requeued_undispatched", "proof=no_start_barrier"),
        )
    return Workflow.from_row(outcome)


def never_dispatched(conn: Connection, workflow_id: str, fence: int) -> bool:
    """The database's proof that no start of this workflow may have reached the tool.

    No start barrier under ``fence``, and every earlier one completed as a definite
    non-effect. A barrier is committed before every dispatch, so its absence proves
    the tool was never called under that fence.
    """
    row = conn.execute(
        queries.OPEN_STARTS, (workflow_id, fence, list(NON_EFFECT_OUTCOMES))
    ).fetchone()
    return row is not None and int(row["open_starts"]) == 0


def requeue_reviewed(
    conn: Connection, reviewer: Actor, workflow_id: str, force: bool, reason: str
) -> Workflow:
    """A person sends an unknown workflow back to the queue (see ``Store.requeue_reviewed``)."""
    row = locked(conn, workflow_id)
    if reviewer.tenant != row["tenant"] or reviewer.role != "reviewer":
        raise errors.Denied("only a reviewer of the workflow's tenant may requeue it")
    if row["state"] != "unknown":
        raise errors.Conflict(f"only unknown work can be requeued, not {row['state']}")
    if row["attempt"] >= row["max_attempts"]:
        raise errors.Conflict("attempt budget spent: resolve it instead")
    barrier = barrier_at(conn, workflow_id, row["fence"])
    if barrier is not None and not (force and reason.strip()):
        raise errors.Denied(
            f"start barrier {barrier.start_id} shows it may have been dispatched: "
            "requeue needs --force and a reason"
        )
    decision = "requeue" if barrier is None else "forced_requeue"
    proof = "no start barrier" if barrier is None else f"barrier {barrier.start_id}"
    conn.execute(
        queries.INSERT_REVIEW,
        (workflow_id, reviewer.subject, decision, proof, reason.strip()),
    )
    updated = conn.execute(queries.REQUEUE_REVIEWED, (workflow_id,)).fetchone()
    assert updated is not None
    event_seq(conn, workflow_id, decision, row["fence"], f"by={reviewer.subject}")
    return Workflow.from_row(updated)


def resolve_reviewed(
    conn: Connection, keys: sealing.KeyCatalog, reviewer: Actor, workflow_id: str,
    outcome: str, reason: str,
) -> Workflow:
    """A person closes an unknown workflow as ``failed`` or ``succeeded`` (checked by hand)."""
    row = locked(conn, workflow_id)
    if reviewer.tenant != row["tenant"] or reviewer.role != "reviewer":
        raise errors.Denied("only a reviewer of the workflow's tenant may resolve it")
    if row["state"] != "unknown":
        raise errors.Conflict(f"only unknown work can be resolved, not {row['state']}")
    conn.execute(
        queries.INSERT_REVIEW,
        (workflow_id, reviewer.subject, f"resolve_{outcome}", "person", reason.strip()),
    )
    result = (
        Jsonb(keys.seal({"resolved_by": reviewer.subject}, workflow_id))
        if outcome == "succeeded"
        else None
    )
    updated = conn.execute(queries.RESOLVE_REVIEWED, (outcome, result, workflow_id)).fetchone()
    assert updated is not None
    event_seq(conn, workflow_id, f"resolved_{outcome}", row["fence"], f"by={reviewer.subject}")
    return Workflow.from_row(updated)


def in_review(conn: Connection, tenant: str) -> list[Workflow]:
    """``tenant``'s workflows waiting for a person: unknown, with the recorded reason."""
    rows = conn.execute(queries.IN_REVIEW, (tenant,)).fetchall()
    return [Workflow.from_row(row) for row in rows]


def open_counts(conn: Connection) -> dict[str, int]:
    """How much work is still open: ready (due or delayed), running, unknown unreviewed."""
    row = conn.execute(queries.OPEN_COUNTS).fetchone()
    assert row is not None
    return {name: int(value) for name, value in row.items()}


def unreviewed_unknown(conn: Connection) -> list[str]:
    """Ids of unknown workflows nobody reconciled yet, oldest change first."""
    return [str(row["id"]) for row in conn.execute(queries.UNREVIEWED_UNKNOWN).fetchall()]


def undispatched_in_review(conn: Connection) -> list[str]:
    """Ids of workflows in review as proven never dispatched, oldest change first."""
    rows = conn.execute(queries.IN_REVIEW_FOR, (UNDISPATCHED_REVIEW,)).fetchall()
    return [str(row["id"]) for row in rows]
