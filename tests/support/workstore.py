"""A store of a test's own schema and approved workflows in it, for the worker tests.

``tests/runtime/test_worker_batch.py`` and ``tests/runtime/test_worker_concurrency.py`` drive real
workers against real PostgreSQL: both need a ``Store`` on the test's schema and a few
approved credit workflows of tenant A.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from lab import pytest_plugin
from lab.runtime import plan, sealing, store

PROPOSER = store.Actor("tenant-a", "employee-a", "proposer")
APPROVER = store.Actor("tenant-a", "manager-a", "approver")


def opened_store(lab_dsn: str, lab_schema: str,
                 request: pytest.FixtureRequest) -> Iterator[store.Store]:
    """The body of a ``db`` fixture: the test's schema, two connections, closed after."""
    opened = store.Store.open(lab_dsn, lab_schema, keys=sealing.load_catalog(),
                              max_connections=2)
    pytest_plugin.reached_database(request.node)
    yield opened
    opened.close()


def approved(db: store.Store, count: int, *, idempotent: bool = True,
             prefix: str = "work") -> list[str]:
    """``count`` approved credit workflows (amounts 100, 101, …); their ids."""
    ids = []
    for index in range(count):
        proposed = plan.Plan(version=plan.SUPPORTED_PLAN_VERSION, action=plan.ACTION,
                             account="account-a", amount_minor=100 + index,
                             currency=plan.CURRENCY, idempotent=idempotent)
        created = db.create(PROPOSER, f"{prefix}-{index}", proposed)
        db.approve(APPROVER, created.id, created.fingerprint, timedelta(hours=1))
        ids.append(created.id)
    return ids
