"""The seed lab's floor: the 26 experiments every publishable run must declare, run and pass.

Fixed in code, not read from the manifest: a commit that drops a seed experiment from
both the tree and ``experiments/manifest.json`` must still fail the gate. The list was
derived once from the manifest entries marked ``"seed": true`` (chapter, test function).
"""

from __future__ import annotations

SEED_EXPERIMENTS: tuple[tuple[str, str], ...] = (
    ("ch01_admission", "test_proposal_cannot_grant_authority"),
    ("ch01_admission", "test_operation_key_has_unambiguous_tenant_scope"),
    ("ch01_admission", "test_operation_identity_rejects_parameter_drift"),
    ("ch02_approval", "test_approval_binds_tenant_role_and_fingerprint"),
    ("ch02_approval", "test_approval_expires_while_queued"),
    ("ch02_approval", "test_approval_expires_after_claim"),
    ("ch03_leases", "test_two_claimers_cannot_own_one_workflow"),
    ("ch03_leases", "test_heartbeat_cannot_revive_an_expired_lease"),
    ("ch03_leases", "test_expired_owner_cannot_commit_an_old_result"),
    ("ch04_unknown_outcomes", "test_commit_reply_lost_becomes_unknown_then_reconciled"),
    ("ch04_unknown_outcomes", "test_non_idempotent_unknown_never_automatically_replays"),
    ("ch04_unknown_outcomes", "test_unknown_404_uses_original_key_and_stops_at_budget"),
    ("ch04_unknown_outcomes", "test_terminal_transaction_rolls_back_but_effect_can_be_reconciled"),
    ("ch04_unknown_outcomes", "test_receipt_fingerprint_mismatch_cannot_complete_or_reconcile"),
    ("ch05_crashes", "test_two_worker_processes_claim_exactly_one"),
    ("ch05_crashes", "test_sigkill_after_claim_queries_404_and_restarts"),
    ("ch05_crashes", "test_sigkill_after_tool_reconciles_existing_effect"),
    ("ch05_crashes", "test_sigkill_non_idempotent_requires_manual_review"),
    ("ch06_cancellation", "test_cancel_before_dispatch"),
    ("ch06_cancellation", "test_cancel_after_effect_preserves_succeeded_fact"),
    ("ch06_cancellation", "test_cancellation_during_lookup_cannot_requeue"),
    ("ch07_retries_and_versions", "test_trusted_429_uses_timed_retry"),
    ("ch07_retries_and_versions", "test_trusted_429_exhausts_persistent_budget"),
    ("ch07_retries_and_versions", "test_persisted_version_two_rejected_by_old_worker"),
    ("ch08_boundaries", "test_events_exclude_raw_sensitive_inputs"),
    ("ch08_boundaries", "test_loopback_boundaries_reject_remote_targets"),
)
