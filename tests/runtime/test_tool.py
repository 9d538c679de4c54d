"""The credit tool's HTTP edge: authentication, body limits and fault switches, over real HTTP."""

from __future__ import annotations

import ssl
import threading

import httpx
import pytest

from lab import errors
from lab.runtime import tool, toolclient

VALID_BODY = {
    "effect_key": "ek1_" + "a" * 64,
    "fingerprint": "f" * 64,
    "account": "account-a",
    "amount_minor": 500,
    "currency": "CNY",
}


@pytest.fixture
def rig(lab):
    return lab.credit_tool()


@pytest.fixture
def service(rig):
    return rig.service


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer x y", "Bearer wrong-token", "Basic dXNlcjpwYXNz", "bearer {token}",
     "Bearer {token}x", "Bearer  {token}", "{token}"],
)
def test_bad_tokens_get_401_and_never_touch_the_ledger(lab, service, authorization):
    headers = {}
    if authorization is not None:
        headers["Authorization"] = authorization.format(token=service.token)
    with httpx.Client(base_url=service.endpoint, trust_env=False) as client:
        post = client.post("/effects", json=VALID_BODY, headers=headers)
        get = client.get(f"/effects/{VALID_BODY['effect_key']}", headers=headers)
    assert post.status_code == 401
    assert get.status_code == 401
    assert service.calls == 0 and service.lookups == 0
    assert lab.effects() == 0
    assert service.token not in post.text


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b'{"effect_key": 1}', 422),
        (b"[]", 422),
        (b'{"effect_key":"k","fingerprint":"f","account":"a","amount_minor":0,"currency":"CNY"}',
         422),
        (b'{"effect_key":"k","fingerprint":"f","account":"a","amount_minor":true,'
         b'"currency":"CNY"}', 422),
        (b'{"effect_key":"k","fingerprint":"f","account":"a","amount_minor":9223372036854775808,'
         b'"currency":"CNY"}', 422),
        (b'{"effect_key":"k","fingerprint":"f","account":"a\\u0000","amount_minor":1,'
         b'"currency":"CNY"}', 422),
        (b'{"effect_key":"k\\ud800","fingerprint":"f","account":"a","amount_minor":1,'
         b'"currency":"CNY"}', 422),
        (b"x" * 5000, 413),
    ],
)
def test_malformed_or_oversized_bodies_get_4xx_without_a_write(lab, service, body, status):
    headers = {"Authorization": f"Bearer {service.token}", "Content-Type": "application/json"}
    with httpx.Client(base_url=service.endpoint, trust_env=False) as client:
        response = client.post("/effects", content=body, headers=headers)
    assert response.status_code == status
    assert lab.effects() == 0


def test_idempotent_tool_keeps_one_effect_per_key_and_refuses_key_reuse(lab, rig, service):
    client = rig.client
    job = lab.approved()
    first = client.call(job)
    again = client.call(job)
    assert first == again
    assert lab.effects() == 1
    with httpx.Client(base_url=service.endpoint, trust_env=False) as raw:
        other_plan = {**VALID_BODY, "effect_key": job.effect_key, "fingerprint": "0" * 64}
        reused = raw.post("/effects", json=other_plan,
                          headers={"Authorization": f"Bearer {service.token}"})
    assert reused.status_code == 409
    assert lab.effects() == 1


def test_non_idempotent_tool_records_every_call_and_has_no_lookup(lab):
    rig = lab.credit_tool(idempotent=False)
    job = lab.approved(idempotent=False)
    rig.client.call(job)
    rig.client.call(job)
    assert lab.effects() == 2  # a replay would be visible, which is the point
    with pytest.raises(errors.ToolRefused):
        rig.client.lookup(job.effect_key)


def test_dropped_reply_is_an_unknown_outcome_after_the_commit(lab, rig, service):
    client = rig.client
    service.drop_responses = True
    with pytest.raises(errors.OutcomeUnknown):
        client.call(lab.approved())
    assert lab.effects() == 1
    assert service.dropped == 1


def test_unreachable_tool_is_never_dispatched(lab):
    rig = lab.credit_tool()
    endpoint, token = rig.service.endpoint, rig.service.token
    rig.service.stop()
    with toolclient.ToolClient(endpoint, token, timeout=2) as client, pytest.raises(
        errors.ToolUnavailable
    ):
        client.call(lab.approved())


