"""Chapter 14: LangGraph with PostgresSaver in the lab's windows, and the lab inside a node.

Each experiment runs ``python -m lab.peers.langgraph_peer`` processes on one ``thread_id``: a
plan → approval ``interrupt()`` → credit graph whose credit node calls the lab's credit
tool over HTTP under the lab's effect key. It asserts what LangGraph 1.2.24 with
langgraph-checkpoint-postgres 3.2.0 does; every observation carries LangGraph's own view
of the thread (next nodes, checkpoints, the approval value it stored). The last
experiment keeps the graph and hands the side effect to the lab.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from datetime import datetime

import pytest

from lab import harness, names
from lab.peers import langgraph_peer

PINNED = {"langgraph": "1.2.24", "langgraph-checkpoint-postgres": "3.2.0"}
APPROVE = json.dumps({"approved": True})

# How long one step of a peer's process may take (its start-up imports, a step, its exit).
# What is awaited always comes (the process's own path reaches it); only its time varies
# with the machine's load, so the wait is long and the experiment's budget (the manifest's
# budget_s, enforced by the plugin) bounds the whole.
STEP_WITHIN = 240.0


@pytest.fixture
def graph(lab: harness.Harness) -> Iterator[langgraph_peer.Peer]:
    """LangGraph processes on a checkpoint schema of this experiment's own."""
    langgraph_peer.modules()  # MissingExtra, with its one-line remedy, without the extra
    assert langgraph_peer.versions() == PINNED, "the chapter asserts what these versions do"
    peer = langgraph_peer.Peer(lab.dsn, f"{lab.schema}_lg", lab.schema, lab.store.keys,
                               on_event=lab.mark)
    try:
        yield peer
    finally:
        peer.close()


def _proposal() -> str:
    return json.dumps(harness.sample_proposal())


def _interrupted(lab, graph, rig, thread: str, *extra: str) -> None:
    """Run the graph up to its approval interrupt in a process of its own."""
    first = graph.spawn("start", "graph-start", rig.service, thread, *extra,
                        proposal_json=_proposal())
    first.wait_for("BOOK_DONE", timeout=STEP_WITHIN)
    first.finish(timeout=30)
    seen = graph.snapshot(thread)
    assert seen["next"] == ["approve"] and seen["interrupts"], "no approval interrupt"


def _checkpointed_before_credit(lab, graph, thread: str) -> None:
    """Wait, while the credit node is paused, for the checkpoint that precedes it.

    LangGraph's default durability is "async": a step's checkpoint is written while the
    next step already runs, so a SIGKILL right after the effect can also lose the
    approval's checkpoint. The window here is the one the chapter names: the step before
    is durable, the credit node is not.
    """
    lab.wait_until(lambda: graph.snapshot(thread)["next"] == ["credit"], within=30.0,
                   what="LangGraph to write the checkpoint before the credit node")


def _seen(graph, thread: str) -> dict[str, object]:
    seen = graph.snapshot(thread)
    return {
        "langgraph_versions": langgraph_peer.versions(),
        "langgraph_config": {"checkpointer": "PostgresSaver", "durability": "async (default)"},
        "langgraph_state": {k: seen[k] for k in ("next", "checkpoints", "receipt_id",
                                                 "approval", "errors")},
    }


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "non_idempotent"])
def test_langgraph_credit_node_reruns_after_sigkill_after_effect(lab, graph, observe, idempotent):
    """The credit node's process SIGKILLed after the tool's effect and before LangGraph
    checkpointed the node: resuming the thread (invoke(None)) in a new process runs the node
    again, so the tool is called twice: two credits with a non-idempotent tool for one
    approved plan, and the final state keeps only the second receipt."""
    rig = lab.credit_tool(idempotent=idempotent)
    thread = names.new_id("thread")
    _interrupted(lab, graph, rig, thread)
    resumed = graph.spawn("resume", "graph-resume", rig.service, thread, "--value", APPROVE,
                          "--pause", "after_tool")
    resumed.wait_for("BOOK_STAGE after_tool", timeout=STEP_WITHIN)
    assert lab.effects() == 1, "the crash window is after the effect"
    _checkpointed_before_credit(lab, graph, thread)
    assert resumed.kill() == -signal.SIGKILL
    assert graph.snapshot(thread)["next"] == ["credit"], "the node was checkpointed"
    again = graph.spawn("continue", "graph-continue", rig.service, thread)
    again.wait_for("BOOK_DONE", timeout=STEP_WITHIN)
    again.finish(timeout=30)
    effects, calls = lab.effects(), rig.service.calls
    seen = _seen(graph, thread)
    receipts = [row["receipt"] for row in lab.store.execute(
        "SELECT receipt FROM tool_effects ORDER BY seq")]
    assert calls == 2, "LangGraph re-runs an uncheckpointed node on resume"
    assert effects == (1 if idempotent else 2)
    assert seen["langgraph_state"]["next"] == []  # type: ignore[index]
    assert seen["langgraph_state"]["receipt_id"] == receipts[-1]  # type: ignore[index]
    window = "kill_after_effect_" + ("idempotent" if idempotent else "non_idempotent")
    observe({
        "peer_window": window,
        "system": "langgraph",
        "effects": effects,
        "tool_calls": calls,
        **seen,
        "outcome": f"credit node re-ran on resume: {calls} tool calls, {effects} effect(s); "
                   f"the state keeps receipt {len(receipts)} of {len(receipts)}",
    }, measurements=("langgraph_state",), facts=("peer_window", "system", "effects",
                                                 "tool_calls", "langgraph_versions",
                                                 "langgraph_config", "outcome"))


