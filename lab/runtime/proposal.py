"""Strict admission of untrusted model output into a ``Plan``.

A proposal is data from the model: it may name an account and an amount, and
nothing else. Authority (approval, identity, tenant, endpoints) and tool
capabilities never come from it: capabilities come from ``TOOL_REGISTRY``.

Admission decisions, in the order they are made (the first failure is the
reason given):

* at most ``MAX_PROPOSAL_BYTES`` bytes, checked before anything is decoded, so
  an oversized input costs nothing however large it is;
* strict UTF-8 (no encoded surrogates, no overlong forms) and no byte order
  mark: RFC 8259 forbids a sender to add one, and a model has no reason to;
* JSON nested at most ``MAX_NESTING`` deep, checked by a linear scan before
  parsing, so the decision never depends on the interpreter's recursion limit;
* exactly one JSON value, with no duplicate keys, no ``NaN``/``Infinity``, no
  number with a fraction or exponent (``500.0`` and ``5e2`` are not integers
  here, though JSON Schema would count them as such) and no integer literal
  longer than ``MAX_INTEGER_DIGITS`` (no valid field needs one, and refusing
  it before conversion keeps parsing linear);
* no string, key or value, holding a lone surrogate: ``"\\ud800"`` is valid
  JSON syntax but decodes to something that is not Unicode text and cannot be
  stored or printed as UTF-8;
* a JSON object with exactly the schema's fields, each of the right JSON type
  and in range, checked field by field for a specific reason, then against
  ``plan.PROPOSAL_SCHEMA`` as the published contract.

Untrusted text is never echoed raw in a reason: field names are shown through
``ascii()`` and truncated, values are never shown, so every reason is one line
of ASCII.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NoReturn

import jsonschema

from lab import errors
from lab.runtime import plan

MAX_PROPOSAL_BYTES = 4096
MAX_NESTING = 16
MAX_INTEGER_DIGITS = 20

_BOM = b"\xef\xbb\xbf"
_FIELDS: tuple[str, ...] = tuple(plan.PROPOSAL_SCHEMA["required"])
# Fields a model might try to smuggle authority through. Any unknown field is
# refused; these get a reason that says why it matters.
AUTHORITY_FIELDS = frozenset(
    {
        "actor",
        "approved",
        "approved_by",
        "approval",
        "capability",
        "endpoint",
        "fingerprint",
        "idempotent",
        "role",
        "tenant",
        "tool",
    }
)


@dataclass(frozen=True)
class ToolContract:
    """What the operator, not the model, knows about a tool."""

    name: str
    idempotent: bool
    authoritative_lookup: bool


# The trusted registry: the only source of tool capabilities.
TOOL_REGISTRY: dict[str, ToolContract] = {
    "credit-service": ToolContract(
        name="credit-service", idempotent=True, authoritative_lookup=True
    ),
    "credit-service-non-idempotent": ToolContract(
        name="credit-service-non-idempotent", idempotent=False, authoritative_lookup=False
    ),
}
DEFAULT_TOOL = "credit-service"

_VALIDATOR = jsonschema.Draft202012Validator(plan.PROPOSAL_SCHEMA)
# Structural characters for the nesting scan; everything else is skipped in C.
_STRUCTURE = re.compile(r'[\[\]{}"\\]')


def _reject(reason: str) -> NoReturn:
    raise errors.Rejected(f"proposal rejected: {reason}")


def _shown(name: str) -> str:
    """An untrusted name as one short line of ASCII, for a reason."""
    return ascii(name[:40]) + ("..." if len(name) > 40 else "")


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False  # a lone surrogate from a \\udXXX escape
    return True


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if not _is_text(key) or (isinstance(value, str) and not _is_text(value)):
            _reject("a string holds a lone surrogate escape, which is not Unicode text")
        if key in seen:
            _reject(f"duplicate field {_shown(key)}")
        seen[key] = value
    return seen


def _no_constant(name: str) -> NoReturn:
    _reject(f"{name} is not a JSON number")


def _no_float(literal: str) -> NoReturn:
    _reject("a number has a fraction or exponent; proposal numbers are plain integers")


def _short_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INTEGER_DIGITS:
        _reject(f"an integer has more than {MAX_INTEGER_DIGITS} digits")
    return int(literal)


def _nesting(text: str) -> int:
    """Deepest array/object nesting in ``text``, ignoring brackets inside strings.

    One pass over the structural characters, so linear in the input. The scan
    need not validate syntax: the parser does that afterwards.
    """
    depth = deepest = 0
    in_string = False
    skip = -1  # the offset of a character escaped by a backslash
    for match in _STRUCTURE.finditer(text):
        at = match.start()
        if at == skip:
            continue
        char = match.group()
        if in_string:
            if char == "\\":
                skip = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _decode(raw: bytes) -> Any:
    if raw.startswith(_BOM):
        _reject("starts with a UTF-8 byte order mark")
    try:
        text = raw.decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        _reject("not valid UTF-8")
    if _nesting(text) > MAX_NESTING:
        _reject(f"JSON nested more than {MAX_NESTING} levels deep")
    try:
        return json.loads(
            text,
            object_pairs_hook=_unique_object,
            parse_constant=_no_constant,
            parse_float=_no_float,
            parse_int=_short_int,
        )
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            _reject("trailing data after the first JSON value")
        _reject(f"malformed JSON ({exc.msg.removesuffix(' at')} at char {exc.pos})")
    except RecursionError:  # unreachable after the nesting scan; kept as a backstop
        _reject("JSON nested too deeply")


def _check_fields(value: dict[str, Any]) -> None:
    """Give the specific reason a decoded object is not a proposal, if it is not."""
    unknown = sorted(set(value) - set(_FIELDS))
    for name in unknown:
        if name in AUTHORITY_FIELDS:
            _reject(f"field {name!r} carries authority, which a proposal cannot grant")
    if unknown:
        _reject(f"unknown field {_shown(unknown[0])}")
    for name in _FIELDS:
        if name not in value:
            _reject(f"missing field {name!r}")
    version = value["version"]
    if type(version) is not int:
        _reject("version must be a JSON integer")
    if version != plan.SUPPORTED_PLAN_VERSION:
        _reject(f"unsupported version (supported: {plan.SUPPORTED_PLAN_VERSION})")
    if value["action"] != plan.ACTION:
        _reject(f"action must be {plan.ACTION!r}")
    if value["account"] not in plan.ACCOUNTS or type(value["account"]) is not str:
        _reject("account is not an allowed account")
    amount = value["amount_minor"]
    if type(amount) is not int:
        _reject("amount_minor must be a JSON integer")
    if not plan.MIN_AMOUNT_MINOR <= amount <= plan.MAX_AMOUNT_MINOR:
        _reject(f"amount_minor out of range ({plan.MIN_AMOUNT_MINOR} to {plan.MAX_AMOUNT_MINOR})")
    if value["currency"] != plan.CURRENCY:
        _reject(f"currency must be {plan.CURRENCY!r}")
    # The published contract is the schema: it must agree with the checks above.
    if not _VALIDATOR.is_valid(value):
        _reject("not valid against the proposal schema")


def admit(raw: bytes, contract: ToolContract | None = None) -> plan.Plan:
    """Admit one untrusted proposal, or raise ``errors.Rejected`` with the reason.

    The bytes must hold exactly one JSON object of at most 4096 bytes, with no
    duplicate or unknown fields, valid against the proposal schema. The plan's
    capabilities are taken from ``contract`` (the registry's default tool when
    omitted), never from the proposal.
    """
    if contract is None:
        contract = TOOL_REGISTRY[DEFAULT_TOOL]
    if TOOL_REGISTRY.get(contract.name) != contract:
        _reject("tool contract is not the trusted registry's")
    if contract.idempotent and not contract.authoritative_lookup:
        _reject("an idempotent tool needs an authoritative lookup")
    if not isinstance(raw, bytes | bytearray):
        _reject("a proposal must be bytes")
    if len(raw) > MAX_PROPOSAL_BYTES:
        _reject(f"larger than {MAX_PROPOSAL_BYTES} bytes")
    value = _decode(bytes(raw))
    if not isinstance(value, dict):
        _reject("not a JSON object")
    _check_fields(value)
    admitted = plan.Plan(
        version=value["version"],
        action=value["action"],
        account=value["account"],
        amount_minor=value["amount_minor"],
        currency=value["currency"],
        idempotent=contract.idempotent,
    )
    admitted.validate()
    return admitted
