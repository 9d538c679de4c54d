"""Stateful exploration of the real store on real PostgreSQL.

A hypothesis ``RuleBasedStateMachine`` drives three worker identities, both
kinds of credit tool (real HTTP services on loopback) and a lease clock it
controls through SQL on PostgreSQL's own clock: create and approve, claim,
heartbeat, expire a lease, recover expired leases, pre-dispatch, call the
tool with each outcome (receipt, reply lost, trusted 429, unreachable),
complete, the looping worker's fused step (completion, recovery, claim and an
idempotent claim's start barrier in one transaction), give up as unknown, crash
(forget a claim), reconcile, cancel and requeue by review (with and without
force). Nothing is mocked: a worker may call the tool with a claim that went
stale meanwhile, exactly as a slow process would.

After every step the checker's safety rules (those that hold at every moment)
must hold of the whole history; at the end of each sequence everything is
drained (leases expired and recovered, unknowns reconciled, ready work carried
out) and every rule must hold, including that nothing is lost.

Sequences: ``ci`` profile (default) runs a bounded, derandomized number;
``HYPOTHESIS_PROFILE=long`` runs at least 2,000. ``LAB_STATEFUL_SEQUENCES``
overrides both.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from lab import errors, pytest_plugin
from lab.faults import invariants
from lab.runtime import barrier, plan, sealing, store, tool, toolclient

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
SEQUENCES = int(os.environ.get("LAB_STATEFUL_SEQUENCES", 2000 if PROFILE == "long" else 20))
STEPS = 25
WORKERS = ("w0", "w1", "w2")
BATCH = 3  # a fused step claims up to this many
# What one worker holds: its first claim under its own name, a batch's others as "w0.1"...
SLOTS = tuple(f"{w}.{i}" if i else w for w in WORKERS for i in range(BATCH))
LEASE = timedelta(seconds=30)  # the machine expires leases itself, on PostgreSQL's clock
PROPOSER = store.Actor("tenant-a", "employee-a", "proposer")
APPROVER = store.Actor("tenant-a", "manager-a", "approver")
REVIEWER = store.Actor("tenant-a", "reviewer-a", "reviewer")
SAFETY_RULES = (
    invariants.duplicate_effects,
    invariants.tool_mode_mismatches,
    invariants.replayed_dispatches,
    invariants.stale_completions,
    invariants.budget_overruns,
    invariants.succeeded_without_effect,
)
EXPECTED = (errors.Stale, errors.Conflict, errors.ManualReview, errors.Denied)


@dataclass
class Rig:
    """One schema, its store, both tool services and their clients, for every sequence."""

    dsn: str
    schema: str
    db: store.Store
    services: dict[bool, tool.ToolService]
    clients: dict[bool, toolclient.ToolClient]
    unreachable: dict[bool, toolclient.ToolClient]
    stats: dict[str, Any] = field(default_factory=lambda: {"sequences": 0, "steps": 0})

    def reset(self) -> None:
        """Empty every table: each sequence starts from nothing."""
        self.db.execute("TRUNCATE workflows, events, start_barriers, completions, reviews, "
                        "tool_effects RESTART IDENTITY CASCADE")
        for service in self.services.values():
            service.drop_responses = False
            service.reject_next(0)


@dataclass
class Held:
    """What one worker process holds in memory: its claim, barrier and receipt."""

    claim: store.Workflow
    start: barrier.StartBarrier | None = None
    receipt: plan.Receipt | None = None


class StoreMachine(RuleBasedStateMachine):
    """The store's state machine explored by hypothesis; see the module docstring."""

    workflows = Bundle("workflows")

    def __init__(self, rig: Rig) -> None:
        super().__init__()
        self.rig = rig
        self.db = rig.db
        rig.reset()
        rig.stats["sequences"] += 1
        self.held: dict[str, Held] = {}  # by slot
        self.operations = 0

    # -- creation and claims --------------------------------------------------------

    @rule(target=workflows, idempotent=st.booleans(), amount=st.integers(1, 10_000))
    def create(self, idempotent: bool, amount: int) -> str:
        proposed = plan.Plan(version=plan.SUPPORTED_PLAN_VERSION, action=plan.ACTION,
                             account="account-a", amount_minor=amount, currency=plan.CURRENCY,
                             idempotent=idempotent)
        self.operations += 1
        created = self.db.create(PROPOSER, f"op-{self.operations}", proposed)
        self.db.approve(APPROVER, created.id, created.fingerprint, timedelta(hours=1))
        return created.id

    def _abandon(self, worker: str) -> list[Held]:
        """Everything ``worker`` holds, taken out of its slots (oldest claim first)."""
        return [held for slot in SLOTS if slot.split(".")[0] == worker
                if (held := self.held.pop(slot, None)) is not None]

    @rule(worker=st.sampled_from(WORKERS))
    def claim(self, worker: str) -> None:
        # A worker that claims again abandoned what it held: its process restarted.
        self._abandon(worker)
        claimed = self.db.claim(worker, LEASE)
        if claimed is not None:
            self.held[worker] = Held(claimed)

    @rule(worker=st.sampled_from(WORKERS), recover=st.booleans(),
          limit=st.integers(1, BATCH))
    def fused_step(self, worker: str, recover: bool = True, limit: int = 1) -> None:
        # A looping ``--fused`` worker: one transaction completes what it holds (what the
        # tool confirmed), recovers expired leases (or not: the worker does that on a
        # timer) and claims up to ``limit`` workflows, idempotent ones with their start
        # barriers. Anything unconfirmed it held is abandoned.
        finished = [store.Finished(held.claim, held.start, held.receipt)
                    for held in self._abandon(worker)
                    if held.start is not None and held.receipt is not None]
        try:
            taken = self.db.complete_and_claim(finished, worker, LEASE, fuse=True,
                                               recover=recover, limit=limit)
        except EXPECTED:
            return
        assert [w.id for w in taken.completed] == [f.claim.id for f in finished]
        assert len(taken.claims) <= limit
        for index, claimed in enumerate(taken.claims):
            assert (claimed.barrier is not None) == claimed.workflow.idempotent
            self.held[f"{worker}.{index}" if index else worker] = Held(claimed.workflow,
                                                                       claimed.barrier)

    @rule(worker=st.sampled_from(WORKERS))
    def crash(self, worker: str) -> None:
        self._abandon(worker)

    @rule(worker=st.sampled_from(SLOTS))
    def heartbeat(self, worker: str) -> None:
        if worker in self.held:
            with contextlib.suppress(errors.Stale):
                self.db.heartbeat(self.held[worker].claim, LEASE)

    @rule(workflow=workflows)
    def expire(self, workflow: str) -> None:
        self.db.execute(
            "UPDATE workflows SET lease_until = clock_timestamp() - interval '1 second' "
            "WHERE id = %s AND state = 'running'", (workflow,))

    @rule()
    def recover(self) -> None:
        self.db.recover_expired()

    # -- around the dispatch ---------------------------------------------------------

    @rule(worker=st.sampled_from(SLOTS))
    def pre_dispatch(self, worker: str) -> None:
        held = self.held.get(worker)
        if held is None or held.start is not None:
            return
        try:
            start = self.db.pre_dispatch(held.claim)
        except EXPECTED:
            self.held.pop(worker)
            return
        if start is None:
            self.held.pop(worker)
        else:
            held.start = start

    @rule(worker=st.sampled_from(SLOTS),
          outcome=st.sampled_from(["receipt", "reply_lost", "rate_limited", "unreachable"]))
    def call_tool(self, worker: str, outcome: str) -> None:
        held = self.held.get(worker)
        if held is None or held.start is None or held.receipt is not None:
            return
        kind = held.claim.idempotent
        service, client = self.rig.services[kind], self.rig.clients[kind]
        if outcome == "unreachable":
            client = self.rig.unreachable[kind]
        if outcome == "rate_limited":
            service.reject_next(1)
        service.drop_responses = outcome == "reply_lost"
        try:
            held.receipt = client.call(held.claim, held.start)
            assert outcome == "receipt", f"{outcome} answered with a receipt"
            return
        except (errors.RateLimited, errors.ToolUnavailable):
            assert outcome in ("rate_limited", "unreachable"), outcome
        except errors.OutcomeUnknown:
            assert outcome == "reply_lost", outcome
        finally:
            service.drop_responses = False
            service.reject_next(0)
        self.held.pop(worker)
        try:
            if outcome == "reply_lost":
                self.db.unknown(held.claim)
            else:
                cause = "rate_limited" if outcome == "rate_limited" else "tool_unreachable"
                self.db.retry_later(held.claim, timedelta(0), cause)
        except EXPECTED:
            pass

    @rule(worker=st.sampled_from(SLOTS))
    def complete(self, worker: str) -> None:
        held = self.held.get(worker)
        if held is None or held.receipt is None:
            return
        self.held.pop(worker)
        with contextlib.suppress(EXPECTED):
            self.db.complete(held.claim, held.receipt)

    @rule(worker=st.sampled_from(SLOTS))
    def give_up_as_unknown(self, worker: str) -> None:
        held = self.held.pop(worker, None)
        if held is not None:
            with contextlib.suppress(EXPECTED):
                self.db.unknown(held.claim, "timeout")

    # -- reconciliation, cancellation, review ------------------------------------------

    @rule(workflow=workflows)
    def reconcile(self, workflow: str) -> None:
        _reconcile(self.rig, workflow)

    @rule(workflow=workflows)
    def cancel(self, workflow: str) -> None:
        self.db.cancel(PROPOSER, workflow)

    @rule(workflow=workflows, force=st.booleans())
    def requeue_by_review(self, workflow: str, force: bool) -> None:
        if force and self.db.execute(
            "SELECT 1 FROM tool_effects t JOIN workflows w USING (effect_key) WHERE w.id = %s",
            (workflow,),
        ):
            return  # the reviewer checked the ledger by hand: an effect is there, no force
        with contextlib.suppress(EXPECTED):
            self.db.requeue_reviewed(REVIEWER, workflow, force=force,
                                     reason="checked the ledger by hand" if force else "")

    # -- the checker ---------------------------------------------------------------

    @invariant()
    def safety_holds_after_every_step(self) -> None:
        self.rig.stats["steps"] += 1
        history = invariants.load(self.rig.dsn, self.rig.schema, open_result=self.db.keys.open)
        found = [v for check in SAFETY_RULES for v in check(history)]
        assert found == [], [v.to_json() for v in found]

    def teardown(self) -> None:
        """Drain, then every rule of the checker must hold, liveness included."""
        _drain(self.rig)
        history = invariants.load(self.rig.dsn, self.rig.schema, open_result=self.db.keys.open)
        found = invariants.check(history)
        assert found == [], [v.to_json() for v in found]


