"""Every SQL statement of the store, each written once and named.

Literals only (``LiteralString``): values always travel as parameters. A statement two
transitions share (the review-divert ``UPDATE``, the review row, an audit event) has one
name here, and every caller uses it.
"""

from __future__ import annotations

import json
from typing import Any, LiteralString

# -- the workflow row ------------------------------------------------------------------

WORKFLOW_BY_ID: LiteralString = "SELECT * FROM workflows WHERE id = %s"
LOCK_WORKFLOW: LiteralString = "SELECT * FROM workflows WHERE id = %s FOR UPDATE"
WORKFLOW_BY_OPERATION: LiteralString = (
    "SELECT * FROM workflows WHERE tenant = %s AND operation = %s"
)
INSERT_WORKFLOW: LiteralString = """
                INSERT INTO workflows (id, tenant, operation, proposed_by, plan, fingerprint,
                                       plan_version, effect_key, trace_id, state, max_attempts)
                VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, 'waiting_approval', %s)
                ON CONFLICT (tenant, operation) DO NOTHING
                RETURNING *
                """
APPROVE: LiteralString = """
                UPDATE workflows
                   SET state = 'ready', approved_by = %s,
                       approval_expires = clock_timestamp() + %s,
                       ready_at = clock_timestamp(), updated_at = clock_timestamp()
                 WHERE id = %s
                RETURNING *
                """
CANCEL: LiteralString = """
                UPDATE workflows
                   SET cancel_requested = true,
                       state = CASE WHEN state IN ('waiting_approval', 'ready')
                                    THEN 'cancelled' ELSE state END,
                       updated_at = clock_timestamp()
                 WHERE id = %s
                RETURNING *
                """


def fenced_update(assignments: LiteralString, guard: LiteralString, touch: bool) -> LiteralString:
    """The one shape of every fenced transition: ``UPDATE workflows SET <assignments>
    WHERE id AND fence AND state IN <states> <guard> RETURNING *``.

    ``touch`` sets ``updated_at`` too. Parameters: the assignments', then id, fence,
    the states (an array), then the guard's.
    """
    stamp: LiteralString = ", updated_at = clock_timestamp()" if touch else ""
    # Every piece is a literal of the store (LiteralString): values travel as parameters.
    return (
        "UPDATE workflows SET " + assignments + stamp  # noqa: S608
        + " WHERE id = %s AND fence = %s AND state = ANY(%s)" + guard + " RETURNING *"
    )


# -- audit events ----------------------------------------------------------------------

RECORD_EVENT: LiteralString = (
    "INSERT INTO events (workflow_id, kind, fence, detail) VALUES (%s, %s, %s, %s)"
)
# ``RECORD_EVENT`` reading the event's sequence number back (a start barrier binds to it).
RECORD_EVENT_SEQ: LiteralString = RECORD_EVENT + " RETURNING seq"
ALL_EVENTS: LiteralString = "SELECT * FROM events ORDER BY seq"
EVENTS_OF: LiteralString = "SELECT * FROM events WHERE workflow_id = %s ORDER BY seq"

# -- claiming and leases -----------------------------------------------------------------

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

# What a due ready row becomes instead of running (cancelled, back to waiting_approval,
# incompatible, failed): parameters state, reason, state, state, id.
DIVERT: LiteralString = """
        UPDATE workflows
           SET state = %s, review_reason = %s,
               approved_by = CASE WHEN %s = 'waiting_approval'
                                  THEN '' ELSE approved_by END,
               approval_expires = CASE WHEN %s = 'waiting_approval'
                                       THEN NULL ELSE approval_expires END,
               updated_at = clock_timestamp()
         WHERE id = %s
        """
# A claim let go before dispatch (cancelled, or its approval lapsed), under its fence.
RELEASE: LiteralString = """
        UPDATE workflows
           SET state = %s, owner = '', lease_until = NULL,
               approved_by = CASE WHEN %s = 'waiting_approval' THEN '' ELSE approved_by END,
               approval_expires = CASE WHEN %s = 'waiting_approval'
                                       THEN NULL ELSE approval_expires END,
               updated_at = clock_timestamp()
         WHERE id = %s AND fence = %s
        """
LEASE_EXPIRED: LiteralString = (
    "SELECT lease_until <= clock_timestamp() AS expired FROM workflows WHERE id = %s"
)

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
# The claim itself, shared by both claim statements: each wanted row, by id and the fence it
# was read under, moves to running under a new fence and lease.
_CLAIMED: LiteralString = """
    claimed AS (
        UPDATE workflows w
           SET state = 'running', owner = %(owner)s, fence = w.fence + 1,
               attempt = w.attempt + 1, lease_until = clock_timestamp() + %(lease)s,
               updated_at = clock_timestamp()
          FROM wanted
         WHERE w.id = ANY(%(ids)s::text[]) AND w.id = wanted.id AND w.fence = wanted.fence
        RETURNING w.id, w.state, w.owner, w.fence, w.attempt, w.lease_until
    )"""
