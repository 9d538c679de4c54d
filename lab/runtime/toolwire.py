"""What the credit tool and its client agree on: the paths, the headers, the effect body.

Both sides import these names, so a header renamed on one side is renamed on the other.
The service (``lab.runtime.tool``) validates a request body with ``valid_effect_body``
(a batch's with ``batch_items``); the client (``lab.runtime.toolclient``) writes bodies
with ``EFFECT_FIELDS`` and ``ITEM_FIELDS``.

A batch (``POST /effects/batch``) carries several effect requests in one HTTP request:
``{"items": [item, ...]}``, each item an effect body plus what the single request sends
in its headers (``fence``, and optionally ``start_id`` and ``traceparent``). The reply
is ``{"results": [{"status": S, "body": B}, ...]}``, one per item in order, each the
status and body the single ``POST /effects`` would have answered.
"""

from __future__ import annotations

import re

MAX_BODY_BYTES = 4096
EFFECTS_PATH = "/effects"
BATCH_PATH = "/effects/batch"
# The most items one batch request carries (a looping worker's whole batch, at most
# ``protocol.MAX_BATCH``), and the most bytes of its body: each item's effect body at its
# largest plus its start's fields.
MAX_BATCH_ITEMS = 64
MAX_BATCH_BODY_BYTES = MAX_BATCH_ITEMS * (MAX_BODY_BYTES + 256)
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

ITEM_FIELDS: dict[str, type] = {"fence": int, "start_id": str, "traceparent": str}
"""A batch item's fields beyond ``EFFECT_FIELDS``: its start's, sent in headers alone."""

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


def batch_items(body: object) -> list[dict[str, object]] | str:
    """The items of a batch request body, or why it is refused (one line).

    A batch is refused as a whole, with nothing written, unless every item is a valid
    effect body (``valid_effect_body``) with at most the fields of ``ITEM_FIELDS``: a fence
    of ``FENCE``'s form, a start id of ``START_ID``'s and a ``traceparent``.
    """
    if not isinstance(body, dict) or set(body) != {"items"}:
        return "a batch body is {\"items\": [...]} and nothing else"
    items = body["items"]
    if not isinstance(items, list) or not 0 < len(items) <= MAX_BATCH_ITEMS:
        return f"items must be a list of 1 to {MAX_BATCH_ITEMS} effect requests"
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            return f"item {index} is not an object"
        extra = {name: item[name] for name in ITEM_FIELDS if name in item}
        effect = {name: value for name, value in item.items() if name not in ITEM_FIELDS}
        if not valid_effect_body(effect):
            return f"item {index} is not a valid effect request"
        for name, value in extra.items():
            if type(value) is not ITEM_FIELDS[name]:
                return f"item {index}: {name} has the wrong type"
        fence = extra.get("fence")
        if fence is not None and not FENCE.fullmatch(str(fence)):
            return f"item {index}: fence out of range"
        start = extra.get("start_id")
        if start is not None and not START_ID.fullmatch(str(start)):
            return f"item {index}: malformed start_id"
        trace = extra.get("traceparent")
        if trace is not None and not TRACEPARENT.fullmatch(str(trace)):
            return f"item {index}: malformed traceparent"
    return items
