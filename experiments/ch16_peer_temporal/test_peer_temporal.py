"""Chapter 16: Temporal in the lab's windows, as real OS processes, with Temporal's own history.

Each experiment runs worker processes (``python -m lab.peers.temporal_peer worker``) that
poll a task queue of the experiment's own on the run's Temporal dev server (the plugin's
``temporal_server``; the server-restart window has one of its own, ``killable_temporal``).
The ``lab_peer_credit`` workflow's credit activity calls the lab's credit tool over HTTP
under the lab's effect key. Each test asserts what temporalio 1.35.0 with Temporal Server
1.32.0 does, so a release that behaves differently fails here and the book's side-by-side
table is revisited. Every observation carries Temporal's own status and the activity's
events from the workflow's history, and the settings it depends on: the activity's
start-to-close timeout and retry policy, the task queue (one per experiment) and the
worker's concurrency (one activity, one workflow task at a time).
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from lab import harness, names
from lab.peers import temporal_peer, temporal_workflows
from lab.runtime import plan

PINNED = "1.35.0"
PINNED_SERVER = "1.32.0"
# Long enough for the workflow to close once a worker is polling again, under load; the
# experiment's budget bounds it all the same.
CLOSE_WITHIN = 240.0
# What the SDK's worker logs (on stdout) when the server refuses an activity's completion.
REFUSED_COMPLETION = "Activity not found on completion"
# The kinds of ``_seen``'s keys: the versions, settings and final status every run observes
# (each test asserts the status); the activity's events carry the server's failure texts and
# the history its event order, which may vary between runs.
SEEN_FACTS = ("temporal_versions", "temporal_config", "temporal_status")
SEEN_MEASUREMENTS = ("temporal_activity_events", "activity_attempt_recorded",
                     "temporal_history")

# How long one step of a peer's process may take (its start-up imports, a step, its exit).
# What is awaited always comes (the process's own path reaches it); only its time varies
# with the machine's load, so the wait is long and the experiment's budget (the manifest's
# budget_s, enforced by the plugin) bounds the whole.
STEP_WITHIN = 240.0


@pytest.fixture
def peer(lab: harness.Harness, temporal_server) -> Iterator[temporal_peer.Peer]:
    """Temporal worker processes on a task queue of this experiment's own."""
    temporal_peer.module()
    assert temporal_peer.version() == PINNED, "the chapter asserts what temporalio 1.35.0 does"
    assert temporal_server.server_version == PINNED_SERVER
    chosen = temporal_peer.Peer(temporal_server.address, names.new_id("tq").lower(),
                                on_event=lab.mark)
    try:
        yield chosen
    finally:
        chosen.close()


def _work(idempotent: bool) -> tuple[str, dict[str, Any]]:
    """A workflow id and the activity's input: the lab's sample plan under the lab's key."""
    sample = harness.sample_plan(idempotent)
    operation = names.new_id("op")
    work = temporal_peer.Work(
        effect_key=plan.effect_key(harness.PROPOSER.tenant, operation),
        fingerprint=sample.fingerprint(),
        plan=sample.to_json(),
    )
    return names.new_id("temporal"), work.to_json()


def _refused(worker) -> str | None:
    """Why the server refused the worker's activity completion, as the SDK logged it."""
    for line in worker.all_lines():
        if REFUSED_COMPLETION in line:
            found = re.search(r'message: "([^"]*)"', line)
            return found.group(1) if found else line[-200:]
    return None


def _activity(history: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in history if e["type"] == kind]


