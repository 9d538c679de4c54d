"""The workflow state machine as fenced SQL transitions on PostgreSQL.

Every transition is one transaction guarded by the caller's fence (and lease
where it matters) that writes its audit event in the same transaction, and a
stale fence is reported as ``errors.Stale``, never as a silent no-op. Time
comes from PostgreSQL's ``clock_timestamp()``, never from this process's clock.
psycopg errors are translated into ``errors.StoreError`` here, at the edge.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from importlib import resources
from typing import Any, LiteralString, overload

import psycopg
from psycopg import conninfo, sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from lab import errors, loopback, names
from lab.pg import edge
from lab.runtime import sealing
from lab.runtime.barrier import Completion, StartBarrier
from lab.runtime.plan import SUPPORTED_PLAN_VERSION, Plan, Receipt, effect_key

DEFAULT_MAX_ATTEMPTS = 3
STATES = (
    "waiting_approval",
    "ready",
    "running",
    "unknown",
    "succeeded",
    "cancelled",
    "failed",
    "incompatible",
)
TERMINAL_STATES = frozenset({"succeeded", "cancelled", "failed", "incompatible"})
# The review reason that carries the database's proof that nothing was dispatched.
UNDISPATCHED_REVIEW = "not_dispatched_no_start_barrier"
# What decides whether a committed transaction survives a crash of the server or machine.
DURABILITY_SETTINGS = ("fsync", "synchronous_commit", "full_page_writes", "wal_sync_method")
# Completions that prove their start had no effect: the tool answered 429 or was never reached.
NON_EFFECT_OUTCOMES = ("rate_limited", "unreachable")

# The oldest due ready workflow, skipping rows another claimer holds. It reads only
# the partial ``ready_work`` index, so its cost does not grow with finished history.
CLAIM_QUERY: LiteralString = """
    SELECT *, (approval_expires IS NULL
               OR approval_expires <= clock_timestamp()) AS approval_lapsed
      FROM workflows
     WHERE state = 'ready' AND ready_at <= clock_timestamp()
     ORDER BY ready_at, created_at
     LIMIT 1
       FOR UPDATE SKIP LOCKED
"""
# ``CLAIM_QUERY`` for a batch: the oldest due ready workflows, up to a limit.
CLAIM_BATCH_QUERY: LiteralString = CLAIM_QUERY.replace("LIMIT 1", "LIMIT %s")

# Every running workflow whose lease ran out becomes unknown, with its audit event.
RECOVER_QUERY: LiteralString = """
    WITH expired AS (
        UPDATE workflows
           SET state = 'unknown', owner = '', lease_until = NULL,
               updated_at = clock_timestamp()
         WHERE state = 'running' AND lease_until <= clock_timestamp()
        RETURNING id, fence
    )
    INSERT INTO events (workflow_id, kind, fence, detail)
    SELECT id, 'lease_expired', fence, '' FROM expired
    RETURNING workflow_id
"""
# A batch's claims and their audit events in one statement: each row by id and the fence
# it was read under (the rows are locked by this transaction's claim query, so the columns
# it does not return are as read). A batch's rows travel as one JSON array: one
# parameter, not a list to adapt per column. The planner guesses 100 rows for any JSON
# record set and would then scan the whole table for them; ``id = ANY(ids)`` keeps every
# update of a batch on the primary key.
CLAIMS_WITH_EVENTS: LiteralString = """
    WITH wanted AS (
        SELECT * FROM json_to_recordset(%(rows)s::json) AS t(id text, fence bigint)
    ), claimed AS (
        UPDATE workflows w
           SET state = 'running', owner = %(owner)s, fence = w.fence + 1,
               attempt = w.attempt + 1, lease_until = clock_timestamp() + %(lease)s,
               updated_at = clock_timestamp()
          FROM wanted
         WHERE w.id = ANY(%(ids)s::text[]) AND w.id = wanted.id AND w.fence = wanted.fence
        RETURNING w.id, w.state, w.owner, w.fence, w.attempt, w.lease_until
    ), audit AS (
        INSERT INTO events (workflow_id, kind, fence, detail)
        SELECT id, 'claimed', fence, %(detail)s FROM claimed
    )
    SELECT * FROM claimed
"""
# ``complete``'s writes for a batch in one statement: each fenced update, its start's
# completion (only when the update found its row and the barrier exists) and its audit
# event. Each stored barrier comes back too, for the caller to verify before it commits.
COMPLETIONS_WITH_EVENTS: LiteralString = """
    WITH wanted AS (
        SELECT * FROM json_to_recordset(%(rows)s::json)
               AS c(id text, fence bigint, fingerprint text, effect_key text, result jsonb,
                    start_id text, barrier_digest text, outcome text, summary text,
                    receipt_id text, digest text)
    ), done AS (
        UPDATE workflows w
           SET state = 'succeeded', result = c.result, owner = '', lease_until = NULL,
               review_reason = '', updated_at = clock_timestamp()
          FROM wanted c
         WHERE w.id = ANY(%(ids)s::text[]) AND w.id = c.id AND w.fence = c.fence
           AND w.state = 'running'
           AND w.fingerprint = c.fingerprint AND w.effect_key = c.effect_key
        RETURNING w.*
    ), completion AS (
        INSERT INTO completions (start_id, barrier_digest, outcome, summary, receipt_id, digest)
        SELECT c.start_id, c.barrier_digest, c.outcome, c.summary, c.receipt_id, c.digest
          FROM wanted c JOIN done USING (id)
         WHERE EXISTS (SELECT 1 FROM start_barriers b WHERE b.start_id = c.start_id)
        ON CONFLICT (start_id) DO NOTHING
        RETURNING start_id
    ), audit AS (
        INSERT INTO events (workflow_id, kind, fence, detail)
        SELECT id, 'completed', fence, '' FROM done
    )
    SELECT done.*,
           EXISTS (SELECT 1 FROM completion JOIN wanted c USING (start_id)
                    WHERE c.id = done.id) AS completion_written,
           (SELECT to_jsonb(b) FROM start_barriers b
             WHERE b.workflow_id = done.id AND b.fence = done.fence) AS stored_barrier
      FROM done
