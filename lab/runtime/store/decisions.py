"""What the store decides before or without I/O: which requests it refuses outright,
what a due ready row becomes instead of running, and why unknown work waits for a
person. Pure: rows and snapshots in, a decision or an error out."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lab import errors
from lab.runtime.plan import SUPPORTED_PLAN_VERSION, Plan
from lab.runtime.store.records import Actor, Workflow


def check_creation(actor: Actor, operation: str, plan: Plan) -> None:
    """Refuse, before any I/O, what no creation may hold: an invalid plan, an actor who
    is not a proposer, an empty tenant, subject or operation."""
    plan.validate()
    if actor.role != "proposer":
        raise errors.Denied("only a proposer may create a workflow")
    if not operation or not actor.tenant or not actor.subject:
        raise errors.Rejected("tenant, subject and operation must be non-empty")


def check_claimer(owner: str, lease: timedelta) -> None:
    """Refuse an empty owner or a lease that is not positive, before any I/O."""
    if not owner:
        raise errors.Rejected("owner must be non-empty")
    if lease <= timedelta(0):
        raise errors.Rejected("lease must be positive")


def claim_diversion(row: dict[str, Any]) -> tuple[str, str, str] | None:
    """What a due ready row becomes instead of running: (state, event kind, reason)."""
    if row["cancel_requested"]:
        return ("cancelled", "cancelled", "")
    if row["approval_lapsed"]:
        return ("waiting_approval", "approval_expired", "")
    if row["plan_version"] != SUPPORTED_PLAN_VERSION:
        return ("incompatible", "incompatible", "unsupported_plan_version")
    try:
        intact = Plan.from_json(row["plan"]).fingerprint() == row["fingerprint"]
    except errors.Rejected:
        intact = False
    if not intact:
        return ("failed", "integrity_failed", "integrity")
    return None


def absent_review_reason(unknown: Workflow, current: Workflow) -> str:
    """Why an unknown workflow the empty lookup could not requeue waits for a person;
    ``errors.Stale`` when it changed since ``unknown`` was read."""
    if current.state != "unknown" or current.fence != unknown.fence:
        raise errors.Stale("workflow changed during reconciliation")
    if current.cancel_requested:
        reason = "cancel_requested"
    elif current.attempt >= current.max_attempts:
        reason = "attempt_budget_spent"
    else:
        reason = "non_idempotent"
    return reason


def check_resolution(outcome: str, reason: str) -> None:
    """Refuse, before any I/O, a resolution other than failed or succeeded, or no reason."""
    if outcome not in ("failed", "succeeded"):
        raise errors.Rejected("a review resolves to 'failed' or 'succeeded'")
    if not reason.strip():
        raise errors.Rejected("resolving a review needs a reason")
