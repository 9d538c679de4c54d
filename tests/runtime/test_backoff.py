"""Backoff delays are jittered, bounded by a growing ceiling, capped, and give up in time."""

from __future__ import annotations

import random

import pytest

from lab.runtime.backoff import Backoff


def test_delays_stay_under_a_doubling_ceiling_up_to_the_cap() -> None:
    backoff = Backoff(base=0.1, cap=1.0, rng=random.Random(1))
    delays = [backoff.failed() for _ in range(12)]
    ceilings = [min(1.0, 0.1 * 2**n) for n in range(12)]
    assert all(0.0 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert len(set(delays)) == len(delays)  # jittered, not a fixed schedule
    assert max(delays[6:]) > 0.5  # the ceiling did grow to the cap


def test_patience_runs_from_the_first_failure_and_a_success_resets() -> None:
    now = [100.0]
    backoff = Backoff(patience=5.0, rng=random.Random(2), clock=lambda: now[0])
    assert not backoff.exhausted
    backoff.failed()
    now[0] += 4.9
    backoff.failed()
    assert not backoff.exhausted
    now[0] += 0.2
    assert backoff.exhausted
    backoff.reset()
    assert not backoff.exhausted and backoff.failures == 0
    assert backoff.failed() <= backoff.base


def test_nonsense_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="base"):
        Backoff(base=0.0)
    with pytest.raises(ValueError, match="patience"):
        Backoff(patience=0.0)
