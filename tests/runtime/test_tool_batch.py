"""The credit tool's batch request (``POST /effects/batch``) over real HTTP and PostgreSQL.

Each item of a batch is treated as its own ``POST /effects`` would be (rate limit, faults,
fence, ledger outcome); a dropped reply loses every item's answer; a bad batch is refused
whole with nothing written; a tool process that dies inside a batch leaves only the items
it had committed.
"""

from __future__ import annotations

import json
import secrets
import threading
from typing import Any

import httpx
import pytest

from lab import errors
from lab.harness import Harness, Rig
from lab.runtime import tool, toolclient, toolprocess, toolwire
from lab.runtime.plan import Receipt

ITEM = {
    "effect_key": "ek1_" + "a" * 64,
    "fingerprint": "f" * 64,
    "account": "account-a",
    "amount_minor": 500,
    "currency": "CNY",
}


@pytest.fixture
def rig(lab: Harness) -> Rig:
    return lab.credit_tool()


@pytest.fixture
def service(rig: Rig) -> tool.ToolService:
    return rig.service


def _post_batch(service: tool.ToolService, content: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {service.token}", "Content-Type": "application/json"}
    with httpx.Client(base_url=service.endpoint, trust_env=False) as client:
        return client.post(toolwire.BATCH_PATH, content=content, headers=headers)


def _items(count: int, **extra: Any) -> list[dict[str, Any]]:
    return [{**ITEM, "effect_key": f"ek1_{i:064d}", **extra} for i in range(count)]


def test_a_batch_answers_each_item_as_its_single_post_would(lab: Harness, rig: Rig,
                                                             service: tool.ToolService) -> None:
    """Receipts per item, idempotent replays give the same receipts, counted per item; the
    batch's answers equal those of the single POSTs of the same works."""
    jobs = [lab.approved() for _ in range(3)]
    first = rig.client.call_all([(job, None) for job in jobs])
    assert all(isinstance(r, Receipt) for r in first)
    assert [r.effect_key for r in first if isinstance(r, Receipt)] == [j.effect_key for j in jobs]
    again = rig.client.call_all([(job, None) for job in jobs])
    singles = [rig.client.call(job) for job in jobs]
    assert first == again == singles
    assert lab.effects() == 3 and service.calls == 9


def test_a_key_reused_with_another_plan_is_refused_alone(lab: Harness, rig: Rig,
                                                         service: tool.ToolService) -> None:
    taken = lab.approved()
    rig.client.call(taken)
    reused = {**ITEM, "effect_key": taken.effect_key, "fingerprint": "0" * 64}
    reply = _post_batch(service, json.dumps({"items": [reused, *_items(2)]}).encode())
    assert reply.status_code == 200
    results = reply.json()["results"]
    assert [r["status"] for r in results] == [409, 200, 200]
    assert results[0]["body"] == {"error": "effect_key_reused_with_other_plan"}
    assert lab.effects() == 3


def test_per_item_faults_are_drawn_as_for_single_posts(lab: Harness, rig: Rig,
                                                       service: tool.ToolService) -> None:
    """The first item is rate limited, the second fails before its commit, the third after
    it, the fourth is written: four requests' worth of fault switches, in order."""
    jobs = [lab.approved() for _ in range(4)]
    service.reject_next(1)
    service.fail_next(500, commit="before")
    service.fail_next(503, commit="after")
    replies = rig.client.call_all([(job, None) for job in jobs])
    assert isinstance(replies[0], errors.RateLimited)
    assert isinstance(replies[1], errors.OutcomeUnknown) and "HTTP 500" in str(replies[1])
    assert isinstance(replies[2], errors.OutcomeUnknown) and "HTTP 503" in str(replies[2])
    assert isinstance(replies[3], Receipt)
    assert (service.rejected, service.failed, service.calls) == (1, 2, 4)
    assert lab.effects() == 2
    assert rig.client.lookup(jobs[1].effect_key) is None
    assert rig.client.lookup(jobs[2].effect_key) is not None


def test_a_dropped_batch_reply_leaves_every_item_unknown(lab: Harness, rig: Rig,
                                                         service: tool.ToolService) -> None:
    """One drop is drawn for the request: all its effects are committed, every answer lost;
    each is then found by the lookup, as a single lost reply's would be."""
    jobs = [lab.approved() for _ in range(3)]
    service.drop_next_reply()
    replies = rig.client.call_all([(job, None) for job in jobs])
    assert all(isinstance(r, errors.OutcomeUnknown) for r in replies), replies
    assert service.dropped == 1 and lab.effects() == 3
    for job in jobs:
        found = rig.client.lookup(job.effect_key, fence=job.fence)
        assert found is not None and found.effect_key == job.effect_key
    # The drop was used up: the next batch is answered.
    assert all(isinstance(r, Receipt) for r in rig.client.call_all([(j, None) for j in jobs]))


def test_a_fenced_lookup_refuses_its_item_and_no_other(lab: Harness, rig: Rig,
                                                       service: tool.ToolService) -> None:
    closed, open_ = lab.approved(), lab.approved()
    assert rig.client.lookup(closed.effect_key, fence=closed.fence) is None  # the tombstone
    replies = rig.client.call_all([(closed, None), (open_, None)])
    assert isinstance(replies[0], errors.StartFenced)
    assert isinstance(replies[1], Receipt)
    assert service.fenced == 1 and lab.effects() == 1


@pytest.mark.parametrize(("body", "status", "detail"), [
    (b"{not json", 400, None),
    (b"[]", 422, "nothing else"),
    (b'{"items": []}', 422, "1 to 64"),
    (json.dumps({"items": _items(toolwire.MAX_BATCH_ITEMS + 1)}).encode(), 422, "1 to 64"),
    (json.dumps({"items": [*_items(2), {**ITEM, "amount_minor": 0}]}).encode(), 422,
     "item 2 is not a valid effect request"),
    (json.dumps({"items": _items(2, fence=-1)}).encode(), 422, "fence"),
    (json.dumps({"items": _items(2, fence=True)}).encode(), 422, "fence"),
    (json.dumps({"items": _items(2, start_id="st1_x")}).encode(), 422, "start_id"),
    (json.dumps({"items": _items(2, traceparent="00-x")}).encode(), 422, "traceparent"),
    (json.dumps({"items": [*_items(1), "x"]}).encode(), 422, "not an object"),
    (b"x" * (toolwire.MAX_BATCH_BODY_BYTES + 1), 413, "bytes"),
])
def test_a_bad_batch_is_refused_whole_with_nothing_written(
    lab: Harness, service: tool.ToolService, body: bytes, status: int, detail: str | None,
) -> None:
    reply = _post_batch(service, body)
    assert reply.status_code == status
    if detail is not None:
        said = reply.json()["detail"]
        assert detail in said and "\n" not in said
    assert lab.effects() == 0 and service.calls == 0


def test_the_client_splits_a_batch_past_the_limit_and_an_unreachable_tool_fails_each_item(
    lab: Harness, rig: Rig, service: tool.ToolService,
) -> None:
    jobs = [lab.approved() for _ in range(toolwire.MAX_BATCH_ITEMS + 1)]
    replies = rig.client.call_all([(job, None) for job in jobs])
    assert all(isinstance(r, Receipt) for r in replies)
    assert lab.effects() == len(jobs)
    service.stop()  # never delivered: every item is ToolUnavailable, as its single POST
    with toolclient.ToolClient(service.endpoint, service.token, timeout=2) as client:
        gone = client.call_all([(job, None) for job in jobs[:2]])
    assert all(isinstance(r, errors.ToolUnavailable) for r in gone), gone


def test_a_ledger_that_is_away_answers_each_item_503(lab: Harness, rig: Rig,
                                                      service: tool.ToolService) -> None:
    service._ledger.stop()
    replies = rig.client.call_all([(lab.approved(), None) for _ in range(2)])
    assert all(isinstance(r, errors.OutcomeUnknown) and "HTTP 503" in str(r) for r in replies)
    assert lab.effects() == 0


def test_a_tool_process_dying_inside_a_batch_keeps_only_its_first_items(lab: Harness) -> None:
    """``--fail-before 1``: the real tool process commits the first item and SIGKILLs itself;
    every item is unknown to the client; a restarted tool finds the first and not the rest."""
    jobs = [lab.approved() for _ in range(3)]
    tools = toolprocess.ToolProcess(lab.dsn, lab.schema, idempotent=True,
                                    token=secrets.token_urlsafe(18))
    try:
        tools.start("--fail-before", "1")
        with toolclient.ToolClient(tools.endpoint, tools.token) as client:
            replies = client.call_all([(job, None) for job in jobs])
            assert all(isinstance(r, errors.OutcomeUnknown) for r in replies), replies
            assert tools.current.finish(timeout=10, expect_exit=None) == -9
            assert lab.effects() == 1
            tools.start()
            found = [client.lookup(job.effect_key, fence=job.fence) for job in jobs]
        assert [f is not None for f in found] == [True, False, False]
        assert tools.stages().count("after_effect") == 1
    finally:
        tools.close()


def test_a_batch_holds_all_its_armed_items_at_once(lab: Harness, rig: Rig,
                                                    service: tool.ToolService) -> None:
    """Three holds armed, one batch of three: all three are held together (as three
    concurrent requests would be), nothing is written until they are released."""
    jobs = [lab.approved() for _ in range(3)]
    holds = [service.hold_next(seconds=30) for _ in jobs]
    replies: list[Receipt | errors.ToolError] = []
    caller = threading.Thread(
        target=lambda: replies.extend(rig.client.call_all([(job, None) for job in jobs])))
    caller.start()
    for hold in holds:
        hold.wait_held()
    assert lab.effects() == 0 and service.held == 3
    for hold in holds:
        hold.release()
    for hold in holds:
        hold.wait_finished()
    caller.join(timeout=10)
    assert all(isinstance(r, Receipt) for r in replies) and lab.effects() == 3
