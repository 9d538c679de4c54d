"""The worker: claim, check, dispatch, complete; and reconcile unknown outcomes.

The worker makes no decision the database does not confirm: every step goes
through a fenced transition in ``store``, and every tool failure is sorted
into "nothing happened" (retry later), "it may have happened" (unknown, to
be reconciled by lookup) or "refused" (failed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

from lab import errors, protocol
from lab.runtime import heartbeat, store, toolclient
from lab.runtime.barrier import StartBarrier
from lab.runtime.plan import Receipt

Hook = Callable[[str, store.Workflow], None]

#: How often a busy fused worker recovers expired leases. Recovery only moves a dead
#: worker's expired claim to ``unknown`` (nothing is claimable or dispatched through it),
#: so doing it on a timer instead of in every claim delays that by at most this much.
RECOVERY_INTERVAL_S = 0.5


@dataclass
class Sweeps:
    """When a fused worker next recovers expired leases; one clock shared by a process's
    ``--concurrency`` slots.

    A sweep recovers every expired lease, whoever held it, so one sweep per interval
    serves every slot. With a clock per slot, 32 slots made 64 sweeps a second, and
    their idle polls one every other poll: the server spent more on sweeps than on work.
    """

    interval: float = RECOVERY_INTERVAL_S
    _due_at: float = 0.0
    _swept_idle: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self, now: float) -> bool:
        """True for one caller once a sweep is due (the first step's is); it owns it."""
        with self._lock:
            if now < self._due_at:
                return False
            self._due_at = now + self.interval
            return True

    def untake(self) -> None:
        """The owner's transaction was refused: the sweep is due again at once."""
        with self._lock:
            self._due_at = 0.0

    def found(self, work: bool, *, swept: bool) -> None:
        """A step found work or none: finding none asks for one sweep before idling;
        after it, an idle worker sweeps on the interval, not on every poll."""
        with self._lock:
            if work:
                self._swept_idle = False
                return
            if not swept and not self._swept_idle:
                self._due_at = 0.0
            self._swept_idle = self._swept_idle or swept


@dataclass
class Worker:
    """One worker identity with its lease, heartbeat and backoff settings.

    ``hook`` is called at each named boundary of ``lab.protocol`` this worker
    passes (claim, start barrier, reply, completion, heartbeat, lookup,
    settlement); experiments use it to inject a cancellation, an expiry or a
    pause, and ``lab crashpoints`` to stop the process dead there.
    """

    db: store.Store
    client: toolclient.ToolClient
    name: str = "worker"
    lease: timedelta = timedelta(seconds=3)
    heartbeat_every: timedelta | None = None
    backoff: timedelta = timedelta(milliseconds=20)
    hook: Hook | None = None
    log: list[str] = field(default_factory=list)
    #: The looping worker's fast path (``step``): each confirmed effect's completion
    #: commits in one transaction with the next claim, and an idempotent claim with its
    #: start barrier (boundary ``after_claim_barrier``).
    fused: bool = False
    #: With ``fused``: how many workflows one step claims and has in flight together.
    #: More share one commit and overlap their requests; a crash leaves all of them to
    #: recovery (the blast radius the book measures).
    batch: int = 1
    _pending: list[store.Finished] = field(default_factory=list, init=False, repr=False)
    #: With ``fused``: when to recover expired leases (shared by a process's slots).
    sweeps: Sweeps = field(default_factory=Sweeps, repr=False)
    _heart: heartbeat.Heartbeat | None = field(default=None, init=False, repr=False)

    def _stage(self, stage: str, claim: store.Workflow) -> None:
        if self.hook is not None:
            self.hook(stage, claim)

    def run_one(self) -> store.Workflow | None:
        """Recover expired leases, then claim and carry out at most one workflow.

        Returns the workflow's final snapshot for this attempt, or None when no
        work was due.
        """
        self.db.recover_expired()
        claim = self.db.claim(self.name, self.lease)
        if claim is None:
            return None
        self._stage(protocol.AFTER_CLAIM, claim)
        try:
            with self._heartbeats([claim]):
                barrier = self.db.pre_dispatch(claim)
                if barrier is None:
                    return self.db.get(claim.id)
                self._stage(protocol.AFTER_BARRIER, claim)
                try:
                    receipt = self.client.call(claim, barrier)
                except (errors.RateLimited, errors.ToolUnavailable) as exc:
                    return self.db.retry_later(claim, self.backoff, _cause(exc))
                except errors.OutcomeUnknown:
                    return self.db.unknown(claim)
                except errors.ToolRefused:
                    return self.db.fail(claim, "tool_refused")
            self._stage(protocol.AFTER_TOOL, claim)
            completed = self.db.complete(claim, receipt)
            self._stage(protocol.AFTER_COMPLETE, completed)
            return completed
        except errors.IntegrityFailure:
            # A stored record failed its digest or binding: never act on it.
            return self.db.quarantine(claim, "integrity")

    def step(self, limit: int | None = None) -> list[store.Workflow]:
        """The fused path: one transaction completes the last dispatches and claims the next.

        The effects confirmed by the previous ``step`` are completed in the same
        transaction that claims the next ``batch`` workflows (an idempotent one with its
        start barrier too) and, on the first step, every ``RECOVERY_INTERVAL_S`` and after
        a step that found no work, recovers expired leases; so a workflow costs its share
        of this commit and the tool's own, where ``run_one`` makes four. A batch of more
        than one reports ``after_batch`` once, then each claim its own boundary. A
        non-idempotent claim then commits its start barrier alone (``pre_dispatch``), all
        of them before any request is sent; the batch's requests are in flight together.
        A confirmed effect waits for the next ``step`` (or ``flush``); every other outcome
        is committed at once, as in ``run_one``. Returns the final snapshots this call
        committed, oldest first: empty when no work was due. ``limit`` caps this step's
        claims below ``batch``.
        """
        finished, self._pending = self._pending, []
        recover = self.sweeps.take(time.monotonic())
        done, claims = self._commit(finished, recover=recover,
                                    limit=min(self.batch, limit or self.batch))
        if claims is None:
            if recover:
                self.sweeps.untake()
            return done  # the transaction was refused: claim again next step
        self.sweeps.found(bool(claims), swept=recover)
        if not claims:
            return done
        if self.batch > 1:
            self._stage(protocol.AFTER_BATCH, claims[0].workflow)
        for claimed in claims:
            if claimed.barrier is None:
                self._stage(protocol.AFTER_CLAIM, claimed.workflow)
            else:
                self._stage(protocol.AFTER_CLAIM_BARRIER, claimed.workflow)
        refused: list[errors.LabError] = []
        with self._heartbeats([claimed.workflow for claimed in claims]):
            ready = self._barriers(claims, done, refused)
            replies = self.client.call_all(ready)
        for (claim, barrier), reply in zip(ready, replies, strict=True):
            try:
                outcome = self._settle_reply(claim, barrier, reply)
            except errors.LabError as exc:
                refused.append(exc)
                continue
            if outcome is not None:
                done.append(outcome)
        if refused:
            self.log.extend(f"{type(exc).__name__}: {exc}" for exc in refused)
            stored = [exc for exc in refused if isinstance(exc, errors.StoreError)]
            if stored or (not done and not self._pending):
                raise (stored or refused)[0]
        return done

    def _barriers(
        self, claims: list[store.Claimed], done: list[store.Workflow],
        refused: list[errors.LabError],
    ) -> list[tuple[store.Workflow, StartBarrier]]:
        """Each claim with its start barrier: fused, or committed now by ``pre_dispatch``
        (a diverted or integrity-failed claim goes to ``done`` instead)."""
        ready = []
        for claimed in claims:
            claim, barrier = claimed.workflow, claimed.barrier
            if barrier is None:
                try:
                    barrier = self.db.pre_dispatch(claim)
                    if barrier is None:
                        done.append(self.db.get(claim.id))
                        continue
                except errors.IntegrityFailure:
                    done.append(self.db.quarantine(claim, "integrity"))
                    continue
                except errors.LabError as exc:
                    refused.append(exc)
                    continue
                self._stage(protocol.AFTER_BARRIER, claim)
            ready.append((claim, barrier))
        return ready

    def _settle_reply(
        self, claim: store.Workflow, barrier: StartBarrier, reply: Receipt | errors.ToolError
    ) -> store.Workflow | None:
        """Commit a failed request's outcome now; keep a confirmed effect for the next step."""
        try:
            if isinstance(reply, (errors.RateLimited, errors.ToolUnavailable)):
                return self.db.retry_later(claim, self.backoff, _cause(reply))
            if isinstance(reply, errors.OutcomeUnknown):
                return self.db.unknown(claim)
            if isinstance(reply, errors.ToolError):
                return self.db.fail(claim, "tool_refused")
        except errors.IntegrityFailure:
            return self.db.quarantine(claim, "integrity")
        self._stage(protocol.AFTER_TOOL, claim)
        self._pending.append(store.Finished(claim, barrier, reply))
        return None

    def _complete_each(self, finished: list[store.Finished]) -> list[store.Workflow]:
        """Complete each confirmed dispatch in its own transaction (``complete``'s checks).

        A refused one is logged and left to recovery (its lease expires into unknown and
        the tool's lookup settles it); one whose record fails integrity is quarantined.
        When none could be completed, the first refusal is raised.
        """
        done: list[store.Workflow] = []
        refused: list[errors.LabError] = []
        for index, item in enumerate(finished):
            try:
                completed = self.db.complete(item.claim, item.receipt)
            except errors.IntegrityFailure:
                done.append(self.db.quarantine(item.claim, "integrity"))
                continue
            except errors.StoreError:
                # The database is away: this one and those not yet tried stay confirmed.
                self._pending.extend(finished[index:])
                raise
            except errors.LabError as exc:
                refused.append(exc)
                continue
            self._stage(protocol.AFTER_COMPLETE, completed)
            done.append(completed)
        self.log.extend(f"{type(exc).__name__}: {exc}" for exc in refused)
        if refused and not done:
            raise refused[0]
        return done

    @property
    def pending(self) -> int:
        """How many confirmed effects' completions wait for the next ``step``."""
        return len(self._pending)

    def flush(self) -> list[store.Workflow]:
        """Commit the completions a ``step`` left pending, if any (the loop's last act)."""
        finished, self._pending = self._pending, []
        if not finished:
            return []
        return self._commit(finished, recover=False, limit=0)[0]

    def _commit(
        self, finished: list[store.Finished], *, recover: bool, limit: int
    ) -> tuple[list[store.Workflow], list[store.Claimed] | None]:
        """One ``complete_and_claim`` transaction: the completed snapshots and the claims.

        A lost database keeps ``finished`` pending and raises. A refused completion rolls
        the transaction back: each is then completed alone (``_complete_each``), so one
        stale item does not hold back the others, and the claims are None.
        """
        try:
            taken = self.db.complete_and_claim(finished, self.name, self.lease, fuse=True,
                                               recover=recover, limit=limit)
        except errors.StoreError:
            # Nothing of the transaction committed: the dispatches are still confirmed,
            # so keep them for the next step (a lost database is waited for).
            self._pending = finished
            raise
        except errors.LabError:
            if not finished:
                raise
            return self._complete_each(finished), None
        for completed in taken.completed:
            self._stage(protocol.AFTER_COMPLETE, completed)
        return list(taken.completed), taken.claims

    def reconcile(self, workflow_id: str) -> store.Workflow:
        """Settle an ``unknown`` workflow through the tool's fenced lookup.

        The lookup uses the workflow's original effect key and the fence of its last
        start. A found effect completes an idempotent workflow. An absent one, fenced by
        the tool, is a proof that no request of its starts took or will take effect, so
        the workflow is requeued (or ends cancelled or failed, truthfully), idempotent or
        not. A non-idempotent workflow whose tool offers no fenced lookup, or whose effect
        the lookup found, waits for a person (``ManualReview``), as does an idempotent one
        whose tool answered absent without the proof (unless its key may be requeued).
        Work in any other state is returned as it is.
        """
        current = self.db.get(workflow_id)
        if current.state != "unknown":
            return current
        if current.review_reason == "integrity":
            raise errors.ManualReview("manual review required: integrity", reason="integrity")
        try:
            self.db.barrier_for(current.id, current.fence)
        except errors.IntegrityFailure:
            self.db.quarantine(current, "integrity")
            raise errors.ManualReview(
                "manual review required: integrity", reason="integrity"
            ) from None
        try:
            settled = self._settle(current)
        except errors.ManualReview:
            # The review itself is the committed settlement.
            self._stage(protocol.AFTER_SETTLE, current)
            raise
        self._stage(protocol.AFTER_SETTLE, settled)
        return settled

    def _settle(self, current: store.Workflow) -> store.Workflow:
        """Look the unknown workflow up (fenced) and commit what the answer proves."""
        try:
            receipt = self.client.lookup(current.effect_key, fence=current.fence)
        except errors.NoFencedLookup:
            if not current.idempotent:
                # Today's rule for a tool that cannot prove absence: a person decides.
                return self.db.require_review(current, "non_idempotent")
            receipt = self.client.lookup(current.effect_key)
            self._stage(protocol.AFTER_LOOKUP, current)
            if receipt is not None:
                return self.db.settle_found(current, receipt)
            return self.db.settle_absent(current)
        self._stage(protocol.AFTER_LOOKUP, current)
        if receipt is None:
            return self.db.settle_absent(current, closed_through=current.fence)
        if not current.idempotent:
            # The effect happened at least once; a non-idempotent key may hold more than
            # one request's effect, so a person settles it with the receipt in view.
            return self.db.require_review(current, "non_idempotent_effect_found")
        return self.db.settle_found(current, receipt)

    @contextmanager
    def _heartbeats(self, claims: list[store.Workflow]) -> Iterator[None]:
        """Extend each claim's lease every ``heartbeat_every`` while the block runs."""
        if self.heartbeat_every is None:
            yield
            return
        if self._heart is None:
            self._heart = heartbeat.Heartbeat(
                self.heartbeat_every.total_seconds(),
                lambda claim: self.db.heartbeat(claim, self.lease),
                beaten=lambda claim: self._stage(protocol.AFTER_HEARTBEAT, claim),
                stopped=self.log.append, name=f"heartbeat-{self.name}",
            )
        with self._heart.beating(claims):
            yield


def _cause(exc: errors.ToolError) -> str:
    return "rate_limited" if isinstance(exc, errors.RateLimited) else "tool_unreachable"
