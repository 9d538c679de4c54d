"""A looping worker's batch (``--batch``) on real PostgreSQL and a real HTTP tool.

One transaction completes the last batch's confirmed effects and claims the next
batch; a non-idempotent batch commits every start barrier before any request is
sent; the requests are in flight together; one stale completion does not hold the
others back.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from lab import protocol
from lab.runtime import store, tool, toolclient, worker
from tests.support import workstore

PROPOSER, APPROVER = workstore.PROPOSER, workstore.APPROVER


@pytest.fixture
def db(lab_dsn: str, lab_schema: str, request: pytest.FixtureRequest) -> Iterator[store.Store]:
    yield from workstore.opened_store(lab_dsn, lab_schema, request)


def _approved(db: store.Store, count: int, *, idempotent: bool) -> list[str]:
    return workstore.approved(db, count, idempotent=idempotent, prefix=f"batch-{idempotent}")


def _worker(
    db: store.Store, client: toolclient.ToolClient, batch: int, **extra: Any
) -> worker.Worker:
    return worker.Worker(db=db, client=client, name="batcher", lease=timedelta(seconds=30),
                         fused=True, batch=batch, **extra)


def test_a_batch_is_claimed_sent_and_completed_together(lab_dsn: str, db: store.Store) -> None:
    ids = _approved(db, 5, idempotent=True)
    with _service(lab_dsn, db, idempotent=True) as service, \
            toolclient.ToolClient(service.endpoint, service.token) as client:
        runner = _worker(db, client, 3)
        assert runner.step() == []  # three claimed and sent; their completions wait
        assert (runner.pending, service.calls) == (3, 3)
        assert [db.get(w).state for w in ids] == ["running"] * 3 + ["ready"] * 2
        completed = runner.step()  # completes those three, claims and sends the rest
        assert [w.id for w in completed] == ids[:3]
        assert (runner.pending, service.calls) == (2, 5)
        assert [w.id for w in runner.flush()] == ids[3:]
    assert [db.get(w).state for w in ids] == ["succeeded"] * 5
    claimed = [e["workflow_id"] for e in db.events() if e["kind"] == "claimed"]
    assert sorted(claimed) == sorted(ids)  # each claimed once


def test_a_non_idempotent_batch_commits_every_barrier_before_any_request(
    lab_dsn: str, db: store.Store,
) -> None:
    ids = _approved(db, 3, idempotent=False)
    seen: list[tuple[str, str, int]] = []
    with _service(lab_dsn, db, idempotent=False) as service, \
            toolclient.ToolClient(service.endpoint, service.token) as client:

        def hook(stage: str, claim: store.Workflow) -> None:
            seen.append((stage, claim.id, service.calls))

        runner = _worker(db, client, 3, hook=hook)
        runner.step()
        runner.flush()
    stages = [stage for stage, _, _ in seen]
    assert stages == [protocol.AFTER_BATCH, *[protocol.AFTER_CLAIM] * 3,
                      *[protocol.AFTER_BARRIER] * 3, *[protocol.AFTER_TOOL] * 3,
                      *[protocol.AFTER_COMPLETE] * 3]
    assert all(calls == 0 for stage, _, calls in seen if stage == protocol.AFTER_BARRIER)
    assert [db.get(w).state for w in ids] == ["succeeded"] * 3


def test_one_stale_completion_does_not_hold_back_the_rest_of_its_batch(
    lab_dsn: str, db: store.Store,
) -> None:
    good, doomed = _approved(db, 2, idempotent=True)
    with _service(lab_dsn, db, idempotent=True) as service, \
            toolclient.ToolClient(service.endpoint, service.token) as client:
        runner = _worker(db, client, 2)
        assert runner.step() == [] and runner.pending == 2
        # The second one's lease runs out and is recovered before the next step.
        db.execute("UPDATE workflows SET lease_until = clock_timestamp() - interval '1s' "
                   "WHERE id = %s", (doomed,))
        assert db.recover_expired() == 1
        completed = runner.step()
        assert [w.id for w in completed] == [good]
        assert any("Stale" in line for line in runner.log)
        assert db.get(doomed).state == "unknown"
        # The tool's lookup settles it: the effect happened once.
        assert runner.reconcile(doomed).state == "succeeded"
    assert db.get(good).state == "succeeded" and service.calls == 2


def test_a_batch_needs_the_fused_loop_and_a_bounded_size(capsys: pytest.CaptureFixture[str],
                                                         ) -> None:
    from lab.runtime import processes

    for options in (processes.WorkerOptions("s", "http://127.0.0.1:1", batch=0),
                    processes.WorkerOptions("s", "http://127.0.0.1:1",
                                            batch=protocol.MAX_BATCH + 1),
                    processes.WorkerOptions("s", "http://127.0.0.1:1", batch=2)):
        assert processes.worker_main(options) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "--batch" in err


def _service(dsn: str, db: store.Store, *, idempotent: bool) -> tool.ToolService:
    return tool.ToolService(dsn, db.schema, idempotent=idempotent)


def test_a_quiet_worker_prints_no_boundary_lines_but_still_crashes_at_one(
    lab_dsn: str, db: store.Store,
) -> None:
    from lab.runtime import processes

    ids = _approved(db, 2, idempotent=True)
    with _service(lab_dsn, db, idempotent=True) as service:
        child = processes.spawn_worker(
            lab_dsn, db.schema, service.endpoint, service.token, "quiet", "--loop", "--fused",
            "--batch", "2", "--quiet", "--crash-at", protocol.AFTER_TOOL,
        )
        try:
            assert child.finish(expect_exit=None) == -signal.SIGKILL
            lines = child.all_lines()
        finally:
            child.cleanup()
    assert not [line for line in lines
                if line.startswith((protocol.STAGE, protocol.ITEM))], lines
    assert service.calls == 2  # it died after both replies, as --crash-at after_tool says
    assert [db.get(w).state for w in ids] == ["running", "running"]
