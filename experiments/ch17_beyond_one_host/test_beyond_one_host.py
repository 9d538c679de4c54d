"""Chapter 17: beyond one host. The workflow database is a primary and a streaming standby
on lab hosts of their own, the credit tool and its ledger on a third, workers on two more
(network namespaces on a bridge of their own: ``beyond_one_host`` in conftest.py). The
primary dies in a window of a workflow and the standby is promoted; what every client was
told is compared with what the new primary holds."""

from __future__ import annotations

import socket

import pytest

from lab import harness, protocol
from lab.hosts import network, replication
from lab.runtime import store

# What a worker's stage line says was committed, and the audit event that commit wrote.
COMMITTED = {protocol.AFTER_CLAIM: "claimed", protocol.AFTER_BARRIER: "dispatching",
             protocol.AFTER_COMPLETE: "completed"}
TOOL_HOLDS = "tool_holds"
WINDOWS = (protocol.AFTER_CLAIM, protocol.AFTER_BARRIER, TOOL_HOLDS, protocol.AFTER_TOOL)


def told(*workers: harness.WorkerProcess) -> list[tuple[str, int, str]]:
    """The commits each worker was told succeeded: (event kind, fence, worker), in order."""
    found = []
    for worker in workers:
        for line in worker.all_lines():
            parts = line.split()
            if parts[:1] == [protocol.STAGE] and parts[1] in COMMITTED:
                found.append((COMMITTED[parts[1]], int(parts[3]), worker.name))
    return found


def held(lab: harness.Harness) -> set[tuple[str, int, str]]:
    """What the primary holds now: (event kind, fence, owner of that fence's claim) of every
    audit event. The owner tells two claims of one fence apart."""
    owners = {c.fence: c.owner for c in harness.retrying(lab.claims)}
    return {(e["kind"], int(e["fence"] or 0), owners.get(int(e["fence"] or 0), ""))
            for e in harness.retrying(lab.event_history)}


def settle(rig, lab: harness.Harness, workflow_id: str, host: str = "w2") -> list[str]:
    """What the lab does after any crash: a lease left running runs out and is recovered,
    an unknown outcome is reconciled by a worker on another host. The steps taken."""
    steps = []
    if harness.retrying(lambda: lab.state(workflow_id)).state == "running":
        lab.recover_by_elapsed_lease(workflow_id)
        steps.append("lease recovered")
    if lab.state(workflow_id).state in ("unknown", "queued"):
        rig.spawn_worker(host, f"{host}-reconciler", "--reconcile", workflow_id).finish(
            expect_exit=None)
        steps.append("reconciled on another host")
    return steps


def test_the_hosts_reach_each_other_and_no_address_outside_the_bridge(beyond_one_host, observe):
    """From inside every host of the chapter's rig, a new process connects to the primary
    on the bridge, and to nothing outside it: a listener on the machine's loopback (which
    the machine itself reaches) is refused by the host's own loopback, and the machine's
    own addresses and a public address have no route. The kernel's errors, as given."""
    rig, _ = beyond_one_host("sync")
    primary = rig.pair.primary.host.address
    # A listener of the machine itself, on every address it has (a host must reach none).
    listener = socket.create_server(("0.0.0.0", 0))  # noqa: S104
    port = listener.getsockname()[1]
    own = network.outside_addresses()
    try:
        machine = {address: network.probe(None, address, port) for address in ["127.0.0.1", *own]}
        seen = {name: {
            "primary": network.probe(host, primary, replication.PORT),
            "loopback": network.probe(host, "127.0.0.1", port),
            "public": network.probe(host, "1.1.1.1", 80),
            **{address: network.probe(host, address, port) for address in own},
        } for name, host in rig.hosts.hosts.items()}
    finally:
        listener.close()
    outcomes = {what: sorted({row[what] for row in seen.values()})
                for what in ("primary", "loopback", "public")}
    machine_addresses = {address: sorted({row[address] for row in seen.values()})
                         for address in own}
    reached = sorted(f"{name} -> {what}" for name, row in seen.items()
                     for what, result in row.items() if what != "primary" and result == "connected")
    assert set(machine.values()) == {"connected"}
    assert outcomes == {"primary": ["connected"], "loopback": ["ECONNREFUSED"],
                        "public": ["ENETUNREACH"]}
    assert machine_addresses == {address: ["ENETUNREACH"] for address in own}
    assert reached == []
    observe({
        "hosts": sorted(seen),
        "machine_reaches_its_listener": machine["127.0.0.1"],
        "to_the_primary": outcomes["primary"],
        "to_the_machine_loopback": outcomes["loopback"],
        "to_a_public_address": outcomes["public"],
        "outside_reached": reached,
        "to_the_machine_addresses": machine_addresses,
    }, facts=("hosts", "machine_reaches_its_listener", "to_the_primary",
              "to_the_machine_loopback", "to_a_public_address", "outside_reached"),
       measurements=("to_the_machine_addresses",))


