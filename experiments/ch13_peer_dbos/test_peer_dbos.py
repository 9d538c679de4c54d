"""Chapter 13: DBOS Transact in the lab's windows, as real OS processes, with DBOS's own state.

Each experiment runs ``python -m lab.peers.dbos_peer``: a DBOS workflow whose one step calls
the lab's credit tool over HTTP under the lab's effect key, against the run's
PostgreSQL. It asserts what DBOS 3.4.0 does, so a release that behaves differently fails
here and the book's side-by-side table is revisited, never silently stale. Every
observation carries DBOS's own ``workflow_status`` and ``operation_outputs`` rows.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from lab import harness, names
from lab.peers import dbos_peer
from lab.runtime import plan

PINNED = "3.4.0"
RECOVER_WAIT = "30"
# How long a process of another application version is given to (not) recover the workflow.
LEFT_BEHIND_SECONDS = "2"

# How long one step of a peer's process may take (its start-up imports, a step, its exit).
# What is awaited always comes (the process's own path reaches it); only its time varies
# with the machine's load, so the wait is long and the experiment's budget (the manifest's
# budget_s, enforced by the plugin) bounds the whole.
STEP_WITHIN = 240.0


@pytest.fixture
def dbos(lab: harness.Harness) -> Iterator[dbos_peer.Peer]:
    """DBOS processes on a system schema of this experiment's own, dropped afterwards."""
    dbos_peer.module()  # MissingExtra, with its one-line remedy, without the peers extra
    assert dbos_peer.version() == PINNED, "the chapter asserts what DBOS 3.4.0 does"
    peer = dbos_peer.Peer(lab.dsn, f"{lab.schema}_dbos", on_event=lab.mark)
    try:
        yield peer
    finally:
        peer.close()


def _work(idempotent: bool) -> tuple[str, dbos_peer.Work]:
    """A workflow id and the step's input: the lab's sample plan under the lab's effect key."""
    sample = harness.sample_plan(idempotent)
    operation = names.new_id("op")
    work = dbos_peer.Work(
        effect_key=plan.effect_key(harness.PROPOSER.tenant, operation),
        fingerprint=sample.fingerprint(),
        plan=sample.to_json(),
    )
    return names.new_id("dbos"), work


def _seen(dbos: dbos_peer.Peer, workflow_id: str, max_attempts: int = 0) -> dict[str, Any]:
    """DBOS's own state of the workflow, as the evidence keeps it, with the step's settings."""
    status = dbos.status(workflow_id)
    return {
        "dbos_version": dbos_peer.version(),
        "dbos_config": {"step_retries": f"max_attempts={max_attempts}" if max_attempts else "off",
                        "executor_id": "local"},
        "dbos_status": [
            {k: row[k] for k in ("status", "recovery_attempts", "application_version")}
            for row in status
        ],
        "dbos_steps": [
            {"function_name": row["function_name"],
             "recorded": "output" if row["has_output"] else "error" if row["has_error"] else "none"}
            for row in dbos.steps(workflow_id)
        ],
    }


def _status(dbos: dbos_peer.Peer, workflow_id: str) -> str | None:
    rows = dbos.status(workflow_id)
    return str(rows[0]["status"]) if rows else None


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "non_idempotent"])
def test_dbos_step_reruns_after_sigkill_after_effect(lab, dbos, observe, idempotent):
    """DBOS process SIGKILLed after the step's tool call took effect and before DBOS
    checkpointed the step: the recovering process runs the step again, so the tool is
    called twice; the non-idempotent tool's ledger then holds two credits for one workflow
    (the idempotent tool's one), and DBOS reports SUCCESS either way."""
    rig = lab.credit_tool(idempotent=idempotent)
    workflow_id, work = _work(idempotent)
    first = dbos.spawn("run", "dbos-a", rig.service, workflow_id, "--pause", "after_tool",
                       work=work)
    first.wait_for("BOOK_STAGE after_tool", timeout=STEP_WITHIN)
    assert lab.effects() == 1, "the crash window is after the effect"
    assert _status(dbos, workflow_id) == "PENDING"
    assert dbos.steps(workflow_id) == [], "the step was checkpointed before the crash"
    assert first.kill() == -signal.SIGKILL
    recovering = dbos.spawn("recover", "dbos-b", rig.service, workflow_id, "--wait", RECOVER_WAIT)
    recovering.wait_for("BOOK_DONE", timeout=90)
    recovering.finish(timeout=30)
    status, effects, calls = _status(dbos, workflow_id), lab.effects(), rig.service.calls
    assert status == "SUCCESS"
    assert calls == 2, "DBOS 3.4.0 re-runs an uncheckpointed step after recovery"
    assert effects == (1 if idempotent else 2)
    window = "kill_after_effect_" + ("idempotent" if idempotent else "non_idempotent")
    observe({
        "peer_window": window,
        "system": "dbos",
        "effects": effects,
        "tool_calls": calls,
        **_seen(dbos, workflow_id),
        "outcome": f"step re-ran after recovery: {calls} tool calls, {effects} effect(s), "
                   f"DBOS status {status}",
    }, facts=("peer_window", "system", "effects", "tool_calls", "dbos_version", "dbos_config",
              "dbos_status", "dbos_steps", "outcome"))


