"""Admission of untrusted proposals: example cases, each with its reason."""

from __future__ import annotations

import json

import pytest

from lab import errors, harness
from lab.runtime import plan, proposal

FIELDS = harness.sample_proposal()
BASE = json.dumps(FIELDS, separators=(",", ":")).encode()


def with_field(text: str) -> bytes:
    """BASE with ``text`` (a ``"key":value`` pair) appended inside the object."""
    return BASE[:-1] + b"," + text.encode() + b"}"


def replaced(field: str, literal: str) -> bytes:
    """BASE with ``field``'s value replaced by the raw JSON ``literal``."""
    parts = [f"{json.dumps(k)}:{json.dumps(v)}" for k, v in FIELDS.items() if k != field]
    parts.append(f"{json.dumps(field)}:{literal}")
    return ("{" + ",".join(parts) + "}").encode()


def rejected(raw: bytes, contract: proposal.ToolContract | None = None) -> str:
    with pytest.raises(errors.Rejected) as info:
        proposal.admit(raw, contract)
    reason = str(info.value)
    assert reason.startswith("proposal rejected: ")
    assert reason.isascii()
    assert "\n" not in reason
    return reason


def test_seed_proposal_is_admitted_with_registry_capability() -> None:
    admitted = proposal.admit(BASE)
    assert admitted == plan.Plan(
        version=1,
        action="issue_credit",
        account="account-a",
        amount_minor=500,
        currency="CNY",
        idempotent=True,
    )
    assert admitted.idempotent is proposal.TOOL_REGISTRY[proposal.DEFAULT_TOOL].idempotent


def test_capability_comes_from_the_contract_not_the_proposal() -> None:
    contract = proposal.TOOL_REGISTRY["credit-service-non-idempotent"]
    assert proposal.admit(BASE, contract).idempotent is False
    # Asking for idempotence in the proposal is refused, not merged.
    reason = rejected(with_field('"idempotent":true'), contract)
    assert "'idempotent' carries authority" in reason


