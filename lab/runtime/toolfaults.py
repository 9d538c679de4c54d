"""The credit tool's fault switches and counters, safe across its handler threads.

``ToolService`` (``lab.runtime.tool``) takes them from ``FaultSwitches``; each switch is
armed for the next effect request(s), and ``lab.runtime.tool``'s docstring and
``docs/authoring.md`` say what each one does.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from http import HTTPStatus
from typing import Literal

from lab import errors

# A hold that nobody releases ends on its own: a forgotten hold must not hang a run.
DEFAULT_HOLD_SECONDS = 30.0

Commit = Literal["before", "after"]
"""Where an injected fault falls relative to the ledger commit of the effect."""


def _check_commit(commit: str) -> None:
    if commit not in ("before", "after"):
        raise ValueError(f"commit must be 'before' or 'after', not {commit!r}")


def _check_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative integer, not {count!r}")


class HeldRequest:
    """One effect request the tool keeps in flight until it is released.

    Returned by ``ToolService.hold_next``. The request is held before the ledger
    commit (``commit="before"``: nothing is written until it is released) or
    after it (``"after"``: the effect is written, the reply waits). A hold ends
    when ``release()`` is called or ``seconds`` have passed, whichever is first;
    the request then carries on as usual, even if its caller is gone by then.
    """

    def __init__(self, seconds: float, commit: Commit) -> None:
        self.seconds = seconds
        self.commit: Commit = commit
        self._arrived = threading.Event()
        self._released = threading.Event()
        self._finished = threading.Event()

    @property
    def arrived(self) -> bool:
        """True once a request has reached the hold."""
        return self._arrived.is_set()

    @property
    def finished(self) -> bool:
        """True once the held request has been answered (or its caller was gone)."""
        return self._finished.is_set()

    def wait_held(self, timeout: float = 15.0) -> None:
        """Block until a request is being held; raise ``TimeoutError`` if none came."""
        if not self._arrived.wait(timeout):
            raise TimeoutError(f"no effect request reached the hold within {timeout}s")

    def release(self) -> None:
        """Let the held request carry on."""
        self._released.set()

    def wait_finished(self, timeout: float = 15.0) -> None:
        """Block until the released request has been handled (its effect written or not)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the held request was not handled within {timeout}s")

    def _block(self) -> None:
        block_together([self])

    def _finish(self) -> None:
        self._finished.set()


def block_together(holds: list[HeldRequest]) -> None:
    """Hold every request of ``holds`` at once (a batch's items, as concurrent requests would
    be): all arrive together, and each ends on its release or its own ``seconds``."""
    arrived = time.monotonic()
    for hold in holds:
        hold._arrived.set()
    for hold in holds:
        hold._released.wait(max(arrived + hold.seconds - time.monotonic(), 0.0))


class Faults:
    """The faults armed for one effect request, taken together when it arrives."""

    def __init__(
        self,
        failure: tuple[HTTPStatus, Commit] | None,
        hold: HeldRequest | None,
        delay: float,
    ) -> None:
        self.failure = failure
        self.hold = hold
        self.delay = delay