@pytest.mark.parametrize("window", WINDOWS)
def test_synchronous_failover_loses_no_acknowledged_commit(beyond_one_host, observe, window):
    """With synchronous replication, the primary killed and the standby promoted in each
    window (after the claim, after the start barrier, while the tool holds the request,
    after the reply): everything a worker was told committed is on the new primary, and the
    workflow ends succeeded with exactly one effect."""
    holds = window == TOOL_HOLDS
    rig, lab = beyond_one_host("sync", tool_flags=("--pause", protocol.AFTER_REQUEST)
                               if holds else ())
    job = lab.approved(idempotent=True)
    first = rig.spawn_worker("w1", "w1-worker", *(() if holds else ("--pause", window)))
    if holds:
        rig.tool.wait_for(f"{protocol.STAGE} {protocol.AFTER_REQUEST}")
    else:
        first.wait_for(f"{protocol.STAGE} {window}")
    before = told(first)
    steps = [s["step"] for s in rig.pair.failover()]
    lab.mark("experiment", "failover: db1 fenced, db2 promoted")
    (rig.tool.send("") if holds else first.release())
    first.finish(expect_exit=None)
    recovery = settle(rig, lab, job.id)
    acknowledged = told(first)
    lost = [commit for commit in acknowledged if commit not in held(lab)]
    final = lab.state(job.id)
    effects = rig.ledger_effects()
    assert before and set(before) <= set(acknowledged)
    assert steps == ["fenced", "promoted", "commits alone"]
    assert lost == []
    assert final.state == "succeeded"
    assert effects == 1
    topology = rig.topology()
    observe({
        "replication": "sync",
        "window": window,
        "failover_steps": steps,
        "acknowledged_commits": len(acknowledged),
        "acknowledged_lost": lost,
        "state": final.state,
        "effects": effects,
        "recovery": recovery,
        "hosts": topology["hosts"],
        "host_roles": topology["roles"],
        "network": topology["network"],
    }, facts=("replication", "window", "failover_steps", "acknowledged_lost", "state",
              "effects", "host_roles", "network"),
       measurements=("acknowledged_commits", "recovery", "hosts"))


def _failover_after_the_barrier(beyond_one_host, mode):
    """A non-idempotent workflow; with ``async`` the standby is cut off from the primary
    first (it falls behind, as a lagging standby does) and stays cut off: a server killed by
    its process group leaves its host's kernel retransmitting what it had already sent, so
    a link restored before the promotion could still deliver the lost commits (CI saw it
    once, under load). The primary dies after the start barrier and
    the standby is promoted; the first worker's request then goes out, and the first worker
    dies once the reply is in (before it can complete: whether its pool would reach the new
    primary in time is up to timing, which load changes); a worker on another host carries
    on from what the new primary holds."""
    rig, lab = beyond_one_host(mode, idempotent=False)
    job = lab.approved(idempotent=False)
    rig.pair.wait_until("the standby to replay the approval",
                        lambda: rig.pair.replay_lag_bytes() == 0, within=30)
    if mode == "async":
        rig.faults.partition("db1", "db2")
    first = rig.spawn_worker("w1", "w1-worker", "--pause", protocol.AFTER_BARRIER,
                             "--crash-at", protocol.AFTER_TOOL)
    first.wait_for(f"{protocol.STAGE} {protocol.AFTER_BARRIER}")
    rig.pair.fence()
    rig.pair.promote()
    lab.mark("experiment", "failover: db1 fenced, db2 promoted")
    first.release()
    first.finish(expect_exit=None)
    second = rig.spawn_worker("w2", "w2-worker")
    second.finish(expect_exit=None)
    settle(rig, lab, job.id)
    acknowledged = told(first)
    lost = [commit for commit in acknowledged if commit not in held(lab)]
    return rig, lab, job, acknowledged, lost


