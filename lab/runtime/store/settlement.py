"""Settling a dispatch, over the caller's connection: success under the claim's fence,
an unknown outcome, a retry after a definite non-effect, a refusal, the reconciling
lookup's answer, and quarantine of records that failed verification."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from psycopg.types.json import Jsonb

from lab import errors, protocol
from lab.runtime.barrier import Completion
from lab.runtime.plan import Receipt
from lab.runtime.store.records import Workflow
from lab.runtime.store.transitions import (
    Connection,
    barrier_at,
    complete_start,
    event_seq,
    fenced,
    has_completion,
)


def complete(
    conn: Connection, claim: Workflow, receipt: Receipt, sealed: dict[str, Any]
) -> Workflow:
    """Record success under ``claim``'s fence, with the receipt ``sealed`` for it."""
    barrier = barrier_at(conn, claim.id, claim.fence)
    row = fenced(
        conn, claim, "running",
        "state = 'succeeded', result = %s, owner = '', lease_until = NULL, "
        "review_reason = ''",
        (Jsonb(sealed),),
        guard=" AND fingerprint = %s AND effect_key = %s",
        guard_params=(claim.fingerprint, claim.effect_key),
        refusal="claim is no longer current: completion refused",
    )
    if barrier is not None:
        complete_start(conn, Completion.success(barrier, receipt.receipt_id))
    event_seq(conn, claim.id, "completed", claim.fence, "")
    return Workflow.from_row(row)


def unknown(conn: Connection, claim: Workflow, cause: str) -> Workflow:
    """Record that the dispatch's outcome is not known (it may have happened)."""
    row = fenced(
        conn, claim, "running", "state = 'unknown', owner = '', lease_until = NULL", (),
        refusal="claim is no longer current: unknown refused",
        event=("unknown", f"cause={cause}"),
    )
    return Workflow.from_row(row)


def retry_later(conn: Connection, claim: Workflow, backoff: timedelta, cause: str) -> Workflow:
    """Queue again after ``backoff`` (see ``Store.retry_later``)."""
    row = fenced(
        conn, claim, "running",
        """
        state = CASE WHEN cancel_requested THEN 'cancelled'
                     WHEN attempt >= max_attempts THEN 'failed'
                     ELSE 'ready' END,
        review_reason = CASE WHEN attempt >= max_attempts AND NOT cancel_requested
                             THEN 'attempt_budget_spent' ELSE '' END,
        ready_at = clock_timestamp() + %s, owner = '', lease_until = NULL
        """,
        (backoff,),
        refusal="claim is no longer current: retry refused",
    )
    barrier = barrier_at(conn, claim.id, claim.fence)
    if barrier is not None:
        outcome = "unreachable" if cause == "tool_unreachable" else (
            "rate_limited_budget_spent"
            if row["review_reason"] == "attempt_budget_spent"
            else "rate_limited"
        )
        complete_start(conn, Completion.failure(barrier, outcome))
    kind = {"ready": "retry_scheduled"}.get(row["state"], row["state"])
    event_seq(conn, claim.id, kind, claim.fence, f"cause={cause}")
    return Workflow.from_row(row)


def fail(conn: Connection, claim: Workflow, reason: str) -> Workflow:
    """Record a definite refusal by the tool: the workflow failed, nothing happened."""
    row = fenced(
        conn, claim, "running",
        "state = 'failed', review_reason = %s, owner = '', lease_until = NULL", (reason,),
        refusal="claim is no longer current: failure refused",
    )
    barrier = barrier_at(conn, claim.id, claim.fence)
    if barrier is not None:
        complete_start(conn, Completion.failure(barrier, "rejected"))
    event_seq(conn, claim.id, "failed", claim.fence, f"cause={reason}")
    return Workflow.from_row(row)


def settle_found(
    conn: Connection, unknown: Workflow, receipt: Receipt, sealed: dict[str, Any]
) -> Workflow:
    """The authoritative lookup found the effect: the workflow succeeded."""
    barrier = barrier_at(conn, unknown.id, unknown.fence)
    row = fenced(
        conn, unknown, "unknown", "state = 'succeeded', result = %s, review_reason = ''",
        (Jsonb(sealed),),
        guard=" AND fingerprint = %s AND effect_key = %s",
        guard_params=(unknown.fingerprint, unknown.effect_key),
        refusal="workflow changed during reconciliation",
    )
    if barrier is not None and not has_completion(conn, barrier.start_id):
        complete_start(conn, Completion.success(barrier, receipt.receipt_id))
    event_seq(conn, unknown.id, "reconciled", unknown.fence, "lookup=found")
    return Workflow.from_row(row)


def requeue_absent(conn: Connection, unknown: Workflow) -> Workflow | None:
    """The lookup found no effect: requeue the same key when the plan is idempotent, with
    attempts left and no cancellation, all re-checked at write time; else None."""
    row = fenced(
        conn, unknown, "unknown",
        "state = 'ready', ready_at = clock_timestamp(), review_reason = ''", (),
        guard=" AND NOT cancel_requested AND attempt < max_attempts"
              " AND plan -> 'idempotent' = 'true'::jsonb",
        refusal=None, event=("reconciled", "lookup=absent"),
    )
    return None if row is None else Workflow.from_row(row)


def settle_proven_absent(conn: Connection, unknown: Workflow, closed_through: int) -> Workflow:
    """A fenced lookup proved no request of ``unknown``'s starts took or will take effect
    (it closed every fence up to ``closed_through``): requeue it while attempts last, end
    it cancelled when cancellation was asked, or failed when its attempts are spent, the
    proof in its ``reconciled`` event. Idempotent or not: nothing can land later."""
    if closed_through < unknown.fence:
        raise errors.Conflict(f"a lookup closed through fence {closed_through} does not "
                              f"cover the workflow's start at fence {unknown.fence}")
    row = fenced(
        conn, unknown, "unknown",
        "state = CASE WHEN cancel_requested THEN 'cancelled'"
        " WHEN attempt >= max_attempts THEN 'failed' ELSE 'ready' END,"
        " ready_at = clock_timestamp(), owner = '', lease_until = NULL,"
        " review_reason = CASE WHEN NOT cancel_requested AND attempt >= max_attempts"
        " THEN 'attempt_budget_spent' ELSE '' END", (),
        refusal="workflow changed during reconciliation",
        event=("reconciled", f"{protocol.FENCED_ABSENT}{closed_through}"),
    )
    if row["state"] == "cancelled":
        event_seq(conn, unknown.id, "cancelled", unknown.fence, "at=reconcile")
    elif row["state"] == "failed":
        event_seq(conn, unknown.id, "failed", unknown.fence, "cause=attempt_budget_spent")
    return Workflow.from_row(row)


def quarantine(conn: Connection, workflow: Workflow, reason: str) -> Workflow:
    """Refuse to act on a workflow whose stored records failed verification."""
    row = fenced(
        conn, workflow, ("running", "unknown"),
        "state = CASE WHEN state = 'running' THEN 'unknown' ELSE state END, "
        "owner = '', lease_until = NULL, review_reason = %s",
        (reason,),
        refusal="workflow changed before it could be quarantined",
        event=("manual_review", f"reason={reason}"),
    )
    return Workflow.from_row(row)
