"""The worker's lasting heartbeat thread: who is beaten, when, and for how long."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from lab import errors
from lab.runtime.heartbeat import Heartbeat


def _claim(claim_id: str) -> Any:
    # The heartbeat reads only a claim's id; the store's ``beat`` reads the rest.
    return SimpleNamespace(id=claim_id)


class _Beats:
    """Records each beat (id, thread) and answers with what the test scripted."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.log: list[str] = []
        self.answers: dict[str, list[BaseException]] = {}
        self.hold = threading.Event()
        self.hold.set()

    def beat(self, claim: Any) -> None:
        self.seen.append((claim.id, threading.get_ident()))
        self.hold.wait(10)
        queued = self.answers.get(claim.id)
        if queued:
            raise queued.pop(0)

    def heart(self, every: float, linger: float = 0.3) -> Heartbeat:
        return Heartbeat(every, self.beat, beaten=lambda claim: None,
                         stopped=self.log.append, linger=linger)

    def count(self, claim_id: str) -> int:
        return sum(1 for seen, _ in self.seen if seen == claim_id)


def _until(condition: Any, what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {limit} s for {what}")
        time.sleep(0.01)


def test_a_claim_is_beaten_every_period_while_its_block_runs_and_never_after() -> None:
    beats = _Beats()
    heart = beats.heart(every=0.1)
    started = time.monotonic()
    with heart.beating([_claim("a")]):
        _until(lambda: beats.count("a") >= 3, "three beats of claim a")
        assert time.monotonic() - started >= 0.3  # the first beat waits one period
    after = beats.count("a")
    time.sleep(0.35)
    assert beats.count("a") == after


def test_one_thread_serves_block_after_block_and_ends_when_idle() -> None:
    beats = _Beats()
    heart = beats.heart(every=0.05, linger=0.3)
    for name in ("a", "b", "c"):
        with heart.beating([_claim(name)]):
            _until(lambda name=name: beats.count(name) >= 1, f"a beat of claim {name}")
    assert len({thread for _, thread in beats.seen}) == 1
    _until(lambda: not any(t.name == "heartbeat" for t in threading.enumerate()),
           "the idle heartbeat thread to end")
    with heart.beating([_claim("d")]):
        _until(lambda: beats.count("d") >= 1, "a beat from a new thread")


def test_a_refused_heartbeat_stops_that_claim_and_a_lost_database_does_not() -> None:
    beats = _Beats()
    beats.answers["gone"] = [errors.Stale("claim is no longer current")]
    beats.answers["away"] = [errors.StoreError("database is away")] * 2
    heart = beats.heart(every=0.05)
    with heart.beating([_claim("gone"), _claim("away")]):
        _until(lambda: beats.count("away") >= 4, "beats of claim away past two failures")
        assert beats.count("gone") == 1
    assert beats.log == ["heartbeat stopped: claim is no longer current"]


def test_a_block_ends_only_after_its_claims_heartbeat_in_flight() -> None:
    beats = _Beats()
    heart = beats.heart(every=0.05)
    beats.hold.clear()
    ended = threading.Event()

    def block() -> None:
        with heart.beating([_claim("a")]):
            _until(lambda: beats.count("a") == 1, "the held beat to start")
        ended.set()

    runner = threading.Thread(target=block)
    runner.start()
    _until(lambda: beats.count("a") == 1, "the held beat to start")
    time.sleep(0.2)
    assert not ended.is_set()
    beats.hold.set()
    runner.join(10)
    assert ended.is_set()


def test_a_claim_that_joins_an_idle_lingering_thread_is_beaten_on_time() -> None:
    # The thread waits out its linger between blocks; a new block must wake it for the
    # claim's first beat (due one period after it joined), not leave it to the linger.
    beats = _Beats()
    heart = beats.heart(every=0.05, linger=60.0)
    with heart.beating([_claim("a")]):
        _until(lambda: beats.count("a") >= 1, "a beat of claim a")
    time.sleep(0.2)  # the thread is now waiting out its linger, with nothing to beat
    with heart.beating([_claim("b")]):
        _until(lambda: beats.count("b") >= 1, "a beat of claim b before the linger ends")
