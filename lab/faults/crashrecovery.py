"""How a crash-point cell ends: its processes' exits awaited with a deadline, and its
workflows settled as an operator's recoverer would (expired leases, reconciliation through
the tool's fenced lookup, requeued work run again), on the real lease and PostgreSQL's
clock."""

from __future__ import annotations

import time
from datetime import timedelta

from lab import errors
from lab.faults.crashscripts import CELL_TIMEOUT_S, LEASE_S
from lab.runtime import processes, store, toolclient, worker
from lab.runtime import toolprocess as toolprocesses


def exit_code(child: processes.WorkerProcess) -> int:
    """Wait for ``child`` to exit by itself; its code (negative: the signal)."""
    deadline = time.monotonic() + CELL_TIMEOUT_S
    while child.alive():
        if time.monotonic() > deadline:
            raise errors.CheckFailed(f"{child.name} did not exit within {CELL_TIMEOUT_S}s")
        time.sleep(0.01)
    return child.cleanup()


def recover(
    db: store.Store, tools: toolprocesses.ToolProcess, workflow_id: str
) -> tuple[store.Workflow, list[str]]:
    """Recover as an operator's recoverer: expired leases, reconciliation, requeued work."""
    actions: list[str] = []
    deadline = time.monotonic() + CELL_TIMEOUT_S
    with toolclient.ToolClient(tools.endpoint, tools.token) as client:
        recoverer = worker.Worker(db=db, client=client, name="recoverer",
                                  lease=timedelta(seconds=LEASE_S))
        while True:
            try:
                current = db.get(workflow_id)
            except errors.StoreError:
                # The server is still coming back after a restart: try again shortly.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
                continue
            settled = current.state in store.TERMINAL_STATES or (
                current.state == "unknown" and bool(current.review_reason))
            if settled or time.monotonic() > deadline:
                return current, actions
            if current.state == "running":
                if db.lease_expired(workflow_id) and db.recover_expired():
                    actions.append("lease_expired")
                else:
                    time.sleep(0.02)
            elif current.state == "unknown":
                try:
                    settled_as = recoverer.reconcile(workflow_id)
                    actions.append({"succeeded": "reconciled_found",
                                    "ready": "reconciled_requeued"}.get(
                                        settled_as.state, f"reconciled_{settled_as.state}"))
                except errors.ManualReview as exc:
                    actions.append(f"review:{exc.reason}")
                except (errors.Stale, errors.ToolError, errors.StoreError):
                    time.sleep(0.05)
            elif current.state == "ready":
                due = db.execute("SELECT ready_at <= clock_timestamp() AS due FROM workflows "
                                 "WHERE id = %s", (workflow_id,))[0]["due"]
                try:
                    ran = due and recoverer.run_one() is not None
                except errors.StoreError:
                    ran = False
                if ran:
                    actions.append("ran_again")
                else:
                    time.sleep(0.02)
            else:
                time.sleep(0.05)