def _seen(peer: temporal_peer.Peer, workflow_id: str,
          settings: temporal_peer.Settings) -> dict[str, Any]:
    """Temporal's own view of the workflow, as the evidence keeps it, with its settings."""
    history = peer.history(workflow_id)
    started = _activity(history, "ACTIVITY_TASK_STARTED")
    return {
        "temporal_versions": {"temporalio": temporal_peer.version(),
                              "server": PINNED_SERVER},
        "temporal_config": {**settings.describe(), "task_queue": "one per experiment",
                            "max_concurrent_activities": "1",
                            "max_concurrent_workflow_tasks": "1"},
        "temporal_status": peer.status(workflow_id),
        "temporal_activity_events": [
            {k: e[k] for k in ("type", "activity", "attempt", "failure") if k in e}
            for e in history if e["type"].startswith("ACTIVITY_TASK")
        ],
        "activity_attempt_recorded": started[-1]["attempt"] if started else 0,
        "temporal_history": [e["type"] for e in history],
    }


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "non_idempotent"])
def test_temporal_activity_reruns_after_sigkill_after_effect(lab, peer, observe, idempotent):
    """A worker process SIGKILLed after the credit activity's tool call took effect and
    before the activity's completion reached the server: once the start-to-close timeout
    (5 s) expires, the server retries the activity (default policy) on the other worker, so
    the tool is called twice; the non-idempotent tool's ledger then holds two credits for
    one workflow (the idempotent tool's one), and Temporal reports the workflow COMPLETED
    with the activity's second attempt recorded."""
    rig = lab.credit_tool(idempotent=idempotent)
    settings = temporal_peer.Settings(start_to_close_s=5.0)
    workflow_id, work = _work(idempotent)
    first = peer.spawn("temporal-a", rig.service, "--pause", "after_tool")
    first.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    peer.start(workflow_id, work, settings)
    first.wait_for("BOOK_STAGE after_tool 1", timeout=STEP_WITHIN)
    assert lab.effects() == 1, "the crash window is after the effect"
    assert peer.status(workflow_id) == "RUNNING"
    assert first.kill() == -signal.SIGKILL
    second = peer.spawn("temporal-b", rig.service)
    second.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    status = peer.result(workflow_id, within=CLOSE_WITHIN)
    seen = _seen(peer, workflow_id, settings)
    effects, calls = lab.effects(), rig.service.calls
    assert status == "COMPLETED"
    assert calls == 2, "the activity re-ran after its start-to-close timeout"
    assert effects == (1 if idempotent else 2)
    assert seen["activity_attempt_recorded"] == 2
    window = "kill_after_effect_" + ("idempotent" if idempotent else "non_idempotent")
    observe({
        "peer_window": window,
        "system": "temporal",
        "effects": effects,
        "tool_calls": calls,
        **seen,
        "outcome": f"activity re-ran after its start-to-close timeout: {calls} tool calls, "
                   f"{effects} effect(s), Temporal status {status}, attempt "
                   f"{seen['activity_attempt_recorded']} recorded",
    }, facts=("peer_window", "system", "effects", "tool_calls", "outcome", *SEEN_FACTS,
              "activity_attempt_recorded"),
       measurements=("temporal_activity_events", "temporal_history"))


def _paused_then_killed(lab, peer, rig, workflow_id, work, settings, **spawn) -> None:
    """Start the workflow on a worker that pauses after the tool's effect, then SIGKILL it."""
    first = peer.spawn("temporal-a", rig.service, "--pause", "after_tool", **spawn)
    first.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    peer.start(workflow_id, work, settings)
    first.wait_for("BOOK_STAGE after_tool 1", timeout=STEP_WITHIN)
    assert lab.effects() == 1, "the crash window is after the effect"
    assert first.kill() == -signal.SIGKILL