def _reconcile(rig: Rig, workflow: str) -> None:
    """One reconciliation pass, as the worker's reconcile does it, with the matching tool."""
    current = rig.db.get(workflow)
    if current.state != "unknown":
        return
    try:
        if not current.idempotent:
            rig.db.require_review(current, "non_idempotent")
            return
        receipt = rig.clients[True].lookup(current.effect_key)
        if receipt is not None:
            rig.db.settle_found(current, receipt)
        else:
            rig.db.settle_absent(current)
    except EXPECTED:
        pass


def _drain(rig: Rig) -> None:
    """Settle everything: no worker is left holding anything, as after a full outage."""
    db = rig.db
    for _ in range(60):
        db.execute("UPDATE workflows SET lease_until = clock_timestamp() - interval '1 second' "
                   "WHERE state = 'running'")
        db.recover_expired()
        rows = db.execute("SELECT id, state, review_reason FROM workflows "
                          "WHERE state IN ('ready', 'unknown')")
        open_rows = [r for r in rows if r["state"] == "ready" or not r["review_reason"]]
        if not open_rows:
            return
        for row in open_rows:
            if row["state"] == "unknown":
                _reconcile(rig, row["id"])
        claimed = db.claim("drainer", LEASE)
        if claimed is not None:
            _carry_out(rig, claimed)
    raise AssertionError("the drain did not settle every workflow")


