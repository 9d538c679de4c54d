"""A GBNF grammar for the proposal, with the schema's ranges written out.

llama-cpp-python's own JSON-schema converter drops ``minimum`` and ``maximum``,
so a grammar built by it lets a model write ``"amount_minor": -3``. This module
derives the grammar from ``plan.PROPOSAL_SCHEMA`` itself: constants become
literals, enums alternatives, and an integer range an explicit union of digit
sequences (``1..10000`` is ``[1-9] | [1-9] [0-9] | ... | "10000"``).

The grammar fixes the members in the schema's ``required`` order, allows a
little whitespace after ``{``, ``:`` and ``,`` and before ``}``, and nothing
else, so its longest sentence is short and known (``max_chars``). It
constrains syntax and ranges; whether the values match the request is still
for admission and the report to judge. Pure code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lab.runtime import plan

# An inclusive class of decimal digits: ("5", "5") is the digit 5, ("0", "9") any digit.
Digits = tuple[str, str]

# Whitespace is bounded so that a grammar-constrained generation cannot wander
# off into unbounded spaces and end on the token budget instead of the grammar.
MAX_WS = 6
_WS_CHARS = "[ \\t\\n]"


def _same_length(low: str, high: str) -> list[tuple[Digits, ...]]:
    """Digit sequences matching exactly the numbers low..high, both of one length."""
    if not low:
        return [()]
    if low[0] == high[0]:
        return [((low[0], low[0]), *rest) for rest in _same_length(low[1:], high[1:])]
    n = len(low) - 1
    if low[1:] == "0" * n and high[1:] == "9" * n:
        return [((low[0], high[0]), *(("0", "9"),) * n)]
    out: list[tuple[Digits, ...]] = []
    if low[1:] == "0" * n:
        first = low[0]
    else:
        out += [((low[0], low[0]), *rest) for rest in _same_length(low[1:], "9" * n)]
        first = chr(ord(low[0]) + 1)
    if high[1:] == "9" * n:
        last, tail = high[0], []
    else:
        last = chr(ord(high[0]) - 1)
        tail = [((high[0], high[0]), *rest) for rest in _same_length("0" * n, high[1:])]
    if first <= last:
        out.append(((first, last), *(("0", "9"),) * n))
    return out + tail


def integer_range(low: int, high: int) -> list[tuple[Digits, ...]]:
    """Digit sequences whose union is exactly the decimal numerals of low..high.

    Numerals are canonical: no sign, no leading zero. Negative bounds are not
    needed by the proposal and raise ``ValueError`` rather than being guessed.
    """
    if low < 0 or high < low:
        raise ValueError(f"unsupported integer range {low}..{high}")
    out: list[tuple[Digits, ...]] = []
    for length in range(len(str(low)), len(str(high)) + 1):
        first = max(low, 10 ** (length - 1) if length > 1 else 0)
        last = min(high, 10**length - 1)
        out += _same_length(str(first), str(last))
    return out


def _quote(text: str) -> str:
    """A GBNF string literal matching ``text`` exactly."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _sequence_gbnf(sequence: tuple[Digits, ...]) -> str:
    parts: list[str] = []
    literal = ""
    for low, high in sequence:
        if low == high:
            literal += low
            continue
        if literal:
            parts.append(_quote(literal))
            literal = ""
        parts.append(f"[{low}-{high}]")
    if literal:
        parts.append(_quote(literal))
    return " ".join(parts)


@dataclass(frozen=True)
class _Value:
    gbnf: str
    max_chars: int


def _json_literal(value: Any) -> str:
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"))


def _value(name: str, spec: dict[str, Any]) -> _Value:
    """The GBNF alternatives of one property, refusing any keyword it does not encode."""
    keys = set(spec) - {"type"}
    if keys == {"const"}:
        text = _json_literal(spec["const"])
        return _Value(_quote(text), len(text))
    if keys == {"enum"}:
        texts = [_json_literal(v) for v in spec["enum"]]
        return _Value(" | ".join(_quote(t) for t in texts), max(map(len, texts)))
    if spec.get("type") == "integer" and keys == {"minimum", "maximum"}:
        sequences = integer_range(spec["minimum"], spec["maximum"])
        return _Value(" | ".join(map(_sequence_gbnf, sequences)), len(str(spec["maximum"])))
    raise ValueError(f"cannot encode schema of {name!r} as a grammar: {sorted(spec)}")


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar and the length of its longest sentence in characters."""

    gbnf: str
    max_chars: int


def from_schema(schema: dict[str, Any]) -> Grammar:
    """Build the GBNF grammar of a flat object schema whose members are all required.

    Raises ``ValueError`` for any schema feature the grammar would not
    enforce, so a change of the schema cannot silently loosen the grammar.
    """
    properties: dict[str, Any] = schema["properties"]
    required: list[str] = schema["required"]
    if (
        schema.get("type") != "object"
        or schema.get("additionalProperties") is not False
        or sorted(required) != sorted(properties)
        or set(schema) - {"type", "properties", "required", "additionalProperties"}
    ):
        raise ValueError("only closed objects with every member required are encoded")
    rules = []
    members = []
    max_chars = 2 + MAX_WS  # the braces and the whitespace before "}"
    for index, name in enumerate(required):
        rule = "v-" + name.replace("_", "-")
        value = _value(name, properties[name])
        rules.append(f"{rule} ::= {value.gbnf}")
        key = _json_literal(name)
        separator = ' "," ws ' if index else " "
        members.append(f"{separator}{_quote(key + ':')} ws {rule}")
        # ws after "{" or ",", the key, the colon, ws, the value, and a comma if not first.
        max_chars += MAX_WS + len(key) + 1 + MAX_WS + value.max_chars + (1 if index else 0)
    # Nested rather than six optional items in a row: one parse per input, not many.
    ws = ""
    for _ in range(MAX_WS):
        ws = f"({_WS_CHARS} {ws})?" if ws else f"{_WS_CHARS}?"
    lines = [
        'root ::= "{" ws' + "".join(members) + ' ws "}"',
        *rules,
        f"ws ::= {ws}",
    ]
    return Grammar(gbnf="\n".join(lines) + "\n", max_chars=max_chars)


PROPOSAL = from_schema(plan.PROPOSAL_SCHEMA)
