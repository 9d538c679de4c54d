"""One worker's heartbeat: a lasting thread that extends the leases of the claims in flight.

A worker used to start a thread for every step and join it after the tool replied. On
the unbatched path that is a thread created and joined per workflow, and with
``--concurrency 32`` up to 64 threads contending for the interpreter: measurable CPU per
workflow in ``lab bench throughput``. This thread lasts while work keeps coming: a claim
joins it for the length of a block (``beating``) and is beaten ``every`` after it joined,
then every ``every`` again, until the block ends or a heartbeat is refused. The thread
ends after ``linger`` seconds with nothing to beat, so an idle or discarded worker keeps
no thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from lab import errors
from lab.runtime import store

#: A thread with nothing to beat for this long ends (a later block starts another).
LINGER_S = 1.0


class Heartbeat:
    """Extends the lease of every claim inside a ``beating`` block, one thread for all.

    ``beat`` extends one claim's lease (raising ``errors.StoreError`` while the database
    is away, another ``errors.LabError`` when the claim is gone); ``beaten`` is told of
    each extension, ``stopped`` of each refusal (that claim is not beaten again).
    """

    def __init__(
        self, every: float, beat: Callable[[store.Workflow], object], *,
        beaten: Callable[[store.Workflow], None], stopped: Callable[[str], None],
        name: str = "heartbeat", linger: float = LINGER_S,
    ) -> None:
        self._every = every
        self._beat = beat
        self._beaten = beaten
        self._stopped = stopped
        self._name = name
        self._linger = max(linger, every)
        self._changed = threading.Condition()
        # Claim id -> (the claim, when it is next due, monotonic seconds).
        self._due: dict[str, tuple[store.Workflow, float]] = {}
        # Claims whose heartbeat is being committed now: a block ends after it.
        self._in_flight: set[str] = set()
        self._thread: threading.Thread | None = None
        # When the thread's wait ends (monotonic seconds; 0 while it is not waiting). A
        # block wakes it only when its first beat is due sooner: a new claim's is due
        # after every earlier claim's, so under load the thread wakes for beats, not for
        # each block's start (two thread switches per workflow, at --concurrency 32).
        self._wakes_at = 0.0

    @contextmanager
    def beating(self, claims: list[store.Workflow]) -> Iterator[None]:
        """Beat ``claims`` while the block runs; no heartbeat of theirs runs after it."""
        ids = [claim.id for claim in claims]
        with self._changed:
            first = time.monotonic() + self._every
            for claim in claims:
                self._due[claim.id] = (claim, first)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._thread.start()
            elif first < self._wakes_at:
                self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                for claim_id in ids:
                    self._due.pop(claim_id, None)
                # A commit under way for one of these claims finishes before the block
                # is over (the next transition then sees its extended lease, or refuses).
                self._changed.wait_for(lambda: self._in_flight.isdisjoint(ids),
                                       timeout=_FLIGHT_LIMIT_S)

    def _run(self) -> None:
        try:
            self._beat_until_idle()
        finally:
            with self._changed:
                if self._thread is threading.current_thread():
                    self._thread = None  # ended by a fault: the next block starts another
                self._in_flight = set()
                self._changed.notify_all()

    def _beat_until_idle(self) -> None:
        idle_since: float | None = None
        while True:
            with self._changed:
                now = time.monotonic()
                if not self._due:
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= self._linger:
                        self._thread = None
                        return
                    self._wait_until(idle_since + self._linger, now)
                    continue
                idle_since = None
                soonest = min(due for _, due in self._due.values())
                if soonest > now:
                    self._wait_until(soonest, now)
                    continue
                ready = [claim for claim, due in self._due.values() if due <= now]
                for claim in ready:
                    self._due[claim.id] = (claim, now + self._every)
                self._in_flight = {claim.id for claim in ready}
            for claim in ready:
                self._beat_one(claim)
            with self._changed:
                self._in_flight = set()
                self._changed.notify_all()

    def _wait_until(self, wake_at: float, now: float) -> None:
        """Wait (holding ``_changed``) until ``wake_at`` or a sooner block's notice."""
        self._wakes_at = wake_at
        try:
            self._changed.wait(wake_at - now)
        finally:
            self._wakes_at = 0.0

    def _beat_one(self, claim: store.Workflow) -> None:
        try:
            self._beat(claim)
        except errors.StoreError:
            # The database is away, not refusing: keep beating, the lease may still be
            # live when it is back (the fence decides).
            return
        except errors.LabError as exc:
            # A refused heartbeat means the claim is gone; the fenced transitions will
            # refuse this worker's writes as well.
            with self._changed:
                self._due.pop(claim.id, None)
            self._stopped(f"heartbeat stopped: {exc}")
            return
        self._beaten(claim)


# A block waits at most this long for a heartbeat commit of its claims to finish, as the
# per-block thread's join did. Past it the block goes on: the waiting only orders the
# worker's log, since a heartbeat is fenced and cannot outlive the claim it extends.
_FLIGHT_LIMIT_S = 5.0