def test_dbos_step_retry_budget_restarts_after_crash(lab, dbos, observe):
    """A DBOS step allowed 3 attempts, answered 429 each time and SIGKILLed after its second
    attempt, gets a fresh budget of 3 in the recovering process: the tool is asked 5 times
    for a budget of 3 before DBOS marks the workflow ERROR."""
    rig = lab.credit_tool(idempotent=True)
    rig.service.reject_next(1000)
    budget = 3
    workflow_id, work = _work(True)
    first = dbos.spawn("run", "dbos-a", rig.service, workflow_id, "--max-attempts", str(budget),
                       "--pause", "after_tool", "--pause-attempt", "2", work=work)
    first.wait_for("BOOK_STAGE after_tool 2", timeout=STEP_WITHIN)
    assert rig.service.calls == 2
    assert first.kill() == -signal.SIGKILL
    recovering = dbos.spawn("recover", "dbos-b", rig.service, workflow_id,
                            "--max-attempts", str(budget), "--wait", RECOVER_WAIT)
    recovering.wait_for("BOOK_DONE", timeout=90)
    recovering.finish(timeout=30)
    status, calls, effects = _status(dbos, workflow_id), rig.service.calls, lab.effects()
    assert status == "ERROR"
    assert calls == 2 + budget, "the retry budget is not persisted across a crash"
    assert effects == 0
    observe({
        "peer_window": "retry_budget_across_crash",
        "system": "dbos",
        "effects": effects,
        "tool_calls": calls,
        "budget": budget,
        **_seen(dbos, workflow_id, max_attempts=budget),
        "outcome": f"{calls} attempts for a budget of {budget}: the budget restarts in the "
                   f"recovering process; DBOS status {status}",
    }, facts=("peer_window", "system", "effects", "tool_calls", "budget", "dbos_version",
              "dbos_config", "dbos_status", "dbos_steps", "outcome"))


def test_dbos_lost_reply_ends_in_error_with_the_effect_done(lab, dbos, observe):
    """The tool commits the credit and the reply is lost: the step (retries off, DBOS's
    default) raises, DBOS records the workflow as ERROR, and nothing looks the effect up:
    the ledger holds the credit that DBOS reports as failed."""
    rig = lab.credit_tool(idempotent=True)
    rig.service.drop_responses = True
    workflow_id, work = _work(True)
    child = dbos.spawn("run", "dbos-a", rig.service, workflow_id, "--wait", RECOVER_WAIT,
                       work=work)
    child.wait_for("BOOK_DONE", timeout=90)
    child.finish(timeout=30)
    status, effects, lookups = _status(dbos, workflow_id), lab.effects(), rig.service.lookups
    assert status == "ERROR"
    assert effects == 1
    assert rig.service.dropped == 1
    assert lookups == 0, "DBOS does not reconcile through the tool's lookup"
    observe({
        "peer_window": "lost_reply",
        "system": "dbos",
        "effects": effects,
        "tool_calls": rig.service.calls,
        "lookups": lookups,
        **_seen(dbos, workflow_id),
        "outcome": f"DBOS status {status} while the ledger holds {effects} effect(s); "
                   f"{lookups} lookups",
    }, facts=("peer_window", "system", "effects", "tool_calls", "lookups", "dbos_version",
              "dbos_config", "dbos_status", "dbos_steps", "outcome"))


def test_dbos_new_version_leaves_the_crashed_workflow_pending(lab, dbos, observe):
    """A workflow of version v1 SIGKILLed after its effect is not recovered by a process of
    version v2: it stays PENDING with no recovery attempt, until a v1 process comes back and
    re-runs the step."""
    rig = lab.credit_tool(idempotent=True)
    workflow_id, work = _work(True)
    first = dbos.spawn("run", "dbos-v1", rig.service, workflow_id, "--pause", "after_tool",
                       work=work)
    first.wait_for("BOOK_STAGE after_tool", timeout=STEP_WITHIN)
    assert first.kill() == -signal.SIGKILL
    before = dbos.status(workflow_id)[0]["recovery_attempts"]
    newer = dbos.spawn("recover", "dbos-v2", rig.service, workflow_id, "--app-version", "v2",
                       "--wait", LEFT_BEHIND_SECONDS)
    left = newer.wait_for("BOOK_DONE", timeout=90).split()[-1]
    newer.finish(timeout=30)
    after_v2 = dbos.status(workflow_id)[0]
    assert left == "PENDING" and after_v2["status"] == "PENDING"
    assert after_v2["recovery_attempts"] == before, "a v2 process touched a v1 workflow"
    assert rig.service.calls == 1
    older = dbos.spawn("recover", "dbos-v1-again", rig.service, workflow_id,
                       "--wait", RECOVER_WAIT)
    older.wait_for("BOOK_DONE", timeout=90)
    older.finish(timeout=30)
    status, effects, calls = _status(dbos, workflow_id), lab.effects(), rig.service.calls
    assert status == "SUCCESS"
    assert calls == 2
    assert effects == 1
    observe({
        "peer_window": "new_version_left_behind",
        "system": "dbos",
        "effects": effects,
        "tool_calls": calls,
        "status_while_v2_ran": after_v2["status"],
        **_seen(dbos, workflow_id),
        "outcome": f"{after_v2['status']} while only v2 ran; a v1 process re-ran the step: "
                   f"{calls} tool calls, DBOS status {status}",
    }, facts=("peer_window", "system", "effects", "tool_calls", "status_while_v2_ran",
              "dbos_version", "dbos_config", "dbos_status", "dbos_steps", "outcome"))