def test_temporal_retry_budget_holds_across_a_crash(lab, peer, observe):
    """A credit activity allowed 3 attempts (maximum_attempts=3), answered 429 each time and
    its worker SIGKILLed during its second attempt: the server counts the killed attempt
    (it ends by its start-to-close timeout), runs the third on the other worker and fails
    the workflow: the tool is asked 3 times for a budget of 3."""
    rig = lab.credit_tool(idempotent=True)
    rig.service.reject_next(1000)
    budget = 3
    settings = temporal_peer.Settings(start_to_close_s=3.0, max_attempts=budget)
    workflow_id, work = _work(True)
    first = peer.spawn("temporal-a", rig.service, "--pause", "after_tool", "--pause-attempt", "2")
    first.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    peer.start(workflow_id, work, settings)
    first.wait_for("BOOK_STAGE after_tool 2", timeout=STEP_WITHIN)
    assert rig.service.calls == 2
    assert first.kill() == -signal.SIGKILL
    second = peer.spawn("temporal-b", rig.service)
    second.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    status = peer.result(workflow_id, within=CLOSE_WITHIN)
    seen = _seen(peer, workflow_id, settings)
    calls, effects = rig.service.calls, lab.effects()
    assert status == "FAILED"
    assert calls == budget, "the attempt budget is the server's, so a crash does not reset it"
    assert effects == 0
    observe({
        "peer_window": "retry_budget_across_crash",
        "system": "temporal",
        "effects": effects,
        "tool_calls": calls,
        "budget": budget,
        **seen,
        "outcome": f"{calls} attempts for a budget of {budget}: the server counts attempts, "
                   f"the killed one included; Temporal status {status}",
    }, facts=("peer_window", "system", "effects", "tool_calls", "budget", "outcome",
              *SEEN_FACTS), measurements=SEEN_MEASUREMENTS)


def test_temporal_lost_reply_times_out_and_retries(lab, peer, observe):
    """The tool commits a non-idempotent credit and holds its reply past the activity's
    start-to-close timeout (3 s): the server times the attempt out and retries it, the
    retry credits again, and Temporal reports COMPLETED with two credits in the ledger and
    no lookup of the first; the first attempt's late failure is refused by the server."""
    rig = lab.credit_tool(idempotent=False)
    rig.service.hold_next(seconds=8.0, commit="after")
    settings = temporal_peer.Settings(start_to_close_s=3.0)
    workflow_id, work = _work(False)
    worker = peer.spawn("temporal-a", rig.service)
    worker.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    peer.start(workflow_id, work, settings)
    status = peer.result(workflow_id, within=CLOSE_WITHIN)
    lab.wait_until(lambda: _refused(worker) is not None, within=30.0,
                   what="the worker to log the first attempt's late outcome refused")
    refused = _refused(worker)
    seen = _seen(peer, workflow_id, settings)
    effects, calls, lookups = lab.effects(), rig.service.calls, rig.service.lookups
    assert status == "COMPLETED"
    assert refused is not None and "already timed out" in refused
    assert calls == 2
    assert effects == 2
    assert lookups == 0, "Temporal does not reconcile through the tool's lookup"
    observe({
        "peer_window": "lost_reply",
        "system": "temporal",
        "effects": effects,
        "tool_calls": calls,
        "lookups": lookups,
        "late_outcome_refused_by_server": refused,
        **seen,
        "outcome": f"the held reply outlived the 3 s start-to-close timeout; the retry "
                   f"credited again: {effects} effect(s), {lookups} lookups, Temporal "
                   f"status {status}",
    }, facts=("peer_window", "system", "effects", "tool_calls", "lookups",
              "late_outcome_refused_by_server", "outcome", *SEEN_FACTS),
       measurements=SEEN_MEASUREMENTS)


