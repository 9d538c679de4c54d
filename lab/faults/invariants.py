"""The invariant checker: what must hold of a finished run, whatever happened during it.

Pure functions over plain data (``History``): the final workflow rows, the
whole audit-event history and the tool's ledger. Nothing here calls the
worker, the store's transitions or the tool, so a bug in those cannot hide
itself from the check; ``load`` reads the tables through ``store.history_rows``,
a read-only snapshot that never goes through a transition. Each rule returns
``Violation`` records that name the workflow and the effect key concerned::

    duplicate_effect          more than one ledger row for one effect key
    effect_without_owner      an effect no succeeded/unknown workflow of that key and plan owns
    tool_mode_mismatch        an effect written by a tool whose mode differs from the plan's
    replayed_dispatch         a non-idempotent workflow dispatched again without a definite
                              non-effect (a 429 or unreachable tool) or a person's forced
                              requeue in between, or performed more than once in the ledger
    stale_completion          a completion not written under the current, still open claim
    lost_workflow             a workflow neither terminal nor awaiting review with a reason
    budget_overrun            more attempts (or claims) than the workflow's budget
    succeeded_without_effect  a succeeded workflow without exactly one matching ledger row
                              whose receipt is the stored result
    lost_after_restart        a write the system acknowledged is missing: an outcome a
                              worker saw committed that the final row does not carry, or
                              a ledger effect whose start barrier (committed before every
                              dispatch) is not in the database
    write_after_absent        an effect from a start at a fence that a fenced lookup of its
                              key had answered "absent" for (it landed after the answer, or
                              the answer missed it): "absent" was not final
    false_outcome             a workflow that ended failed, cancelled or incompatible while
                              an effect of its key and plan is in the ledger
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lab import protocol
from lab.runtime import store

# Repeated here, not imported from ``store``: the checker states its own idea of "finished".
TERMINAL_STATES = frozenset({"succeeded", "cancelled", "failed", "incompatible"})
# Where an effect may legitimately sit: recorded, or awaiting a person's decision.
EFFECT_OWNER_STATES = frozenset({"succeeded", "unknown"})
# Event kinds that end a claim: after one of them no write may use that claim's fence.
CLAIM_ENDING_KINDS = frozenset(
    {
        "completed",
        "unknown",
        "lease_expired",
        "retry_scheduled",
        "failed",
        "cancelled",
        "approval_expired",
    }
)

DUPLICATE_EFFECT = "duplicate_effect"
EFFECT_WITHOUT_OWNER = "effect_without_owner"
TOOL_MODE_MISMATCH = "tool_mode_mismatch"
REPLAYED_DISPATCH = "replayed_dispatch"
STALE_COMPLETION = "stale_completion"
LOST_WORKFLOW = "lost_workflow"
BUDGET_OVERRUN = "budget_overrun"
SUCCEEDED_WITHOUT_EFFECT = "succeeded_without_effect"
LOST_AFTER_RESTART = "lost_after_restart"
WRITE_AFTER_ABSENT = "write_after_absent"
FALSE_OUTCOME = "false_outcome"
KINDS = (
    DUPLICATE_EFFECT,
    EFFECT_WITHOUT_OWNER,
    TOOL_MODE_MISMATCH,
    REPLAYED_DISPATCH,
    STALE_COMPLETION,
    LOST_WORKFLOW,
    BUDGET_OVERRUN,
    SUCCEEDED_WITHOUT_EFFECT,
    LOST_AFTER_RESTART,
    WRITE_AFTER_ABSENT,
    FALSE_OUTCOME,
)


@dataclass(frozen=True)
class WorkflowFact:
    """A workflow's final row, reduced to what the invariants read."""

    id: str
    state: str
    idempotent: bool
    effect_key: str
    fingerprint: str
    fence: int
    attempt: int
    max_attempts: int
    review_reason: str = ""
    result: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class EventFact:
    """One audit event; ``seq`` orders the history."""

    seq: int
    workflow_id: str
    kind: str
    fence: int
    detail: str = ""


@dataclass(frozen=True)
class EffectFact:
    """One row of the tool's ledger."""

    seq: int
    effect_key: str
    fingerprint: str
    receipt: str
    idempotent: bool
    start_id: str | None = None
    fence: int = 0


@dataclass(frozen=True)
class AbsenceFact:
    """A fenced lookup's tombstone: "absent" was answered for ``effect_key`` at fences up
    to ``closed_through``."""

    effect_key: str
    closed_through: int


@dataclass(frozen=True)
class BarrierFact:
    """One committed start barrier: the intent recorded before a dispatch."""

    start_id: str
    workflow_id: str
    fence: int