def test_asynchronous_failover_after_the_start_barrier_loses_it_and_sends_a_second_effect(
    beyond_one_host, observe
):
    """With asynchronous replication and a standby behind, the claim and the start barrier a
    worker was told had committed are not on the new primary: another worker claims the
    workflow again under the same fence and calls the non-idempotent tool a second time.
    The lab's one-effect guarantee needs synchronous replication."""
    rig, lab, job, acknowledged, lost = _failover_after_the_barrier(beyond_one_host, "async")
    final = lab.state(job.id)
    claims = lab.claims(job.id)
    effects = rig.ledger_effects()
    assert acknowledged == [("claimed", 1, "w1-worker"), ("dispatching", 1, "w1-worker")]
    assert lost == acknowledged
    assert [(c.owner, c.fence) for c in claims] == [("w2-worker", 1)]
    assert effects == 2
    assert rig.tool_requests()["call"] == 2
    observe({
        "replication": "async",
        "window": protocol.AFTER_BARRIER,
        "acknowledged_lost": [f"{kind} fence {fence} by {who}" for kind, fence, who in lost],
        "fence_reused_by": [c.owner for c in claims],
        "effects": effects,
        "second_effect": effects - 1,
        "state": final.state,
    }, facts=("replication", "window", "acknowledged_lost", "fence_reused_by", "effects",
              "second_effect"), measurements=("state",))


def test_synchronous_failover_after_the_start_barrier_keeps_one_effect_and_asks_a_person(
    beyond_one_host, observe
):
    """The same failover with synchronous replication: the new primary holds the start
    barrier, so no worker calls the non-idempotent tool again; once the dead first
    worker's lease runs out the workflow waits for a person, with exactly one effect."""
    rig, lab, job, _, lost = _failover_after_the_barrier(beyond_one_host, "sync")
    final = lab.state(job.id)
    effects = rig.ledger_effects()
    assert lost == []
    assert [c.owner for c in lab.claims(job.id)] == ["w1-worker"]
    assert effects == 1
    assert rig.tool_requests()["call"] == 1
    assert final.state == "unknown"
    assert final.review_reason == "non_idempotent_dispatched"
    observe({
        "replication": "sync",
        "window": protocol.AFTER_BARRIER,
        "acknowledged_lost": lost,
        "effects": effects,
        "state": final.state,
        "review_reason": final.review_reason,
    }, facts=("replication", "window", "acknowledged_lost", "effects", "state",
              "review_reason"))


def on_node(rig, lab: harness.Harness, node, workflow_id: str) -> dict:
    """What one server holds of the experiment's schema, read over its own unix socket:
    ``held`` (as ``held``), the claims of ``workflow_id`` (owner, fence) and its state."""
    dsn = rig.pair.local_dsn(node)
    db = store.Store.open(dsn, lab.schema, max_connections=1, keys=lab.store.keys)
    try:
        view = harness.Harness(dsn, lab.schema, db)
        return {"held": held(view), "state": view.state(workflow_id).state,
                "claims": [(c.owner, c.fence) for c in view.claims(workflow_id)]}
    finally:
        db.close()


