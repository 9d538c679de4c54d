"""Plans: canonical JSON, fingerprint and the tenant-scoped effect key."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab import errors, harness
from lab.runtime import plan

SEED = harness.sample_plan()

# One changed value per field: the fingerprint must notice each.
CHANGES: dict[str, Any] = {
    "version": 2,
    "action": "issue_debit",
    "account": "account-b",
    "amount_minor": 501,
    "currency": "USD",
    "idempotent": False,
}


def test_fingerprint_is_stable() -> None:
    again = plan.Plan(**SEED.to_json())
    assert again.fingerprint() == SEED.fingerprint()
    assert SEED.fingerprint() == SEED.fingerprint()
    assert len(SEED.fingerprint()) == 64
    int(SEED.fingerprint(), 16)


def test_fingerprint_pinned_value() -> None:
    """A silent change to the canonical form would orphan every stored approval."""
    body = (
        b'{"account":"account-a","action":"issue_credit","amount_minor":500,'
        b'"currency":"CNY","idempotent":true,"version":1}'
    )
    assert plan.canonical_json(SEED.to_json()) == body
    import hashlib

    assert SEED.fingerprint() == hashlib.sha256(b"lab/plan@v1\0" + body).hexdigest()


def test_fingerprint_covers_every_field() -> None:
    assert set(CHANGES) == {f.name for f in dataclasses.fields(plan.Plan)}
    seen = {SEED.fingerprint()}
    for name, value in CHANGES.items():
        changed = dataclasses.replace(SEED, **{name: value})
        assert changed.fingerprint() != SEED.fingerprint(), name
        seen.add(changed.fingerprint())
    assert len(seen) == len(CHANGES) + 1


def test_fingerprint_distinguishes_bool_from_int() -> None:
    # JSON true and 1 are different values; Python's True == 1 must not blur them.
    as_int = dataclasses.replace(SEED, idempotent=1)  # type: ignore[arg-type]
    assert as_int.fingerprint() != SEED.fingerprint()


@given(
    account=st.sampled_from(plan.ACCOUNTS),
    amount=st.integers(plan.MIN_AMOUNT_MINOR, plan.MAX_AMOUNT_MINOR),
    other=st.integers(plan.MIN_AMOUNT_MINOR, plan.MAX_AMOUNT_MINOR),
    idempotent=st.booleans(),
)
def test_fingerprint_equal_iff_plans_equal(
    account: str, amount: int, other: int, idempotent: bool
) -> None:
    a = dataclasses.replace(SEED, account=account, amount_minor=amount, idempotent=idempotent)
    b = dataclasses.replace(a, amount_minor=other)
    assert (a.fingerprint() == b.fingerprint()) == (a == b)


def test_canonical_json_is_sorted_compact_utf8() -> None:
    assert plan.canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()
    with pytest.raises(ValueError, match="Out of range float"):
        plan.canonical_json({"a": float("nan")})


def test_round_trip_through_json() -> None:
    stored = json.loads(json.dumps(SEED.to_json()))
    assert plan.Plan.from_json(stored) == SEED
    assert plan.Plan.from_json(stored).fingerprint() == SEED.fingerprint()


@pytest.mark.parametrize(
    "stored",
    [
        None,
        [],
        {},
        {**SEED.to_json(), "tenant": "victim"},
        {k: v for k, v in SEED.to_json().items() if k != "idempotent"},
    ],
    ids=["null", "array", "empty", "extra-field", "missing-capability"],
)
def test_from_json_refuses_other_shapes(stored: Any) -> None:
    with pytest.raises(errors.Rejected, match="unexpected shape"):
        plan.Plan.from_json(stored)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("version", 2, "unsupported plan version"),
        ("version", True, "unsupported plan version"),
        ("action", "issue_debit", "unsupported action"),
        ("account", "\u0430ccount-a", "account must be 1-64 letters"),  # Cyrillic a
        ("account", "", "account must be 1-64 letters"),
        ("account", "a" * 65, "account must be 1-64 letters"),
        ("account", "account-a\n", "account must be 1-64 letters"),
        ("account", None, "account must be 1-64 letters"),
        ("amount_minor", 0, "amount_minor must be an integer"),
        ("amount_minor", 10_001, "amount_minor must be an integer"),
        ("amount_minor", 500.0, "amount_minor must be an integer"),
        ("amount_minor", True, "amount_minor must be an integer"),
        ("currency", "USD", "currency must be CNY"),
        ("idempotent", 1, "idempotent must come from the registry"),
    ],
)
def test_validate_refuses_out_of_range(field: str, value: Any, reason: str) -> None:
    with pytest.raises(errors.Rejected, match=reason):
        dataclasses.replace(SEED, **{field: value}).validate()


def test_validate_accepts_operator_accounts_beyond_the_proposal_list() -> None:
    # Admission narrows accounts to plan.ACCOUNTS; a stored plan only needs a safe shape.
    dataclasses.replace(SEED, account="account-c").validate()
    SEED.validate()


def test_effect_key_is_unambiguous() -> None:
    assert plan.effect_key("a:b", "c") != plan.effect_key("a", "b:c")
    assert plan.effect_key("a", "bc") != plan.effect_key("ab", "c")
    assert plan.effect_key('a","b', "c") != plan.effect_key("a", 'b","c')
    assert plan.effect_key("a", "b") != plan.effect_key("b", "a")


def test_effect_key_is_stable() -> None:
    key = plan.effect_key("a:b", "c")
    assert key == plan.effect_key("a:b", "c")
    assert key.startswith("ek1_")
    assert len(key) == len("ek1_") + 64


@given(st.text(), st.text(), st.text(), st.text())
def test_effect_key_injective(t1: str, o1: str, t2: str, o2: str) -> None:
    """Different (tenant, operation) pairs never share a key (barring sha256 collisions)."""
    k1, k2 = plan.effect_key(t1, o1), plan.effect_key(t2, o2)
    assert (k1 == k2) == ((t1, o1) == (t2, o2))
