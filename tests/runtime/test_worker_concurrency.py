"""A looping worker's concurrency (``--concurrency``) on real PostgreSQL and a real tool.

N slots in one process, each a thread with its own workflow in flight and its own claim,
barrier and completion transactions: no transaction carries two slots' workflows.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lab import protocol
from lab.runtime import processes, store, tool, worker
from tests.support import workstore

PROPOSER, APPROVER = workstore.PROPOSER, workstore.APPROVER
ENDPOINT = "http://127.0.0.1:1"


@pytest.fixture
def db(lab_dsn: str, lab_schema: str, request: pytest.FixtureRequest) -> Iterator[store.Store]:
    yield from workstore.opened_store(lab_dsn, lab_schema, request)


def _approved(db: store.Store, count: int) -> list[str]:
    return workstore.approved(db, count, prefix="slots")


@pytest.mark.parametrize(("options", "word"), [
    (processes.WorkerOptions("s", ENDPOINT, concurrency=0), "--concurrency"),
    (processes.WorkerOptions("s", ENDPOINT, loop=True,
                             concurrency=protocol.MAX_CONCURRENCY + 1), "--concurrency"),
    (processes.WorkerOptions("s", ENDPOINT, concurrency=2), "--loop"),
    (processes.WorkerOptions("s", ENDPOINT, loop=True, fused=True, batch=2, concurrency=2),
     "--batch"),
    (processes.WorkerOptions("s", ENDPOINT, loop=True, max_items=3, concurrency=2),
     "--max-items"),
])
def test_concurrency_needs_the_loop_and_is_not_a_batch(
    options: processes.WorkerOptions, word: str, capsys: pytest.CaptureFixture[str],
) -> None:
    assert processes.worker_main(options) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and word in err


def test_slots_drain_a_backlog_each_claim_in_its_own_transaction(
    lab_dsn: str, db: store.Store,
) -> None:
    ids = _approved(db, 9)
    with tool.ToolService(lab_dsn, db.schema, idempotent=True) as service:
        child = processes.spawn_worker(
            lab_dsn, db.schema, service.endpoint, service.token, "slots", "--loop", "--fused",
            "--concurrency", "3", "--idle-exit", "0.5", keys=db.keys,
        )
        try:
            assert child.finish(timeout=60) == 0, child.tail()
        finally:
            child.cleanup()
    assert [db.get(w).state for w in ids] == ["succeeded"] * 9
    assert service.calls == 9
    claimed = [e for e in db.events() if e["kind"] == "claimed"]
    assert sorted(e["workflow_id"] for e in claimed) == sorted(ids)  # each claimed once
    assert {e["detail"] for e in claimed} <= {f"owner=slots.{k}" for k in range(3)}
    # One claim per transaction: no claim shares its commit with another slot's.
    rows = db.execute("SELECT count(DISTINCT xmin::text) AS n FROM events WHERE kind = 'claimed'")
    assert rows[0]["n"] == 9


def test_slots_share_one_clock_of_lease_recovery_sweeps() -> None:
    """A sweep recovers every expired lease, so a process's slots take turns on one clock."""
    options = processes.WorkerOptions("s", ENDPOINT, loop=True, fused=True, concurrency=4)
    runners = processes._runners(options, None, None, lambda stage, workflow: None)  # type: ignore[arg-type]
    assert len({id(runner.sweeps) for runner in runners}) == 1


def test_one_sweep_per_interval_whoever_asks() -> None:
    sweeps = worker.Sweeps(interval=0.5)
    assert [sweeps.take(10.0) for _ in range(4)] == [True, False, False, False]
    assert not sweeps.take(10.4)
    assert sweeps.take(10.5)


def test_finding_no_work_asks_for_one_sweep_then_idles_on_the_interval() -> None:
    sweeps = worker.Sweeps(interval=0.5)
    assert sweeps.take(10.0)
    sweeps.found(True, swept=True)
    assert not sweeps.take(10.1)
    sweeps.found(False, swept=False)  # no work: one sweep before calling this idle
    assert sweeps.take(10.1)
    sweeps.found(False, swept=True)
    for now in (10.2, 10.3, 10.4):  # idle polls do not sweep again before the interval
        assert not sweeps.take(now)
        sweeps.found(False, swept=False)
    assert sweeps.take(10.6)
    sweeps.found(True, swept=True)  # work again: the next empty step asks for a sweep
    sweeps.found(False, swept=False)
    assert sweeps.take(10.7)


def test_a_refused_sweep_is_due_again_at_once() -> None:
    sweeps = worker.Sweeps(interval=0.5)
    assert sweeps.take(10.0)
    sweeps.untake()
    assert sweeps.take(10.01)
