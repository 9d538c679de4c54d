"""``Store``: the workflow state machine as fenced SQL transitions on PostgreSQL.

Every transition is one transaction guarded by the caller's fence (and lease
where it matters) that writes its audit event in the same transaction, and a
stale fence is reported as ``errors.Stale``, never as a silent no-op. Time
comes from PostgreSQL's ``clock_timestamp()``, never from this process's clock.
psycopg errors are translated into ``errors.StoreError`` here, at the edge.

The face owns the pool and the transactions; what each transition does inside its
transaction lives in ``lifecycle``, ``claims``, ``settlement`` and ``review``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, LiteralString

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from lab import errors, loopback, names
from lab.pg import edge
from lab.runtime import sealing
from lab.runtime.barrier import Completion, StartBarrier
from lab.runtime.plan import Plan, Receipt
from lab.runtime.store import (
    claims,
    decisions,
    lifecycle,
    queries,
    review,
    settlement,
    transitions,
)
from lab.runtime.store.records import Actor, Finished, Step, Workflow
from lab.runtime.store.tables import create_schema


class Store:
    """Workflows in one PostgreSQL schema, reached through a small connection pool."""

    def __init__(
        self,
        pool: ConnectionPool[psycopg.Connection[dict[str, Any]]],
        schema: str,
        keys: sealing.KeyCatalog,
    ):
        self._pool = pool
        self.schema = schema
        self.keys = keys

    @classmethod
    def open(
        cls,
        dsn: str,
        schema: str,
        *,
        create: bool = False,
        allow_remote: bool = False,
        max_connections: int = 4,
        application_name: str = "lab",
        keys: sealing.KeyCatalog | None = None,
    ) -> Store:
        """Connect to ``schema`` (creating it and its tables when ``create``).

        The DSN must point at loopback unless ``allow_remote`` is set. Results
        are sealed with ``keys`` (by default the catalog from the environment).
        """
        names.check_schema_name(schema)
        target = dsn if allow_remote else loopback.check_dsn(dsn)
        if create:
            create_schema(target, schema)
        pool: ConnectionPool[psycopg.Connection[dict[str, Any]]] = ConnectionPool(
            target,
            min_size=1,
            max_size=max_connections,
            kwargs={
                "autocommit": True,
                "row_factory": dict_row,
                # The name passed names.SCHEMA_NAME above, so it is safe inside options.
                "options": f"-c search_path={schema}",
                "application_name": application_name,
            },
            connection_class=psycopg.Connection[dict[str, Any]],
            open=False,
        )
        with edge.translated("open a connection pool"):
            pool.open(wait=True, timeout=10)
        return cls(pool, schema, keys or sealing.load_catalog())

    def close(self) -> None:
        """Close every connection of the pool."""
        self._pool.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self, action: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        with edge.translated(action), self._pool.connection() as conn, conn.transaction():
            yield conn

    def execute(
        self, query: LiteralString, params: tuple[Any, ...] = (), *,
        action: str = "run a statement",
    ) -> list[dict[str, Any]]:
        """Run one literal SQL statement in its own transaction; return its rows, if any.

        For experiments and fault tools that inject faults (expire a lease, add a
        constraint, end a backend): the query is a literal, values travel as parameters.
        ``action`` names what failed in a ``StoreError``.
        """
        with self._transaction(action) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

    # -- creation and approval -------------------------------------------------

    def create(self, actor: Actor, operation: str, plan: Plan) -> Workflow:
        """Persist a plan awaiting approval, once per tenant and operation.

        Creating the same operation again returns the same workflow; the same
        operation with different parameters raises ``errors.Conflict``.
        """
        decisions.check_creation(actor, operation, plan)
        fingerprint = plan.fingerprint()
        with self._transaction("create a workflow") as conn:
            return lifecycle.create(conn, actor, operation, plan, fingerprint)

    def approve(
        self, actor: Actor, workflow_id: str, fingerprint: str, ttl: timedelta
    ) -> Workflow:
        """Approve exactly the plan with ``fingerprint``, for ``ttl``, as ``actor``.

        The approver must be of the workflow's tenant, hold the approver role,
        not be its proposer, and name the stored fingerprint; otherwise
        ``errors.Denied`` and nothing changes.
        """
        if ttl <= timedelta(0):
            raise errors.Rejected("approval lifetime must be positive")
        with self._transaction("approve a workflow") as conn:
            return lifecycle.approve(conn, actor, workflow_id, fingerprint, ttl)

    def get(self, workflow_id: str) -> Workflow:
        """The current snapshot of one workflow, or ``errors.NotFound``."""
        with self._transaction("read a workflow") as conn:
            return lifecycle.get(conn, workflow_id)

    def cancel(self, actor: Actor, workflow_id: str) -> Workflow:
        """Request cancellation. Work not yet dispatched is cancelled at once;

        running or unknown work keeps its state with the request recorded, so
        an effect that already happened is never erased.
        """
        with self._transaction("cancel a workflow") as conn:
            return lifecycle.cancel(conn, actor, workflow_id)

    # -- claiming and leases -----------------------------------------------------

    def claim(self, owner: str, lease: timedelta) -> Workflow | None:
        """Claim the oldest due ready workflow: fence + 1, attempt + 1, a lease.

        The claim also decides, in the same transaction, what must not run: a
        requested cancellation (cancelled), a lapsed approval (back to
        waiting_approval), an unsupported plan version (incompatible, attempt
        unchanged) or a stored plan that no longer matches its fingerprint
        (failed, reason ``integrity``). Returns None when nothing is due.
        """
        decisions.check_claimer(owner, lease)
        while True:
            with self._transaction("claim work") as conn:
                done, claimed = claims.claim_next(conn, owner, lease)
            if done:
                return claimed

    def heartbeat(self, claim: Workflow, lease: timedelta) -> datetime:
        """Extend a live lease held under ``claim``'s fence; an expired one stays expired."""
        with self._transaction("extend a lease") as conn:
            return claims.heartbeat(conn, claim, lease)

    def lease_expired(self, workflow_id: str) -> bool:
        """True when ``workflow_id``'s lease has run out on PostgreSQL's clock."""
        row = self.execute(queries.LEASE_EXPIRED, (workflow_id,))
        return bool(row and row[0]["expired"])

    def recover_expired(self) -> int:
        """Turn every running workflow whose lease ran out into ``unknown``.

        Whether its effect happened is not known, so it is reconciled, never rerun blindly.
        """
        with self._transaction("recover expired leases") as conn:
            return claims.recover_expired(conn)

    def complete_and_claim(
        self, finished: Sequence[Finished], owner: str, lease: timedelta, *, fuse: bool,
        recover: bool = True, limit: int = 1,
    ) -> Step:
        """Commit ``finished``'s completions, recover expired leases (with ``recover``) and
        claim up to ``limit`` workflows, all in one transaction (one WAL flush).

        Each completion is ``complete``'s, re-checked here: its receipt proves the
        effect, its stored start barrier still matches (digest and content) and its
        fence is current, else nothing of this transaction commits and
        ``errors.ReceiptMismatch``, ``errors.IntegrityFailure`` or ``errors.Stale``
        names the first completion's problem. Expired leases become unknown as in
        ``recover_expired``. Each claim is ``claim``'s, diversions included. With
        ``fuse`` an idempotent claim also commits its start barrier (``pre_dispatch``'s
        checks all hold: the row is locked, just claimed, neither cancelled nor lapsed):
        a crash after this commit leaves a barrier, which an idempotent tool's lookup
        settles. A non-idempotent claim never fuses: a crash between its claim and its
        barrier must keep the database's proof that nothing was dispatched. ``limit``
        0 only completes (and recovers).
        """
        decisions.check_claimer(owner, lease)
        if limit < 0:
            raise errors.Rejected("claim limit must not be negative")
        sealed = claims.sealed_results(self.keys, finished)
        # Not in psycopg's pipeline mode, which saved round trips but not CPU: on loopback
        # its per-command polls and flushes cost more than the round trips it saved. A
        # transaction of this shape (two updates, a locking select, an insert) took 250 us
        # of the client's CPU pipelined and 160 us sent plainly (1,500 a run, three runs
        # each, fsync on), and no less wall time. In `lab bench throughput --workers 2`,
        # with and without the pipeline alternated (load 2 to 5): --concurrency 32
        # 503-530 -> 568-588 wf/s, worker CPU 1.74-1.85 -> 1.52-1.60 ms/wf; one in flight
        # 476/500 -> 503/555 wf/s; --batch 32 2,336-2,661 -> 2,537-3,631 wf/s.
        with self._transaction("complete and claim work") as conn:
            return claims.complete_and_claim(
                conn, finished, sealed, owner, lease, fuse=fuse, recover=recover, limit=limit)

    # -- around the dispatch ---------------------------------------------------------

    def pre_dispatch(self, claim: Workflow) -> StartBarrier | None:
        """The fenced step right before the tool is called: commit the start barrier.

        One transaction re-checks fence, lease, cancellation and approval
        expiry, then writes the audit event and the start barrier bound to it.
        Returns the barrier when the claim may dispatch; None when a
        cancellation or an approval expiry diverted it. An exact replay
        returns the stored barrier and writes nothing; the same start with
        different content is ``errors.Conflict``; a fence that moved or a lease
        that ran out raises ``errors.Stale`` with nothing written.
        """
        with self._transaction("check before dispatch") as conn:
            return claims.pre_dispatch(conn, claim)

    def complete(self, claim: Workflow, receipt: Receipt) -> Workflow:
        """Record success under ``claim``'s fence, if ``receipt`` proves this effect."""
        if not receipt.proves(claim.effect_key, claim.fingerprint):
            raise errors.ReceiptMismatch()
        sealed = self.keys.seal(receipt.to_json(), claim.id)
        with self._transaction("complete a workflow") as conn:
            return settlement.complete(conn, claim, receipt, sealed)

    def unknown(self, claim: Workflow, cause: str = "reply_lost") -> Workflow:
        """Record that the dispatch's outcome is not known (it may have happened)."""
        with self._transaction("record an unknown outcome") as conn:
            return settlement.unknown(conn, claim, cause)

    def retry_later(self, claim: Workflow, backoff: timedelta, cause: str) -> Workflow:
        """After a definite non-effect (a trusted 429), queue again after ``backoff``.

        The attempt budget is persistent: when it is spent the workflow fails;
        a cancellation requested meanwhile cancels it instead.
        """
        if backoff < timedelta(0):
            raise errors.Rejected("backoff must not be negative")
        with self._transaction("schedule a retry") as conn:
            return settlement.retry_later(conn, claim, backoff, cause)

    def fail(self, claim: Workflow, reason: str) -> Workflow:
        """Record a definite refusal by the tool: the workflow failed, nothing happened."""
        with self._transaction("record a failure") as conn:
            return settlement.fail(conn, claim, reason)

    # -- reconciliation ----------------------------------------------------------------

    def settle_found(self, unknown: Workflow, receipt: Receipt) -> Workflow:
        """The authoritative lookup found the effect: the workflow succeeded."""
        if not receipt.proves(unknown.effect_key, unknown.fingerprint):
            raise errors.ReceiptMismatch()
        sealed = self.keys.seal(receipt.to_json(), unknown.id)
        with self._transaction("record a reconciled effect") as conn:
            return settlement.settle_found(conn, unknown, receipt, sealed)

    def settle_absent(self, unknown: Workflow, *, closed_through: int | None = None) -> Workflow:
        """The authoritative lookup found no effect: queue the same key again.

        Without ``closed_through`` the absence proves nothing about a request still in
        flight: only an idempotent plan (its key deduplicates a late write) with attempts
        left and no cancellation, all re-checked at write time, is requeued; otherwise the
        workflow stays unknown for manual review and ``errors.ManualReview`` names the
        reason.

        ``closed_through`` is the fence a fenced lookup closed (at least the workflow's):
        then the absence is a proof, recorded in the audit event. The plan, idempotent or
        not, is requeued when it has attempts left; a cancelled one ends ``cancelled`` and
        one whose attempts are spent ends ``failed`` (``attempt_budget_spent``): true
        outcomes (``settlement.settle_proven_absent``).
        """
        if closed_through is not None:
            with self._transaction("settle a proven absence") as conn:
                return settlement.settle_proven_absent(conn, unknown, closed_through)
        with self._transaction("requeue after an empty lookup") as conn:
            requeued = settlement.requeue_absent(conn, unknown)
        if requeued is not None:
            return requeued
        current = self.get(unknown.id)
        return self.require_review(current, decisions.absent_review_reason(unknown, current))

    def require_review(self, unknown: Workflow, reason: str) -> Workflow:
        """Leave an unknown workflow for a person, recording why; raises ``ManualReview``.

        For a non-idempotent workflow the reason carries the database's proof:
        ``not_dispatched_no_start_barrier`` when no start barrier was committed
        under its fence (the tool was never called), else
        ``non_idempotent_dispatched``.
        """
        with self._transaction("record a manual review") as conn:
            reason = review.require_review(conn, unknown, reason)
        raise errors.ManualReview(f"manual review required: {reason}", reason=reason)

    def settle_undispatched(self, workflow_id: str) -> Workflow | None:
        """Take proven-undispatched work out of manual review, as an operator's recoverer does.

        Applies to an ``unknown`` workflow reviewed as ``not_dispatched_no_start_barrier``
        when, re-checked under a row lock, no start barrier of any fence may have
        dispatched: none under its current fence, and every earlier one ended in a
        definite non-effect (a 429 or an unreachable tool). Then nothing ever reached
        the tool, so: a requested cancellation cancels it, a spent attempt budget fails
        it, and otherwise it is queued again (event ``requeued_undispatched``). Every
        outcome carries ``proof=no_start_barrier`` in its audit event. Returns the new
        snapshot, or None when the proof does not hold (it stays for a person).
        """
        with self._transaction("requeue proven-undispatched work") as conn:
            return review.settle_undispatched(conn, workflow_id)

    def quarantine(self, workflow: Workflow, reason: str = "integrity") -> Workflow:
        """Refuse to act on a workflow whose stored records failed verification.

        Running work becomes unknown (its effect may have happened); either way
        it waits for a person with ``reason``. Fenced like every transition.
        """
        with self._transaction("quarantine a workflow") as conn:
            return settlement.quarantine(conn, workflow, reason)

    def barrier_for(self, workflow_id: str, fence: int) -> StartBarrier | None:
        """The verified start barrier of one workflow and fence, if one was committed."""
        with self._transaction("read a start barrier") as conn:
            return transitions.barrier_at(conn, workflow_id, fence)

    def completion_for(self, start: str) -> Completion | None:
        """The verified completion of one start, if it has one."""
        with self._transaction("read a completion") as conn:
            return transitions.completion_for(conn, start)

    def receipt_of(self, workflow: Workflow) -> Receipt | None:
        """The receipt stored (sealed) in ``workflow``'s result, opened and checked."""
        if workflow.result is None:
            return None
        opened = self.keys.open(workflow.result, workflow.id)
        try:
            receipt = Receipt(
                str(opened["receipt_id"]), str(opened["effect_key"]), str(opened["fingerprint"])
            )
        except KeyError as exc:
            raise errors.IntegrityFailure("sealed result is not a receipt") from exc
        if not receipt.proves(workflow.effect_key, workflow.fingerprint):
            raise errors.IntegrityFailure("sealed receipt does not match its workflow")
        return receipt

    # -- review, and what an operator's recoverer reads ---------------------------------

    def in_review(self, tenant: str) -> list[Workflow]:
        """``tenant``'s workflows waiting for a person: unknown, with the recorded reason."""
        with self._transaction("list manual reviews") as conn:
            return review.in_review(conn, tenant)

    def requeue_reviewed(
        self, reviewer: Actor, workflow_id: str, *, force: bool = False, reason: str = ""
    ) -> Workflow:
        """A person sends an unknown workflow back to the queue.

        Without ``force`` this is allowed only with the database's proof that
        it was never dispatched (no start barrier under its fence). A workflow
        with a barrier needs ``force`` and a reason, both recorded.
        """
        with self._transaction("requeue a reviewed workflow") as conn:
            return review.requeue_reviewed(conn, reviewer, workflow_id, force, reason)

    def resolve_reviewed(
        self, reviewer: Actor, workflow_id: str, outcome: str, reason: str
    ) -> Workflow:
        """A person closes an unknown workflow as ``failed`` or ``succeeded`` (checked by hand)."""
        decisions.check_resolution(outcome, reason)
        with self._transaction("resolve a reviewed workflow") as conn:
            return review.resolve_reviewed(conn, self.keys, reviewer, workflow_id, outcome,
                                           reason)

    def open_counts(self) -> dict[str, int]:
        """How much work is still open: ready (due or delayed), running, unknown unreviewed."""
        with self._transaction("count open work") as conn:
            return review.open_counts(conn)

    def unreviewed_unknown(self) -> list[str]:
        """Ids of unknown workflows nobody reconciled yet, oldest change first."""
        with self._transaction("list unreconciled work") as conn:
            return review.unreviewed_unknown(conn)

    def undispatched_in_review(self) -> list[str]:
        """Ids of workflows in review as proven never dispatched, oldest change first."""
        with self._transaction("list undispatched reviews") as conn:
            return review.undispatched_in_review(conn)

    def events(self, workflow_id: str | None = None) -> list[dict[str, Any]]:
        """Audit events in order, for one workflow or all."""
        with self._transaction("read events") as conn:
            if workflow_id is None:
                return conn.execute(queries.ALL_EVENTS).fetchall()
            return conn.execute(queries.EVENTS_OF, (workflow_id,)).fetchall()