@dataclass(frozen=True)
class Acknowledged:
    """An outcome a worker was told was committed (seen outside the database)."""

    workflow_id: str
    state: str
    fence: int


@dataclass(frozen=True)
class History:
    """Everything the checker reads: final workflows, every event, every ledger row.

    ``barriers`` are the committed start barriers; ``acknowledged`` are outcomes
    reported by workers after their commit returned (empty when nobody recorded any).
    """

    workflows: Sequence[WorkflowFact]
    events: Sequence[EventFact]
    effects: Sequence[EffectFact]
    barriers: Sequence[BarrierFact] = ()
    acknowledged: Sequence[Acknowledged] = ()
    absences: Sequence[AbsenceFact] = ()


@dataclass(frozen=True)
class Violation:
    """One broken invariant, naming the workflow and/or effect key concerned."""

    kind: str
    workflow_id: str
    effect_key: str
    detail: str

    def to_json(self) -> dict[str, str]:
        """The violation as a JSON object."""
        return asdict(self)


def _events_by_workflow(history: History) -> dict[str, list[EventFact]]:
    grouped: dict[str, list[EventFact]] = defaultdict(list)
    for event in sorted(history.events, key=lambda e: e.seq):
        grouped[event.workflow_id].append(event)
    return grouped


def _effects_by_key(history: History) -> dict[str, list[EffectFact]]:
    grouped: dict[str, list[EffectFact]] = defaultdict(list)
    for effect in sorted(history.effects, key=lambda e: e.seq):
        grouped[effect.effect_key].append(effect)
    return grouped


def _owner_ids(history: History) -> dict[str, str]:
    return {wf.effect_key: wf.id for wf in history.workflows}


def duplicate_effects(history: History) -> list[Violation]:
    """At most one ledger effect per effect key."""
    owners = _owner_ids(history)
    return [
        Violation(
            DUPLICATE_EFFECT,
            owners.get(key, ""),
            key,
            f"{len(rows)} ledger rows (receipts {', '.join(r.receipt for r in rows)})",
        )
        for key, rows in _effects_by_key(history).items()
        if len(rows) > 1
    ]


def effects_without_owner(history: History) -> list[Violation]:
    """Every effect belongs to a workflow of its key and plan that succeeded or awaits review."""
    by_key = {wf.effect_key: wf for wf in history.workflows}
    found: list[Violation] = []
    for effect in sorted(history.effects, key=lambda e: e.seq):
        owner = by_key.get(effect.effect_key)
        if owner is None:
            problem = "no workflow has this effect key"
        elif owner.fingerprint != effect.fingerprint:
            problem = "ledger fingerprint differs from the workflow's plan"
        elif owner.state not in EFFECT_OWNER_STATES:
            problem = f"owning workflow ended {owner.state}"
        else:
            continue
        found.append(
            Violation(
                EFFECT_WITHOUT_OWNER,
                owner.id if owner else "",
                effect.effect_key,
                f"receipt {effect.receipt}: {problem}",
            )
        )
    return found


def tool_mode_mismatches(history: History) -> list[Violation]:
    """An effect is written by a tool of the mode the plan was admitted with."""
    by_key = {wf.effect_key: wf for wf in history.workflows}
    return [
        Violation(
            TOOL_MODE_MISMATCH,
            owner.id,
            effect.effect_key,
            f"plan idempotent={owner.idempotent}, ledger row idempotent={effect.idempotent}",
        )
        for effect in history.effects
        if (owner := by_key.get(effect.effect_key)) is not None
        and owner.idempotent != effect.idempotent
    ]


def replayed_dispatches(history: History) -> list[Violation]:
    """No non-idempotent workflow is dispatched twice.

    A second ``dispatching`` event is allowed only after the previous dispatch
    ended in a definite non-effect: a ``retry_scheduled`` event under the same
    fence (the tool answered 429 or was never reached), or a person's
    ``forced_requeue`` under that fence (a decision audited with its reason:
    the person, not the runtime, vouched that nothing happened). Whatever
    anyone decided, the ledger must hold at most one row for the workflow's key.
    """
    events = _events_by_workflow(history)
    effects = _effects_by_key(history)
    found: list[Violation] = []
    for wf in history.workflows:
        if wf.idempotent:
            continue
        pending: int | None = None  # fence of a dispatch that may have taken effect
        for event in events.get(wf.id, []):
            if event.kind == "dispatching":
                if pending is not None:
                    found.append(
                        Violation(
                            REPLAYED_DISPATCH,
                            wf.id,
                            wf.effect_key,
                            f"dispatch at fence {event.fence} (event {event.seq}) after an "
                            f"unresolved dispatch at fence {pending}",
                        )
                    )
                pending = event.fence
            elif event.fence == pending and (
                event.kind in ("retry_scheduled", "forced_requeue")
                or (event.kind == "reconciled" and event.detail.startswith(protocol.FENCED_ABSENT))
            ):
                # A 429, an unreachable tool, a person's decision, or a fenced lookup's
                # proof of absence: the dispatch at that fence took no effect.
                pending = None
        rows = effects.get(wf.effect_key, [])
        if len(rows) > 1:
            found.append(
                Violation(
                    REPLAYED_DISPATCH,
                    wf.id,
                    wf.effect_key,
                    f"non-idempotent effect performed {len(rows)} times",
                )
            )
    return found