def test_langgraph_lost_reply_is_replayed_on_resume(lab, graph, observe):
    """The tool commits a non-idempotent credit and the reply is lost: the credit node fails,
    LangGraph leaves it as the thread's next node, and resuming the thread calls the tool
    again: two credits; nothing marks the outcome unknown or looks it up."""
    rig = lab.credit_tool(idempotent=False)
    thread = names.new_id("thread")
    _interrupted(lab, graph, rig, thread)
    rig.service.drop_responses = True
    resumed = graph.spawn("resume", "graph-resume", rig.service, thread, "--value", APPROVE)
    failed = resumed.wait_for("BOOK_FAILED", timeout=STEP_WITHIN)
    resumed.finish(timeout=30)
    after_loss = graph.snapshot(thread)
    assert failed == "BOOK_FAILED OutcomeUnknown"
    assert after_loss["next"] == ["credit"]
    assert lab.effects() == 1
    rig.service.drop_responses = False
    again = graph.spawn("continue", "graph-continue", rig.service, thread)
    again.wait_for("BOOK_DONE", timeout=STEP_WITHIN)
    again.finish(timeout=30)
    effects, lookups = lab.effects(), rig.service.lookups
    assert effects == 2
    assert lookups == 0
    observe({
        "peer_window": "lost_reply",
        "system": "langgraph",
        "effects": effects,
        "tool_calls": rig.service.calls,
        "next_after_lost_reply": after_loss["next"],
        **_seen(graph, thread),
        "outcome": f"lost reply left next={after_loss['next']}; resume called again: "
                   f"{effects} effect(s), {lookups} lookups",
    }, measurements=("langgraph_state",), facts=("peer_window", "system", "effects",
                                                 "tool_calls", "next_after_lost_reply",
                                                 "langgraph_versions", "langgraph_config",
                                                 "outcome"))


@pytest.mark.parametrize("decision", [
    "yes-anything",
    {"approved": True, "tenant": "tenant-b", "fingerprint": "sha256:" + "0" * 64},
], ids=["any_string", "other_tenant_and_plan"])
def test_langgraph_approval_is_any_resume_value(lab, graph, observe, decision):
    """The approval is whatever Command(resume=...) carries: a bare string, or a decision
    naming another tenant and another plan's fingerprint, is accepted and the credit runs;
    nothing binds it to the plan, a tenant, a role or an expiry."""
    rig = lab.credit_tool(idempotent=True)
    thread = names.new_id("thread")
    _interrupted(lab, graph, rig, thread)
    plan_fingerprint = graph.snapshot(thread)["interrupts"][0]["fingerprint"]
    resumed = graph.spawn("resume", "graph-resume", rig.service, thread,
                          "--value", json.dumps(decision))
    resumed.wait_for("BOOK_DONE", timeout=STEP_WITHIN)
    resumed.finish(timeout=30)
    seen = _seen(graph, thread)
    stored = seen["langgraph_state"]["approval"]  # type: ignore[index]
    effects = lab.effects()
    assert stored == decision
    assert effects == 1
    names_plan = isinstance(stored, dict) and stored.get("fingerprint") == plan_fingerprint
    assert not names_plan
    observe({
        "peer_window": "approval_binding",
        "system": "langgraph",
        "effects": effects,
        "approval_names_this_plan": names_plan,
        **seen,
        "outcome": f"resume value {json.dumps(stored)} accepted as approval: {effects} effect(s)",
    }, measurements=("langgraph_state",), facts=("peer_window", "system", "effects",
                                                 "approval_names_this_plan",
                                                 "langgraph_versions", "langgraph_config",
                                                 "outcome"))


