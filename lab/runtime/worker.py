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
from lab.runtime import store, tool

Hook = Callable[[str, store.Workflow], None]

#: How often a busy fused worker recovers expired leases. Recovery only moves a dead
#: worker's expired claim to ``unknown`` (nothing is claimable or dispatched through it),
#: so doing it on a timer instead of in every claim delays that by at most this much.
RECOVERY_INTERVAL_S = 0.5


@dataclass
class Worker:
    """One worker identity with its lease, heartbeat and backoff settings.

    ``hook`` is called at each named boundary of ``lab.protocol`` this worker
    passes (claim, start barrier, reply, completion, heartbeat, lookup,
    settlement); experiments use it to inject a cancellation, an expiry or a
    pause, and ``lab crashpoints`` to stop the process dead there.
    """

    db: store.Store
    client: tool.ToolClient
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
    _pending: store.Finished | None = field(default=None, init=False, repr=False)
    _recover_at: float = field(default=0.0, init=False, repr=False)

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
            with self._heartbeats(claim):
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

    def step(self) -> list[store.Workflow]:
        """The fused path: one transaction completes the last dispatch and claims the next.

        The effect confirmed by the previous ``step`` is completed in the same
        transaction that claims the next workflow (for an idempotent plan with its start
        barrier too) and, on the first step, every ``RECOVERY_INTERVAL_S`` and after a
        step that found no work, recovers expired leases; so a workflow costs two commits of
        its own (this one and the tool's) where ``run_one`` makes four. The next item is
        then dispatched; a confirmed effect waits for the next ``step`` (or ``flush``),
        every other outcome is committed at once, as in ``run_one``. Returns the final
        snapshots this call committed, oldest first: empty when no work was due.
        """
        finished, self._pending = self._pending, None
        now = time.monotonic()
        recover = now >= self._recover_at
        try:
            taken = self.db.complete_and_claim(finished, self.name, self.lease, fuse=True,
                                               recover=recover)
        except errors.IntegrityFailure:
            if finished is None:
                raise
            return [self.db.quarantine(finished.claim, "integrity")]
        except errors.StoreError:
            if finished is not None:
                # Nothing of the transaction committed: the dispatch is still confirmed,
                # so keep it for the next step (a lost database is waited for).
                self._pending = finished
            raise
        if recover:
            self._recover_at = now + RECOVERY_INTERVAL_S
        done = [] if taken.completed is None else [taken.completed]
        if taken.completed is not None:
            self._stage(protocol.AFTER_COMPLETE, taken.completed)
        if taken.claim is None:
            if not recover:
                self._recover_at = 0.0  # no work found: recover before calling this idle
            return done
        claim = taken.claim
        if taken.barrier is None:
            self._stage(protocol.AFTER_CLAIM, claim)
        else:
            self._stage(protocol.AFTER_CLAIM_BARRIER, claim)
        try:
            with self._heartbeats(claim):
                barrier = taken.barrier
                if barrier is None:
                    barrier = self.db.pre_dispatch(claim)
                    if barrier is None:
                        return [*done, self.db.get(claim.id)]
                    self._stage(protocol.AFTER_BARRIER, claim)
                try:
                    receipt = self.client.call(claim, barrier)
                except (errors.RateLimited, errors.ToolUnavailable) as exc:
                    return [*done, self.db.retry_later(claim, self.backoff, _cause(exc))]
                except errors.OutcomeUnknown:
                    return [*done, self.db.unknown(claim)]
                except errors.ToolRefused:
                    return [*done, self.db.fail(claim, "tool_refused")]
            self._stage(protocol.AFTER_TOOL, claim)
            self._pending = store.Finished(claim, barrier, receipt)
            return done
        except errors.IntegrityFailure:
            return [*done, self.db.quarantine(claim, "integrity")]

    @property
    def pending(self) -> bool:
        """True while a confirmed effect's completion waits for the next ``step``."""
        return self._pending is not None

    def flush(self) -> list[store.Workflow]:
        """Commit the completion a ``step`` left pending, if any (the loop's last act)."""
        finished, self._pending = self._pending, None
        if finished is None:
            return []
        try:
            completed = self.db.complete(finished.claim, finished.receipt)
        except errors.IntegrityFailure:
            return [self.db.quarantine(finished.claim, "integrity")]
        self._stage(protocol.AFTER_COMPLETE, completed)
        return [completed]

    def reconcile(self, workflow_id: str) -> store.Workflow:
        """Settle an ``unknown`` workflow through the tool's authoritative lookup.

        The lookup uses the workflow's original effect key. A found effect
        completes it; an absent one requeues it when that is safe; a
        non-idempotent tool is never looked up nor replayed: ``ManualReview``.
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
            if not current.idempotent:
                settled = self.db.require_review(current, "non_idempotent")
            else:
                receipt = self.client.lookup(current.effect_key)
                self._stage(protocol.AFTER_LOOKUP, current)
                if receipt is not None:
                    settled = self.db.settle_found(current, receipt)
                else:
                    settled = self.db.settle_absent(current)
        except errors.ManualReview:
            # The review itself is the committed settlement.
            self._stage(protocol.AFTER_SETTLE, current)
            raise
        self._stage(protocol.AFTER_SETTLE, settled)
        return settled

    @contextmanager
    def _heartbeats(self, claim: store.Workflow) -> Iterator[None]:
        if self.heartbeat_every is None:
            yield
            return
        every = self.heartbeat_every.total_seconds()
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(every):
                try:
                    self.db.heartbeat(claim, self.lease)
                except errors.StoreError:
                    # The database is away, not refusing: keep beating, the lease
                    # may still be live when it is back (the fence decides).
                    continue
                except errors.LabError as exc:
                    # A refused heartbeat means the claim is gone; the fenced
                    # transitions will refuse this worker's writes as well.
                    self.log.append(f"heartbeat stopped: {exc}")
                    return
                self._stage(protocol.AFTER_HEARTBEAT, claim)

        thread = threading.Thread(target=beat, name=f"heartbeat-{self.name}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)


def _cause(exc: errors.ToolError) -> str:
    return "rate_limited" if isinstance(exc, errors.RateLimited) else "tool_unreachable"
