"""Chapter 11: the database itself dies mid-window, and the workflow still ends right.

The run's shared server cannot be killed under other experiments, so this chapter
starts its own embedded PostgreSQL in durable mode (fsync=on, synchronous_commit=on,
on disk) and SIGKILLs its postmaster while a real worker OS process is inside one
window of a workflow: after its claim, after its start barrier (the tool call is
held in flight by a blackholed link), and after the tool's effect but before the
completion. The postmaster restarts on the same data directory and recovers from
its WAL; the worker rides out the outage; an operator's recoverer (lease recovery
and lookup reconciliation, as in chapter 5) settles the rest. The invariant
checker then reads the whole history.
"""

from __future__ import annotations

import contextlib
import queue
import time

import pytest

from lab import errors, harness
from lab.faults import chaos, diagnostics, invariants, proxy
from lab.runtime import store

WINDOWS = ("after_claim", "after_barrier", "after_tool")


@pytest.mark.parametrize("window", WINDOWS)
def test_postgres_killed_mid_window_recovers_without_violation(
    killable_lab: harness.Harness, killable_postgres, observe, window: str
) -> None:
    """PostgreSQL (fsync and synchronous commits on) SIGKILLed while a worker process is
    after its claim, after its start barrier with the tool call in flight, or after the
    tool's effect before its completion: it restarts on the same data, the worker rides
    out the outage, recovery settles the workflow as succeeded with exactly one effect,
    and the invariant checker finds no violation in the whole history."""
    lab = killable_lab
    rig = lab.credit_tool(idempotent=True)
    job = lab.approved(idempotent=True)
    durability = diagnostics.server_settings(lab.store)
    assert durability["fsync"] == "on" and durability["synchronous_commit"] == "on"
    link = proxy.Proxy("127.0.0.1", int(rig.service.endpoint.rsplit(":", 1)[1]), "worker-tool")
    link.start()
    pause = {"after_claim": ("--pause", "after_claim"),
             "after_tool": ("--pause", "after_tool")}.get(window, ())
    child = lab.spawn_worker(
        rig, "crashed", "--loop", "--idle-exit", "60", "--lease", "2", "--heartbeat", "0.5",
        *pause, endpoint=f"http://127.0.0.1:{link.port}",
    )
    try:
        if window == "after_barrier":
            link.partition(proxy.BLACKHOLE)  # the call will leave the worker, not arrive
            child.wait_for("BOOK_STAGE after_claim", timeout=30)
            lab.wait_until(lambda: lab.store.barrier_for(job.id, job.fence + 1) is not None,
                           within=15, what="the start barrier to commit")
            assert lab.effects() == 0
        else:
            child.wait_for(f"BOOK_STAGE {window}", timeout=30)
        effects_at_crash = lab.effects()
        lab.mark("experiment", f"SIGKILL postmaster ({window})")
        down = killable_postgres.crash_restart()
        lab.mark("postgresql", f"restarted after {down:.2f}s")
        if window == "after_barrier":
            link.heal()
        else:
            child.release()
        final = _settle(lab, rig, job.id, child, window)
        history = harness.retrying(lambda: invariants.load(lab.dsn, lab.schema,
                                                           open_result=lab.store.keys.open))
        found = invariants.check(history)
        assert child.alive(), f"the worker exited on a lost database; {child.stderr[-500:]}"
    finally:
        child.cleanup()
        link.stop()
    effects = lab.effects()
    observe({
        "window": window,
        "durability": {k: durability[k] for k in ("fsync", "synchronous_commit")},
        "postmaster": "SIGKILL, restarted on the same data directory",
        "effects_when_killed": effects_at_crash,
        "state": final.state,
        "effects": effects,
        "tool_calls": rig.service.calls,
        "violations": len(found),
    }, facts=("window", "durability", "postmaster", "effects_when_killed", "state", "effects",
              "tool_calls", "violations"))
    assert found == [], [v.to_json() for v in found]
    assert final.state == "succeeded"
    assert effects == 1
    assert effects_at_crash == (1 if window == "after_tool" else 0)
    if window == "after_tool":
        assert rig.service.calls == 1, "an effect that happened was dispatched again"


def _settle(
    lab: harness.Harness, rig: harness.Rig, workflow_id: str,
    child: harness.WorkerProcess, window: str, within: float = 60.0,
) -> store.Workflow:
    """Play the operator's recoverer until the workflow succeeds: expired leases become
    unknown, unknowns are reconciled by lookup; the worker is released at each pause."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            while (line := child.lines.get_nowait()) is not None:
                if line.startswith(f"BOOK_STAGE {window}"):
                    child.release()
        try:
            lab.store.recover_expired()
            current = lab.state(workflow_id)
            if current.state == "unknown" and not current.review_reason:
                current = rig.worker.reconcile(workflow_id)
        except (errors.StoreError, errors.ToolUnavailable, errors.Stale):
            time.sleep(0.1)  # the database is still coming back, or a race: next pass
            continue
        if current.state in store.TERMINAL_STATES or current.review_reason:
            return current
        time.sleep(0.1)
    raise AssertionError(f"bounded wait: {workflow_id} did not settle within {within}s")


def test_chaos_round_with_database_restarts_and_partitions_keeps_every_invariant(
    killable_postgres, reached_database, observe
) -> None:
    """A chaos round whose PostgreSQL (durable) is SIGKILLed and restarted every few
    seconds while links between workers, tool and database are blackholed or reset, on
    top of worker SIGKILLs, lost replies and 429s: after the drain no effect is
    duplicated, lost, replayed or stale, nothing acknowledged is missing, and every
    workflow is finished or waiting for a person with a reason."""
    settings = chaos.Settings(
        workflows=120, workers=3, duration=20.0, kill_every_ms=400.0,
        terminate_every_ms=2000.0, restart_every_ms=4000.0, partition_every_ms=2000.0,
        partition_for_ms=800.0, durable=True, min_restarts=2, seed=11, drain_timeout=90.0,
    )
    # With the server itself: a postmaster that dies outside a restart fails the round at
    # once, with the reason, instead of leaving its retry loops waiting on it.
    report = chaos.run(killable_postgres.provisioned.dsn, settings,
                       restart=killable_postgres.crash_restart, server=killable_postgres.server)
    reached_database()
    database = report["database"]
    observe({
        "seed": settings.seed,
        "workflows": settings.workflows,
        "durability": {k: database["durability"][k] for k in ("fsync", "synchronous_commit")},
        "restarts": database["restart_count"],
        "down_s": database["down_s"],
        "partitions": report["faults"]["partitions"],
        "states": report["states"],
        "effects": report["effects"],
        "manual_review_reasons": report["manual_review_reasons"],
        "violations": report["violation_count"],
    }, measurements=(
        # Restarts, partitions and how the round ends vary run to run; violations are the fact.
        "restarts", "partitions", "states", "effects", "manual_review_reasons",
    ), facts=("seed", "workflows", "durability", "violations"))
    assert report["violations"] == [], report["violations"][:10]
    assert sum(report["states"].values()) == settings.workflows
    assert database["durability"]["fsync"] == "on"
    assert database["restart_count"] >= 2, "the database was not restarted: nothing proven"
    assert report["faults"]["partitions"] > 0, "no link was cut"
    assert report["cleanup"] == []