def _split_brain(beyond_one_host, fenced: bool):
    """Asynchronous replication, a non-idempotent workflow approved and on the standby.
    ``db1`` is cut from ``db2`` and from ``w2`` (``w1`` still reaches it), fenced or not,
    and ``db2`` promoted. A worker on ``w1`` runs the workflow, then one on ``w2``."""
    rig, lab = beyond_one_host("async", idempotent=False)
    job = lab.approved(idempotent=False)
    rig.pair.wait_until("the standby to replay the approval",
                        lambda: rig.pair.replay_lag_bytes() == 0, within=30)
    old = rig.pair.primary
    rig.faults.partition("db1", "db2")
    rig.faults.partition("db1", "w2")
    if fenced:
        rig.pair.fence()
    new = rig.pair.promote()
    lab.mark("experiment", f"split: db1 cut from db2 and w2, {'fenced' if fenced else 'serving'}"
             ", db2 promoted")
    first = rig.spawn_worker("w1", "w1-worker")
    first.finish(expect_exit=None)
    second = rig.spawn_worker("w2", "w2-worker")
    second.finish(expect_exit=None)
    servers = {"db2": on_node(rig, lab, new, job.id)}
    if not fenced:
        servers["db1"] = on_node(rig, lab, old, job.id)
    return rig, told(first, second), servers


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "not_fenced"])
def test_split_brain_without_fencing_loses_acknowledged_commits_and_sends_a_second_effect(
    beyond_one_host, observe, fenced
):
    """The old primary is cut from the standby but one worker still reaches it, and the
    standby is promoted (asynchronous replication, a non-idempotent tool). Fenced, the
    worker's commits go to the new primary: nothing acknowledged is lost, one owner per
    fence, one effect. Not fenced, the old primary goes on acknowledging: the new primary
    never sees that worker's claim, barrier or completion, a worker there claims the same
    fence again and the tool is called a second time."""
    rig, acknowledged, servers = _split_brain(beyond_one_host, fenced)
    lost = [commit for commit in acknowledged if commit not in servers["db2"]["held"]]
    owners = sorted({f"{owner} on {name}" for name, seen in servers.items()
                     for owner, fence in seen["claims"] if fence == 1})
    effects, calls = rig.ledger_effects(), rig.tool_requests()["call"]
    by_w1 = [("claimed", 1, "w1-worker"), ("dispatching", 1, "w1-worker"),
             ("completed", 1, "w1-worker")]
    assert acknowledged[:3] == by_w1
    assert servers["db2"]["state"] == "succeeded"
    if fenced:
        assert (lost, owners, effects, calls) == ([], ["w1-worker on db2"], 1, 1)
    else:
        assert lost == by_w1
        assert owners == ["w1-worker on db1", "w2-worker on db2"]
        assert servers["db1"]["state"] == "succeeded"
        assert (effects, calls) == (2, 2)
    observe({
        "replication": "async",
        "old_primary": "fenced" if fenced else "serving w1",
        "acknowledged_lost": [f"{kind} fence {fence} by {who}" for kind, fence, who in lost],
        "owners_of_fence_1": owners,
        "effects": effects,
        "tool_calls": calls,
        "state_on_new_primary": servers["db2"]["state"],
        "hosts": rig.topology()["hosts"],
    }, facts=("replication", "old_primary", "acknowledged_lost", "owners_of_fence_1",
              "effects", "tool_calls", "state_on_new_primary"), measurements=("hosts",))


