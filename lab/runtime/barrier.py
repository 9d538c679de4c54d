"""Start barriers and completions: the durable record of intent before a dispatch.

Pure code. A start barrier says "attempt A of workflow W under fence F is
about to call the tool with effect key K for plan P, in trace T". It is
committed, with its audit event and the transition, before the tool is
called, so after any crash the database proves whether a dispatch could
have happened. Every record carries a sha256 digest over its canonical JSON
with a domain-separation prefix, and is verified whenever it is read: a
mismatch fails closed.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

from lab import errors
from lab.runtime.plan import canonical_json, scalar_fields

BARRIER_DOMAIN = b"lab/start-barrier@v1\0"
COMPLETION_DOMAIN = b"lab/completion@v1\0"
START_ID_DOMAIN = b"lab/start-id@v1\0"
SPAN_DOMAIN = b"lab/span-id@v1\0"

# Failure completions carry fixed facts: an outcome and its fixed summary,
# never the tool's own (untrusted, possibly sensitive) text.
FAILURE_FACTS: dict[str, str] = {
    "rate_limited": "Tool answered 429: no effect; retry scheduled",
    "rate_limited_budget_spent": "Tool answered 429 on the last allowed attempt: no effect",
    "rejected": "Tool refused the request: no effect",
    "unreachable": "Tool could not be reached: request never delivered",
}
SUCCESS_SUMMARY = "Tool performed the effect and returned a matching receipt"


def start_id(workflow_id: str, fence: int) -> str:
    """The start's identity: one per workflow and fence, so a replay finds it again."""
    digest = hashlib.sha256(START_ID_DOMAIN + canonical_json([workflow_id, fence]))
    return "st1_" + digest.hexdigest()[:32]


def span_id(start: str) -> str:
    """A W3C span id (8 bytes, hex) derived from the start id, stable under replay."""
    span = hashlib.sha256(SPAN_DOMAIN + start.encode()).hexdigest()[:16]
    return span if span != "0" * 16 else "0" * 15 + "1"


def traceparent(trace_id: str, span: str) -> str:
    """The W3C ``traceparent`` header value for a sampled span."""
    return f"00-{trace_id}-{span}-01"


def _digest(domain: bytes, record: dict[str, Any]) -> str:
    return hashlib.sha256(domain + canonical_json(record)).hexdigest()


@dataclass(frozen=True)
class StartBarrier:
    """The committed intent to dispatch one attempt."""

    start_id: str
    workflow_id: str
    fence: int
    attempt: int
    effect_key: str
    fingerprint: str
    trace_id: str
    span_id: str

    @classmethod
    def for_claim(
        cls,
        workflow_id: str,
        fence: int,
        attempt: int,
        effect_key: str,
        fingerprint: str,
        trace_id: str,
    ) -> StartBarrier:
        """The barrier a claim would write: every field derived from the claim."""
        start = start_id(workflow_id, fence)
        return cls(start, workflow_id, fence, attempt, effect_key, fingerprint, trace_id,
                   span_id(start))

    def record(self) -> dict[str, Any]:
        """The canonical content the digest covers."""
        return scalar_fields(self)

    def digest(self) -> str:
        """sha256 over the domain prefix and the canonical record."""
        return _digest(BARRIER_DOMAIN, self.record())

    def verify(self, stored_digest: str, audit_event: int | None) -> None:
        """Fail closed unless the stored digest matches and the audit binding exists."""
        if not hmac.compare_digest(stored_digest, self.digest()):
            raise errors.IntegrityFailure("start barrier digest does not match its record")
        if audit_event is None:
            raise errors.IntegrityFailure("start barrier has no audit event binding")


@dataclass(frozen=True)
class Completion:
    """How one start ended: success bound to a receipt, or a failure with fixed facts."""

    start_id: str
    barrier_digest: str
    outcome: str
    summary: str
    receipt_id: str | None

    @classmethod
    def success(cls, barrier: StartBarrier, receipt_id: str) -> Completion:
        """A success bound to the barrier's digest and the tool's receipt."""
        return cls(barrier.start_id, barrier.digest(), "succeeded", SUCCESS_SUMMARY, receipt_id)

    @classmethod
    def failure(cls, barrier: StartBarrier, outcome: str) -> Completion:
        """A failure with the fixed facts of ``outcome``."""
        if outcome not in FAILURE_FACTS:
            raise errors.Rejected(f"unknown failure outcome {outcome!r}")
        return cls(barrier.start_id, barrier.digest(), outcome, FAILURE_FACTS[outcome], None)

    def record(self) -> dict[str, Any]:
        """The canonical content the digest covers."""
        return scalar_fields(self)

    def digest(self) -> str:
        """sha256 over the domain prefix and the canonical record."""
        return _digest(COMPLETION_DOMAIN, self.record())

    def verify(self, stored_digest: str, barrier: StartBarrier) -> None:
        """Fail closed unless the digest matches and the completion binds this barrier."""
        if not hmac.compare_digest(stored_digest, self.digest()):
            raise errors.IntegrityFailure("completion digest does not match its record")
        if self.barrier_digest != barrier.digest() or self.start_id != barrier.start_id:
            raise errors.IntegrityFailure("completion is not bound to its start barrier")