def test_dbos_cancel_during_the_call_hides_the_effect(lab, dbos, observe):
    """A DBOS workflow cancelled while its step's tool call has taken effect ends CANCELLED:
    DBOS's status says cancelled while the ledger holds the credit, and no record of DBOS
    carries the receipt."""
    rig = lab.credit_tool(idempotent=True)
    workflow_id, work = _work(True)
    child = dbos.spawn("run", "dbos-a", rig.service, workflow_id, "--pause", "after_tool",
                       "--wait", RECOVER_WAIT, work=work)
    child.wait_for("BOOK_STAGE after_tool", timeout=STEP_WITHIN)
    dbos_peer.cancel(lab.dsn, dbos.schema, workflow_id)
    lab.mark("experiment", "DBOS cancel_workflow")
    child.release()
    child.wait_for("BOOK_DONE", timeout=90)
    child.finish(timeout=30)
    status, effects = _status(dbos, workflow_id), lab.effects()
    seen = _seen(dbos, workflow_id)
    receipts = sum(1 for step in seen["dbos_steps"] if step["recorded"] == "output")
    assert status == "CANCELLED"
    assert effects == 1
    assert receipts == 0, "DBOS 3.4.0 keeps no output of a step that finished after cancel"
    observe({
        "peer_window": "cancel_during_call",
        "system": "dbos",
        "effects": effects,
        "tool_calls": rig.service.calls,
        "step_outputs_recorded": receipts,
        **seen,
        "outcome": f"DBOS status {status} with {effects} effect(s) in the ledger; "
                   f"{receipts} step output(s) recorded",
    }, facts=("peer_window", "system", "effects", "tool_calls", "step_outputs_recorded",
              "dbos_version", "dbos_config", "dbos_status", "dbos_steps", "outcome"))


def test_dbos_postgres_restart_between_effect_and_checkpoint(lab, killable_postgres, observe):
    """DBOS's system PostgreSQL (fsync on) SIGKILLed and restarted while a step holds a
    non-idempotent credit it has not yet checkpointed: the same process retries its own
    database writes once the server is back, records the step's output and ends the
    workflow SUCCESS with one credit and one tool call."""
    rig = lab.credit_tool(idempotent=False)
    workflow_id, work = _work(False)
    dbos = dbos_peer.Peer(killable_postgres.provisioned.dsn, f"{lab.schema}_dbos",
                          on_event=lab.mark)
    try:
        child = dbos.spawn("run", "dbos-a", rig.service, workflow_id, "--pause", "after_tool",
                           "--wait", RECOVER_WAIT, work=work)
        child.wait_for("BOOK_STAGE after_tool", timeout=STEP_WITHIN)
        assert lab.effects() == 1
        assert dbos.steps(workflow_id) == [], "the step was checkpointed before the restart"
        down = killable_postgres.crash_restart()
        lab.mark("postgresql", f"DBOS system server restarted after {down:.2f}s")
        child.release()
        ended = child.wait_for("BOOK_DONE", timeout=90).split()[-1]
        child.finish(timeout=30)
        seen = _seen(dbos, workflow_id)
        status, effects, calls = _status(dbos, workflow_id), lab.effects(), rig.service.calls
        recorded = [step["recorded"] for step in seen["dbos_steps"]]
        assert ended == status == "SUCCESS"
        assert recorded == ["output"]
        assert effects == 1
        assert calls == 1
        observe({
            "peer_window": "postgres_restart_during_recovery",
            "system": "dbos",
            "effects": effects,
            "tool_calls": calls,
            "server_down_seconds": round(down, 2),
            **seen,
            "outcome": f"system database restarted before the checkpoint: the process "
                       f"recorded the step ({recorded}), DBOS status {status}, "
                       f"{effects} effect(s)",
        }, facts=("peer_window", "system", "effects", "tool_calls", "dbos_version",
                  "dbos_config", "dbos_status", "dbos_steps", "outcome"))
    finally:
        dbos.close()