def _carry_out(rig: Rig, claimed: store.Workflow) -> None:
    """What ``Worker.run_one`` does after a claim, with the tool of the plan's kind."""
    try:
        start = rig.db.pre_dispatch(claimed)
        if start is None:
            return
        receipt = rig.clients[claimed.idempotent].call(claimed, start)
        rig.db.complete(claimed, receipt)
    except EXPECTED:
        pass


@pytest.fixture
def rig(lab_dsn: str, lab_schema: str, request: pytest.FixtureRequest) -> Any:
    keys = sealing.load_catalog()
    db = store.Store.open(lab_dsn, lab_schema, keys=keys, max_connections=2)
    services = {kind: tool.ToolService(lab_dsn, lab_schema, idempotent=kind).start()
                for kind in (True, False)}
    clients = {kind: toolclient.ToolClient(s.endpoint, s.token) for kind, s in services.items()}
    # A loopback port nothing listens on: the request is never delivered.
    unreachable = {kind: toolclient.ToolClient("http://127.0.0.1:9", s.token)
                   for kind, s in services.items()}
    pytest_plugin.reached_database(request.node)
    made = Rig(lab_dsn, lab_schema, db, services, clients, unreachable)
    yield made
    for client in [*clients.values(), *unreachable.values()]:
        client.close()
    for service in services.values():
        service.stop()
    db.close()