def stale_completions(history: History) -> list[Violation]:
    """Each completion carries the fence of the last claim before it, and that claim was open."""
    keys = {wf.id: wf.effect_key for wf in history.workflows}
    found: list[Violation] = []
    for workflow_id, events in _events_by_workflow(history).items():
        claim_fence: int | None = None
        claim_open = False
        for event in events:
            if event.kind == "claimed":
                claim_fence, claim_open = event.fence, True
                continue
            current = claim_open and event.fence == claim_fence
            if event.kind == "completed" and not current:
                state = "none" if claim_fence is None else str(claim_fence)
                found.append(
                    Violation(
                        STALE_COMPLETION,
                        workflow_id,
                        keys.get(workflow_id, ""),
                        f"completion event {event.seq} at fence {event.fence}; last claim "
                        f"fence {state}, {'open' if claim_open else 'already ended'}",
                    )
                )
            if event.kind in CLAIM_ENDING_KINDS and event.fence == claim_fence:
                claim_open = False
    return found


def lost_workflows(history: History) -> list[Violation]:
    """Every workflow ends terminal, or ``unknown`` with the reason a person must review it."""
    return [
        Violation(
            LOST_WORKFLOW,
            wf.id,
            wf.effect_key,
            f"ended in {wf.state} without a review reason",
        )
        for wf in history.workflows
        if wf.state not in TERMINAL_STATES
        and not (wf.state == "unknown" and wf.review_reason.strip())
    ]


def budget_overruns(history: History) -> list[Violation]:
    """Attempts, as stored and as counted in claims, never exceed the budget."""
    claims = Counter(e.workflow_id for e in history.events if e.kind == "claimed")
    return [
        Violation(
            BUDGET_OVERRUN,
            wf.id,
            wf.effect_key,
            f"attempt {wf.attempt}, {claims[wf.id]} claims, budget {wf.max_attempts}",
        )
        for wf in history.workflows
        if max(wf.attempt, claims[wf.id]) > wf.max_attempts
    ]


def succeeded_without_effect(history: History) -> list[Violation]:
    """Every succeeded workflow has exactly one ledger row of its key and plan: its receipt."""
    effects = _effects_by_key(history)
    found: list[Violation] = []
    for wf in history.workflows:
        if wf.state != "succeeded":
            continue
        matching = [e for e in effects.get(wf.effect_key, []) if e.fingerprint == wf.fingerprint]
        result = wf.result or {}
        if len(matching) != 1:
            problem = f"{len(matching)} matching ledger rows"
        elif (
            result.get("receipt_id") != matching[0].receipt
            or result.get("effect_key") != wf.effect_key
            or result.get("fingerprint") != wf.fingerprint
        ):
            problem = f"stored result does not name receipt {matching[0].receipt}"
        else:
            continue
        found.append(Violation(SUCCEEDED_WITHOUT_EFFECT, wf.id, wf.effect_key, problem))
    return found


def lost_after_restart(history: History) -> list[Violation]:
    """Nothing acknowledged is lost: what a worker saw committed is still in the database.

    A worker reports an outcome only after its transaction committed, so the final
    row must still show it: a reported success is final (succeeded is terminal) and
    no reported fence is newer than the row's. And a ledger effect that names a start
    barrier must find that barrier of its own workflow, since the barrier is committed
    before the tool is called. Either missing means a committed write was lost, as a
    database restart without durable commits can do.
    """
    rows = {wf.id: wf for wf in history.workflows}
    found: list[Violation] = []
    for ack in history.acknowledged:
        wf = rows.get(ack.workflow_id)
        if wf is None:
            problem = "acknowledged workflow is missing"
        elif ack.state == "succeeded" and wf.state != "succeeded":
            problem = f"acknowledged succeeded at fence {ack.fence}, ended {wf.state}"
        elif wf.fence < ack.fence:
            problem = f"acknowledged {ack.state} at fence {ack.fence}, row has fence {wf.fence}"
        else:
            continue
        found.append(Violation(LOST_AFTER_RESTART, ack.workflow_id,
                               wf.effect_key if wf else "", problem))
    barriers = {b.start_id: b for b in history.barriers}
    owners = {wf.effect_key: wf for wf in history.workflows}
    for effect in sorted(history.effects, key=lambda e: e.seq):
        if effect.start_id is None:
            continue
        barrier = barriers.get(effect.start_id)
        owner = owners.get(effect.effect_key)
        if barrier is not None and owner is not None and barrier.workflow_id == owner.id:
            continue
        problem = ("its start barrier is not in the database" if barrier is None
                   else "its start barrier belongs to another workflow")
        found.append(Violation(LOST_AFTER_RESTART, owner.id if owner else "",
                               effect.effect_key,
                               f"receipt {effect.receipt} names start {effect.start_id}: "
                               f"{problem}"))
    return found


