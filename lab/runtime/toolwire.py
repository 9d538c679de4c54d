"""What the credit tool and its client agree on: the paths, the headers, the effect body.

Both sides import these names, so a header renamed on one side is renamed on the other.
The service (``lab.runtime.tool``) validates a request body with ``valid_effect_body``;
the client (``lab.runtime.toolclient``) writes bodies with ``EFFECT_FIELDS``.
"""

from __future__ import annotations

import re

MAX_BODY_BYTES = 4096
EFFECTS_PATH = "/effects"
START_HEADER = "Lab-Start-Id"
# The fence of the start that sent an effect request; the ledger refuses a write of a key
# whose fenced lookup already answered "absent" at that fence or a later one.
FENCE_HEADER = "Lab-Fence"
FENCE = re.compile(r"[0-9]{1,18}")
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-[0-9a-f]{16}-0[01]")
START_ID = re.compile(r"st1_[0-9a-f]{32}")

EFFECT_FIELDS: dict[str, type] = {
    "effect_key": str,
    "fingerprint": str,
    "account": str,
    "amount_minor": int,
    "currency": str,
}
"""The fields of an effect request's JSON body, and each one's type."""

# The ledger's bigint: a larger amount is refused here (422), not by the database, where
# it would fail the whole group of requests it was written with.
MAX_AMOUNT_MINOR = 2**63 - 1


def valid_effect_body(body: object) -> bool:
    """Whether ``body`` is an effect request the ledger can store: exactly the fields of
    ``EFFECT_FIELDS``, texts of 1 to 200 storable characters, a positive bigint amount."""
    if not isinstance(body, dict) or set(body) != set(EFFECT_FIELDS):
        return False
    for name, kind in EFFECT_FIELDS.items():
        value = body[name]
        if type(value) is not kind:
            return False
        if isinstance(value, str) and not (0 < len(value) <= 200 and storable(value)):
            return False
    amount: int = body["amount_minor"]
    return 0 < amount <= MAX_AMOUNT_MINOR


def storable(text: str) -> bool:
    """Whether PostgreSQL's text can hold ``text``: UTF-8 (no lone surrogate), no NUL."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
