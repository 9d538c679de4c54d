"""Claiming work, its lease, and the start barrier before dispatch, over the caller's
connection: a claim takes the oldest due ready workflow (fence + 1, attempt + 1, a lease)
unless it must not run, and a batch step completes, recovers and claims in one
transaction."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from lab import errors
from lab.runtime import sealing
from lab.runtime.barrier import Completion, StartBarrier
from lab.runtime.store import decisions, queries
from lab.runtime.store.records import Claimed, Finished, Step, Workflow
from lab.runtime.store.transitions import (
    Connection,
    barrier_row,
    event_queued,
    event_seq,
    fenced,
    release,
    verified_barrier,
)


def divert(conn: Connection, row: dict[str, Any], diverted: tuple[str, str, str]) -> None:
    """Write what a due ready row becomes instead of running, with its audit event."""
    state, kind, reason = diverted
    conn.execute(queries.DIVERT, (state, reason, state, state, row["id"]))
    event_queued(conn, row["id"], kind, row["fence"], "at=claim")


def claim_next(conn: Connection, owner: str, lease: timedelta) -> tuple[bool, Workflow | None]:
    """One claim attempt (see ``Store.claim``): (True, the claim), (True, None) when
    nothing is due, or (False, None) when the oldest due row was diverted instead (its
    diversion written): the caller commits and tries again."""
    row = conn.execute(queries.CLAIM_QUERY).fetchone()
    if row is None:
        return True, None
    diverted = decisions.claim_diversion(row)
    if diverted is None:
        # The same claim statement as a worker's batch: one home for what a claim sets.
        (claimed,) = _claim_rows(conn, [row], owner, lease, fuse=False)
        return True, claimed.workflow
    divert(conn, row, diverted)
    return False, None


def heartbeat(conn: Connection, claim: Workflow, lease: timedelta) -> datetime:
    """Extend a live lease held under ``claim``'s fence; an expired one stays expired."""
    row = fenced(
        conn, claim, "running", "lease_until = clock_timestamp() + %s", (lease,),
        guard=" AND owner = %s AND lease_until > clock_timestamp()",
        guard_params=(claim.owner,),
        refusal="lease expired or fence moved: heartbeat refused", touch=False,
    )
    lease_until: datetime = row["lease_until"]
    return lease_until


def recover_expired(conn: Connection) -> int:
    """Turn every running workflow whose lease ran out into ``unknown``; how many."""
    return len(conn.execute(queries.RECOVER_QUERY).fetchall())


def sealed_results(keys: sealing.KeyCatalog, finished: Sequence[Finished]) -> list[dict[str, Any]]:
    """Each finished dispatch's receipt, sealed for its workflow, once it proves the effect;
    else ``errors.ReceiptMismatch`` before anything is sent."""
    sealed: list[dict[str, Any]] = []
    for done in finished:
        if not done.receipt.proves(done.claim.effect_key, done.claim.fingerprint):
            raise errors.ReceiptMismatch()
        sealed.append(keys.seal(done.receipt.to_json(), done.claim.id))
    return sealed


def complete_and_claim(
    conn: Connection, finished: Sequence[Finished], sealed: Sequence[dict[str, Any]],
    owner: str, lease: timedelta, *, fuse: bool, recover: bool, limit: int,
) -> Step:
    """``Store.complete_and_claim``'s statements, in the caller's transaction."""
    completed = _write_completions(conn, finished, sealed)
    if recover:
        conn.execute(queries.RECOVER_QUERY)
    if limit == 0:
        return Step(completed, [])
    while True:
        rows = conn.execute(queries.CLAIM_BATCH_QUERY, (limit,)).fetchall()
        if not rows:
            return Step(completed, [])
        claimable = []
        for row in rows:
            diverted = decisions.claim_diversion(row)
            if diverted is None:
                claimable.append(row)
            else:
                divert(conn, row, diverted)
        if claimable:
            return Step(completed, _claim_rows(conn, claimable, owner, lease, fuse))
        # every row was diverted: claim again


def _write_completions(
    conn: Connection, finished: Sequence[Finished], sealed: Sequence[dict[str, Any]],
) -> list[Workflow]:
    """Write ``complete``'s rows for every finished dispatch in one statement, and judge
    them: the completed snapshots, in ``finished``'s order.

    Each must have found its row by the fenced update, have its stored barrier match the
    one dispatched under (digest and content) and its start no completion yet: else this
    raises for the first that fails, and the caller's transaction rolls back with nothing
    written.
    """
    if not finished:
        return []
    completions = [Completion.success(done.barrier, done.receipt.receipt_id)
                   for done in finished]
    statement, rows = queries.with_rows(queries.COMPLETIONS_WITH_EVENTS, [
        {"id": done.claim.id, "fence": done.claim.fence,
         "fingerprint": done.claim.fingerprint, "effect_key": done.claim.effect_key,
         "result": seal, "start_id": completion.start_id,
         "barrier_digest": completion.barrier_digest, "outcome": completion.outcome,
         "summary": completion.summary, "receipt_id": completion.receipt_id,
         "digest": completion.digest()}
        for done, seal, completion in zip(finished, sealed, completions, strict=True)
    ])
    written = conn.execute(statement, {"rows": rows, "ids": [done.claim.id for done in finished]})
    by_id = {row["id"]: row for row in written.fetchall()}
    snapshots = []
    for done in finished:
        row = by_id.get(done.claim.id)
        if row is None:
            raise errors.Stale("claim is no longer current: completion refused")
        stored = row.pop("stored_barrier")
        if stored is None or verified_barrier(stored) != done.barrier:
            raise errors.IntegrityFailure("start barrier is missing or differs from the dispatch")
        if not row.pop("completion_written"):
            raise errors.Conflict("this start already has a completion")
        snapshots.append(Workflow.from_row(row))
    return snapshots