"""
# A batch's start barriers, each bound to its own audit event, in one statement.
FUSED_BARRIERS_INSERT: LiteralString = """
    WITH wanted AS (
        SELECT * FROM json_to_recordset(%s::json)
               AS b(start_id text, workflow_id text, fence bigint, attempt integer,
                    effect_key text, fingerprint text, trace_id text, span_id text, digest text)
    ), audit AS (
        INSERT INTO events (workflow_id, kind, fence, detail)
        SELECT workflow_id, 'dispatching', fence, 'start=' || start_id FROM wanted
        RETURNING seq, workflow_id
    )
    INSERT INTO start_barriers (start_id, workflow_id, fence, attempt, effect_key,
                                fingerprint, trace_id, span_id, audit_event, digest)
    SELECT b.start_id, b.workflow_id, b.fence, b.attempt, b.effect_key, b.fingerprint,
           b.trace_id, b.span_id, audit.seq, b.digest
      FROM wanted b JOIN audit USING (workflow_id)
"""

# A step of one row (an unbatched worker's) reads it with ``json_to_record``: the same
# statement, but the planner then knows it is one row rather than guessing 100.
_ONE_ROW: dict[str, LiteralString] = {
    statement: statement.replace("json_to_recordset(", "json_to_record(")
    for statement in (CLAIMS_WITH_EVENTS, COMPLETIONS_WITH_EVENTS, FUSED_BARRIERS_INSERT)
}


def _with_rows(statement: LiteralString, rows: list[dict[str, Any]]) -> tuple[LiteralString, str]:
    """``statement`` (one of the batch statements) and its JSON rows parameter, as one
    object for a single row (``_ONE_ROW``'s form) or as an array."""
    if len(rows) == 1:
        return _ONE_ROW[statement], json.dumps(rows[0])
    return statement, json.dumps(rows)


@dataclass(frozen=True)
class Finished:
    """A dispatch whose effect the tool confirmed, waiting for its completion to commit."""

    claim: Workflow
    barrier: StartBarrier
    receipt: Receipt


@dataclass(frozen=True)
class Claimed:
    """A workflow claimed by ``complete_and_claim``, with its start barrier when the
    barrier committed in the same transaction (a fused start), else None."""

    workflow: Workflow
    barrier: StartBarrier | None


@dataclass(frozen=True)
class Step:
    """What one ``complete_and_claim`` transaction committed.

    ``completed``: the finished workflows' new snapshots, in the order given;
    ``claims``: the newly claimed workflows, oldest first (empty when nothing was due).
    """

    completed: list[Workflow]
    claims: list[Claimed]


@dataclass(frozen=True)
class Actor:
    """A person acting on a workflow: tenant, subject and role are all checked."""

    tenant: str
    subject: str
    role: str


@dataclass(frozen=True)
class Workflow:
    """A snapshot of one workflow row."""

    id: str
    tenant: str
    operation: str
    proposed_by: str
    plan: dict[str, Any]
    fingerprint: str
    plan_version: int
    effect_key: str
    trace_id: str
    state: str
    approved_by: str
    approval_expires: datetime | None
    owner: str
    fence: int
    attempt: int
    max_attempts: int
    lease_until: datetime | None
    ready_at: datetime
    cancel_requested: bool
    review_reason: str
    result: dict[str, Any] | None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Workflow:
        """Build a snapshot from a ``SELECT *`` row of ``workflows``."""
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})

    @property
    def idempotent(self) -> bool:
        """The registry's capability, persisted in the plan at admission."""
        return self.plan.get("idempotent") is True


