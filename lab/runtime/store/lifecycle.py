"""A workflow's life before any worker: created once per tenant and operation,
approved for one fingerprint, cancelled on request; each over the caller's connection."""

from __future__ import annotations

import secrets
from datetime import timedelta

from psycopg.types.json import Jsonb

from lab import errors, names
from lab.runtime.plan import Plan, effect_key
from lab.runtime.store import queries
from lab.runtime.store.records import DEFAULT_MAX_ATTEMPTS, Actor, Workflow
from lab.runtime.store.transitions import Connection, event_seq, locked


def create(
    conn: Connection, actor: Actor, operation: str, plan: Plan, fingerprint: str
) -> Workflow:
    """Insert the workflow awaiting approval, once per tenant and operation (see
    ``Store.create``): the new snapshot, or the one already there for the same plan.

    A conflict is raised only when the insert wrote nothing, so rolling back loses nothing.
    """
    row = conn.execute(
        queries.INSERT_WORKFLOW,
        (
            names.new_id(),
            actor.tenant,
            operation,
            actor.subject,
            Jsonb(plan.to_json()),
            fingerprint,
            plan.version,
            effect_key(actor.tenant, operation),
            secrets.token_hex(16),  # the W3C trace id linking every record
            DEFAULT_MAX_ATTEMPTS,
        ),
    ).fetchone()
    if row is not None:
        event_seq(conn, row["id"], "created", 0, f"plan_version={plan.version}")
        return Workflow.from_row(row)
    existing = conn.execute(queries.WORKFLOW_BY_OPERATION, (actor.tenant, operation)).fetchone()
    if existing is None:  # the row that conflicted was removed meanwhile
        raise errors.Conflict("operation changed concurrently; retry")
    if existing["fingerprint"] != fingerprint:
        raise errors.Conflict("operation already exists with different parameters")
    return Workflow.from_row(existing)


def approve(
    conn: Connection, actor: Actor, workflow_id: str, fingerprint: str, ttl: timedelta
) -> Workflow:
    """Approve exactly the plan with ``fingerprint`` (see ``Store.approve``)."""
    row = locked(conn, workflow_id)
    if actor.tenant != row["tenant"]:
        raise errors.Denied("approver belongs to another tenant")
    if actor.role != "approver":
        raise errors.Denied("only the approver role may approve")
    if actor.subject == row["proposed_by"]:
        raise errors.Denied("a proposer cannot approve their own plan")
    if fingerprint != row["fingerprint"]:
        raise errors.Denied("approval names a different plan fingerprint")
    if row["state"] != "waiting_approval" or row["cancel_requested"]:
        raise errors.Conflict(f"cannot approve a workflow in state {row['state']}")
    updated = conn.execute(queries.APPROVE, (actor.subject, ttl, workflow_id)).fetchone()
    assert updated is not None
    event_seq(conn, workflow_id, "approved", updated["fence"], f"by={actor.subject}")
    return Workflow.from_row(updated)


def get(conn: Connection, workflow_id: str) -> Workflow:
    """The current snapshot of one workflow, or ``errors.NotFound``."""
    row = conn.execute(queries.WORKFLOW_BY_ID, (workflow_id,)).fetchone()
    if row is None:
        raise errors.NotFound(f"no workflow {workflow_id!r}")
    return Workflow.from_row(row)


def cancel(conn: Connection, actor: Actor, workflow_id: str) -> Workflow:
    """Request cancellation (see ``Store.cancel``)."""
    row = locked(conn, workflow_id)
    if actor.tenant != row["tenant"]:
        raise errors.Denied("actor belongs to another tenant")
    if actor.role not in ("proposer", "approver"):
        raise errors.Denied("only a proposer or approver may cancel")
    updated = conn.execute(queries.CANCEL, (workflow_id,)).fetchone()
    assert updated is not None
    event_seq(conn, workflow_id, "cancel_requested", row["fence"], f"by={actor.subject}")
    if updated["state"] == "cancelled" and row["state"] != "cancelled":
        event_seq(conn, workflow_id, "cancelled", row["fence"], "at=queue")
    return Workflow.from_row(updated)
