"""The credit tool's HTTP edge: authentication, body limits and fault switches, over real HTTP."""

from __future__ import annotations

import httpx
import pytest

from lab import errors, tool

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
    with tool.ToolClient(endpoint, token, timeout=2) as client, pytest.raises(
        errors.ToolUnavailable
    ):
        client.call(lab.approved())


def test_client_refuses_unsafe_endpoints_and_empty_tokens():
    with pytest.raises(errors.BoundaryViolation):
        tool.ToolClient("http://192.0.2.1:80", "token")
    with pytest.raises(errors.ToolError):
        tool.ToolClient("http://127.0.0.1:80", "")


def test_token_comparison_is_constant_time():
    """The service compares tokens with hmac.compare_digest (checked in the source)."""
    import inspect

    source = inspect.getsource(tool._Handler._authenticated)
    assert "hmac.compare_digest" in source