def _claim_rows(
    conn: Connection, rows: list[dict[str, Any]], owner: str, lease: timedelta, fuse: bool,
) -> list[Claimed]:
    """Claim due ``rows`` (locked by this transaction) in one statement, with ``fuse``
    committing each idempotent one's start barrier in the same statement; the claims,
    oldest first."""
    barriers: dict[str, StartBarrier] = {}
    if fuse:
        for row in rows:
            if row["plan"].get("idempotent") is True:
                barriers[row["id"]] = StartBarrier.for_claim(
                    row["id"], row["fence"] + 1, row["attempt"] + 1, row["effect_key"],
                    row["fingerprint"], row["trace_id"],
                )
    if barriers:
        statement, wanted = queries.with_rows(queries.CLAIMS_WITH_BARRIERS, [
            {"id": row["id"], "fence": row["fence"], **_barrier_fields(barriers.get(row["id"]))}
            for row in rows
        ])
    else:
        statement, wanted = queries.with_rows(
            queries.CLAIMS_WITH_EVENTS, [{"id": row["id"], "fence": row["fence"]} for row in rows])
    claimed = conn.execute(statement, {
        "rows": wanted, "ids": [row["id"] for row in rows], "owner": owner, "lease": lease,
        "detail": f"owner={owner}",
    })
    written = {row["id"]: row for row in claimed.fetchall()}
    # Every row is locked by this transaction and still at its fence: each is claimed.
    assert written.keys() == {row["id"] for row in rows}
    for workflow_id, row in written.items():
        if not row.pop("barrier_written", False) and workflow_id in barriers:
            # Never dispatch on a barrier that was not committed: the transaction rolls back.
            raise errors.IntegrityFailure("a fused start barrier was not written with its claim")
    return [Claimed(Workflow.from_row({**row, **written[row["id"]]}), barriers.get(row["id"]))
            for row in rows]


def _barrier_fields(barrier: StartBarrier | None) -> dict[str, Any]:
    """A claim row's barrier columns for ``CLAIMS_WITH_BARRIERS``: null without one."""
    if barrier is None:
        return {"start_id": None}
    return {"start_id": barrier.start_id, "barrier_fence": barrier.fence,
            "attempt": barrier.attempt, "effect_key": barrier.effect_key,
            "fingerprint": barrier.fingerprint, "trace_id": barrier.trace_id,
            "span_id": barrier.span_id, "digest": barrier.digest()}


def pre_dispatch(conn: Connection, claim: Workflow) -> StartBarrier | None:
    """``Store.pre_dispatch``'s checks and writes, in the caller's transaction."""
    wanted = StartBarrier.for_claim(
        claim.id, claim.fence, claim.attempt, claim.effect_key, claim.fingerprint,
        claim.trace_id,
    )
    row = conn.execute(queries.DISPATCH_CHECK, (claim.id,)).fetchone()
    if row is None:
        raise errors.NotFound(f"no workflow {claim.id!r}")
    if row["state"] != "running" or row["fence"] != claim.fence or not row["lease_live"]:
        raise errors.Stale("claim is no longer current: not dispatching")
    existing = barrier_row(conn, wanted.start_id)
    if existing is not None:
        stored = verified_barrier(existing)
        if stored != wanted:
            raise errors.Conflict("start barrier exists with different content")
        return stored
    if row["cancel_requested"]:
        release(conn, claim, "cancelled")
        event_seq(conn, claim.id, "cancelled", claim.fence, "at=pre_dispatch")
        return None
    if row["approval_lapsed"]:
        release(conn, claim, "waiting_approval")
        event_seq(conn, claim.id, "approval_expired", claim.fence, "at=pre_dispatch")
        return None
    if (row["attempt"], row["fingerprint"], row["effect_key"], row["trace_id"]) != (
        wanted.attempt, wanted.fingerprint, wanted.effect_key, wanted.trace_id
    ):
        raise errors.Conflict("claim does not match the stored workflow")
    audit = event_seq(conn, claim.id, "dispatching", claim.fence, f"start={wanted.start_id}")
    conn.execute(
        queries.INSERT_BARRIER,
        (wanted.start_id, wanted.workflow_id, wanted.fence, wanted.attempt,
         wanted.effect_key, wanted.fingerprint, wanted.trace_id, wanted.span_id,
         audit, wanted.digest()),
    )
    return wanted
