"""A looping worker's concurrency (``--concurrency``) on real PostgreSQL and a real tool.

N slots in one process, each a thread with its own workflow in flight and its own claim,
barrier and completion transactions: no transaction carries two slots' workflows.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lab import protocol
from lab.runtime import processes, store, tool
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
