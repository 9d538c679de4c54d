"""Plans: the admitted, canonical form of a proposal, its fingerprint and effect key.

Pure code: nothing here touches a database or the network.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from lab import errors

SUPPORTED_PLAN_VERSION = 1
ACTION = "issue_credit"
CURRENCY = "CNY"
ACCOUNTS = ("account-a", "account-b")
ACCOUNT_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
MIN_AMOUNT_MINOR = 1
MAX_AMOUNT_MINOR = 10_000

# The proposal schema of the seed: the only shape a model may propose.
PROPOSAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "version": {"const": SUPPORTED_PLAN_VERSION},
        "action": {"const": ACTION},
        "account": {"type": "string", "enum": list(ACCOUNTS)},
        "amount_minor": {
            "type": "integer",
            "minimum": MIN_AMOUNT_MINOR,
            "maximum": MAX_AMOUNT_MINOR,
        },
        "currency": {"const": CURRENCY},
    },
    "required": ["version", "action", "account", "amount_minor", "currency"],
    "additionalProperties": False,
}


def scalar_fields(instance: Any) -> dict[str, Any]:
    """A dataclass whose fields are all scalars (str, int, bool, None) as a new dict.

    ``dataclasses.asdict`` deep-copies every value: it was a sixth of a looping worker's
    CPU, for records that hold nothing to copy.
    """
    return {name: getattr(instance, name) for name in instance.__dataclass_fields__}


def canonical_json(value: Any) -> bytes:
    """Serialise ``value`` deterministically: sorted keys, no spaces, UTF-8."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


@dataclass(frozen=True)
class Plan:
    """An admitted plan. ``idempotent`` comes from the trusted tool registry."""

    version: int
    action: str
    account: str
    amount_minor: int
    currency: str
    idempotent: bool

    def to_json(self) -> dict[str, Any]:
        """The plan as a JSON object, as stored and fingerprinted."""
        return scalar_fields(self)

    def fingerprint(self) -> str:
        """sha256 over the canonical JSON of the whole plan, capabilities included."""
        return hashlib.sha256(b"lab/plan@v1\0" + canonical_json(self.to_json())).hexdigest()

    def validate(self) -> None:
        """Raise ``Rejected`` unless every field is within the admitted range."""
        if type(self.version) is not int or self.version != SUPPORTED_PLAN_VERSION:
            raise errors.Rejected(f"unsupported plan version {self.version!r}")
        if self.action != ACTION:
            raise errors.Rejected("unsupported action")
        # Admission restricts proposals to ACCOUNTS; the store accepts any well-formed
        # account an operator creates, so its events can be shown never to leak one.
        if type(self.account) is not str or not ACCOUNT_PATTERN.fullmatch(self.account):
            raise errors.Rejected("account must be 1-64 letters, digits, '.', '_' or '-'")
        if (
            type(self.amount_minor) is not int
            or not MIN_AMOUNT_MINOR <= self.amount_minor <= MAX_AMOUNT_MINOR
        ):
            raise errors.Rejected(
                f"amount_minor must be an integer from {MIN_AMOUNT_MINOR} to {MAX_AMOUNT_MINOR}"
            )
        if self.currency != CURRENCY:
            raise errors.Rejected(f"currency must be {CURRENCY}")
        if type(self.idempotent) is not bool:
            raise errors.Rejected("idempotent must come from the registry as a boolean")

    @classmethod
    def from_json(cls, value: Any) -> Plan:
        """Rebuild a stored plan; raise ``Rejected`` if the stored shape is not a plan."""
        if not isinstance(value, dict) or set(value) != set(cls.__dataclass_fields__):
            raise errors.Rejected("stored plan has an unexpected shape")
        return cls(**value)


def effect_key(tenant: str, operation: str) -> str:
    """The tool's idempotency key for one operation of one tenant.

    The pair is encoded as a JSON array before hashing, so no choice of
    separators inside the names can make two different pairs collide
    (``("a:b", "c")`` and ``("a", "b:c")`` give different keys).
    """
    digest = hashlib.sha256(b"lab/effect-key@v1\0" + canonical_json([tenant, operation]))
    return "ek1_" + digest.hexdigest()


@dataclass(frozen=True)
class Receipt:
    """The tool's proof that one effect happened for one effect key and plan."""

    receipt_id: str
    effect_key: str
    fingerprint: str

    def to_json(self) -> dict[str, str]:
        """The receipt as stored in the workflow's result."""
        return scalar_fields(self)

    def proves(self, effect_key: str, fingerprint: str) -> bool:
        """True when this receipt is for exactly this effect key and plan fingerprint."""
        return self.effect_key == effect_key and self.fingerprint == fingerprint
