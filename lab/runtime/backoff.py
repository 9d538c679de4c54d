"""Bounded, jittered backoff for riding out a lost database or tool.

Pure arithmetic over an injected RNG and clock: each failure waits a random
delay up to an exponentially growing ceiling ("full jitter", so many
processes that lost the same server do not come back in lock step), capped,
and a run of failures longer than ``patience`` gives up.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays for consecutive failures; ``reset`` after a success.

    ``base`` is the first ceiling, doubled per failure up to ``cap``; after
    ``patience`` seconds of failing without a success ``exhausted`` is True.
    """

    base: float = 0.05
    cap: float = 2.0
    patience: float = 60.0
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic
    failures: int = 0
    failing_since: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.base <= self.cap:
            raise ValueError("backoff needs 0 < base <= cap")
        if self.patience <= 0:
            raise ValueError("backoff patience must be positive")

    def failed(self) -> float:
        """Record one failure; return how long to wait before the next try."""
        if self.failing_since is None:
            self.failing_since = self.clock()
        ceiling = min(self.cap, self.base * 2.0 ** min(self.failures, 32))
        self.failures += 1
        return self.rng.uniform(0.0, ceiling)

    def reset(self) -> None:
        """A success: the next failure starts from ``base`` again."""
        self.failures = 0
        self.failing_since = None

    @property
    def exhausted(self) -> bool:
        """True once failures have lasted ``patience`` seconds without a success."""
        return (
            self.failing_since is not None
            and self.clock() - self.failing_since >= self.patience
        )