def _sync_split_brain(beyond_one_host):
    """Synchronous replication, ``db1`` cut from ``db2`` and ``w2``, not fenced, ``db2``
    promoted. A worker on ``w1`` reaches ``db1`` and its claim's commit waits for the lost
    standby; a worker on ``w2`` runs the workflow on ``db2``; then the waiting commit is
    cancelled on ``db1`` (as a statement timeout or an operator would) and the first
    worker goes on until its next commit waits in turn."""
    rig, lab = beyond_one_host("sync", idempotent=False)
    job = lab.approved(idempotent=False)
    old = rig.pair.primary
    rig.faults.partition("db1", "db2")
    rig.faults.partition("db1", "w2")
    new = rig.pair.promote()
    lab.mark("experiment", "split: db1 cut from db2 and w2, serving, db2 promoted")
    # A lease and a heartbeat period longer than anything here waits: what stops this
    # worker must be the waiting commit, never its lease running out while a loaded
    # machine is slow to run the second worker (it did, beside 4 busy processes).
    first = rig.spawn_worker("w1", "w1-worker", "--lease", "300", "--heartbeat", "300")
    waiting = store.Store.open(rig.pair.local_dsn(old), lab.schema, max_connections=1)
    try:
        def stuck() -> int:
            return int(waiting.execute("SELECT count(*) AS n FROM pg_stat_activity "
                                       "WHERE wait_event = 'SyncRep'")[0]["n"])
        lab.wait_until(lambda: stuck() == 1, within=30.0,
                       what="the old primary's commit to wait for the lost standby")
        rig.spawn_worker("w2", "w2-worker").finish(expect_exit=None)
        before = told(first)
        waiting.execute("SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
                        "WHERE wait_event = 'SyncRep'")
        lab.mark("experiment", "db1: the commit waiting for the lost standby cancelled")
        first.wait_for(f"{protocol.STAGE} {protocol.AFTER_CLAIM}")
        lab.wait_until(lambda: stuck() == 1, within=30.0,
                       what="the first worker's next commit to wait for the lost standby")
        servers = {"db2": on_node(rig, lab, new, job.id),
                   "db1": on_node(rig, lab, old, job.id)}
    finally:
        waiting.close()
        # Fenced at last, whatever happened above: the experiment's own teardown follows
        # the read-write primary, and a commit on this one would wait for the lost standby.
        rig.pair.fence()
    return rig, before, told(first), servers


def test_split_brain_with_synchronous_replication_acknowledges_nothing_until_a_wait_is_cancelled(
    beyond_one_host, observe
):
    """The same split brain with synchronous replication, the old primary not fenced: the
    worker that still reaches it is told nothing while its claim's commit waits for a
    standby that no longer follows, and a worker on the new primary runs the workflow
    with one effect. Once that wait is cancelled (PostgreSQL then reports the commit, as
    it is on the old primary's disk), the first worker is told its claim committed: an
    acknowledged claim the new primary never sees, and two owners of one fence. Its next
    commit, the start barrier, waits again, so the tool is called once."""
    rig, before, acknowledged, servers = _sync_split_brain(beyond_one_host)
    lost = [commit for commit in acknowledged if commit not in servers["db2"]["held"]]
    owners = sorted({f"{owner} on {name}" for name, seen in servers.items()
                     for owner, fence in seen["claims"] if fence == 1})
    effects, calls = rig.ledger_effects(), rig.tool_requests()["call"]
    assert before == []
    assert acknowledged == lost == [("claimed", 1, "w1-worker")]
    assert owners == ["w1-worker on db1", "w2-worker on db2"]
    assert (servers["db2"]["state"], effects, calls) == ("succeeded", 1, 1)
    observe({
        "replication": "sync",
        "old_primary": "serving w1",
        "told_w1_while_waiting": before,
        "acknowledged_lost": [f"{kind} fence {fence} by {who}" for kind, fence, who in lost],
        "owners_of_fence_1": owners,
        "effects": effects,
        "tool_calls": calls,
        "state_on_new_primary": servers["db2"]["state"],
    }, facts=("replication", "old_primary", "told_w1_while_waiting", "acknowledged_lost",
              "owners_of_fence_1", "effects", "tool_calls", "state_on_new_primary"))


# Which packets a one-way partition drops: (sender, receiver).
ONE_WAY = {"worker_to_primary": ("w1", "db1"), "primary_to_worker": ("db1", "w1")}