def test_client_refuses_unsafe_endpoints_and_empty_tokens():
    with pytest.raises(errors.BoundaryViolation):
        toolclient.ToolClient("http://192.0.2.1:80", "token")
    with pytest.raises(errors.ToolError):
        toolclient.ToolClient("http://127.0.0.1:80", "")


def test_token_comparison_is_constant_time():
    """The service compares tokens with hmac.compare_digest (checked in the source)."""
    import inspect

    source = inspect.getsource(tool._Handler._authenticated)
    assert "hmac.compare_digest" in source


# -- the documented fault switches -------------------------------------------------------


@pytest.mark.parametrize(("commit", "written"), [("before", 0), ("after", 1)])
def test_fail_next_answers_500_before_or_after_the_commit(lab, rig, service, commit, written):
    """fail_next answers the armed status once; "before" writes nothing, "after" writes the
    effect; the next call is served normally and replays nothing."""
    job = lab.approved()
    service.fail_next(500, commit=commit)
    with pytest.raises(errors.OutcomeUnknown, match="HTTP 500"):
        rig.client.call(job)
    assert lab.effects() == written
    assert service.failed == 1
    receipt = rig.client.call(job)
    assert receipt.effect_key == job.effect_key
    assert lab.effects() == 1 and service.calls == 2 and service.failed == 1


def test_fail_next_counts_and_statuses(lab, rig, service):
    """A count arms that many failures with the given status; bad arguments are refused."""
    service.fail_next(503, count=2)
    for _ in range(2):
        with pytest.raises(errors.OutcomeUnknown, match="HTTP 503"):
            rig.client.call(lab.approved())
    rig.client.call(lab.approved())
    assert service.failed == 2 and lab.effects() == 1
    for bad in ({"status": 404}, {"status": True}, {"commit": "during"}, {"count": -1}):
        with pytest.raises(ValueError):
            service.fail_next(**bad)


def test_drop_next_reply_drops_only_the_armed_replies(lab, rig, service):
    """drop_next_reply commits the effect and loses the reply once, then replies again."""
    job = lab.approved()
    service.drop_next_reply()
    with pytest.raises(errors.OutcomeUnknown):
        rig.client.call(job)
    assert lab.effects() == 1 and service.dropped == 1
    assert rig.client.call(job).effect_key == job.effect_key
    assert service.dropped == 1


def test_reject_next_answers_429_and_writes_nothing(lab, rig, service):
    service.reject_next(2)
    for _ in range(2):
        with pytest.raises(errors.RateLimited):
            rig.client.call(lab.approved())
    assert service.rejected == 2 and lab.effects() == 0
    rig.client.call(lab.approved())
    assert lab.effects() == 1


def test_hold_next_keeps_the_request_in_flight_until_released(lab, rig, service):
    """A held request has written nothing until it is released; then it completes."""
    job = lab.approved()
    hold = service.hold_next(seconds=10)
    results: list[object] = []
    caller = threading.Thread(target=lambda: results.append(rig.client.call(job)))
    caller.start()
    hold.wait_held()
    assert hold.arrived and not hold.finished
    assert lab.effects() == 0, "a held request wrote before its release"
    assert service.held == 1
    hold.release()
    hold.wait_finished()
    caller.join(timeout=10)
    assert lab.effects() == 1 and len(results) == 1


def test_hold_after_commit_has_written_the_effect(lab, rig, service):
    job = lab.approved()
    hold = service.hold_next(seconds=10, commit="after")
    caller = threading.Thread(target=rig.client.call, args=(job,))
    caller.start()
    hold.wait_held()
    assert lab.effects() == 1
    hold.release()
    hold.wait_finished()
    caller.join(timeout=10)
    assert not caller.is_alive()


def test_an_unreleased_hold_ends_by_itself(lab, rig, service):
    hold = service.hold_next(seconds=0.2)
    rig.client.call(lab.approved())
    hold.wait_finished()  # the handler marks it after writing the reply the call returned
    assert hold.arrived and lab.effects() == 1


def test_slow_next_delays_the_commit_past_a_short_client_timeout(lab, service):
    """A slow tool past the client's timeout is an unknown outcome whose effect lands later."""
    service.slow_next(0.6)
    with toolclient.ToolClient(service.endpoint, service.token, timeout=0.2) as client, \
            pytest.raises(errors.OutcomeUnknown):
        client.call(lab.approved())
    lab.wait_until(lambda: lab.effects() == 1, within=5, what="the slow effect")
    assert service.slowed == 1


