-- The independent audit: the key invariants a second time, as plain SQL over the kept
-- tables. Shares no code with lab/faults/invariants.py or the store: lab/faults/audit.py
-- only runs each query below, in a read-only transaction with the run's schema as its
-- search_path, and reports every row as a finding. Each query returns
-- (workflow_id, effect_key, detail); no row means the rule holds.

-- name: duplicate_effect
-- Every effect key in the ledger has at most one effect.
SELECT coalesce(min(w.id), ''), e.effect_key, count(*)::text || ' ledger rows'
FROM tool_effects e LEFT JOIN workflows w ON w.effect_key = e.effect_key
GROUP BY e.effect_key
HAVING count(DISTINCT e.seq) > 1;

-- name: succeeded_without_effect
-- Every succeeded workflow has exactly one effect of its key and plan, and that effect's
-- receipt is the receipt of a succeeded completion of one of its own starts.
SELECT w.id, w.effect_key,
       (SELECT count(*) FROM tool_effects e
         WHERE e.effect_key = w.effect_key AND e.fingerprint = w.fingerprint)::text
       || ' matching ledger rows'
FROM workflows w
WHERE w.state = 'succeeded'
  AND ((SELECT count(*) FROM tool_effects e
         WHERE e.effect_key = w.effect_key AND e.fingerprint = w.fingerprint) <> 1
       OR NOT EXISTS (
         SELECT 1 FROM tool_effects e
         JOIN completions c ON c.receipt_id = e.receipt AND c.outcome = 'succeeded'
         JOIN start_barriers b ON b.start_id = c.start_id AND b.workflow_id = w.id
         WHERE e.effect_key = w.effect_key AND e.fingerprint = w.fingerprint));

-- name: effect_without_dispatch
-- No effect without a workflow that dispatched it: a workflow of the effect's key and plan,
-- succeeded or waiting for a person, with a start barrier (the record of intent that
-- precedes every dispatch) for that key.
SELECT coalesce(w.id, ''), e.effect_key, 'receipt ' || e.receipt || ': ' ||
       CASE WHEN w.id IS NULL THEN 'no workflow has this effect key'
            WHEN w.fingerprint <> e.fingerprint THEN 'plan differs from the workflow''s'
            WHEN w.state NOT IN ('succeeded', 'unknown') THEN 'workflow ended ' || w.state
            ELSE 'no start barrier: never dispatched' END
FROM tool_effects e LEFT JOIN workflows w ON w.effect_key = e.effect_key
WHERE w.id IS NULL
   OR w.fingerprint <> e.fingerprint
   OR w.state NOT IN ('succeeded', 'unknown')
   OR NOT EXISTS (SELECT 1 FROM start_barriers b
                   WHERE b.workflow_id = w.id AND b.effect_key = e.effect_key);

-- name: lost_workflow
-- No workflow is lost: each is finished, or waits for a person with a reason.
SELECT w.id, w.effect_key, 'ended in ' || w.state || ' without a review reason'
FROM workflows w
WHERE w.state NOT IN ('succeeded', 'cancelled', 'failed', 'incompatible')
  AND NOT (w.state = 'unknown' AND btrim(w.review_reason) <> '');

-- name: resurrected_after_completion
-- Expiry never resurrects a finished workflow: after a workflow's completion event, no
-- claim and no lease expiry of it follows.
SELECT w.id, w.effect_key, later.kind || ' event ' || later.seq::text
       || ' after completion event ' || done.seq::text
FROM workflows w
JOIN events done ON done.workflow_id = w.id AND done.kind = 'completed'
JOIN events later ON later.workflow_id = w.id AND later.seq > done.seq
                 AND later.kind IN ('claimed', 'lease_expired')
WHERE w.state = 'succeeded';

-- name: write_after_absent
-- "Absent" is final: no effect comes from a start at a fence that a fenced lookup of its
-- key answered "absent" for (the tombstone in tool_fences closes every fence up to it).
SELECT coalesce((SELECT min(w.id) FROM workflows w WHERE w.effect_key = e.effect_key), ''),
       e.effect_key,
       'receipt ' || e.receipt || ' from fence ' || e.fence::text
       || ', absent answered through fence ' || f.closed_through::text
FROM tool_effects e JOIN tool_fences f ON f.effect_key = e.effect_key
WHERE e.fence <= f.closed_through;

-- name: false_outcome
-- No workflow ends failed, cancelled or incompatible while an effect of its key and plan
-- is in the ledger.
SELECT w.id, w.effect_key, 'ended ' || w.state || ' with an effect in the ledger'
FROM workflows w
WHERE w.state IN ('failed', 'cancelled', 'incompatible')
  AND EXISTS (SELECT 1 FROM tool_effects e
               WHERE e.effect_key = w.effect_key AND e.fingerprint = w.fingerprint);
