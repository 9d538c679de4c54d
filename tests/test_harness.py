"""The author-facing helpers that need no database: actors, plans, and process exits."""

from __future__ import annotations

import sys

import pytest

from lab import errors, harness
from lab.runtime import plan, processes


def test_actor_for_any_tenant_and_role():
    approver = harness.actor("tenant-b", "approver")
    assert (approver.tenant, approver.role, approver.subject) == (
        "tenant-b", "approver", "approver-tenant-b"
    )
    assert harness.actor("tenant-b", "reviewer", "alice").subject == "alice"
    with pytest.raises(ValueError, match="role must be one of"):
        harness.actor("tenant-b", "admin")
    with pytest.raises(ValueError, match="tenant"):
        harness.actor("", "approver")


def test_the_amount_limits_are_the_ones_admission_enforces():
    low, high = harness.AMOUNT_RANGE
    assert (low, high) == (1, 10_000)
    harness.sample_plan(amount_minor=high).validate()
    for amount in (low - 1, high + 1):
        with pytest.raises(errors.Rejected, match="amount_minor"):
            harness.sample_plan(amount_minor=amount).validate()
    assert harness.ACCOUNTS == plan.ACCOUNTS


@pytest.fixture
def exiting():
    started: list[processes.WorkerProcess] = []

    def start(code: int) -> processes.WorkerProcess:
        child = processes.WorkerProcess(
            [sys.executable, "-c", f"import sys; sys.exit({code})"], env={}, name="child"
        )
        started.append(child)
        return child

    yield start
    for child in started:
        child.cleanup()


def test_finish_returns_the_expected_exit_and_refuses_another(exiting):
    assert exiting(1).finish(timeout=30, expect_exit=1) == 1
    assert exiting(3).finish(timeout=30, expect_exit=None) == 3
    with pytest.raises(AssertionError, match="child exited 1, expected 0"):
        exiting(1).finish(timeout=30)