@pytest.mark.parametrize(
    "extra",
    [
        '"approved":true',
        '"idempotent":true',
        '"tenant":"victim"',
        '"endpoint":"http://evil.invalid"',
        '"actor":"admin"',
    ],
)
def test_authority_fields_are_rejected(extra: str) -> None:
    name = extra.split(":")[0].strip('"')
    assert f"field {name!r} carries authority" in rejected(with_field(extra))


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (BASE + BASE, "trailing data after the first JSON value"),
        (BASE + b"\n" + BASE, "trailing data after the first JSON value"),
        (BASE + b" 1", "trailing data after the first JSON value"),
        (b" " * 4097, "larger than 4096 bytes"),
        (BASE + b" " * (4097 - len(BASE)), "larger than 4096 bytes"),
        (b"", "malformed JSON (Expecting value at char 0)"),
        (b"{", "malformed JSON"),
        (BASE[:-1], "malformed JSON"),
        (b"{'version': 1}", "malformed JSON"),
        (b"[1,2]", "not a JSON object"),
        (b'"a string"', "not a JSON object"),
        (b"null", "not a JSON object"),
        (b"{}", "missing field 'version'"),
        (replaced("account", '"account-c"'), "account is not an allowed account"),
        (replaced("account", '"ACCOUNT-A"'), "account is not an allowed account"),
        (replaced("account", '"account-a "'), "account is not an allowed account"),
        (replaced("account", '["account-a"]'), "account is not an allowed account"),
        (replaced("account", "null"), "account is not an allowed account"),
        (replaced("amount_minor", "0"), "amount_minor out of range (1 to 10000)"),
        (replaced("amount_minor", "10001"), "amount_minor out of range (1 to 10000)"),
        (replaced("amount_minor", "-3"), "amount_minor out of range (1 to 10000)"),
        (replaced("amount_minor", "-0"), "amount_minor out of range (1 to 10000)"),
        (replaced("amount_minor", '"500"'), "amount_minor must be a JSON integer"),
        (replaced("amount_minor", "true"), "amount_minor must be a JSON integer"),
        (replaced("amount_minor", "null"), "amount_minor must be a JSON integer"),
        (replaced("amount_minor", "500.0"), "a number has a fraction or exponent"),
        (replaced("amount_minor", "5e2"), "a number has a fraction or exponent"),
        (replaced("amount_minor", "1E2"), "a number has a fraction or exponent"),
        (replaced("amount_minor", "1e400"), "a number has a fraction or exponent"),
        (replaced("amount_minor", "9" * 21), "an integer has more than 20 digits"),
        (replaced("amount_minor", "-" + "9" * 4000), "an integer has more than 20 digits"),
        (replaced("amount_minor", "NaN"), "NaN is not a JSON number"),
        (replaced("amount_minor", "Infinity"), "Infinity is not a JSON number"),
        (replaced("amount_minor", "-Infinity"), "-Infinity is not a JSON number"),
        (replaced("currency", '"USD"'), "currency must be 'CNY'"),
        (replaced("currency", '"cny"'), "currency must be 'CNY'"),
        (replaced("version", "2"), "unsupported version (supported: 1)"),
        (replaced("version", "0"), "unsupported version (supported: 1)"),
        (replaced("version", "true"), "version must be a JSON integer"),
        (replaced("version", '"1"'), "version must be a JSON integer"),
        (replaced("action", '"issue_debit"'), "action must be 'issue_credit'"),
        (BASE.replace(b'"currency":"CNY"', b'"currency":"CNY","currency":"CNY"'), "duplicate"),
        (BASE.replace(b'"version":1', b'"version":1,"version":1'), "duplicate field 'version'"),
        (with_field('"Account":"account-b"'), "unknown field 'Account'"),
        (with_field('"note":"x"'), "unknown field 'note'"),
        (with_field('"a":{"b":1,"b":2}'), "duplicate field 'b'"),
        (b"\xef\xbb\xbf" + BASE, "starts with a UTF-8 byte order mark"),
        (b"\xff\xfe" + BASE, "not valid UTF-8"),
        (BASE.replace(b"account-a", b"account-\xe1"), "not valid UTF-8"),
        (BASE.replace(b"account-a", b"\xed\xa0\x80"), "not valid UTF-8"),  # encoded surrogate
        (BASE.replace(b"account-a", b"account-\xc0\xe1"), "not valid UTF-8"),  # overlong
        (replaced("account", '"\\ud800"'), "lone surrogate"),
        (replaced("account", '"account-a\\udfff"'), "lone surrogate"),
        (with_field('"\\udc00":1'), "lone surrogate"),
        (BASE.replace(b"account-a", b"account-a\x00"), "malformed JSON (Invalid control"),
        (BASE + b"\x00", "trailing data after the first JSON value"),
        (b"\x00" + BASE, "malformed JSON"),
        (replaced("account", '"account-a\\u0000"'), "account is not an allowed account"),
        (b"[" * 17 + b"]" * 17, "JSON nested more than 16 levels deep"),
        (b"[" * 2000 + b"]" * 2000, "JSON nested more than 16 levels deep"),
        (b'{"a":' * 600 + b"1" + b"}" * 600, "JSON nested more than 16 levels deep"),
        (b"[" * 4000, "JSON nested more than 16 levels deep"),
        (b'["' + b"[" * 100 + b'"]', "not a JSON object"),  # brackets in strings don't count
    ],
)
def test_rejections_have_specific_reasons(raw: bytes, reason: str) -> None:
    assert reason in rejected(raw)