def schema_sql() -> str:
    """The text of ``schema.sql``: every table, index and constraint."""
    return resources.files("lab.runtime").joinpath("schema.sql").read_text(encoding="utf-8")


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

    @contextmanager
    def _pipelined(self, action: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """One transaction in pipeline mode: statements queue, a fetch sends them at once.

        BEGIN, the queued statements and COMMIT travel together, so a transition of
        several statements costs one or two round trips to the server, not one each.
        """
        with (
            edge.translated(action),
            self._pool.connection() as conn,
            conn.pipeline(),
            conn.transaction(),
        ):
            yield conn

    def execute(self, query: LiteralString, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        """Run one literal SQL statement in its own transaction; return its rows, if any.

        For experiments that inject faults (expire a lease, add a constraint):
        the query is a literal, values travel as parameters.
        """
        with self._transaction("run a statement") as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

    # -- creation and approval -------------------------------------------------

    def create(self, actor: Actor, operation: str, plan: Plan) -> Workflow:
        """Persist a plan awaiting approval, once per tenant and operation.

        Creating the same operation again returns the same workflow; the same
        operation with different parameters raises ``errors.Conflict``.
        """
        plan.validate()
        if actor.role != "proposer":
            raise errors.Denied("only a proposer may create a workflow")
        if not operation or not actor.tenant or not actor.subject:
            raise errors.Rejected("tenant, subject and operation must be non-empty")
        fingerprint = plan.fingerprint()
        with self._transaction("create a workflow") as conn:
            row = conn.execute(
                """
                INSERT INTO workflows (id, tenant, operation, proposed_by, plan, fingerprint,
                                       plan_version, effect_key, trace_id, state, max_attempts)
                VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, 'waiting_approval', %s)
                ON CONFLICT (tenant, operation) DO NOTHING
                RETURNING *
                """,
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
                _event(conn, row["id"], "created", 0, f"plan_version={plan.version}")
                return Workflow.from_row(row)
            existing = conn.execute(
                "SELECT * FROM workflows WHERE tenant = %s AND operation = %s",
                (actor.tenant, operation),
            ).fetchone()
        if existing is None:  # the row that conflicted was removed meanwhile
            raise errors.Conflict("operation changed concurrently; retry")
        if existing["fingerprint"] != fingerprint:
            raise errors.Conflict("operation already exists with different parameters")
        return Workflow.from_row(existing)

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
            row = _locked(conn, workflow_id)
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
            updated = conn.execute(
                """
                UPDATE workflows
                   SET state = 'ready', approved_by = %s,
                       approval_expires = clock_timestamp() + %s,
                       ready_at = clock_timestamp(), updated_at = clock_timestamp()
                 WHERE id = %s
                RETURNING *
                """,
                (actor.subject, ttl, workflow_id),
            ).fetchone()
            assert updated is not None
            _event(conn, workflow_id, "approved", updated["fence"], f"by={actor.subject}")
        return Workflow.from_row(updated)

    def get(self, workflow_id: str) -> Workflow:
        """The current snapshot of one workflow, or ``errors.NotFound``."""
        with self._transaction("read a workflow") as conn:
            row = conn.execute("SELECT * FROM workflows WHERE id = %s", (workflow_id,)).fetchone()
        if row is None:
            raise errors.NotFound(f"no workflow {workflow_id!r}")
        return Workflow.from_row(row)

    def cancel(self, actor: Actor, workflow_id: str) -> Workflow:
        """Request cancellation. Work not yet dispatched is cancelled at once;

        running or unknown work keeps its state with the request recorded, so
        an effect that already happened is never erased.
        """
        with self._transaction("cancel a workflow") as conn:
            row = _locked(conn, workflow_id)
            if actor.tenant != row["tenant"]:
                raise errors.Denied("actor belongs to another tenant")
            if actor.role not in ("proposer", "approver"):
                raise errors.Denied("only a proposer or approver may cancel")
            updated = conn.execute(
                """
                UPDATE workflows
                   SET cancel_requested = true,
                       state = CASE WHEN state IN ('waiting_approval', 'ready')
                                    THEN 'cancelled' ELSE state END,
                       updated_at = clock_timestamp()
                 WHERE id = %s
                RETURNING *
                """,
                (workflow_id,),
            ).fetchone()
            assert updated is not None
            _event(conn, workflow_id, "cancel_requested", row["fence"], f"by={actor.subject}")
            if updated["state"] == "cancelled" and row["state"] != "cancelled":
                _event(conn, workflow_id, "cancelled", row["fence"], "at=queue")
        return Workflow.from_row(updated)

    # -- claiming and leases -----------------------------------------------------

    def claim(self, owner: str, lease: timedelta) -> Workflow | None:
        """Claim the oldest due ready workflow: fence + 1, attempt + 1, a lease.

        The claim also decides, in the same transaction, what must not run: a
        requested cancellation (cancelled), a lapsed approval (back to
        waiting_approval), an unsupported plan version (incompatible, attempt
        unchanged) or a stored plan that no longer matches its fingerprint
        (failed, reason ``integrity``). Returns None when nothing is due.
        """
        if not owner:
            raise errors.Rejected("owner must be non-empty")
        if lease <= timedelta(0):
            raise errors.Rejected("lease must be positive")
        while True:
            with self._transaction("claim work") as conn:
                row = conn.execute(CLAIM_QUERY).fetchone()
                if row is None:
                    return None
                diverted = _claim_diversion(row)
                if diverted is None:
                    claimed = conn.execute(
                        """
                        UPDATE workflows
                           SET state = 'running', owner = %s, fence = fence + 1,
                               attempt = attempt + 1, lease_until = clock_timestamp() + %s,
                               updated_at = clock_timestamp()
                         WHERE id = %s
                        RETURNING *
                        """,
                        (owner, lease, row["id"]),
                    ).fetchone()
                    assert claimed is not None
                    _event(conn, row["id"], "claimed", claimed["fence"], f"owner={owner}")
                    return Workflow.from_row(claimed)
                state, kind, reason = diverted
                conn.execute(
                    """
                    UPDATE workflows
                       SET state = %s, review_reason = %s,
                           approved_by = CASE WHEN %s = 'waiting_approval'
                                              THEN '' ELSE approved_by END,
                           approval_expires = CASE WHEN %s = 'waiting_approval'
                                                   THEN NULL ELSE approval_expires END,
                           updated_at = clock_timestamp()
                     WHERE id = %s
                    """,
                    (state, reason, state, state, row["id"]),
                )
                _event(conn, row["id"], kind, row["fence"], "at=claim")

    def heartbeat(self, claim: Workflow, lease: timedelta) -> datetime:
        """Extend a live lease held under ``claim``'s fence; an expired one stays expired."""
        with self._transaction("extend a lease") as conn:
            row = _fenced(
                conn, claim, "running", "lease_until = clock_timestamp() + %s", (lease,),
                guard=" AND owner = %s AND lease_until > clock_timestamp()",
                guard_params=(claim.owner,),
                refusal="lease expired or fence moved: heartbeat refused", touch=False,
            )
        lease_until: datetime = row["lease_until"]
        return lease_until

    def lease_expired(self, workflow_id: str) -> bool:
        """True when ``workflow_id``'s lease has run out on PostgreSQL's clock."""
        row = self.execute(
            "SELECT lease_until <= clock_timestamp() AS expired FROM workflows WHERE id = %s",
            (workflow_id,),
        )
        return bool(row and row[0]["expired"])

    def recover_expired(self) -> int:
        """Turn every running workflow whose lease ran out into ``unknown``.

        Whether its effect happened is not known, so it is reconciled, never rerun blindly.
        """
        with self._transaction("recover expired leases") as conn:
            rows = conn.execute(RECOVER_QUERY).fetchall()
        return len(rows)

    def complete_and_claim(
        self, finished: Sequence[Finished], owner: str, lease: timedelta, *, fuse: bool,
        recover: bool = True, limit: int = 1,
    ) -> Step:
        """Commit ``finished``'s completions, recover expired leases (with ``recover``) and
        claim up to ``limit`` workflows, all in one transaction (one WAL flush), pipelined
        (two round trips).

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
        if not owner:
            raise errors.Rejected("owner must be non-empty")
        if lease <= timedelta(0):
            raise errors.Rejected("lease must be positive")
        if limit < 0:
            raise errors.Rejected("claim limit must not be negative")
        sealed: list[dict[str, Any]] = []
        for done in finished:
            if not done.receipt.proves(done.claim.effect_key, done.claim.fingerprint):
                raise errors.ReceiptMismatch()
            sealed.append(self.keys.seal(done.receipt.to_json(), done.claim.id))
        with self._pipelined("complete and claim work") as conn:
            check = _queue_completions(conn, finished, sealed)
            if recover:
                conn.execute(RECOVER_QUERY)
            if limit == 0:
                # Judging the completions fetches their result, which sends the queue.
                return Step(check(), [])
            completed: list[Workflow] | None = None
            while True:
                rows = conn.execute(CLAIM_BATCH_QUERY, (limit,)).fetchall()
                if completed is None:
                    # The fetch above sent every queued statement: judge the completions
                    # first; raising here rolls the whole transaction back.
                    completed = check()
                if not rows:
                    return Step(completed, [])
                claimable = []
                for row in rows:
                    diverted = _claim_diversion(row)
                    if diverted is None:
                        claimable.append(row)
                    else:
                        _divert(conn, row, diverted)
                if claimable:
                    return Step(completed, _claim_rows(conn, claimable, owner, lease, fuse))
                # every row was diverted: claim again

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
        wanted = StartBarrier.for_claim(
            claim.id, claim.fence, claim.attempt, claim.effect_key, claim.fingerprint,
            claim.trace_id,
        )
        with self._transaction("check before dispatch") as conn:
            row = conn.execute(
                """
                SELECT *, (approval_expires IS NULL
                           OR approval_expires <= clock_timestamp()) AS approval_lapsed,
                          (lease_until > clock_timestamp()) AS lease_live
                  FROM workflows WHERE id = %s FOR UPDATE
                """,
                (claim.id,),
            ).fetchone()
            if row is None:
                raise errors.NotFound(f"no workflow {claim.id!r}")
            if row["state"] != "running" or row["fence"] != claim.fence or not row["lease_live"]:
                raise errors.Stale("claim is no longer current: not dispatching")
            existing = _barrier_row(conn, wanted.start_id)
            if existing is not None:
                stored = _verified_barrier(existing)
                if stored != wanted:
                    raise errors.Conflict("start barrier exists with different content")
                return stored
            if row["cancel_requested"]:
                _release(conn, claim, "cancelled")
                _event(conn, claim.id, "cancelled", claim.fence, "at=pre_dispatch")
                return None
            if row["approval_lapsed"]:
                _release(conn, claim, "waiting_approval")
                _event(conn, claim.id, "approval_expired", claim.fence, "at=pre_dispatch")
                return None
            if (row["attempt"], row["fingerprint"], row["effect_key"], row["trace_id"]) != (
                wanted.attempt, wanted.fingerprint, wanted.effect_key, wanted.trace_id
            ):
                raise errors.Conflict("claim does not match the stored workflow")
            audit = _event(
                conn, claim.id, "dispatching", claim.fence, f"start={wanted.start_id}"
            )
            conn.execute(
                """
                INSERT INTO start_barriers (start_id, workflow_id, fence, attempt, effect_key,
                                            fingerprint, trace_id, span_id, audit_event, digest)
                VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
                """,
                (wanted.start_id, wanted.workflow_id, wanted.fence, wanted.attempt,
                 wanted.effect_key, wanted.fingerprint, wanted.trace_id, wanted.span_id,
                 audit, wanted.digest()),
            )
        return wanted

    def complete(self, claim: Workflow, receipt: Receipt) -> Workflow:
        """Record success under ``claim``'s fence, if ``receipt`` proves this effect."""
        if not receipt.proves(claim.effect_key, claim.fingerprint):
            raise errors.ReceiptMismatch()
        sealed = self.keys.seal(receipt.to_json(), claim.id)
        with self._transaction("complete a workflow") as conn:
            barrier = _barrier_at(conn, claim.id, claim.fence)
            row = _fenced(
                conn, claim, "running",
                "state = 'succeeded', result = %s, owner = '', lease_until = NULL, "
                "review_reason = ''",
                (Jsonb(sealed),),
                guard=" AND fingerprint = %s AND effect_key = %s",
                guard_params=(claim.fingerprint, claim.effect_key),
                refusal="claim is no longer current: completion refused",
            )
            if barrier is not None:
                _complete_start(conn, Completion.success(barrier, receipt.receipt_id))
            _event(conn, claim.id, "completed", claim.fence, "")
        return Workflow.from_row(row)

    def unknown(self, claim: Workflow, cause: str = "reply_lost") -> Workflow:
        """Record that the dispatch's outcome is not known (it may have happened)."""
        with self._transaction("record an unknown outcome") as conn:
            row = _fenced(
                conn, claim, "running", "state = 'unknown', owner = '', lease_until = NULL", (),
                refusal="claim is no longer current: unknown refused",
                event=("unknown", f"cause={cause}"),
            )
        return Workflow.from_row(row)

    def retry_later(self, claim: Workflow, backoff: timedelta, cause: str) -> Workflow:
        """After a definite non-effect (a trusted 429), queue again after ``backoff``.

        The attempt budget is persistent: when it is spent the workflow fails;
        a cancellation requested meanwhile cancels it instead.
        """
        if backoff < timedelta(0):
            raise errors.Rejected("backoff must not be negative")
        with self._transaction("schedule a retry") as conn:
            row = _fenced(
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
            barrier = _barrier_at(conn, claim.id, claim.fence)
            if barrier is not None:
                outcome = "unreachable" if cause == "tool_unreachable" else (
                    "rate_limited_budget_spent"
                    if row["review_reason"] == "attempt_budget_spent"
                    else "rate_limited"
                )
                _complete_start(conn, Completion.failure(barrier, outcome))
            kind = {"ready": "retry_scheduled"}.get(row["state"], row["state"])
            _event(conn, claim.id, kind, claim.fence, f"cause={cause}")
        return Workflow.from_row(row)

    def fail(self, claim: Workflow, reason: str) -> Workflow:
        """Record a definite refusal by the tool: the workflow failed, nothing happened."""
        with self._transaction("record a failure") as conn:
            row = _fenced(
                conn, claim, "running",
                "state = 'failed', review_reason = %s, owner = '', lease_until = NULL", (reason,),
                refusal="claim is no longer current: failure refused",
            )
            barrier = _barrier_at(conn, claim.id, claim.fence)
            if barrier is not None:
                _complete_start(conn, Completion.failure(barrier, "rejected"))
            _event(conn, claim.id, "failed", claim.fence, f"cause={reason}")
        return Workflow.from_row(row)

    # -- reconciliation ----------------------------------------------------------------

    def settle_found(self, unknown: Workflow, receipt: Receipt) -> Workflow:
        """The authoritative lookup found the effect: the workflow succeeded."""
        if not receipt.proves(unknown.effect_key, unknown.fingerprint):
            raise errors.ReceiptMismatch()
        sealed = self.keys.seal(receipt.to_json(), unknown.id)
        with self._transaction("record a reconciled effect") as conn:
            barrier = _barrier_at(conn, unknown.id, unknown.fence)
            row = _fenced(
                conn, unknown, "unknown", "state = 'succeeded', result = %s, review_reason = ''",
                (Jsonb(sealed),),
                guard=" AND fingerprint = %s AND effect_key = %s",
                guard_params=(unknown.fingerprint, unknown.effect_key),
                refusal="workflow changed during reconciliation",
            )
            if barrier is not None and not _has_completion(conn, barrier.start_id):
                _complete_start(conn, Completion.success(barrier, receipt.receipt_id))
            _event(conn, unknown.id, "reconciled", unknown.fence, "lookup=found")
        return Workflow.from_row(row)

    def settle_absent(self, unknown: Workflow) -> Workflow:
        """The authoritative lookup found no effect: queue the same key again.

        Only an idempotent plan with attempts left and no cancellation, all
        re-checked at write time, is requeued; otherwise the workflow stays
        unknown for manual review and ``errors.ManualReview`` names the reason.
        """
        with self._transaction("requeue after an empty lookup") as conn:
            row = _fenced(
                conn, unknown, "unknown",
                "state = 'ready', ready_at = clock_timestamp(), review_reason = ''", (),
                guard=" AND NOT cancel_requested AND attempt < max_attempts"
                      " AND plan -> 'idempotent' = 'true'::jsonb",
                refusal=None, event=("reconciled", "lookup=absent"),
            )
            if row is not None:
                return Workflow.from_row(row)
        current = self.get(unknown.id)
        if current.state != "unknown" or current.fence != unknown.fence:
            raise errors.Stale("workflow changed during reconciliation")
        if current.cancel_requested:
            reason = "cancel_requested"
        elif current.attempt >= current.max_attempts:
            reason = "attempt_budget_spent"
        else:
            reason = "non_idempotent"
        return self.require_review(current, reason)

    def require_review(self, unknown: Workflow, reason: str) -> Workflow:
        """Leave an unknown workflow for a person, recording why; raises ``ManualReview``.

        For a non-idempotent workflow the reason carries the database's proof:
        ``not_dispatched_no_start_barrier`` when no start barrier was committed
        under its fence (the tool was never called), else
        ``non_idempotent_dispatched``.
        """
        with self._transaction("record a manual review") as conn:
            if reason == "non_idempotent":
                barrier = _barrier_at(conn, unknown.id, unknown.fence)
                reason = (
                    UNDISPATCHED_REVIEW
                    if barrier is None
                    else "non_idempotent_dispatched"
                )
            _fenced(
                conn, unknown, "unknown", "review_reason = %s", (reason,),
                refusal="workflow changed during reconciliation",
                event=("manual_review", f"reason={reason}"),
            )
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
            row = _locked(conn, workflow_id)
            if row["state"] != "unknown" or row["review_reason"] != UNDISPATCHED_REVIEW:
                return None
            if not _never_dispatched(conn, workflow_id, row["fence"]):
                return None
            current = Workflow.from_row(row)
            if row["cancel_requested"]:
                outcome = _fenced(
                    conn, current, "unknown", "state = 'cancelled'", (),
                    refusal="workflow changed during recovery",
                    event=("cancelled", "at=review proof=no_start_barrier"),
                )
            elif row["attempt"] >= row["max_attempts"]:
                outcome = _fenced(
                    conn, current, "unknown",
                    "state = 'failed', review_reason = 'attempt_budget_spent'", (),
                    refusal="workflow changed during recovery",
                    event=("failed", "cause=attempt_budget_spent proof=no_start_barrier"),
                )
            else:
                outcome = _fenced(
                    conn, current, "unknown",
                    "state = 'ready', ready_at = clock_timestamp(), review_reason = ''", (),
                    refusal="workflow changed during recovery",
                    event=("requeued_undispatched", "proof=no_start_barrier"),
                )
        return Workflow.from_row(outcome)

    def quarantine(self, workflow: Workflow, reason: str = "integrity") -> Workflow:
        """Refuse to act on a workflow whose stored records failed verification.

        Running work becomes unknown (its effect may have happened); either way
        it waits for a person with ``reason``. Fenced like every transition.
        """
        with self._transaction("quarantine a workflow") as conn:
            row = _fenced(
                conn, workflow, ("running", "unknown"),
                "state = CASE WHEN state = 'running' THEN 'unknown' ELSE state END, "
                "owner = '', lease_until = NULL, review_reason = %s",
                (reason,),
                refusal="workflow changed before it could be quarantined",
                event=("manual_review", f"reason={reason}"),
            )
        return Workflow.from_row(row)

    def barrier_for(self, workflow_id: str, fence: int) -> StartBarrier | None:
        """The verified start barrier of one workflow and fence, if one was committed."""
        with self._transaction("read a start barrier") as conn:
            return _barrier_at(conn, workflow_id, fence)

    def completion_for(self, start: str) -> Completion | None:
        """The verified completion of one start, if it has one."""
        with self._transaction("read a completion") as conn:
            row = conn.execute(
                "SELECT c.*, b.* , c.digest AS completion_digest, b.digest AS barrier_row_digest "
                "FROM completions c JOIN start_barriers b USING (start_id) "
                "WHERE c.start_id = %s",
                (start,),
            ).fetchone()
        if row is None:
            return None
        barrier = _verified_barrier({**row, "digest": row["barrier_row_digest"]})
        completion = Completion(
            start_id=row["start_id"],
            barrier_digest=row["barrier_digest"],
            outcome=row["outcome"],
            summary=row["summary"],
            receipt_id=row["receipt_id"],
        )
        completion.verify(row["completion_digest"], barrier)
        return completion

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

    def in_review(self) -> list[Workflow]:
        """Workflows waiting for a person: unknown, with the recorded reason."""
        with self._transaction("list manual reviews") as conn:
            rows = conn.execute(
                "SELECT * FROM workflows WHERE state = 'unknown' ORDER BY updated_at, id"
            ).fetchall()
        return [Workflow.from_row(row) for row in rows]

    def requeue_reviewed(
        self, reviewer: Actor, workflow_id: str, *, force: bool = False, reason: str = ""
    ) -> Workflow:
        """A person sends an unknown workflow back to the queue.

        Without ``force`` this is allowed only with the database's proof that
        it was never dispatched (no start barrier under its fence). A workflow
        with a barrier needs ``force`` and a reason, both recorded.
        """
        with self._transaction("requeue a reviewed workflow") as conn:
            row = _locked(conn, workflow_id)
            if reviewer.tenant != row["tenant"] or reviewer.role != "reviewer":
                raise errors.Denied("only a reviewer of the workflow's tenant may requeue it")
            if row["state"] != "unknown":
                raise errors.Conflict(f"only unknown work can be requeued, not {row['state']}")
            if row["attempt"] >= row["max_attempts"]:
                raise errors.Conflict("attempt budget spent: resolve it instead")
            barrier = _barrier_at(conn, workflow_id, row["fence"])
            if barrier is not None and not (force and reason.strip()):
                raise errors.Denied(
                    f"start barrier {barrier.start_id} shows it may have been dispatched: "
                    "requeue needs --force and a reason"
                )
            decision = "requeue" if barrier is None else "forced_requeue"
            proof = "no start barrier" if barrier is None else f"barrier {barrier.start_id}"
            conn.execute(
                "INSERT INTO reviews (workflow_id, reviewer, decision, proof, reason) "
                "VALUES (%s, %s, %s, %s, %s)",
                (workflow_id, reviewer.subject, decision, proof, reason.strip()),
            )
            updated = conn.execute(
                """
                UPDATE workflows SET state = 'ready', ready_at = clock_timestamp(),
                       review_reason = '', updated_at = clock_timestamp()
                 WHERE id = %s RETURNING *
                """,
                (workflow_id,),
            ).fetchone()
            assert updated is not None
            _event(conn, workflow_id, decision, row["fence"], f"by={reviewer.subject}")
        return Workflow.from_row(updated)

    def resolve_reviewed(
        self, reviewer: Actor, workflow_id: str, outcome: str, reason: str
    ) -> Workflow:
        """A person closes an unknown workflow as ``failed`` or ``succeeded`` (checked by hand)."""
        if outcome not in ("failed", "succeeded"):
            raise errors.Rejected("a review resolves to 'failed' or 'succeeded'")
        if not reason.strip():
            raise errors.Rejected("resolving a review needs a reason")
        with self._transaction("resolve a reviewed workflow") as conn:
            row = _locked(conn, workflow_id)
            if reviewer.tenant != row["tenant"] or reviewer.role != "reviewer":
                raise errors.Denied("only a reviewer of the workflow's tenant may resolve it")
            if row["state"] != "unknown":
                raise errors.Conflict(f"only unknown work can be resolved, not {row['state']}")
            conn.execute(
                "INSERT INTO reviews (workflow_id, reviewer, decision, proof, reason) "
                "VALUES (%s, %s, %s, %s, %s)",
                (workflow_id, reviewer.subject, f"resolve_{outcome}", "person", reason.strip()),
            )
            result = (
                Jsonb(self.keys.seal({"resolved_by": reviewer.subject}, workflow_id))
                if outcome == "succeeded"
                else None
            )
            updated = conn.execute(
                """
                UPDATE workflows SET state = %s, result = %s, review_reason = 'resolved_by_person',
                       updated_at = clock_timestamp()
                 WHERE id = %s RETURNING *
                """,
                (outcome, result, workflow_id),
            ).fetchone()
            assert updated is not None
            _event(conn, workflow_id, f"resolved_{outcome}", row["fence"],
                   f"by={reviewer.subject}")
        return Workflow.from_row(updated)

    # -- what an operator's recoverer reads ------------------------------------------------

    def open_counts(self) -> dict[str, int]:
        """How much work is still open: ready (due or delayed), running, unknown unreviewed."""
        with self._transaction("count open work") as conn:
            row = conn.execute(
                """
                SELECT count(*) FILTER (WHERE state = 'ready') AS ready,
                       count(*) FILTER (WHERE state = 'running') AS running,
                       count(*) FILTER (WHERE state = 'unknown' AND review_reason = '')
                           AS unreviewed_unknown
                  FROM workflows
                """
            ).fetchone()
        assert row is not None
        return {name: int(value) for name, value in row.items()}

    def unreviewed_unknown(self) -> list[str]:
        """Ids of unknown workflows nobody reconciled yet, oldest change first."""
        with self._transaction("list unreconciled work") as conn:
            rows = conn.execute(
                "SELECT id FROM workflows WHERE state = 'unknown' AND review_reason = '' "
                "ORDER BY updated_at, id"
            ).fetchall()
        return [str(row["id"]) for row in rows]

    def undispatched_in_review(self) -> list[str]:
        """Ids of workflows in review as proven never dispatched, oldest change first."""
        with self._transaction("list undispatched reviews") as conn:
            rows = conn.execute(
                "SELECT id FROM workflows WHERE state = 'unknown' AND review_reason = %s "
                "ORDER BY updated_at, id",
                (UNDISPATCHED_REVIEW,),
            ).fetchall()
        return [str(row["id"]) for row in rows]

    def server_settings(self) -> dict[str, str]:
        """The server's durability settings, as it reports them (``SHOW``)."""
        with self._transaction("read the server's settings") as conn:
            rows = conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name = ANY(%s) ORDER BY name",
                (list(DURABILITY_SETTINGS),),
            ).fetchall()
        return {str(row["name"]): str(row["setting"]) for row in rows}

    def backends(self, application_prefix: str) -> list[tuple[int, str]]:
        """(pid, application name) of every server backend whose name has this prefix."""
        with self._transaction("list backends") as conn:
            rows = conn.execute(
                "SELECT pid, application_name FROM pg_stat_activity "
                "WHERE left(application_name, %s) = %s ORDER BY pid",
                (len(application_prefix), application_prefix),
            ).fetchall()
        return [(int(row["pid"]), str(row["application_name"])) for row in rows]

    def terminate_backend(self, pid: int) -> bool:
        """``pg_terminate_backend(pid)``: True when the server signalled it."""
        with self._transaction("terminate a backend") as conn:
            row = conn.execute("SELECT pg_terminate_backend(%s) AS done", (pid,)).fetchone()
        return bool(row is not None and row["done"])

    def events(self, workflow_id: str | None = None) -> list[dict[str, Any]]:
        """Audit events in order, for one workflow or all."""
        with self._transaction("read events") as conn:
            if workflow_id is None:
                return conn.execute("SELECT * FROM events ORDER BY seq").fetchall()
            return conn.execute(
                "SELECT * FROM events WHERE workflow_id = %s ORDER BY seq", (workflow_id,)
            ).fetchall()


def create_schema(dsn: str, schema: str) -> None:
    """Create ``schema`` and every table of ``schema.sql`` inside it, atomically."""
    names.check_schema_name(schema)
    with (
        edge.translated("create the schema"),
        psycopg.connect(dsn, autocommit=True) as conn,
        conn.transaction(),
    ):
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
        # schema.sql is a file of this package, not input: it is trusted SQL text.
        conn.execute(schema_sql().encode())


def dsn_address(dsn: str) -> tuple[str, int]:
    """The (host, port) a loopback DSN connects to (port 5432 when it names none)."""
    try:
        params = conninfo.conninfo_to_dict(loopback.check_dsn(dsn))
    except psycopg.Error as exc:
        raise errors.UsageError("the database DSN is malformed") from exc
    host = str(params.get("hostaddr") or params.get("host") or "127.0.0.1")
    return host, int(str(params.get("port") or 5432))


def dsn_via(dsn: str, host: str, port: int) -> str:
    """``dsn`` redirected to ``host:port`` (a proxy in front of the same server)."""
    params = {k: v for k, v in conninfo.conninfo_to_dict(dsn).items() if k != "hostaddr"}
    params.update(host=host, port=str(port))
    return conninfo.make_conninfo("", **params)


def history_rows(dsn: str, schema: str) -> dict[str, list[dict[str, Any]]]:
    """Everything the invariant checker reads, as plain rows, in one consistent snapshot.

    ``workflows``, ``events``, ``effects`` (the tool's ledger) and ``barriers`` (start
    barriers: id, workflow, fence) of one schema, read in a single REPEATABLE READ
    transaction, so the four see one moment even while something still writes. Only
    reads: the checker never goes through a transition.
    """
    names.check_schema_name(schema)
    with (
        edge.translated("read the history"),
        psycopg.connect(
            loopback.check_dsn(dsn), row_factory=dict_row, application_name="lab-invariants",
            connect_timeout=10,
        ) as conn,
    ):
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with conn.transaction():
            conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(sql.Identifier(schema)))
            return {
                "workflows": conn.execute(
                    """
                    SELECT id, state, coalesce(plan -> 'idempotent' = 'true'::jsonb, false)
                               AS idempotent,
                           effect_key, fingerprint, fence, attempt, max_attempts,
                           review_reason, result
                      FROM workflows ORDER BY created_at, id
                    """
                ).fetchall(),
                "events": conn.execute(
                    "SELECT seq, workflow_id, kind, fence, detail FROM events ORDER BY seq"
                ).fetchall(),
                "effects": conn.execute(
                    "SELECT seq, effect_key, fingerprint, receipt, idempotent, start_id "
                    "FROM tool_effects ORDER BY seq"
                ).fetchall(),
                "barriers": conn.execute(
                    "SELECT start_id, workflow_id, fence FROM start_barriers ORDER BY start_id"
                ).fetchall(),
            }


def _queue_completions(
    conn: psycopg.Connection[dict[str, Any]], finished: Sequence[Finished],
    sealed: Sequence[dict[str, Any]],
) -> Callable[[], list[Workflow]]:
    """Queue ``complete``'s writes for every finished dispatch in a pipeline; the returned
    check judges their result and gives the completed snapshots, in ``finished``'s order.

    The check (call it after a fetch has sent them) requires of each that the fenced
    update found its row, that the stored barrier matches the one dispatched under (digest
    and content) and that the start had no completion yet: else it raises for the first
    that fails, and the caller's transaction rolls back with nothing written.
    """
    if not finished:
        return list
    completions = [Completion.success(done.barrier, done.receipt.receipt_id)
                   for done in finished]
    statement, rows = _with_rows(COMPLETIONS_WITH_EVENTS, [
        {"id": done.claim.id, "fence": done.claim.fence,
         "fingerprint": done.claim.fingerprint, "effect_key": done.claim.effect_key,
         "result": seal, "start_id": completion.start_id,
         "barrier_digest": completion.barrier_digest, "outcome": completion.outcome,
         "summary": completion.summary, "receipt_id": completion.receipt_id,
         "digest": completion.digest()}
        for done, seal, completion in zip(finished, sealed, completions, strict=True)
    ])
    written = conn.execute(statement, {"rows": rows, "ids": [done.claim.id for done in finished]})

    def check() -> list[Workflow]:
        rows = {row["id"]: row for row in written.fetchall()}
        snapshots = []
        for done in finished:
            row = rows.get(done.claim.id)
            if row is None:
                raise errors.Stale("claim is no longer current: completion refused")
            stored = row.pop("stored_barrier")
            if stored is None or _verified_barrier(stored) != done.barrier:
                raise errors.IntegrityFailure(
                    "start barrier is missing or differs from the dispatch")
            if not row.pop("completion_written"):
                raise errors.Conflict("this start already has a completion")
            snapshots.append(Workflow.from_row(row))
        return snapshots

    return check


def _claim_rows(
    conn: psycopg.Connection[dict[str, Any]], rows: list[dict[str, Any]], owner: str,
    lease: timedelta, fuse: bool,
) -> list[Claimed]:
    """Claim due ``rows`` (locked by this transaction) in one statement, and with ``fuse``
    commit each idempotent one's start barrier in another; the claims, oldest first."""
    statement, wanted = _with_rows(CLAIMS_WITH_EVENTS,
                                   [{"id": row["id"], "fence": row["fence"]} for row in rows])
    claimed = conn.execute(statement, {
        "rows": wanted, "ids": [row["id"] for row in rows], "owner": owner, "lease": lease,
        "detail": f"owner={owner}",
    })
    barriers: dict[str, StartBarrier] = {}
    if fuse:
        for row in rows:
            if row["plan"].get("idempotent") is True:
                barriers[row["id"]] = StartBarrier.for_claim(
                    row["id"], row["fence"] + 1, row["attempt"] + 1, row["effect_key"],
                    row["fingerprint"], row["trace_id"],
                )
    if barriers:
        inserted, starts = _with_rows(FUSED_BARRIERS_INSERT, [
            {"start_id": b.start_id, "workflow_id": b.workflow_id, "fence": b.fence,
             "attempt": b.attempt, "effect_key": b.effect_key, "fingerprint": b.fingerprint,
             "trace_id": b.trace_id, "span_id": b.span_id, "digest": b.digest()}
            for b in barriers.values()
        ])
        conn.execute(inserted, (starts,))
    written = {row["id"]: row for row in claimed.fetchall()}
    # Every row is locked by this transaction and still at its fence: each is claimed.
    assert written.keys() == {row["id"] for row in rows}
    return [Claimed(Workflow.from_row({**row, **written[row["id"]]}), barriers.get(row["id"]))
            for row in rows]


def _event_queued(
    conn: psycopg.Connection[dict[str, Any]], workflow_id: str, kind: str, fence: int, detail: str
) -> None:
    """``_event`` without reading its sequence number back (a pipeline need not wait)."""
    conn.execute(
        "INSERT INTO events (workflow_id, kind, fence, detail) VALUES (%s, %s, %s, %s)",
        (workflow_id, kind, fence, detail),
    )


def _divert(
    conn: psycopg.Connection[dict[str, Any]], row: dict[str, Any], diverted: tuple[str, str, str]
) -> None:
    """Write what a due ready row becomes instead of running, with its audit event."""
    state, kind, reason = diverted
    conn.execute(
        """
        UPDATE workflows
           SET state = %s, review_reason = %s,
               approved_by = CASE WHEN %s = 'waiting_approval'
                                  THEN '' ELSE approved_by END,
               approval_expires = CASE WHEN %s = 'waiting_approval'
                                       THEN NULL ELSE approval_expires END,
               updated_at = clock_timestamp()
         WHERE id = %s
        """,
        (state, reason, state, state, row["id"]),
    )
    _event_queued(conn, row["id"], kind, row["fence"], "at=claim")


def _never_dispatched(
    conn: psycopg.Connection[dict[str, Any]], workflow_id: str, fence: int
) -> bool:
    """The database's proof that no start of this workflow may have reached the tool.

    No start barrier under ``fence``, and every earlier one completed as a definite
    non-effect. A barrier is committed before every dispatch, so its absence proves
    the tool was never called under that fence.
    """
    row = conn.execute(
        """
        SELECT count(*) AS open_starts
          FROM start_barriers b LEFT JOIN completions c USING (start_id)
         WHERE b.workflow_id = %s
           AND (b.fence = %s OR c.outcome IS NULL OR c.outcome <> ALL(%s))
        """,
        (workflow_id, fence, list(NON_EFFECT_OUTCOMES)),
    ).fetchone()
    return row is not None and int(row["open_starts"]) == 0


def _locked(conn: psycopg.Connection[dict[str, Any]], workflow_id: str) -> dict[str, Any]:
    row = conn.execute(
        "SELECT * FROM workflows WHERE id = %s FOR UPDATE", (workflow_id,)
    ).fetchone()
    if row is None:
        raise errors.NotFound(f"no workflow {workflow_id!r}")
    return row


@overload
def _fenced(
    conn: psycopg.Connection[dict[str, Any]], workflow: Workflow, states: str | tuple[str, ...],
    assignments: LiteralString, params: tuple[Any, ...], *, guard: LiteralString = "",
    guard_params: tuple[Any, ...] = (), refusal: str, event: tuple[str, str] | None = None,
    touch: bool = True,
) -> dict[str, Any]: ...


@overload
def _fenced(
    conn: psycopg.Connection[dict[str, Any]], workflow: Workflow, states: str | tuple[str, ...],
    assignments: LiteralString, params: tuple[Any, ...], *, guard: LiteralString = "",
    guard_params: tuple[Any, ...] = (), refusal: None, event: tuple[str, str] | None = None,
    touch: bool = True,
) -> dict[str, Any] | None: ...


def _fenced(
    conn: psycopg.Connection[dict[str, Any]],
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
    stamp: LiteralString = ", updated_at = clock_timestamp()" if touch else ""
    # Every piece is a literal of this module (LiteralString): values travel as parameters.
    row = conn.execute(
        "UPDATE workflows SET " + assignments + stamp  # noqa: S608
        + " WHERE id = %s AND fence = %s AND state = ANY(%s)" + guard + " RETURNING *",
        (*params, workflow.id, workflow.fence, wanted, *guard_params),
    ).fetchone()
    if row is None:
        if refusal is None:
            return None
        raise errors.Stale(refusal)
    if event is not None:
        _event(conn, workflow.id, event[0], workflow.fence, event[1])
    return row


def _event(
    conn: psycopg.Connection[dict[str, Any]], workflow_id: str, kind: str, fence: int, detail: str
) -> int:
    row = conn.execute(
        "INSERT INTO events (workflow_id, kind, fence, detail) VALUES (%s, %s, %s, %s) "
        "RETURNING seq",
        (workflow_id, kind, fence, detail),
    ).fetchone()
    assert row is not None
    seq: int = row["seq"]
    return seq


def _barrier_row(
    conn: psycopg.Connection[dict[str, Any]], start: str
) -> dict[str, Any] | None:
    return conn.execute("SELECT * FROM start_barriers WHERE start_id = %s", (start,)).fetchone()


def _verified_barrier(row: dict[str, Any]) -> StartBarrier:
    """Rebuild a stored barrier and verify it; any mismatch fails closed."""
    barrier = StartBarrier(**{name: row[name] for name in StartBarrier.__dataclass_fields__})
    barrier.verify(row["digest"], row["audit_event"])
    return barrier


def _barrier_at(
    conn: psycopg.Connection[dict[str, Any]], workflow_id: str, fence: int
) -> StartBarrier | None:
    row = conn.execute(
        "SELECT * FROM start_barriers WHERE workflow_id = %s AND fence = %s",
        (workflow_id, fence),
    ).fetchone()
    return None if row is None else _verified_barrier(row)


def _has_completion(conn: psycopg.Connection[dict[str, Any]], start: str) -> bool:
    return (
        conn.execute("SELECT 1 FROM completions WHERE start_id = %s", (start,)).fetchone()
        is not None
    )


def _complete_start(conn: psycopg.Connection[dict[str, Any]], completion: Completion) -> None:
    """Write the start's one completion; a second one (of either kind) is a conflict."""
    row = conn.execute(
        """
        INSERT INTO completions (start_id, barrier_digest, outcome, summary, receipt_id, digest)
        VALUES (%s, %s, %s, %s, %s, %s)
        ON CONFLICT (start_id) DO NOTHING
        RETURNING start_id
        """,
        (completion.start_id, completion.barrier_digest, completion.outcome, completion.summary,
         completion.receipt_id, completion.digest()),
    ).fetchone()
    if row is None:
        raise errors.Conflict("this start already has a completion")


def _release(conn: psycopg.Connection[dict[str, Any]], claim: Workflow, state: str) -> None:
    conn.execute(
        """
        UPDATE workflows
           SET state = %s, owner = '', lease_until = NULL,
               approved_by = CASE WHEN %s = 'waiting_approval' THEN '' ELSE approved_by END,
               approval_expires = CASE WHEN %s = 'waiting_approval'
                                       THEN NULL ELSE approval_expires END,
               updated_at = clock_timestamp()
         WHERE id = %s AND fence = %s
        """,
        (state, state, state, claim.id, claim.fence),
    )


def _claim_diversion(row: dict[str, Any]) -> tuple[str, str, str] | None:
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