def test_temporal_unguarded_code_change_is_nondeterministic(lab, peer, observe):
    """A workflow of v1 whose worker is SIGKILLed after the effect, taken over by a worker
    running v2 code that inserts an activity before the credit (unguarded): the credit's
    retry runs, then replaying the history against v2 fails the workflow task with a
    nondeterminism error, again and again; the workflow stays RUNNING with its credit done."""
    rig = lab.credit_tool(idempotent=True)
    settings = temporal_peer.Settings(start_to_close_s=3.0)
    workflow_id, work = _work(True)
    _paused_then_killed(lab, peer, rig, workflow_id, work, settings)
    newer = peer.spawn("temporal-v2", rig.service, variant="v2")
    newer.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    lab.wait_until(
        lambda: any(e["type"] == "WORKFLOW_TASK_FAILED" for e in peer.history(workflow_id)),
        within=CLOSE_WITHIN, what="a failed workflow task in the workflow's history")
    seen = _seen(peer, workflow_id, settings)
    failed = [e for e in peer.history(workflow_id) if e["type"] == "WORKFLOW_TASK_FAILED"]
    status, effects, calls = peer.status(workflow_id), lab.effects(), rig.service.calls
    assert status == "RUNNING"
    assert failed[0]["cause"] == "NON_DETERMINISTIC_ERROR"
    assert effects == 1
    observe({
        "peer_window": "new_version_left_behind",
        "system": "temporal",
        "code_change": "unguarded",
        "effects": effects,
        "tool_calls": calls,
        "workflow_task_failure": failed[0]["cause"],
        **seen,
        "outcome": f"v2 replay failed the workflow task ({failed[0]['cause']}); the workflow "
                   f"is {status} with {effects} effect(s)",
    }, facts=("peer_window", "system", "code_change", "effects", "workflow_task_failure",
              "outcome", *SEEN_FACTS), measurements=("tool_calls", *SEEN_MEASUREMENTS))


def test_temporal_patched_code_change_completes_the_old_workflow(lab, peer, observe):
    """The same takeover by v2 code guarded with workflow.patched: the v1 history replays
    without the inserted activity, the credit's retry completes, and the workflow ends
    COMPLETED without the notification (one effect with the idempotent tool)."""
    rig = lab.credit_tool(idempotent=True)
    settings = temporal_peer.Settings(start_to_close_s=3.0)
    workflow_id, work = _work(True)
    _paused_then_killed(lab, peer, rig, workflow_id, work, settings)
    newer = peer.spawn("temporal-v2", rig.service, variant="v2-patched")
    newer.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    status = peer.result(workflow_id, within=CLOSE_WITHIN)
    seen = _seen(peer, workflow_id, settings)
    effects, calls = lab.effects(), rig.service.calls
    notified = [e for e in seen["temporal_activity_events"]
                if e.get("activity") == temporal_workflows.NOTIFY_ACTIVITY]
    assert status == "COMPLETED"
    assert notified == []
    assert calls == 2
    assert effects == 1
    observe({
        "peer_window": "new_version_left_behind",
        "system": "temporal",
        "code_change": "workflow.patched",
        "effects": effects,
        "tool_calls": calls,
        "notifications_scheduled": len(notified),
        **seen,
        "outcome": f"workflow.patched kept the v1 path: Temporal status {status}, "
                   f"{calls} tool calls, {effects} effect(s), no notification",
    }, facts=("peer_window", "system", "code_change", "effects", "tool_calls",
              "notifications_scheduled", "outcome", *SEEN_FACTS),
       measurements=SEEN_MEASUREMENTS)


def test_temporal_cancel_during_the_call_hides_the_effect(lab, peer, observe):
    """A workflow cancelled while its credit activity's tool call has taken effect ends
    CANCELED (the activity's default cancellation type, TRY_CANCEL, does not wait): the
    ledger holds the credit, and Temporal's history records no completion of the activity."""
    rig = lab.credit_tool(idempotent=True)
    settings = temporal_peer.Settings(start_to_close_s=10.0)
    workflow_id, work = _work(True)
    worker = peer.spawn("temporal-a", rig.service, "--pause", "after_tool")
    worker.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    peer.start(workflow_id, work, settings)
    worker.wait_for("BOOK_STAGE after_tool 1", timeout=STEP_WITHIN)
    peer.cancel(workflow_id)
    status = peer.result(workflow_id, within=CLOSE_WITHIN)
    worker.release()
    # The released activity reports its completion; the server no longer has the activity.
    lab.wait_until(lambda: _refused(worker) is not None, within=30.0,
                   what="the worker to log its activity's completion refused")
    refused = _refused(worker)
    seen = _seen(peer, workflow_id, settings)
    effects = lab.effects()
    completed = _activity(peer.history(workflow_id), "ACTIVITY_TASK_COMPLETED")
    assert status == "CANCELED"
    assert effects == 1
    assert completed == []
    assert refused == "workflow execution already completed"
    observe({
        "peer_window": "cancel_during_call",
        "system": "temporal",
        "effects": effects,
        "tool_calls": rig.service.calls,
        "activity_completions_recorded": len(completed),
        "completion_refused_by_server": refused,
        **seen,
        "outcome": f"Temporal status {status} with {effects} effect(s) in the ledger; "
                   f"{len(completed)} activity completion(s) recorded",
    }, facts=("peer_window", "system", "effects", "activity_completions_recorded",
              "completion_refused_by_server", "outcome", *SEEN_FACTS),
       measurements=("tool_calls", *SEEN_MEASUREMENTS))


