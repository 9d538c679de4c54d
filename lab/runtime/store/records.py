"""What the store hands out and takes in: workflow snapshots, actors, a step's result,
and the names of the states and review reasons every transition shares."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from lab.runtime.barrier import StartBarrier
from lab.runtime.plan import Receipt

DEFAULT_MAX_ATTEMPTS = 3
STATES = (
    "waiting_approval",
    "ready",
    "running",
    "unknown",
    "succeeded",
    "cancelled",
    "failed",
    "incompatible",
)
TERMINAL_STATES = frozenset({"succeeded", "cancelled", "failed", "incompatible"})
# The review reason that carries the database's proof that nothing was dispatched.
UNDISPATCHED_REVIEW = "not_dispatched_no_start_barrier"
# Completions that prove their start had no effect: the tool answered 429 or was never reached.
NON_EFFECT_OUTCOMES = ("rate_limited", "unreachable")


@dataclass(frozen=True)
class Finished:
    """A dispatch whose effect the tool confirmed, waiting for its completion to commit."""

    claim: Workflow
    barrier: StartBarrier
    receipt: Receipt


@dataclass(frozen=True)
class Claimed:
    """A workflow claimed by ``complete_and_claim``, with its start barrier when the
    barrier committed in the same transaction (a fused start), else None."""

    workflow: Workflow
    barrier: StartBarrier | None


@dataclass(frozen=True)
class Step:
    """What one ``complete_and_claim`` transaction committed.

    ``completed``: the finished workflows' new snapshots, in the order given;
    ``claims``: the newly claimed workflows, oldest first (empty when nothing was due).
    """

    completed: list[Workflow]
    claims: list[Claimed]


@dataclass(frozen=True)
class Actor:
    """A person acting on a workflow: tenant, subject and role are all checked."""

    tenant: str
    subject: str
    role: str


@dataclass(frozen=True)
class Workflow:
    """A snapshot of one workflow row."""

    id: str
    tenant: str
    operation: str
    proposed_by: str
    plan: dict[str, Any]
    fingerprint: str
    plan_version: int
    effect_key: str
    trace_id: str
    state: str
    approved_by: str
    approval_expires: datetime | None
    owner: str
    fence: int
    attempt: int
    max_attempts: int
    lease_until: datetime | None
    ready_at: datetime
    cancel_requested: bool
    review_reason: str
    result: dict[str, Any] | None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Workflow:
        """Build a snapshot from a ``SELECT *`` row of ``workflows``."""
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})

    @property
    def idempotent(self) -> bool:
        """The registry's capability, persisted in the plan at admission."""
        return self.plan.get("idempotent") is True