def writes_after_absent(history: History) -> list[Violation]:
    """No effect from a start whose key a fenced lookup answered "absent" for at that
    start's fence or later: the ledger must have refused it."""
    closed = {absence.effect_key: absence.closed_through for absence in history.absences}
    owners = _owner_ids(history)
    return [
        Violation(
            WRITE_AFTER_ABSENT,
            owners.get(effect.effect_key, ""),
            effect.effect_key,
            f"receipt {effect.receipt} from a start at fence {effect.fence}; a lookup had "
            f"answered absent through fence {closed[effect.effect_key]}",
        )
        for effect in sorted(history.effects, key=lambda e: e.seq)
        if effect.effect_key in closed and effect.fence <= closed[effect.effect_key]
    ]


def false_outcomes(history: History) -> list[Violation]:
    """No workflow ends failed, cancelled or incompatible while its effect is in the ledger."""
    effects = _effects_by_key(history)
    found: list[Violation] = []
    for wf in history.workflows:
        if wf.state not in TERMINAL_STATES or wf.state == "succeeded":
            continue
        matching = [e for e in effects.get(wf.effect_key, []) if e.fingerprint == wf.fingerprint]
        if matching:
            found.append(Violation(
                FALSE_OUTCOME, wf.id, wf.effect_key,
                f"ended {wf.state} with {len(matching)} effect(s) in the ledger "
                f"(receipt {matching[0].receipt})",
            ))
    return found


RULES: tuple[Callable[[History], list[Violation]], ...] = (
    duplicate_effects,
    effects_without_owner,
    tool_mode_mismatches,
    replayed_dispatches,
    stale_completions,
    lost_workflows,
    budget_overruns,
    succeeded_without_effect,
    lost_after_restart,
    writes_after_absent,
    false_outcomes,
)


def check(history: History) -> list[Violation]:
    """Every violation of every invariant in ``history`` (empty when all hold)."""
    return [violation for rule in RULES for violation in rule(history)]


def count_by_kind(violations: Iterable[Violation]) -> dict[str, int]:
    """How many violations of each kind (every kind listed, zeros included)."""
    counts = Counter(v.kind for v in violations)
    return {kind: counts.get(kind, 0) for kind in KINDS}


ResultOpener = Callable[[Mapping[str, Any], str], Mapping[str, Any]]


def _readable(
    result: Mapping[str, Any] | None, workflow_id: str, open_result: ResultOpener | None
) -> Mapping[str, Any] | None:
    """The stored result in plain form; one that cannot be opened names why, and fails checks."""
    if result is None or "ciphertext" not in result:
        return result
    if open_result is None:
        return {"unreadable": "sealed result and no key catalog to open it"}
    try:
        return open_result(result, workflow_id)
    except Exception as exc:  # any failure to open is a finding, never a crash of the check
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def load(
    dsn: str,
    schema: str,
    *,
    open_result: ResultOpener | None = None,
    acknowledged: Sequence[Acknowledged] = (),
) -> History:
    """Read one schema's workflows, events, ledger and barriers in a single snapshot.

    Results sealed at rest are opened with ``open_result(sealed, workflow_id)``
    (a key catalog's ``open``); one that cannot be opened is kept as
    ``{"unreadable": why}`` and so never proves an effect. ``acknowledged`` are the
    outcomes workers reported, carried into the history unchanged. Raises
    ``errors.StoreError`` when the database cannot be read.
    """
    rows = store.history_rows(dsn, schema)
    return History(
        workflows=[
            WorkflowFact(**{**row, "result": _readable(row["result"], row["id"], open_result)})
            for row in rows["workflows"]
        ],
        events=[EventFact(**row) for row in rows["events"]],
        effects=[EffectFact(**row) for row in rows["effects"]],
        barriers=[BarrierFact(**row) for row in rows["barriers"]],
        acknowledged=list(acknowledged),
        absences=[AbsenceFact(**row) for row in rows["fences"]],
    )
