"""The steps every transition is made of, inside the caller's transaction: the fenced
update, its audit event, the locked row, and the start barrier and completion reads
and writes, each verified where it is read."""

from __future__ import annotations

from typing import Any, LiteralString, TypeAlias, overload

import psycopg

from lab import errors
from lab.runtime.barrier import Completion, StartBarrier
from lab.runtime.store import queries
from lab.runtime.store.records import Workflow

# A pooled connection of the store: autocommit off inside a transaction, rows as dicts.
Connection: TypeAlias = psycopg.Connection[dict[str, Any]]


@overload
def fenced(
    conn: Connection, workflow: Workflow, states: str | tuple[str, ...],
    assignments: LiteralString, params: tuple[Any, ...], *, guard: LiteralString = "",
    guard_params: tuple[Any, ...] = (), refusal: str, event: tuple[str, str] | None = None,
    touch: bool = True,
) -> dict[str, Any]: ...


@overload
def fenced(
    conn: Connection, workflow: Workflow, states: str | tuple[str, ...],
    assignments: LiteralString, params: tuple[Any, ...], *, guard: LiteralString = "",
    guard_params: tuple[Any, ...] = (), refusal: None, event: tuple[str, str] | None = None,
    touch: bool = True,
) -> dict[str, Any] | None: ...


def fenced(
    conn: Connection,
    workflow: Workflow,
    states: str | tuple[str, ...],
    assignments: LiteralString,
    params: tuple[Any, ...],
    *,
    guard: LiteralString = "",
    guard_params: tuple[Any, ...] = (),
    refusal: str | None,
    event: tuple[str, str] | None = None,
    touch: bool = True,
) -> dict[str, Any] | None:
    """The one shape of every fenced transition, inside the caller's transaction.

    ``UPDATE workflows SET <assignments> WHERE id AND fence AND state IN <states>
    <guard> RETURNING *``: the row as updated, with the audit event ``(kind,
    detail)`` written under the workflow's fence when one is given. No row
    means the caller's view is no longer current: ``errors.Stale(refusal)``, or
    None when ``refusal`` is None (the caller decides what that means).
    ``touch`` sets ``updated_at`` (a heartbeat does not: it changes no state).
    """
    wanted = [states] if isinstance(states, str) else list(states)
    row = conn.execute(
        queries.fenced_update(assignments, guard, touch),
        (*params, workflow.id, workflow.fence, wanted, *guard_params),
    ).fetchone()
    if row is None:
        if refusal is None:
            return None
        raise errors.Stale(refusal)
    if event is not None:
        event_seq(conn, workflow.id, event[0], workflow.fence, event[1])
    return row


def event_seq(conn: Connection, workflow_id: str, kind: str, fence: int, detail: str) -> int:
    """Write one audit event and return its sequence number."""
    row = conn.execute(queries.RECORD_EVENT_SEQ, (workflow_id, kind, fence, detail)).fetchone()
    assert row is not None
    seq: int = row["seq"]
    return seq


def event_queued(conn: Connection, workflow_id: str, kind: str, fence: int, detail: str) -> None:
    """``event_seq`` without reading its sequence number back."""
    conn.execute(queries.RECORD_EVENT, (workflow_id, kind, fence, detail))


def locked(conn: Connection, workflow_id: str) -> dict[str, Any]:
    """The workflow's row, locked for this transaction, or ``errors.NotFound``."""
    row = conn.execute(queries.LOCK_WORKFLOW, (workflow_id,)).fetchone()
    if row is None:
        raise errors.NotFound(f"no workflow {workflow_id!r}")
    return row


def barrier_row(conn: Connection, start: str) -> dict[str, Any] | None:
    """The stored start barrier ``start``, unverified (``verified_barrier`` checks it)."""
    return conn.execute(queries.BARRIER_BY_START, (start,)).fetchone()


def verified_barrier(row: dict[str, Any]) -> StartBarrier:
    """Rebuild a stored barrier and verify it; any mismatch fails closed."""
    barrier = StartBarrier(**{name: row[name] for name in StartBarrier.__dataclass_fields__})
    barrier.verify(row["digest"], row["audit_event"])
    return barrier


def barrier_at(conn: Connection, workflow_id: str, fence: int) -> StartBarrier | None:
    """The verified start barrier committed under one workflow's fence, if any."""
    row = conn.execute(queries.BARRIER_AT_FENCE, (workflow_id, fence)).fetchone()
    return None if row is None else verified_barrier(row)


def has_completion(conn: Connection, start: str) -> bool:
    """Whether the start ``start`` has its completion."""
    return conn.execute(queries.HAS_COMPLETION, (start,)).fetchone() is not None


def complete_start(conn: Connection, completion: Completion) -> None:
    """Write the start's one completion; a second one (of either kind) is a conflict."""
    row = conn.execute(
        queries.INSERT_COMPLETION,
        (completion.start_id, completion.barrier_digest, completion.outcome, completion.summary,
         completion.receipt_id, completion.digest()),
    ).fetchone()
    if row is None:
        raise errors.Conflict("this start already has a completion")


def release(conn: Connection, claim: Workflow, state: str) -> None:
    """Let a claim go before dispatch, to ``state``, under its fence."""
    conn.execute(queries.RELEASE, (state, state, state, claim.id, claim.fence))


def completion_for(conn: Connection, start: str) -> Completion | None:
    """The verified completion of one start (and its verified barrier), if it has one."""
    row = conn.execute(queries.COMPLETION_WITH_BARRIER, (start,)).fetchone()
    if row is None:
        return None
    barrier = verified_barrier({**row, "digest": row["barrier_row_digest"]})
    completion = Completion(
        start_id=row["start_id"],
        barrier_digest=row["barrier_digest"],
        outcome=row["outcome"],
        summary=row["summary"],
        receipt_id=row["receipt_id"],
    )
    completion.verify(row["completion_digest"], barrier)
    return completion