def test_stopping_the_service_releases_a_forgotten_hold(lab, rig, service):
    """stop() lets a held request finish instead of leaving its caller hanging."""
    hold = service.hold_next(seconds=60)
    outcomes: list[object] = []

    def call() -> None:
        try:
            outcomes.append(rig.client.call(lab.approved()))
        except errors.ToolError as exc:
            outcomes.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    hold.wait_held()
    service.stop()
    caller.join(timeout=10)
    assert hold.finished and not caller.is_alive() and len(outcomes) == 1


def _post_together(service, bodies):
    """POST ``bodies`` from one thread each, released together; their statuses, in order."""
    statuses: list[int] = [0] * len(bodies)
    gate = threading.Barrier(len(bodies))

    def post(index: int) -> None:
        with httpx.Client(base_url=service.endpoint, trust_env=False) as client:
            gate.wait()
            statuses[index] = client.post(
                "/effects", json=bodies[index],
                headers={"Authorization": f"Bearer {service.token}"}).status_code

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


def test_requests_sharing_a_commit_keep_one_effect_per_key(lab, service):
    # Sent together, these land in one or a few of the ledger's group commits: the same
    # key still gives one effect, and its other plan a 409, however they were grouped.
    same = [{**VALID_BODY, "effect_key": "ek1_" + "b" * 64} for _ in range(6)]
    other_plan = {**VALID_BODY, "effect_key": "ek1_" + "b" * 64, "fingerprint": "0" * 64}
    distinct = [{**VALID_BODY, "effect_key": f"ek1_{i:064d}"} for i in range(8)]
    statuses = _post_together(service, [*same, other_plan, *distinct])
    assert lab.effects() == 1 + 8
    # Whichever plan came first took the key: its requests get 200, the other plan's 409.
    assert statuses[:7] in ([200] * 6 + [409], [409] * 6 + [200]), statuses
    assert statuses[7:] == [200] * 8


def test_a_row_the_database_refuses_does_not_fail_the_rest_of_its_group(lab, service):
    from lab.runtime import ledger

    def effect(key: str, amount: int) -> ledger.Effect:
        return ledger.Effect(effect_key=key, fingerprint="f" * 64, account="a",
                             amount_minor=amount, currency="CNY", trace_id=None, start_id=None)

    # Past the HTTP edge's checks (which refuse such an amount with 422), straight into one
    # group: the database refuses the bigint overflow, and the good rows are still written.
    group = [ledger._Waiting(effect("ek-good-1", 1)), ledger._Waiting(effect("ek-bad", 2**63)),
             ledger._Waiting(effect("ek-good-2", 2))]
    service._ledger._write(group)
    assert [w.outcome.exception() is None for w in group] == [True, False, True]
    assert group[0].outcome.result() is not None and group[2].outcome.result() is not None
    assert lab.effects() == 2


def test_stopping_the_ledger_answers_queued_requests_without_writing(lab, service):
    from lab.runtime import ledger

    service._ledger.stop()
    with pytest.raises(ledger.LedgerBusy):
        service._ledger.record(ledger.Effect(
            effect_key="ek-late", fingerprint="f" * 64, account="a", amount_minor=1,
            currency="CNY", trace_id=None, start_id=None))
    with httpx.Client(base_url=service.endpoint, trust_env=False) as client:
        reply = client.post("/effects", json=VALID_BODY,
                            headers={"Authorization": f"Bearer {service.token}"})
    assert reply.status_code == 503
    assert lab.effects() == 0


def test_each_calling_thread_has_its_own_connection_and_close_ends_them_all(lab, service):
    """Slots in threads never share a pool (or its lock); after close nothing is sent."""
    client = toolclient.ToolClient(service.endpoint, service.token, timeout=5)
    receipts: list[object] = []

    def call() -> None:
        receipts.append(client.call(lab.approved()))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(receipts) == 3 and lab.effects() == 3
    assert len(client._transports) == 3  # one httpx transport per thread that called
    # They share one TLS context with no CA loaded (the endpoint is plain http): a
    # transport costs no CA bundle, and TLS, were it ever attempted, would verify nothing.
    contexts = {id(transport._pool._ssl_context) for transport in client._transports}
    assert contexts == {id(client._tls)}
    assert client._tls.cert_store_stats()["x509_ca"] == 0
    assert client._tls.verify_mode == ssl.CERT_REQUIRED
    client.close()
    with pytest.raises(errors.ToolUnavailable):
        client.call(lab.approved())
    assert lab.effects() == 3