@pytest.mark.parametrize("direction", ONE_WAY)
def test_one_way_partition_during_the_lease_keeps_one_effect(
    beyond_one_host, observe, direction
):
    """A worker holds the lease and has passed the start barrier when a one-way partition
    drops its packets to the primary, or the primary's to it (the tool stays reachable).
    Either way it calls the tool once and then can neither record the completion nor
    renew its lease (a conversation with the database needs both directions): it stops
    on the lost connection. The lease runs out on the primary, the unknown outcome is
    reconciled from another host by a lookup that finds the effect, and the workflow ends
    succeeded with one effect."""
    rig, lab = beyond_one_host("sync")
    job = lab.approved(idempotent=True)
    first = rig.spawn_worker("w1", "w1-worker", "--pause", protocol.AFTER_BARRIER)
    first.wait_for(f"{protocol.STAGE} {protocol.AFTER_BARRIER}")
    rig.faults.partition(*ONE_WAY[direction], one_way=True)
    lab.mark("experiment", f"one-way partition {'->'.join(ONE_WAY[direction])}")
    first.release()
    code = first.finish(timeout=90, expect_exit=None)
    recovery = settle(rig, lab, job.id)
    acknowledged = told(first)
    lost = [commit for commit in acknowledged if commit not in held(lab)]
    final, effects, requests = lab.state(job.id), rig.ledger_effects(), rig.tool_requests()
    owners = [c.owner for c in lab.claims(job.id)]
    assert acknowledged == [("claimed", 1, "w1-worker"), ("dispatching", 1, "w1-worker")]
    assert lost == []
    assert recovery == ["lease recovered", "reconciled on another host"]
    assert (final.state, effects, requests) == ("succeeded", 1, {"call": 1, "lookup": 1})
    assert owners == ["w1-worker"]
    observe({
        "direction": direction,
        "acknowledged": [f"{kind} fence {fence}" for kind, fence, _ in acknowledged],
        "acknowledged_lost": lost,
        "recovery": recovery,
        "state": final.state,
        "effects": effects,
        "tool_requests": requests,
        "owners": owners,
        "worker_exit": code,
        "worker_stopped_on": first.tail(),
    }, facts=("direction", "acknowledged", "acknowledged_lost", "recovery", "state",
              "effects", "tool_requests", "owners"),
       measurements=("worker_exit", "worker_stopped_on"))


# How far a worker host's clock is set from real time: an hour, far past a 3 s lease.
SKEWS = {"ahead": 3600, "behind": -3600}


@pytest.mark.parametrize("skew", SKEWS)
def test_a_worker_host_clock_skewed_past_the_lease_changes_nothing(
    beyond_one_host, observe, skew
):
    """The worker on ``w1`` runs with its wall clock an hour ahead of real time, or an hour
    behind: far past its 3 s lease either way. The lab reads one clock, PostgreSQL's, so
    nothing changes: the lease it holds runs for 3 s of the primary's time and is kept by
    heartbeats, a worker on ``w2`` with a true clock finds nothing to take while the first
    is paused after its start barrier, and the workflow ends succeeded with one effect
    and one owner."""
    rig, lab = beyond_one_host("sync")
    offset = SKEWS[skew]
    seen = rig.wall_clock_offset("w1", offset)
    job = lab.approved(idempotent=True)
    first = rig.spawn_worker("w1", "w1-worker", "--pause", protocol.AFTER_BARRIER,
                             clock_offset_s=offset)
    first.wait_for(f"{protocol.STAGE} {protocol.AFTER_BARRIER}")
    held_for = float(lab.store.execute(
        "SELECT extract(epoch FROM lease_until - clock_timestamp()) AS s FROM workflows "
        "WHERE id = %s", (job.id,))[0]["s"])
    lab.mark("experiment", f"w1's clock {offset:+d} s; w2 tries while w1 holds the lease")
    second = rig.spawn_worker("w2", "w2-worker")
    second.finish(expect_exit=None)
    first.release()
    first.finish()
    final, effects, requests = lab.state(job.id), rig.ledger_effects(), rig.tool_requests()
    owners = [c.owner for c in lab.claims(job.id)]
    assert abs(seen - offset) < 60, f"w1's clock is {seen:+.0f} s from real time"
    assert 0 < held_for <= 3.0, f"the lease runs {held_for:.1f} s more on the primary"
    assert (final.state, effects, requests) == ("succeeded", 1, {"call": 1, "lookup": 0})
    assert owners == ["w1-worker"]
    observe({
        "skew": skew,
        "worker_clock_offset_s": offset,
        "worker_clock_seen_s": round(seen, 1),
        "lease_left_on_the_primary_s": round(held_for, 2),
        "state": final.state,
        "effects": effects,
        "tool_requests": requests,
        "owners": owners,
    }, facts=("skew", "worker_clock_offset_s", "state", "effects", "tool_requests", "owners"),
       measurements=("worker_clock_seen_s", "lease_left_on_the_primary_s"))