# A batch's claims and their audit events in one statement: each row by id and the fence
# it was read under (the rows are locked by this transaction's claim query, so the columns
# it does not return are as read). A batch's rows travel as one JSON array: one
# parameter, not a list to adapt per column. The planner guesses 100 rows for any JSON
# record set and would then scan the whole table for them; ``id = ANY(ids)`` keeps every
# update of a batch on the primary key.
CLAIMS_WITH_EVENTS: LiteralString = """
    WITH wanted AS (
        SELECT * FROM json_to_recordset(%(rows)s::json) AS t(id text, fence bigint)
    ),""" + _CLAIMED + """, audit AS (
        INSERT INTO events (workflow_id, kind, fence, detail)
        SELECT id, 'claimed', fence, %(detail)s FROM claimed
    )
    SELECT * FROM claimed
"""  # noqa: S608 (literals of the store joined: values travel as parameters)
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
# A batch's claims with, for each idempotent claim a fused step commits with it, its start
# barrier bound to its own audit event: one statement, so one round trip fewer per claim
# than a claim and a barrier insert sent apart. A row's barrier fields are null when it
# has none. Data-modifying CTEs run in no set order, so both audit events of every claim
# come from one insert whose rows are sorted first (every 'claimed' before any
# 'dispatching'); ``seq``'s default is evaluated as each sorted row is inserted, so the
# events' order is the one a claim and a later barrier insert would give. Each barrier
# comes back by workflow, for the caller to check that every one it asked for was written.
# Measured against the two statements it replaced (single fused claims over a backlog on an
# embedded PostgreSQL, fsync on, 1,000 a run, four alternated pairs on a busy VM): client
# CPU 593-652 against 751-916 us per claim, server backend 780-930 against 1,160-1,430 us.
CLAIMS_WITH_BARRIERS: LiteralString = """
    WITH wanted AS (
        SELECT * FROM json_to_recordset(%(rows)s::json)
               AS t(id text, fence bigint, start_id text, barrier_fence bigint,
                    attempt integer, effect_key text, fingerprint text, trace_id text,
                    span_id text, digest text)
    ),""" + _CLAIMED + """, audit AS (
        INSERT INTO events (workflow_id, kind, fence, detail)
        SELECT e.workflow_id, e.kind, e.fence, e.detail FROM (
            SELECT 1 AS step, c.id AS workflow_id, 'claimed' AS kind, c.fence,
                   %(detail)s AS detail
              FROM claimed c
            UNION ALL
            SELECT 2, c.id, 'dispatching', c.fence, 'start=' || b.start_id
              FROM claimed c JOIN wanted b ON b.id = c.id AND b.barrier_fence = c.fence
             WHERE b.start_id IS NOT NULL
        ) e
        ORDER BY e.step, e.workflow_id
        RETURNING seq, workflow_id, kind
    ), barriers AS (
        INSERT INTO start_barriers (start_id, workflow_id, fence, attempt, effect_key,
                                    fingerprint, trace_id, span_id, audit_event, digest)
        SELECT b.start_id, b.id, b.barrier_fence, b.attempt, b.effect_key, b.fingerprint,
               b.trace_id, b.span_id, a.seq, b.digest
          FROM wanted b JOIN audit a ON a.workflow_id = b.id AND a.kind = 'dispatching'
        RETURNING workflow_id
    )
    SELECT claimed.*,
           EXISTS (SELECT 1 FROM barriers WHERE barriers.workflow_id = claimed.id)
               AS barrier_written
      FROM claimed
"""  # noqa: S608 (literals of the store joined: values travel as parameters)

# A step of one row (an unbatched worker's) reads it with ``json_to_record``: the same
# statement, but the planner then knows it is one row rather than guessing 100.
_ONE_ROW: dict[str, LiteralString] = {
    statement: statement.replace("json_to_recordset(", "json_to_record(")
    for statement in (CLAIMS_WITH_EVENTS, CLAIMS_WITH_BARRIERS, COMPLETIONS_WITH_EVENTS)
}


def with_rows(statement: LiteralString, rows: list[dict[str, Any]]) -> tuple[LiteralString, str]:
    """``statement`` (one of the batch statements) and its JSON rows parameter, as one
    object for a single row (``_ONE_ROW``'s form) or as an array."""
    if len(rows) == 1:
        return _ONE_ROW[statement], json.dumps(rows[0])
    return statement, json.dumps(rows)


# -- start barriers and completions ---------------------------------------------------------

# ``pre_dispatch``'s read of its claim, locked: is the approval lapsed, the lease live?
DISPATCH_CHECK: LiteralString = """
                SELECT *, (approval_expires IS NULL
                           OR approval_expires <= clock_timestamp()) AS approval_lapsed,
                          (lease_until > clock_timestamp()) AS lease_live
                  FROM workflows WHERE id = %s FOR UPDATE
                """
INSERT_BARRIER: LiteralString = """
                INSERT INTO start_barriers (start_id, workflow_id, fence, attempt, effect_key,
                                            fingerprint, trace_id, span_id, audit_event, digest)
                VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
                """