def test_store_state_machine_keeps_every_invariant(rig: Rig) -> None:
    """Random sequences of claims, heartbeats, expiries, dispatches with every tool outcome,
    completions, crashes, reconciliations, cancellations and reviews keep the checker's
    safety rules after every step and every rule once drained."""
    began = time.monotonic()
    run_state_machine_as_test(
        lambda: StoreMachine(rig),
        settings=settings(max_examples=SEQUENCES, stateful_step_count=STEPS),
    )
    elapsed = time.monotonic() - began
    print(f"stateful store: {rig.stats['sequences']} sequences, {rig.stats['steps']} checked "
          f"steps in {elapsed:.1f}s (profile {PROFILE})")
    assert rig.stats["sequences"] >= SEQUENCES


def test_forced_requeue_of_an_undispatched_effect_is_not_a_replay(rig: Rig) -> None:
    """Regression example kept from the exploration: a person forces a requeue of a
    non-idempotent workflow whose dispatch left no effect (the ledger is empty); the second
    dispatch is the person's recorded decision, not an automatic replay."""
    machine = StoreMachine(rig)
    workflow = machine.create(False, 100)
    for step in (lambda: machine.claim("w0"), lambda: machine.pre_dispatch("w0"),
                 lambda: machine.expire(workflow), machine.recover,
                 lambda: machine.reconcile(workflow),
                 lambda: machine.requeue_by_review(workflow, True),
                 lambda: machine.claim("w1"), lambda: machine.pre_dispatch("w1"),
                 lambda: machine.call_tool("w1", "receipt"), lambda: machine.complete("w1")):
        step()
        machine.safety_holds_after_every_step()
    machine.teardown()
    final = rig.db.get(workflow)
    assert (final.state, final.attempt) == ("succeeded", 2)
    assert rig.db.execute("SELECT count(*) AS n FROM tool_effects")[0]["n"] == 1


def test_fused_steps_complete_in_the_next_claims_transaction(rig: Rig) -> None:
    """The fused path end to end: an idempotent claim commits with its start barrier, its
    completion commits with the next claim (a non-idempotent one, which gets no barrier),
    and a stale completion rolls the next claim back with it."""
    machine = StoreMachine(rig)
    first = machine.create(True, 100)
    second = machine.create(False, 200)
    machine.fused_step("w0")
    held = machine.held["w0"]
    assert (held.claim.id, held.start is not None) == (first, True)
    machine.call_tool("w0", "receipt")
    machine.fused_step("w0")
    assert rig.db.get(first).state == "succeeded"
    completion = rig.db.completion_for(barrier.start_id(first, 1))
    assert completion is not None and completion.outcome == "succeeded"
    kinds = [e["kind"] for e in rig.db.events(first)]
    assert kinds == ["created", "approved", "claimed", "dispatching", "completed"]
    held = machine.held["w0"]
    assert (held.claim.id, held.start) == (second, None)
    # A third workflow is due; the held (unconfirmed) claim of the second goes stale.
    third = machine.create(True, 300)
    machine.expire(second)
    machine.recover()
    stale = store.Finished(held.claim, barrier.StartBarrier.for_claim(
        second, held.claim.fence, held.claim.attempt, held.claim.effect_key,
        held.claim.fingerprint, held.claim.trace_id), plan.Receipt("rcpt_x", held.claim.effect_key,
                                                                   held.claim.fingerprint))
    with pytest.raises((errors.Stale, errors.IntegrityFailure)):
        rig.db.complete_and_claim([stale], "w0", LEASE, fuse=True)
    assert rig.db.get(third).state == "ready"  # nothing of the failed transaction committed
    machine.held.clear()
    machine.teardown()


