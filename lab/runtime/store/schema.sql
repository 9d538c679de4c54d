-- Every table, index and constraint of the lab. Applied inside one schema per
-- experiment (the search_path names it), so nothing here names a schema.

CREATE TABLE workflows (
 id text PRIMARY KEY,
 tenant text NOT NULL,
 operation text NOT NULL,
 proposed_by text NOT NULL,
 plan jsonb NOT NULL,
 fingerprint text NOT NULL,
 plan_version integer NOT NULL,
 effect_key text NOT NULL,
 trace_id text NOT NULL CHECK (trace_id ~ '^[0-9a-f]{32}$'),
 state text NOT NULL CHECK (state IN ('waiting_approval','ready','running','unknown',
                                      'succeeded','cancelled','failed','incompatible')),
 approved_by text NOT NULL DEFAULT '',
 approval_expires timestamptz,
 owner text NOT NULL DEFAULT '',
 fence bigint NOT NULL DEFAULT 0,
 attempt integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
 max_attempts integer NOT NULL DEFAULT 3 CHECK (max_attempts BETWEEN 1 AND 10),
 lease_until timestamptz,
 ready_at timestamptz NOT NULL DEFAULT clock_timestamp(),
 cancel_requested boolean NOT NULL DEFAULT false,
 review_reason text NOT NULL DEFAULT '',
 result jsonb,
 created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
 updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
 UNIQUE (tenant, operation),
 -- A running workflow always has an owner and a lease; a succeeded one its receipt.
 CHECK (state <> 'running' OR (owner <> '' AND lease_until IS NOT NULL)),
 CHECK (state <> 'succeeded' OR result IS NOT NULL),
 CHECK (attempt <= max_attempts)
);

-- Claiming scans only ready work, so its cost does not grow with finished history.
CREATE INDEX ready_work ON workflows (ready_at, created_at) WHERE state = 'ready';
CREATE INDEX running_leases ON workflows (lease_until) WHERE state = 'running';

-- Audit events hold kinds and identifiers only: never accounts, amounts, tokens or headers.
CREATE TABLE events (
 seq bigserial PRIMARY KEY,
 workflow_id text NOT NULL REFERENCES workflows(id),
 kind text NOT NULL,
 fence bigint NOT NULL,
 detail text NOT NULL DEFAULT '',
 created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX events_by_workflow ON events (workflow_id, seq);

-- The durable record of intent, committed with its audit event before any dispatch.
-- One start per workflow and fence; its digest is verified whenever it is read.
CREATE TABLE start_barriers (
 start_id text PRIMARY KEY,
 workflow_id text NOT NULL REFERENCES workflows(id),
 fence bigint NOT NULL,
 attempt integer NOT NULL,
 effect_key text NOT NULL,
 fingerprint text NOT NULL,
 trace_id text NOT NULL CHECK (trace_id ~ '^[0-9a-f]{32}$'),
 span_id text NOT NULL CHECK (span_id ~ '^[0-9a-f]{16}$'),
 audit_event bigint REFERENCES events(seq),
 digest text NOT NULL CHECK (digest ~ '^[0-9a-f]{64}$'),
 created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
 UNIQUE (workflow_id, fence)
);

-- How a start ended. The primary key makes success and failure exclusive per start.
CREATE TABLE completions (
 start_id text PRIMARY KEY REFERENCES start_barriers(start_id),
 barrier_digest text NOT NULL,
 outcome text NOT NULL CHECK (outcome IN ('succeeded', 'rate_limited',
                                          'rate_limited_budget_spent', 'rejected',
                                          'unreachable')),
 summary text NOT NULL,
 receipt_id text,
 digest text NOT NULL CHECK (digest ~ '^[0-9a-f]{64}$'),
 created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
 CHECK ((outcome = 'succeeded') = (receipt_id IS NOT NULL))
);

-- What a person decided about a workflow in manual review; free text stays out of events.
CREATE TABLE reviews (
 seq bigserial PRIMARY KEY,
 workflow_id text NOT NULL REFERENCES workflows(id),
 reviewer text NOT NULL,
 decision text NOT NULL CHECK (decision IN ('requeue', 'forced_requeue', 'resolve_failed',
                                            'resolve_succeeded')),
 proof text NOT NULL,
 reason text NOT NULL DEFAULT '',
 created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The credit tool's own ledger. It shares the server, never a transaction, with the workflow.
-- An idempotent tool keeps one effect per key; a non-idempotent one records every call.
CREATE TABLE tool_effects (
 seq bigserial PRIMARY KEY,
 effect_key text NOT NULL,
 idempotent boolean NOT NULL,
 fingerprint text NOT NULL,
 account text NOT NULL,
 amount_minor bigint NOT NULL CHECK (amount_minor > 0),
 currency text NOT NULL,
 receipt text NOT NULL UNIQUE,
 trace_id text CHECK (trace_id ~ '^[0-9a-f]{32}$'),
 start_id text,
 -- The fence of the start that sent the request (0 when it carried none).
 fence bigint NOT NULL DEFAULT 0 CHECK (fence >= 0),
 created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE UNIQUE INDEX tool_effects_one_per_key ON tool_effects (effect_key) WHERE idempotent;
CREATE INDEX tool_effects_by_key ON tool_effects (effect_key);

-- The fenced lookup's tombstones: one row per effect key the tool has seen. A lookup at
-- fence F that finds no effect raises closed_through to F in the transaction that looked,
-- and every later write of that key from a start at fence <= closed_through is refused.
-- Writes and lookups of one key serialize on this row (both lock it), so "absent" is final.
CREATE TABLE tool_fences (
 effect_key text PRIMARY KEY,
 closed_through bigint NOT NULL DEFAULT -1,
 absent_answers integer NOT NULL DEFAULT 0,
 refused_writes integer NOT NULL DEFAULT 0
);