def test_temporal_server_restart_between_effect_and_completion(lab, killable_temporal, observe):
    """Temporal's dev server SIGKILLed and restarted on its SQLite file while a credit
    activity holds a non-idempotent credit whose completion the server has not received:
    the worker delivers the completion once the server is back, and the workflow ends
    COMPLETED with one credit and one tool call."""
    rig = lab.credit_tool(idempotent=False)
    settings = temporal_peer.Settings(start_to_close_s=30.0)
    workflow_id, work = _work(False)
    peer = temporal_peer.Peer(killable_temporal.address, names.new_id("tq").lower(),
                              on_event=lab.mark)
    try:
        worker = peer.spawn("temporal-a", rig.service, "--pause", "after_tool")
        worker.wait_for("BOOK_READY", timeout=STEP_WITHIN)
        peer.start(workflow_id, work, settings)
        worker.wait_for("BOOK_STAGE after_tool 1", timeout=STEP_WITHIN)
        assert lab.effects() == 1
        down = killable_temporal.crash_restart()
        lab.mark("temporal", f"Temporal dev server restarted after {down:.2f}s")
        worker.release()
        status = peer.result(workflow_id, within=CLOSE_WITHIN)
        seen = _seen(peer, workflow_id, settings)
        effects, calls = lab.effects(), rig.service.calls
        assert status == "COMPLETED"
        assert effects == 1
        assert calls == 1
        observe({
            "peer_window": "server_restart_during_call",
            "system": "temporal",
            "effects": effects,
            "tool_calls": calls,
            "server_down_seconds": round(down, 2),
            "server_restarts": killable_temporal.restarts,
            **seen,
            "outcome": f"server restarted before the activity's completion: Temporal status "
                       f"{status}, {calls} tool call(s), {effects} effect(s)",
        }, facts=("peer_window", "system", "effects", "tool_calls", "outcome", *SEEN_FACTS),
           measurements=("server_restarts", *SEEN_MEASUREMENTS))
    finally:
        peer.close()


