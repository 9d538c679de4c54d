"""Chapter 8: audit events carry no secrets, and nothing leaves the loopback boundary."""

from __future__ import annotations

import dataclasses
import os
import secrets as secret_values

import pytest
from psycopg import conninfo

from lab import errors, harness, loopback, protocol
from lab.runtime import store, toolclient

REMOTE_DSNS = [
    "postgres://book:book-lab-only@192.0.2.1:25432/book?sslmode=disable",
    "host=127.0.0.1,192.0.2.1 port=25432,25432 user=book password=book-lab-only "
    "dbname=book sslmode=disable",
]
UNSAFE_ENDPOINTS = [
    "http://192.0.2.1:8080",
    "https://127.0.0.1:8080",
    "http://user:secret@127.0.0.1:8080",
    "http://127.0.0.1:8080?token=secret",
]


def test_events_exclude_raw_sensitive_inputs(lab, lab_dsn, observe):
    """The audit trail records kinds and identifiers only: no account, amount, token,
    header or database password appears in any event of a full successful run."""
    # The account is the run's secret: given by the caller, else drawn now.
    given = os.environ.get(protocol.CANARY_ACCOUNT_ENV, "")
    account = given or f"private-account-{secret_values.token_hex(8)}"
    private = dataclasses.replace(harness.sample_plan(True), account=account)
    created = lab.approved(plan=private)
    rig = lab.credit_tool(idempotent=True)
    assert rig.worker.run_one() is not None
    assert lab.state(created.id).state == "succeeded"
    secrets = [private.account, rig.service.token, "amount_minor", "Authorization",
               "book-lab-only"]
    password = conninfo.conninfo_to_dict(lab_dsn).get("password")
    if password:
        secrets.append(str(password))
    events = lab.store.events()
    for event in events:
        text = f"{event['kind']} {event['detail']}"
        for secret in secrets:
            assert secret not in text, f"raw sensitive event content in {event['kind']}"
    assert len(events) >= 4, "missing audit events"
    observe({
        "events_checked": len(events),
        "raw_sensitive_markers_found": 0,
        "scope": "events kind/detail; workflow and tool ledger intentionally retain "
        "business fields",
        # Who chose the account: "caller" lets a search of the run's files for it mean
        # something. It depends on the caller's environment, so it is a measurement.
        "account_from": "caller" if given else "drawn",
    }, facts=("events_checked", "raw_sensitive_markers_found", "scope"),
        measurements=("account_from",))


def test_loopback_boundaries_reject_remote_targets(observe):
    """A database DSN whose primary or fallback host is remote, and a tool endpoint that
    is remote, encrypted elsewhere, or carries credentials or a query, are refused before
    any connection is attempted."""
    refused_dsns = 0
    for dsn in REMOTE_DSNS:
        with pytest.raises(errors.BoundaryViolation) as refused:
            store.Store.open(dsn, "wf_boundary")
        assert "book-lab-only" not in str(refused.value)
        refused_dsns += 1
    refused_endpoints = 0
    for endpoint in UNSAFE_ENDPOINTS:
        with pytest.raises(errors.BoundaryViolation):
            toolclient.ToolClient(endpoint, "token")
        refused_endpoints += 1
    pinned = conninfo.conninfo_to_dict(
        loopback.check_dsn("host=localhost port=5432 dbname=book", environ={})
    )
    assert pinned.get("hostaddr") == "127.0.0.1"
    observe({
        "remote_dsns_refused": f"{refused_dsns}/{len(REMOTE_DSNS)}",
        "unsafe_endpoints_refused": f"{refused_endpoints}/{len(UNSAFE_ENDPOINTS)}",
        "localhost_pinned_to": pinned.get("hostaddr"),
    }, facts=("remote_dsns_refused", "unsafe_endpoints_refused", "localhost_pinned_to"))

