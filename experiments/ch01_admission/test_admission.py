"""Chapter 1: model output is untrusted input; identity is scoped and stable."""

from __future__ import annotations

import dataclasses

import pytest

from lab import errors, harness
from lab.runtime import plan, proposal

BASE = (
    b'{"version":1,"action":"issue_credit","account":"account-a",'
    b'"amount_minor":500,"currency":"CNY"}'
)
AUTHORITY_FIELDS = [
    b'"approved":true',
    b'"idempotent":true',
    b'"tenant":"victim"',
    b'"endpoint":"http://evil.invalid"',
    b'"actor":"admin"',
]


def test_proposal_cannot_grant_authority(observe):
    """A model's proposal cannot approve itself, claim capabilities, pick a tenant or an
    endpoint: capabilities come from the trusted registry, and only one bounded object
    is read."""
    admitted = proposal.admit(BASE, proposal.TOOL_REGISTRY["credit-service"])
    assert admitted.idempotent is True, "capability must come from the trusted registry"
    rejected = 0
    for extra in AUTHORITY_FIELDS:
        with pytest.raises(errors.Rejected):
            proposal.admit(BASE[:-1] + b"," + extra + b"}")
        rejected += 1
    with pytest.raises(errors.Rejected):
        proposal.admit(BASE + BASE)
    with pytest.raises(errors.Rejected):
        proposal.admit(b" " * 4097)
    observe(
        {"authority_fields_rejected": rejected, "capability_from_registry": admitted.idempotent},
        facts=("authority_fields_rejected", "capability_from_registry"))


def test_operation_key_has_unambiguous_tenant_scope(observe):
    """The effect key of (tenant "a:b", operation "c") differs from that of ("a", "b:c"),
    and the same pair always gives the same key."""
    first = plan.effect_key("a:b", "c")
    second = plan.effect_key("a", "b:c")
    assert first != second, "ambiguous compound identity"
    again = plan.effect_key("a:b", "c")
    assert first == again, "unstable identity"
    observe({"keys_distinct": first != second, "key_stable": first == again,
             "key_prefix": first.split("_", 1)[0]},
            facts=("keys_distinct", "key_stable", "key_prefix"))


def test_operation_identity_rejects_parameter_drift(lab, observe):
    """Creating the same operation twice gives one workflow; the same operation with a
    different amount is a conflict, not a second workflow."""
    first = lab.store.create(harness.PROPOSER, "same-operation", harness.sample_plan(True))
    again = lab.store.create(harness.PROPOSER, "same-operation", harness.sample_plan(True))
    assert first.id == again.id, "duplicate workflow"
    changed = dataclasses.replace(harness.sample_plan(True), amount_minor=501)
    with pytest.raises(errors.Conflict) as drift:
        lab.store.create(harness.PROPOSER, "same-operation", changed)
    workflows = lab.store.execute("SELECT count(*) AS n FROM workflows")[0]["n"]
    assert workflows == 1
    observe(
        {"same_workflow": first.id == again.id, "drift_refused_with": drift.typename,
         "workflows": workflows, "state": lab.state(first.id).state},
            facts=("same_workflow", "drift_refused_with", "workflows", "state"))