def test_a_batch_step_claims_several_and_completes_them_in_one_transaction(rig: Rig) -> None:
    """A batch: one transaction claims up to its limit (each idempotent claim with its own
    barrier, a non-idempotent one without), the next completes all the confirmed ones with
    the next claims, and one stale completion among them rolls the whole step back."""
    machine = StoreMachine(rig)
    first, second, third = (machine.create(kind, amount)
                            for kind, amount in ((True, 100), (True, 200), (False, 300)))
    machine.fused_step("w0", limit=2)
    assert [machine.held[s].claim.id for s in ("w0", "w0.1")] == [first, second]
    assert all(machine.held[s].start is not None for s in ("w0", "w0.1"))
    assert rig.db.get(third).state == "ready"  # beyond the limit
    machine.call_tool("w0", "receipt")
    machine.call_tool("w0.1", "receipt")
    machine.fused_step("w0", limit=3)
    assert [rig.db.get(w).state for w in (first, second)] == ["succeeded", "succeeded"]
    assert (machine.held["w0"].claim.id, machine.held["w0"].start) == (third, None)
    fourth, fifth = machine.create(True, 400), machine.create(True, 500)
    machine.fused_step("w1", limit=2)
    good, doomed = machine.held.pop("w1"), machine.held.pop("w1.1")
    for held in (good, doomed):
        held.receipt = rig.clients[True].call(held.claim, held.start)
    machine.expire(doomed.claim.id)
    machine.recover()
    sixth = machine.create(True, 600)
    finished = [store.Finished(h.claim, h.start, h.receipt) for h in (good, doomed)
                if h.start is not None and h.receipt is not None]
    with pytest.raises(errors.Stale):
        rig.db.complete_and_claim(finished, "w1", LEASE, fuse=True, limit=2)
    # Nothing committed: the good one is still running, nothing new was claimed.
    assert [rig.db.get(w).state for w in (fourth, fifth, sixth)] == [
        "running", "unknown", "ready"]
    machine.held.clear()
    machine.teardown()


def test_a_fused_batch_writes_each_claim_then_its_barrier_in_order(rig: Rig) -> None:
    """One statement claims a batch and writes its barriers: still every claim's
    'claimed' event precedes its 'dispatching' one (all claims of the step first), and
    each barrier points at its own 'dispatching' event; a non-idempotent claim gets
    neither."""
    machine = StoreMachine(rig)
    idempotent = [machine.create(True, 100 + n) for n in range(12)]
    others = [machine.create(False, 900 + n) for n in range(2)]
    machine.fused_step("w0", limit=14)
    assert {h.claim.id for h in machine.held.values()} == {*idempotent, *others}
    events = rig.db.execute(
        "SELECT seq, workflow_id, kind FROM events WHERE kind IN ('claimed', 'dispatching')"
        " ORDER BY seq")
    kinds = [e["kind"] for e in events]
    assert kinds == ["claimed"] * 14 + ["dispatching"] * 12
    dispatching = {e["workflow_id"]: e["seq"] for e in events if e["kind"] == "dispatching"}
    assert set(dispatching) == set(idempotent)
    barriers = rig.db.execute("SELECT workflow_id, fence, audit_event FROM start_barriers")
    assert {b["workflow_id"]: b["audit_event"] for b in barriers} == dispatching
    assert all(b["fence"] == 1 for b in barriers)
    machine.held.clear()
    machine.teardown()


def test_a_fused_step_recovers_expired_leases_only_when_asked(rig: Rig) -> None:
    """The worker's timer decides: a step without ``recover`` leaves an expired lease
    running (nothing claims it meanwhile), the next one with it makes it unknown."""
    machine = StoreMachine(rig)
    first = machine.create(True, 100)
    machine.fused_step("w0")
    machine.held.clear()  # w0 died holding it
    machine.expire(first)
    machine.fused_step("w1", recover=False)
    assert rig.db.get(first).state == "running" and "w1" not in machine.held
    machine.fused_step("w1", recover=True)
    assert rig.db.get(first).state == "unknown" and "w1" not in machine.held
    machine.teardown()