def test_langgraph_resume_after_expiry_still_credits(lab, graph, observe):
    """The graph's interrupt asks for an approval valid for 1 s; resumed after that expiry,
    LangGraph runs the credit: the expiry in the interrupt's payload binds nothing."""
    rig = lab.credit_tool(idempotent=True)
    thread = names.new_id("thread")
    _interrupted(lab, graph, rig, thread)
    expires = datetime.fromisoformat(graph.snapshot(thread)["interrupts"][0]["expires_at"])
    lab.wait_until(lambda: datetime.now(expires.tzinfo) > expires, within=5.0,
                   what="the approval to expire")
    late = (datetime.now(expires.tzinfo) - expires).total_seconds()
    resumed = graph.spawn("resume", "graph-resume", rig.service, thread, "--value", APPROVE)
    resumed.wait_for("BOOK_DONE", timeout=STEP_WITHIN)
    resumed.finish(timeout=30)
    effects = lab.effects()
    assert late > 0
    assert effects == 1
    observe({
        "peer_window": "approval_expiry",
        "system": "langgraph",
        "effects": effects,
        "resumed_seconds_after_expiry": round(late, 3),
        **_seen(graph, thread),
        "outcome": f"resumed at least {late:.2f} s after the approval expired: "
                   f"{effects} effect(s)",
    }, measurements=("langgraph_state", "outcome"), facts=("peer_window", "system", "effects",
                                                           "langgraph_versions",
                                                           "langgraph_config"))


def test_langgraph_two_processes_resume_one_thread(lab, graph, observe):
    """Two processes resume the same interrupted thread at once and both reach the credit
    node: LangGraph has no claim or lease on a thread, so both call the non-idempotent tool
    and the ledger holds two credits for one approval."""
    rig = lab.credit_tool(idempotent=False)
    thread = names.new_id("thread")
    _interrupted(lab, graph, rig, thread)
    both = [graph.spawn("resume", f"graph-{n}", rig.service, thread, "--value", APPROVE,
                        "--start-gate", "--pause", "before_tool") for n in ("a", "b")]
    for child in both:
        child.wait_for("BOOK_READY", timeout=STEP_WITHIN)
    for child in both:
        child.release()
    for child in both:
        child.wait_for("BOOK_STAGE before_tool", timeout=STEP_WITHIN)
    for child in both:
        child.release()
    for child in both:
        child.wait_for("BOOK_DONE", timeout=STEP_WITHIN)
        child.finish(timeout=30)
    effects, calls = lab.effects(), rig.service.calls
    assert calls == 2
    assert effects == 2
    observe({
        "peer_window": "concurrent_resume",
        "system": "langgraph",
        "effects": effects,
        "tool_calls": calls,
        "processes_in_credit_node": len(both),
        **_seen(graph, thread),
        "outcome": f"{len(both)} processes ran the credit node of one thread: "
                   f"{effects} effect(s)",
    }, measurements=("langgraph_state",), facts=("peer_window", "system", "effects",
                                                 "tool_calls", "processes_in_credit_node",
                                                 "langgraph_versions", "langgraph_config",
                                                 "outcome"))


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "non_idempotent"])
def test_langgraph_node_delegating_to_the_lab_keeps_one_effect(lab, graph, observe, idempotent):
    """The same graph with a credit node that hands the effect to the lab (admission, bound
    approval, a lab worker with lease, start barrier and effect key), SIGKILLed in the same
    window: resuming the thread leaves one effect; the lab reconciles it by lookup
    (idempotent) or holds it for a person (non-idempotent), never calling the tool again."""
    rig = lab.credit_tool(idempotent=idempotent)
    contract = "credit-service" if idempotent else "credit-service-non-idempotent"
    thread = names.new_id("thread")
    _interrupted(lab, graph, rig, thread, "--mode", "delegate", "--contract", contract)
    waiting = graph.snapshot(thread)["interrupts"][0]
    approval = json.dumps({"tenant": harness.APPROVER.tenant,
                           "approver": harness.APPROVER.subject,
                           "fingerprint": waiting["fingerprint"]})
    resumed = graph.spawn("resume", "graph-resume", rig.service, thread, "--value", approval,
                          "--mode", "delegate", "--contract", contract, "--pause", "after_tool")
    resumed.wait_for("BOOK_STAGE after_tool", timeout=STEP_WITHIN)
    assert lab.effects() == 1, "the crash window is after the effect"
    _checkpointed_before_credit(lab, graph, thread)
    assert resumed.kill() == -signal.SIGKILL
    assert graph.snapshot(thread)["next"] == ["credit"], "the node was checkpointed"
    started = time.monotonic()
    again = graph.spawn("continue", "graph-continue", rig.service, thread,
                        "--mode", "delegate", "--contract", contract)
    again.wait_for("BOOK_DONE", timeout=STEP_WITHIN)
    again.finish(timeout=30)
    effects, calls = lab.effects(), rig.service.calls
    seen = graph.snapshot(thread)
    workflow = lab.store.execute("SELECT id, state, review_reason FROM workflows")[0]
    assert calls == 1, "the lab never calls the tool a second time"
    assert effects == 1
    assert seen["lab_state"] == workflow["state"]
    if idempotent:
        assert workflow["state"] == "succeeded"
        assert rig.service.lookups == 1
    else:
        assert workflow["state"] == "unknown"
        assert workflow["review_reason"] == "non_idempotent_dispatched"
    window = "kill_after_effect_" + ("idempotent" if idempotent else "non_idempotent")
    observe({
        "peer_window": window,
        "system": "lab",
        "via": "langgraph_node_delegating_to_the_lab",
        "effects": effects,
        "tool_calls": calls,
        "lookups": rig.service.lookups,
        "lab_state": workflow["state"],
        "review_reason": workflow["review_reason"],
        "resume_seconds": round(time.monotonic() - started, 2),
        **_seen(graph, thread),
        "outcome": f"{calls} tool call(s), {effects} effect(s) after the SIGKILL; "
                   f"lab state {workflow['state']}",
    }, measurements=("langgraph_state",), facts=("peer_window", "system", "via", "effects",
                                                 "tool_calls", "lookups", "lab_state",
                                                 "review_reason", "langgraph_versions",
                                                 "langgraph_config", "outcome"))