class FaultSwitches:
    """The fault switches of the credit service and what they did, under one lock."""

    def __init__(self) -> None:
        #: While True, every effect reply is dropped after the commit (see ``drop_next_reply``).
        self.drop_responses = False
        self._lock = threading.Lock()
        self._reject_remaining = 0
        self._drop_remaining = 0
        self._failures: deque[tuple[HTTPStatus, Commit]] = deque()
        self._holds: deque[HeldRequest] = deque()
        self._all_holds: list[HeldRequest] = []
        self._delays: deque[float] = deque()
        self._calls = 0
        self._lookups = 0
        self._dropped = 0
        self._rejected = 0
        self._failed = 0
        self._held = 0
        self._slowed = 0
        self._fenced = 0
        self._drop_rate = 0.0
        self._reject_rate = 0.0
        self._random = random.Random(0)

    # -- counters and fault switches, safe across handler threads --

    @property
    def calls(self) -> int:
        """Authenticated, well-formed effect requests received (429s and failures included)."""
        with self._lock:
            return self._calls

    @property
    def lookups(self) -> int:
        """Authenticated lookups received."""
        with self._lock:
            return self._lookups

    @property
    def fenced(self) -> int:
        """Effect requests refused because a fenced lookup had closed their start."""
        with self._lock:
            return self._fenced

    @property
    def dropped(self) -> int:
        """Replies dropped after the effect was committed."""
        with self._lock:
            return self._dropped

    @property
    def rejected(self) -> int:
        """Requests answered with 429 (nothing written)."""
        with self._lock:
            return self._rejected

    @property
    def failed(self) -> int:
        """Requests answered with an injected error status by ``fail_next``."""
        with self._lock:
            return self._failed

    @property
    def held(self) -> int:
        """Requests that reached a ``hold_next`` hold."""
        with self._lock:
            return self._held

    @property
    def slowed(self) -> int:
        """Requests delayed by ``slow_next``."""
        with self._lock:
            return self._slowed

    def fail_next(self, status: int = 500, commit: Commit = "before", count: int = 1) -> None:
        """Answer the next ``count`` effect requests with HTTP ``status`` (500..599).

        ``commit="before"``: the failure comes before the ledger commit, so nothing
        is written. ``commit="after"``: the effect is committed, then the error is
        answered; the caller cannot tell the two apart (``OutcomeUnknown``).
        """
        if isinstance(status, bool) or not isinstance(status, int) or not 500 <= status <= 599:
            raise ValueError(f"status must be a server error from 500 to 599, not {status!r}")
        _check_commit(commit)
        _check_count(count)
        with self._lock:
            self._failures.extend([(HTTPStatus(status), commit)] * count)

    def hold_next(
        self, seconds: float = DEFAULT_HOLD_SECONDS, commit: Commit = "before"
    ) -> HeldRequest:
        """Keep the next effect request in flight; returns the hold to wait on and release.

        The request is held at most ``seconds``. ``commit="before"`` holds it before
        the ledger commit (kill the caller now and the effect is still written once
        the hold ends, as a real service finishes a request whose client vanished);
        ``"after"`` holds the reply of an effect already written. A caller held past
        its client's timeout (5 s) sees ``OutcomeUnknown``. ``stop()`` releases every
        hold, so a forgotten one never outlives the experiment.
        """
        if not 0 < seconds <= 300:
            raise ValueError(f"seconds must lie in (0, 300], not {seconds!r}")
        _check_commit(commit)
        hold = HeldRequest(seconds, commit)
        with self._lock:
            self._holds.append(hold)
            self._all_holds.append(hold)
        return hold

    def drop_next_reply(self, count: int = 1) -> None:
        """Commit the next ``count`` effects, then close the connection without a reply."""
        _check_count(count)
        with self._lock:
            self._drop_remaining += count

    def slow_next(self, seconds: float, count: int = 1) -> None:
        """Wait ``seconds`` before committing each of the next ``count`` effects.

        Past the client's timeout (5 s) the caller sees ``OutcomeUnknown`` while the
        effect is still written afterwards.
        """
        if not 0 < seconds <= 300:
            raise ValueError(f"seconds must lie in (0, 300], not {seconds!r}")
        _check_count(count)
        with self._lock:
            self._delays.extend([float(seconds)] * count)

    def _take_faults(self) -> Faults:
        with self._lock:
            failure = self._failures.popleft() if self._failures else None
            hold = self._holds.popleft() if self._holds else None
            delay = self._delays.popleft() if self._delays else 0.0
            if failure is not None:
                self._failed += 1
            if hold is not None:
                self._held += 1
            if delay:
                self._slowed += 1
        return Faults(failure, hold, delay)

    def randomize_faults(self, *, drop_reply_rate: float, reject_rate: float, seed: int) -> None:
        """Drop replies after commit and answer 429 at random, reproducibly from ``seed``."""
        if not (0.0 <= drop_reply_rate <= 1.0 and 0.0 <= reject_rate <= 1.0):
            raise errors.Rejected("fault rates must lie between 0 and 1")
        with self._lock:
            self._drop_rate = drop_reply_rate
            self._reject_rate = reject_rate
            self._random = random.Random(seed)

    def _drop_this_reply(self) -> bool:
        with self._lock:
            drop = self.drop_responses or self._drop_remaining > 0 or (
                self._drop_rate > 0 and self._random.random() < self._drop_rate
            )
            if self._drop_remaining > 0:
                self._drop_remaining -= 1
            if drop:
                self._dropped += 1
            return drop

    def reject_next(self, count: int) -> None:
        """Answer the next ``count`` effect requests with 429, writing nothing.

        The client raises ``RateLimited``; the worker queues the work again on a
        persisted timer and spends one attempt of the persistent budget.
        """
        _check_count(count)
        with self._lock:
            self._reject_remaining = count

    def _count_call(self) -> bool:
        """Count one call; True when it must be rejected with 429."""
        with self._lock:
            self._calls += 1
            if self._reject_remaining > 0:
                self._reject_remaining -= 1
                self._rejected += 1
                return True
            if self._reject_rate > 0 and self._random.random() < self._reject_rate:
                self._rejected += 1
                return True
            return False

    def _count_lookup(self) -> None:
        with self._lock:
            self._lookups += 1
