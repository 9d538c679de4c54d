"""A peer's step that hands its side effect to the lab: one function both peers call.

LangGraph's credit node (``lab.peers.langgraph_peer``, delegate mode) and Temporal's
credit activity (``lab.peers.temporal_peer``, delegate mode) keep their engine's control
flow and retries, but the effect itself goes through a lab worker: the lease, the fence,
the start barrier and the effect key. A step the engine re-runs after a crash therefore
never calls the tool a second time: it finds the lab workflow ``running`` under a dead
predecessor's lease (which runs out on PostgreSQL's clock and turns the work
``unknown``), or ``unknown`` already, and reconciles it through the tool's lookup
instead, or leaves it to a person when nothing can prove what happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lab import errors, protocol
from lab.runtime import store, toolclient, worker

LAB_LEASE = timedelta(seconds=3)
# How long a re-run step waits for a dead predecessor's lease to run out (it is
# LAB_LEASE; the margin is for a loaded machine).
SETTLE_SECONDS = 30.0


def carry_out(
    db: store.Store,
    client: toolclient.ToolClient,
    workflow_id: str,
    *,
    name: str,
    after_tool: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Carry out the approved lab workflow ``workflow_id`` as a worker called ``name``, or
    settle what a crashed predecessor left of it; the lab's final view as plain data.

    ``after_tool`` is called once the tool answered (the crash window after the effect).
    A workflow that must wait for a person is reported as such (its state ``unknown``
    and the recorded reason), not raised: the engine's step has ended either way.
    """

    def hook(stage: str, claim: store.Workflow) -> None:
        if stage == protocol.AFTER_TOOL and after_tool is not None:
            after_tool()

    runner = worker.Worker(db=db, client=client, name=name, lease=LAB_LEASE, hook=hook)
    deadline = time.monotonic() + SETTLE_SECONDS
    current = db.get(workflow_id)
    while current.state == "running" and time.monotonic() < deadline:
        db.recover_expired()
        time.sleep(0.1)
        current = db.get(workflow_id)
    if current.state == "running":
        raise TimeoutError(
            f"lab workflow {workflow_id} still running under another worker's lease "
            f"after {SETTLE_SECONDS:g}s"
        )
    try:
        if current.state == "ready":
            runner.run_one()
        elif current.state == "unknown":
            runner.reconcile(workflow_id)
    except errors.ManualReview:
        # The lab has recorded why a person must decide; the step reports that state.
        pass
    final = db.get(workflow_id)
    receipt = db.receipt_of(final)
    return {"lab_state": final.state, "review_reason": final.review_reason,
            "receipt": None if receipt is None else receipt.to_json()}