@pytest.mark.parametrize(
    ("account", "why"),
    [
        ("\u0430ccount-a", "Cyrillic small a"),
        ("acc\u043eunt-a", "Cyrillic small o"),
        ("\uff41ccount-a", "fullwidth a"),
        ("account-a\u200b", "zero-width space"),
        ("account\u2010a", "Unicode hyphen"),
        ("account-\u0061\u0301", "combining accent"),
        ("\u202eaccount-a", "right-to-left override"),
    ],
)
def test_look_alike_accounts_are_rejected(account: str, why: str) -> None:
    escaped = replaced("account", json.dumps(account))  # as \\uXXXX escapes
    raw_utf8 = replaced("account", json.dumps(account, ensure_ascii=False))
    for raw in (escaped, raw_utf8):
        assert "account is not an allowed account" in rejected(raw), why


def test_valid_surrogate_pair_is_text_but_not_an_account() -> None:
    # A correctly paired escape decodes to one character: not a surrogate problem.
    assert "not an allowed account" in rejected(replaced("account", '"\\ud83d\\ude00"'))


def test_reorder_and_whitespace_do_not_matter() -> None:
    shuffled = json.dumps(dict(reversed(list(FIELDS.items())))).encode()
    spaced = b" \t\r\n" + json.dumps(FIELDS, indent=4).encode() + b"\n"
    escaped = json.dumps(FIELDS, ensure_ascii=True).replace("a", "\\u0061").encode()
    for raw in (shuffled, spaced, escaped):
        assert proposal.admit(raw) == proposal.admit(BASE)


def test_size_bound_is_inclusive_at_4096() -> None:
    exact = BASE + b" " * (proposal.MAX_PROPOSAL_BYTES - len(BASE))
    assert len(exact) == 4096
    assert proposal.admit(exact) == proposal.admit(BASE)
    assert "larger than 4096" in rejected(exact + b" ")


def test_oversized_input_is_rejected_before_decoding() -> None:
    # Invalid UTF-8 and a BOM would give other reasons if they were looked at.
    assert "larger than 4096" in rejected(b"\xef\xbb\xbf\xff" * 4_000_000)


def test_nesting_at_the_limit_is_parsed() -> None:
    depth = proposal.MAX_NESTING - 1
    inside = "[" * depth + "]" * depth
    assert "unknown field 'x'" in rejected(with_field(f'"x":{inside}'))


def test_bytearray_is_accepted_and_str_is_refused() -> None:
    assert proposal.admit(bytearray(BASE)) == proposal.admit(BASE)  # type: ignore[arg-type]
    assert "must be bytes" in rejected(BASE.decode())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("contract", "reason"),
    [
        (
            proposal.ToolContract("credit-service", idempotent=True, authoritative_lookup=False),
            "not the trusted registry's",
        ),
        (
            proposal.ToolContract("evil-service", idempotent=True, authoritative_lookup=True),
            "not the trusted registry's",
        ),
        (
            proposal.ToolContract(
                "credit-service-non-idempotent", idempotent=True, authoritative_lookup=False
            ),
            "not the trusted registry's",
        ),
    ],
)
def test_only_registry_contracts_are_trusted(contract: proposal.ToolContract, reason: str) -> None:
    assert reason in rejected(BASE, contract)


def test_registry_has_no_idempotent_tool_without_lookup() -> None:
    for contract in proposal.TOOL_REGISTRY.values():
        assert not contract.idempotent or contract.authoritative_lookup


def test_every_schema_field_is_checked() -> None:
    """Dropping any one field is refused with its name, so none is optional by accident."""
    for name in FIELDS:
        rest = {k: v for k, v in FIELDS.items() if k != name}
        assert f"missing field {name!r}" in rejected(json.dumps(rest).encode())


def test_long_unknown_field_name_is_truncated_in_reason() -> None:
    reason = rejected(with_field(json.dumps("x" * 3000) + ":1"))
    assert len(reason) < 120
    assert "..." in reason


def test_reason_for_hostile_field_name_is_ascii() -> None:
    reason = rejected(with_field('"\\u202e\\n\\u001b[31m":1'))
    assert "\\u202e" in reason
    assert "\x1b" not in reason