BARRIER_BY_START: LiteralString = "SELECT * FROM start_barriers WHERE start_id = %s"
BARRIER_AT_FENCE: LiteralString = (
    "SELECT * FROM start_barriers WHERE workflow_id = %s AND fence = %s"
)
HAS_COMPLETION: LiteralString = "SELECT 1 FROM completions WHERE start_id = %s"
# The start's one completion; a second one (of either kind) inserts nothing.
INSERT_COMPLETION: LiteralString = """
        INSERT INTO completions (start_id, barrier_digest, outcome, summary, receipt_id, digest)
        VALUES (%s, %s, %s, %s, %s, %s)
        ON CONFLICT (start_id) DO NOTHING
        RETURNING start_id
        """
COMPLETION_WITH_BARRIER: LiteralString = (
    "SELECT c.*, b.* , c.digest AS completion_digest, b.digest AS barrier_row_digest "
    "FROM completions c JOIN start_barriers b USING (start_id) "
    "WHERE c.start_id = %s"
)
# Starts of a workflow that may have reached the tool: any under ``fence``, and earlier
# ones not completed as a definite non-effect (parameters id, fence, the non-effects).
OPEN_STARTS: LiteralString = """
        SELECT count(*) AS open_starts
          FROM start_barriers b LEFT JOIN completions c USING (start_id)
         WHERE b.workflow_id = %s
           AND (b.fence = %s OR c.outcome IS NULL OR c.outcome <> ALL(%s))
        """

# -- review ------------------------------------------------------------------------------

IN_REVIEW: LiteralString = (
    "SELECT * FROM workflows WHERE state = 'unknown' AND tenant = %s ORDER BY updated_at, id"
)
INSERT_REVIEW: LiteralString = (
    "INSERT INTO reviews (workflow_id, reviewer, decision, proof, reason) "
    "VALUES (%s, %s, %s, %s, %s)"
)
REQUEUE_REVIEWED: LiteralString = """
                UPDATE workflows SET state = 'ready', ready_at = clock_timestamp(),
                       review_reason = '', updated_at = clock_timestamp()
                 WHERE id = %s RETURNING *
                """
RESOLVE_REVIEWED: LiteralString = """
                UPDATE workflows SET state = %s, result = %s, review_reason = 'resolved_by_person',
                       updated_at = clock_timestamp()
                 WHERE id = %s RETURNING *
                """
OPEN_COUNTS: LiteralString = """
                SELECT count(*) FILTER (WHERE state = 'ready') AS ready,
                       count(*) FILTER (WHERE state = 'running') AS running,
                       count(*) FILTER (WHERE state = 'unknown' AND review_reason = '')
                           AS unreviewed_unknown
                  FROM workflows
                """
UNREVIEWED_UNKNOWN: LiteralString = (
    "SELECT id FROM workflows WHERE state = 'unknown' AND review_reason = '' "
    "ORDER BY updated_at, id"
)
IN_REVIEW_FOR: LiteralString = (
    "SELECT id FROM workflows WHERE state = 'unknown' AND review_reason = %s "
    "ORDER BY updated_at, id"
)

# -- the schema and the history the invariant checker reads ------------------------------

# Formats for ``psycopg.sql.SQL(...).format(sql.Identifier(schema))``.
CREATE_SCHEMA: LiteralString = "CREATE SCHEMA {}"
SET_SEARCH_PATH: LiteralString = "SET LOCAL search_path TO {}"
HISTORY_WORKFLOWS: LiteralString = """
                    SELECT id, state, coalesce(plan -> 'idempotent' = 'true'::jsonb, false)
                               AS idempotent,
                           effect_key, fingerprint, fence, attempt, max_attempts,
                           review_reason, result
                      FROM workflows ORDER BY created_at, id
                    """
HISTORY_EVENTS: LiteralString = (
    "SELECT seq, workflow_id, kind, fence, detail FROM events ORDER BY seq"
)
HISTORY_EFFECTS: LiteralString = (
    "SELECT seq, effect_key, fingerprint, receipt, idempotent, start_id, fence "
    "FROM tool_effects ORDER BY seq"
)
HISTORY_BARRIERS: LiteralString = (
    "SELECT start_id, workflow_id, fence FROM start_barriers ORDER BY start_id"
)
# The fenced lookup's tombstones: keys a lookup answered "absent" for, through which fence.
HISTORY_FENCES: LiteralString = (
    "SELECT effect_key, closed_through FROM tool_fences WHERE closed_through >= 0"
    " ORDER BY effect_key"
)

# -- the server, for the fault tools (lab.faults.diagnostics) ------------------------------

SERVER_SETTINGS: LiteralString = (
    "SELECT name, setting FROM pg_settings WHERE name = ANY(%s) ORDER BY name"
)
BACKENDS: LiteralString = (
    "SELECT pid, application_name FROM pg_stat_activity "
    "WHERE left(application_name, %s) = %s ORDER BY pid"
)
TERMINATE_BACKEND: LiteralString = "SELECT pg_terminate_backend(%s) AS done"