def test_langgraph_postgres_restart_between_effect_and_checkpoint(
    lab, killable_postgres, observe
):
    """LangGraph's checkpoint PostgreSQL (fsync on) SIGKILLed and restarted while the credit
    node holds a non-idempotent credit it has not checkpointed: the process's checkpoint
    write fails, the thread still names the credit node as next, and resuming it in a new
    process credits again: two credits for one approval."""
    rig = lab.credit_tool(idempotent=False)
    thread = names.new_id("thread")
    graph = langgraph_peer.Peer(killable_postgres.provisioned.dsn, f"{lab.schema}_lg",
                                lab.schema, lab.store.keys, on_event=lab.mark)
    try:
        _interrupted(lab, graph, rig, thread)
        resumed = graph.spawn("resume", "graph-resume", rig.service, thread, "--value", APPROVE,
                              "--pause", "after_tool")
        resumed.wait_for("BOOK_STAGE after_tool", timeout=STEP_WITHIN)
        _checkpointed_before_credit(lab, graph, thread)
        assert lab.effects() == 1
        down = killable_postgres.crash_restart()
        lab.mark("postgresql", f"checkpoint server restarted after {down:.2f}s")
        resumed.release()
        ended = resumed.wait_for("BOOK_", timeout=STEP_WITHIN)
        resumed.finish(timeout=30)
        after_restart = graph.snapshot(thread)
        again = graph.spawn("continue", "graph-continue", rig.service, thread)
        again.wait_for("BOOK_DONE", timeout=STEP_WITHIN)
        again.finish(timeout=30)
        effects, calls = lab.effects(), rig.service.calls
        assert ended.startswith("BOOK_FAILED"), f"the checkpoint write survived: {ended}"
        assert after_restart["next"] == ["credit"]
        assert calls == 2
        assert effects == 2
        observe({
            "peer_window": "postgres_restart_during_recovery",
            "system": "langgraph",
            "effects": effects,
            "tool_calls": calls,
            "resume_process": ended,
            "next_after_restart": after_restart["next"],
            "server_down_seconds": round(down, 2),
            **_seen(graph, thread),
            "outcome": f"restart before the checkpoint: {ended.split()[-1]} in the node's "
                       f"process, next={after_restart['next']}; resume credited again: "
                       f"{effects} effect(s)",
        }, measurements=("langgraph_state",), facts=("peer_window", "system", "effects",
                                                     "tool_calls", "resume_process",
                                                     "next_after_restart", "langgraph_versions",
                                                     "langgraph_config", "outcome"))
    finally:
        graph.close()
