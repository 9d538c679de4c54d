"""Admission under fuzzing.

The property, for every input: ``admit`` either returns a plan that is valid
against the proposal schema, agrees with a standard JSON parser and carries
the registry's capability, or raises ``errors.Rejected`` with a one-line ASCII
reason. Nothing else ever escapes. Where the input is generated from a known
value, an independent oracle also says which of the two must happen.

Examples per test come from the hypothesis profile (tests/conftest.py):
``ci`` by default, ``HYPOTHESIS_PROFILE=long`` for 10,000 per test.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from hypothesis import assume, event, example, given, note
from hypothesis import strategies as st

from lab import errors, harness
from lab.runtime import plan, proposal

FIELDS: dict[str, Any] = harness.sample_proposal()
SEED = json.dumps(FIELDS, separators=(",", ":")).encode()
REGISTRY = list(proposal.TOOL_REGISTRY.values())
LIMIT = proposal.MAX_PROPOSAL_BYTES


def check(raw: bytes, contract: proposal.ToolContract | None = None) -> plan.Plan | None:
    """Admit ``raw`` and check the universal property; return the plan or None."""
    try:
        admitted = proposal.admit(raw, contract)
    except errors.Rejected as exc:
        reason = str(exc)
        assert reason.startswith("proposal rejected: ")
        assert len(reason) > len("proposal rejected: ")
        assert reason.isascii() and reason.isprintable(), reason
        note(reason)
        # For --hypothesis-show-statistics: which reasons the examples reached.
        event(reason.removeprefix("proposal rejected: ").split(" (")[0].split("'")[0][:40])
        return None
    # Admitted: schema-valid, within the size bound, and what a standard parser reads.
    assert len(raw) <= LIMIT
    body = {k: v for k, v in admitted.to_json().items() if k != "idempotent"}
    jsonschema.validate(body, plan.PROPOSAL_SCHEMA)
    assert json.loads(raw) == body
    assert type(admitted.version) is int and type(admitted.amount_minor) is int
    assert admitted.account in plan.ACCOUNTS
    # The capability is the registry's, whatever the proposal said.
    trusted = contract or proposal.TOOL_REGISTRY[proposal.DEFAULT_TOOL]
    assert admitted.idempotent is trusted.idempotent
    admitted.validate()
    event("admitted")
    return admitted


def oracle(value: Any) -> bool:
    """Independently: is this decoded JSON value an admissible proposal?"""
    if not isinstance(value, dict) or set(value) != set(FIELDS):
        return False
    amount = value["amount_minor"]
    return (
        type(value["version"]) is int
        and value["version"] == 1
        and value["action"] == "issue_credit"
        and value["account"] in ("account-a", "account-b")
        and type(amount) is int
        and 1 <= amount <= 10_000
        and value["currency"] == "CNY"
    )


def encode(value: Any, ascii_only: bool) -> bytes:
    # surrogatepass: a lone surrogate becomes an (invalid) encoded surrogate.
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------------------
# Strategies

# Any character, lone surrogates included.
any_text = st.text(st.characters(exclude_categories=()), max_size=12)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
valid_fields = st.fixed_dictionaries(
    {
        "version": st.just(1),
        "action": st.just("issue_credit"),
        "account": st.sampled_from(plan.ACCOUNTS),
        "amount_minor": st.integers(plan.MIN_AMOUNT_MINOR, plan.MAX_AMOUNT_MINOR),
        "currency": st.just("CNY"),
    }
)
field_names = st.sampled_from(sorted(FIELDS))
extra_names = (
    st.sampled_from(sorted(proposal.AUTHORITY_FIELDS))
    | st.sampled_from(["Account", "amount", "amount_minor ", "VERSION", "__proto__", ""])
    | any_text
)
whitespace = st.text(" \t\r\n", max_size=3)
contracts = st.sampled_from(REGISTRY)


def render(pairs: list[tuple[str, Any]], gaps: list[str], ascii_only: bool = True) -> bytes:
    """An object from ``pairs`` (duplicates allowed), with ``gaps`` as whitespace."""
    pad = [*gaps, "", "", "", ""]
    items = [
        f"{pad[i % len(pad)]}{json.dumps(k, ensure_ascii=ascii_only)}:"
        f"{pad[(i + 1) % len(pad)]}{json.dumps(v, ensure_ascii=ascii_only)}"
        for i, (k, v) in enumerate(pairs)
    ]
    text = pad[0] + "{" + ",".join(items) + pad[1] + "}" + pad[2]
    return text.encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------------------
# Arbitrary input


@given(st.binary(max_size=LIMIT + 64), contracts)
def test_arbitrary_bytes(raw: bytes, contract: proposal.ToolContract) -> None:
    check(raw, contract)


@given(json_values, st.booleans())
def test_arbitrary_json(value: Any, ascii_only: bool) -> None:
    raw = encode(value, ascii_only)
    assert (check(raw) is not None) is False or oracle(value)


@given(st.dictionaries(extra_names | field_names, json_values, max_size=7), st.booleans())
@example({**FIELDS}, True)
def test_arbitrary_objects_match_the_oracle(value: dict[str, Any], ascii_only: bool) -> None:
    raw = encode(value, ascii_only)
    admitted = check(raw)
    expected = oracle(value) and len(raw) <= LIMIT
    assert (admitted is not None) == expected


# ---------------------------------------------------------------------------
# Near-valid proposals: one thing changed


@given(valid_fields, st.permutations(sorted(FIELDS)), st.lists(whitespace, max_size=6), contracts)
def test_reordered_and_spaced_valid_proposals_are_admitted(
    fields: dict[str, Any], order: list[str], gaps: list[str], contract: proposal.ToolContract
) -> None:
    raw = render([(k, fields[k]) for k in order], gaps)
    admitted = check(raw, contract)
    assert admitted is not None
    assert admitted.to_json() == {**fields, "idempotent": contract.idempotent}


@given(valid_fields, field_names, json_values, st.booleans())
def test_one_field_changed(fields: dict[str, Any], name: str, value: Any, ascii_only: bool) -> None:
    changed = {**fields, name: value}
    raw = encode(changed, ascii_only)
    assert (check(raw) is not None) == oracle(changed)


RETYPES: list[Callable[[Any], Any]] = [
    str,
    lambda v: [v],
    lambda v: {"value": v},
    lambda v: None,
    lambda v: True,
    lambda v: False,
    lambda v: float(v) if isinstance(v, int) else 0.5,
    lambda v: v.upper() if isinstance(v, str) else -v,
    lambda v: v + " " if isinstance(v, str) else v + 10_000,
]


@given(valid_fields, field_names, st.sampled_from(range(len(RETYPES))))
def test_one_field_retyped(fields: dict[str, Any], name: str, which: int) -> None:
    changed = {**fields, name: RETYPES[which](fields[name])}
    assume(changed != fields)
    raw = encode(changed, True)
    assert (check(raw) is not None) == oracle(changed)


@given(valid_fields, extra_names, json_values, st.integers(0, 5))
def test_one_field_added(fields: dict[str, Any], name: str, value: Any, at: int) -> None:
    assume(name not in fields)
    pairs = list(fields.items())
    pairs.insert(at, (name, value))
    assert check(render(pairs, [])) is None


@given(valid_fields, field_names)
def test_one_field_removed(fields: dict[str, Any], name: str) -> None:
    del fields[name]
    assert check(render(list(fields.items()), [])) is None


@given(valid_fields, field_names, st.integers(0, 5), st.booleans())
def test_one_field_duplicated(fields: dict[str, Any], name: str, at: int, same: bool) -> None:
    pairs = list(fields.items())
    pairs.insert(at, (name, fields[name] if same else "other"))
    with pytest.raises(errors.Rejected, match="duplicate field"):
        proposal.admit(render(pairs, []))


@given(valid_fields, st.integers(0, len(SEED) + 40), st.binary(min_size=1, max_size=3))
def test_bytes_inserted_into_a_valid_proposal(fields: dict[str, Any], at: int, junk: bytes) -> None:
    raw = render(list(fields.items()), [])
    check(raw[:at] + junk + raw[at:])


@given(valid_fields, st.integers(0, len(SEED) + 40), st.integers(1, 4))
def test_bytes_deleted_from_a_valid_proposal(fields: dict[str, Any], at: int, n: int) -> None:
    raw = render(list(fields.items()), [])
    check(raw[:at] + raw[at + n :])


# ---------------------------------------------------------------------------
# Hostile shapes


# opener: (closer, nesting levels each opener adds)
NESTERS = {"[": ("]", 1), '{"a":': ("}", 1), '{"a":[': ("]}", 2), "[{}, ": ("]", 1)}


@given(st.integers(1, 2100), st.sampled_from(sorted(NESTERS)))
def test_deep_nesting(depth: int, opener: str) -> None:
    closer, levels = NESTERS[opener]
    raw = (opener * depth + "1" + closer * depth).encode()
    assert check(raw) is None
    if len(raw) <= LIMIT and depth * levels > proposal.MAX_NESTING:
        with pytest.raises(errors.Rejected, match="nested more than 16"):
            proposal.admit(raw)


@given(valid_fields, st.integers(1, 3000), st.sampled_from(["[", "{"]))
def test_deep_nesting_inside_an_extra_field(fields: dict[str, Any], depth: int, kind: str) -> None:
    inner = (kind * depth).replace("{", '{"k":') + "0" + ("]" if kind == "[" else "}") * depth
    raw = render(list(fields.items()), [])[:-1] + b',"x":' + inner.encode() + b"}"
    assert check(raw) is None


@given(
    valid_fields,
    st.sampled_from(["version", "amount_minor"]),
    st.from_regex(r"-?(0|[1-9][0-9]{0,3999})", fullmatch=True),
)
def test_huge_and_odd_integers(fields: dict[str, Any], name: str, literal: str) -> None:
    raw = render(list(fields.items()), [])
    raw = raw.replace(
        f'"{name}":{json.dumps(fields[name])}'.encode(), f'"{name}":{literal}'.encode()
    )
    admitted = check(raw)
    expected = oracle({**fields, name: int(literal)}) and len(raw) <= LIMIT
    assert (admitted is not None) == expected


@given(
    valid_fields,
    st.sampled_from(["version", "amount_minor"]),
    st.from_regex(
        r"-?(0|[1-9][0-9]{0,400})(\.[0-9]{1,400})?([eE][+-]?[0-9]{1,400})?", fullmatch=True
    )
    | st.sampled_from(["NaN", "Infinity", "-Infinity", "1e2", "5E2", "500.0", "1e400", "-0.0"])
    | st.sampled_from(["true", "false", "null", '"500"', "0x1F4", "+500", ".5", "05", "1_000"]),
)
def test_floats_booleans_and_not_quite_numbers(
    fields: dict[str, Any], name: str, literal: str
) -> None:
    raw = render(list(fields.items()), [])
    raw = raw.replace(
        f'"{name}":{json.dumps(fields[name])}'.encode(), f'"{name}":{literal}'.encode()
    )
    if literal.lstrip("-").isdigit() and not literal.lstrip("-").startswith("0"):
        return  # a plain integer: covered by test_huge_and_odd_integers
    assert check(raw) is None


@given(
    st.binary(max_size=200) | st.just(SEED),
    st.sampled_from([b"\xef\xbb\xbf", b"\xfe\xff", b"\xff\xfe"]),
)
def test_byte_order_marks(raw: bytes, bom: bytes) -> None:
    assert check(bom + raw) is None
    if bom == b"\xef\xbb\xbf":
        with pytest.raises(errors.Rejected, match="byte order mark"):
            proposal.admit(bom + raw)


INVALID_UTF8 = [
    b"\x80",
    b"\xbf",
    b"\xc0\xaf",  # overlong "/"
    b"\xc1\xbf",
    b"\xe0\x80\xaf",  # overlong
    b"\xed\xa0\x80",  # encoded high surrogate
    b"\xed\xbf\xbf",  # encoded low surrogate
    b"\xf4\x90\x80\x80",  # above U+10FFFF
    b"\xf8\x88\x80\x80\x80",
    b"\xfe",
    b"\xff",
    b"\xe2\x82",  # truncated
]


@given(valid_fields, st.integers(0, len(SEED) + 40), st.sampled_from(INVALID_UTF8))
def test_invalid_utf8(fields: dict[str, Any], at: int, junk: bytes) -> None:
    raw = render(list(fields.items()), [])
    with pytest.raises(errors.Rejected, match="not valid UTF-8"):
        proposal.admit(raw[:at] + junk + raw[at:])


surrogate_escapes = st.integers(0xD800, 0xDFFF).map(lambda c: f"\\u{c:04x}")


@given(valid_fields, st.sampled_from(["key", "account", "extra"]), surrogate_escapes)
def test_lone_surrogate_escapes(fields: dict[str, Any], where: str, escape: str) -> None:
    """Decision: a lone surrogate anywhere admission looks is refused with its own reason."""
    raw = render(list(fields.items()), [])
    if where == "account":
        raw = raw.replace(fields["account"].encode(), escape.encode())
    elif where == "key":
        raw = raw[:-1] + f',"{escape}":1}}'.encode()
    else:
        raw = raw[:-1] + f',"note":"x{escape}"}}'.encode()
    with pytest.raises(errors.Rejected, match="lone surrogate"):
        proposal.admit(raw)


@given(valid_fields, st.integers(0, len(SEED) + 40), st.sampled_from([b"\x00", b"\\u0000"]))
def test_nul_bytes(fields: dict[str, Any], at: int, nul: bytes) -> None:
    raw = render(list(fields.items()), [])
    assert check(raw[:at] + nul + raw[at:]) is None


LOOK_ALIKES = {
    "a": ["\u0430", "\uff41", "\u0251", "\u1d00"],
    "c": ["\u0441", "\u217d", "\uff43"],
    "o": ["\u043e", "\u03bf", "\u0585"],
    "u": ["\u057d", "\u03c5"],
    "n": ["\u0578", "\u043f"],
    "t": ["\u0442", "\u03c4"],
    "b": ["\u0432", "\u042c"],
    "-": ["\u2010", "\u2011", "\u2212", "\u2013", "\u00ad"],
}
INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u034f", "\u202e"]


@given(
    st.sampled_from(plan.ACCOUNTS),
    st.data(),
    st.booleans(),
)
def test_look_alike_accounts(account: str, data: st.DataObject, ascii_only: bool) -> None:
    at = data.draw(st.integers(0, len(account) - 1))
    if data.draw(st.booleans()) and account[at] in LOOK_ALIKES:
        fake = (
            account[:at] + data.draw(st.sampled_from(LOOK_ALIKES[account[at]])) + account[at + 1 :]
        )
    else:
        fake = account[:at] + data.draw(st.sampled_from(INVISIBLE)) + account[at:]
    raw = encode({**FIELDS, "account": fake}, ascii_only)
    with pytest.raises(errors.Rejected, match="account is not an allowed account"):
        proposal.admit(raw)


@given(
    valid_fields, st.integers(LIMIT - 16, LIMIT + 16), st.sampled_from(["head", "tail", "inside"])
)
def test_lengths_around_the_bound(fields: dict[str, Any], size: int, where: str) -> None:
    raw = render(list(fields.items()), [])
    pad = b" " * (size - len(raw))
    if where == "head":
        raw = pad + raw
    elif where == "tail":
        raw = raw + pad
    else:
        raw = raw[:1] + pad + raw[1:]
    assert len(raw) == size
    admitted = check(raw)
    assert (admitted is not None) == (size <= LIMIT)


# ---------------------------------------------------------------------------
# Cost: at most linear in the input


def _best_time(raw: bytes, repeat: int = 15) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        with contextlib.suppress(errors.Rejected):
            proposal.admit(raw)
        best = min(best, time.perf_counter() - start)
    return best


SHAPES: dict[str, Callable[[int], bytes]] = {
    "long string": lambda n: b'{"account":"' + b"a" * n + b'"}',
    "many escapes": lambda n: b'{"account":"' + b"\\u0430" * (n // 6) + b'"}',
    "many keys": lambda n: b"{" + b",".join(b'"k%d":1' % i for i in range(n // 8)) + b"}",
    "many numbers": lambda n: b"[" + b"1," * (n // 2) + b"1]",
    "long integer": lambda n: b'{"amount_minor":' + b"9" * n + b"}",
    "long float": lambda n: b'{"amount_minor":1.' + b"9" * n + b"}",
    "nesting": lambda n: b"[" * (n // 2) + b"]" * (n // 2),
    "strings in nesting": lambda n: b'["' + b"[" * n + b'"]',
    "duplicate keys": lambda n: b"{" + b'"a":1,' * (n // 6) + b'"b":1}',
    "whitespace": lambda n: b" " * n + SEED,
    "backslashes": lambda n: b'["' + b"\\\\" * (n // 2) + b'"]',
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_cost_is_at_most_linear(shape: str) -> None:
    """Structural argument first, a loose timing bound second.

    Admission reads at most 4096 bytes and every step is one pass over them
    (strict decode, the nesting scan, the C JSON scanner, hooks that look at
    each key once, a schema check on at most five fields); integer and float
    literals are refused before conversion, so no quadratic bignum parsing.
    The timing check only catches a gross regression: best-of-15 times, a 4x
    larger input may take at most 4x as long times a factor of 8, plus 2 ms
    of slack for a loaded two-core machine.
    """
    small, large = SHAPES[shape](900), SHAPES[shape](3600)
    assert len(large) <= LIMIT
    t_small, t_large = _best_time(small), _best_time(large)
    assert t_large <= 4 * 8 * t_small + 0.002, (shape, t_small, t_large)


def test_oversized_input_costs_the_same_however_large() -> None:
    small = b"\xff" * (LIMIT + 1)
    huge = b"\xff" * (64 * 1024 * 1024)
    assert _best_time(huge, 5) <= 50 * _best_time(small, 5) + 0.002


# ---------------------------------------------------------------------------
# The command line


def plancheck(raw: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "lab.cli", "plancheck"],
        input=raw,
        capture_output=True,
        timeout=60,
        check=False,
    )


def test_plancheck_admits_the_seed_proposal() -> None:
    done = plancheck(SEED)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["next_required_stage"] == "persist_then_wait_for_approval"
    assert out["plan"] == {**FIELDS, "idempotent": True}
    assert out["fingerprint"] == proposal.admit(SEED).fingerprint()
    assert done.stderr == b""


BAD_FOR_CLI = {
    "empty": b"",
    "malformed": b"{",
    "two objects": SEED + SEED,
    "authority": SEED[:-1] + b',"approved":true}',
    "oversized": b" " * (1024 * 1024) + SEED,
    "bom": b"\xef\xbb\xbf" + SEED,
    "invalid utf-8": b"\xff\xfe\xfd",
    "encoded surrogate": b'{"account":"\xed\xa0\x80"}',
    "lone surrogate escape": b'{"\\ud800":1}',
    "nan": SEED.replace(b"500", b"NaN"),
    "huge integer": SEED.replace(b"500", b"9" * 4000),
    "float": SEED.replace(b"500", b"5e2"),
    "deep": b"[" * 4000,
    "nul": b"\x00",
    "hostile name": SEED[:-1] + b',"\\u202e\\u001b[2J\\n":1}',
    "negative amount": SEED.replace(b"500", b"-3"),
}


@pytest.mark.parametrize("name", sorted(BAD_FOR_CLI))
def test_plancheck_rejects_with_one_line_and_no_traceback(name: str) -> None:
    done = plancheck(BAD_FOR_CLI[name])
    assert done.returncode == 1, done
    assert done.stdout == b""
    assert b"Traceback" not in done.stderr
    lines = done.stderr.decode("ascii").splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("proposal rejected: ")