@pytest.mark.parametrize("approval", [
    {"approved": True, "tenant": "tenant-b", "fingerprint": "sha256:" + "0" * 64,
     "expires_at": "2000-01-01T00:00:00Z"},
], ids=["other_tenant_other_plan_expired"])
def test_temporal_approval_signal_binds_nothing(lab, peer, observe, approval):
    """A workflow that waits for an approval signal proceeds on any signal payload: one
    naming another tenant, another plan's fingerprint and an expiry long past releases the
    credit; Temporal binds a signal to the workflow id only."""
    rig = lab.credit_tool(idempotent=True)
    settings = temporal_peer.Settings(start_to_close_s=5.0, await_approval=True)
    workflow_id, work = _work(True)
    worker = peer.spawn("temporal-a", rig.service)
    worker.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    peer.start(workflow_id, work, settings)
    assert rig.service.calls == 0
    peer.signal(workflow_id, temporal_workflows.APPROVE_SIGNAL, approval)
    status = peer.result(workflow_id, within=CLOSE_WITHIN)
    seen = _seen(peer, workflow_id, settings)
    signals = [e for e in peer.history(workflow_id) if e["type"] == "WORKFLOW_EXECUTION_SIGNALED"]
    effects = lab.effects()
    assert status == "COMPLETED"
    assert effects == 1
    assert len(signals) == 1
    # The approval as Temporal's history holds it, against the plan the workflow credits.
    received = json.loads(signals[0]["payload"][0])
    names_plan = isinstance(received, dict) and received.get("fingerprint") == work["fingerprint"]
    assert received == approval
    assert not names_plan
    observe({
        "peer_window": "approval_binding",
        "system": "temporal",
        "effects": effects,
        "approval_names_this_plan": names_plan,
        "approval_signals": [{"signal": e["signal"], "payload": e["payload"]} for e in signals],
        **seen,
        "outcome": f"a signal naming another tenant and plan, expired, released the credit: "
                   f"Temporal status {status}, {effects} effect(s)",
    }, facts=("peer_window", "system", "effects", "approval_names_this_plan", "outcome",
              *SEEN_FACTS),
       measurements=("approval_signals", *SEEN_MEASUREMENTS))


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "non_idempotent"])
def test_temporal_activity_delegating_to_the_lab_keeps_one_effect(lab, peer, observe,
                                                                  idempotent):
    """The same workflow with a credit activity that hands the effect to the lab (an approved
    lab workflow: bound approval, a lab worker with lease, fence, start barrier and effect
    key), its worker SIGKILLed in the same window: Temporal retries the activity after its
    start-to-close timeout (5 s) on the other worker, as it does without the lab, but the
    retried activity finds the lab workflow under a dead lease and never calls the tool
    again: one tool call, one effect. The lab settles it by its fenced lookup (idempotent)
    or holds it for a person (non-idempotent); Temporal reports the workflow COMPLETED with
    the lab's state as the activity's result."""
    rig = lab.credit_tool(idempotent=idempotent)
    settings = temporal_peer.Settings(start_to_close_s=5.0)
    approved = lab.approved(idempotent)
    hand_to = temporal_peer.LabStore(lab.dsn, lab.schema, lab.store.keys)
    workflow_id = names.new_id("temporal")
    first = peer.spawn("temporal-a", rig.service, "--pause", "after_tool", delegate_to=hand_to)
    first.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    peer.start(workflow_id, {"lab_workflow": approved.id}, settings)
    first.wait_for("BOOK_STAGE after_tool 1", timeout=STEP_WITHIN)
    assert lab.effects() == 1, "the crash window is after the effect"
    assert first.kill() == -signal.SIGKILL
    second = peer.spawn("temporal-b", rig.service, delegate_to=hand_to)
    second.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    status = peer.result(workflow_id, within=CLOSE_WITHIN)
    seen = _seen(peer, workflow_id, settings)
    final = lab.state(approved.id)
    effects, calls, lookups = lab.effects(), rig.service.calls, rig.service.lookups
    assert status == "COMPLETED"
    assert seen["activity_attempt_recorded"] >= 2, "Temporal re-ran the activity"
    assert calls == 1, "the lab never calls the tool a second time"
    assert effects == 1
    if idempotent:
        assert final.state == "succeeded"
        assert lookups >= 1, "the lab proved the effect by its lookup"
    else:
        assert final.state == "unknown"
        assert final.review_reason == "non_idempotent_dispatched"
    window = "kill_after_effect_" + ("idempotent" if idempotent else "non_idempotent")
    observe({
        "peer_window": window,
        "system": "lab",
        "via": "temporal_activity_delegating_to_the_lab",
        "effects": effects,
        "tool_calls": calls,
        "lookups": lookups,
        "lab_state": final.state,
        "review_reason": final.review_reason,
        **seen,
        "outcome": f"Temporal re-ran the activity; {calls} tool call(s), {effects} effect(s) "
                   f"after the SIGKILL; lab state {final.state}; Temporal status {status}",
    }, facts=("peer_window", "system", "via", "effects", "tool_calls", "lab_state",
              "review_reason", "outcome", *SEEN_FACTS),
       measurements=("lookups", *SEEN_MEASUREMENTS))
