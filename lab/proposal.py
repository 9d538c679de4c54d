"""Strict admission of untrusted model output into a ``Plan``.

A proposal is data from the model: it may name an account and an amount, and
nothing else. Authority (approval, identity, tenant, endpoints) and tool
capabilities never come from it: capabilities come from ``TOOL_REGISTRY``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn

import jsonschema

from lab import errors
from lab.plan import PROPOSAL_SCHEMA, Plan

MAX_PROPOSAL_BYTES = 4096


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

_VALIDATOR = jsonschema.Draft202012Validator(PROPOSAL_SCHEMA)


def _reject(reason: str) -> NoReturn:
    raise errors.Rejected(f"proposal rejected: {reason}")


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            _reject(f"duplicate field {key!r}")
        seen[key] = value
    return seen


def _no_constant(name: str) -> NoReturn:
    _reject(f"{name} is not JSON")


def _decode(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        _reject("not valid UTF-8")
    try:
        return json.loads(text, object_pairs_hook=_unique_object, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            _reject("more than one JSON value")
        _reject(f"malformed JSON ({exc.msg})")
    except RecursionError:
        _reject("JSON nested too deeply")
    except ValueError as exc:  # for example an integer with too many digits
        _reject(f"malformed JSON ({exc})")


def admit(raw: bytes, contract: ToolContract | None = None) -> Plan:
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
    if len(raw) > MAX_PROPOSAL_BYTES:
        _reject(f"larger than {MAX_PROPOSAL_BYTES} bytes")
    value = _decode(raw)
    if not isinstance(value, dict):
        _reject("not a JSON object")
    problems = sorted(_VALIDATOR.iter_errors(value), key=lambda e: list(e.absolute_path))
    if problems:
        first = problems[0]
        where = "/".join(str(p) for p in first.absolute_path) or "proposal"
        if first.validator == "additionalProperties":
            extra = sorted(set(value) - set(PROPOSAL_SCHEMA["properties"]))
            _reject(f"unknown field {extra[0]!r}" if extra else "unknown field")
        if first.validator == "enum" and where == "account":
            _reject("account is not an allowed account")
        _reject(f"{where}: {first.validator} check failed")
    # JSON Schema counts 500.0 and true as acceptable in places; a plan does not.
    for field in ("version", "amount_minor"):
        if type(value[field]) is not int:
            _reject(f"{field} must be a JSON integer")
    plan = Plan(
        version=value["version"],
        action=value["action"],
        account=value["account"],
        amount_minor=value["amount_minor"],
        currency=value["currency"],
        idempotent=contract.idempotent,
    )
    plan.validate()
    return plan
