"""What an experiment works with: its store, tools, workers, worker processes and helpers.

One ``Harness`` per experiment, built by the plugin's ``lab`` fixture on the
experiment's own schema (``def test_x(lab, observe): ...``). It owns everything
it starts (tool services, clients, OS processes) and closes or kills all of it
at teardown, pass or fail. It also keeps a timeline of what the experiment did
to its processes, for the book's figures.

What an author uses, all documented with examples in ``docs/authoring.md``:

* ``lab.approved(..., approval_ttl=...)``, ``sample_plan(...)``, ``lab.actor(tenant, role)``;
* ``lab.credit_tool()`` -> ``Rig`` (``rig.service`` has the fault switches of
  ``lab.runtime.tool``: ``fail_next``, ``hold_next``, ``drop_next_reply``,
  ``reject_next``, ``slow_next`` and the counters);
* ``lab.spawn_worker(rig, name, ...)`` -> ``WorkerProcess`` (``wait_for``,
  ``release``, ``kill``, ``finish(expect_exit=...)``);
* ``lab.state``, ``lab.effects``, ``lab.count_events``, ``lab.claims``;
* ``lab.expire_lease``, ``lab.expire_approval``, ``lab.make_due``,
  ``lab.recover_by_elapsed_lease``, ``lab.wait_until``, ``lab.approval_lapsed``;
* ``retrying(action)`` while a killed database comes back; ``PUBLIC_MODULES`` (what an
  experiment may import), ``EVENT_KINDS``, ``REVIEW_REASONS`` and ``reference()`` (the
  guide's generated reference section).

Admission limits a plan must respect: ``amount_minor`` from
``plan.MIN_AMOUNT_MINOR`` to ``plan.MAX_AMOUNT_MINOR`` (1..10000), ``currency``
``plan.CURRENCY``; a model's proposal may only name an account of ``plan.ACCOUNTS``
and is at most ``proposal.MAX_PROPOSAL_BYTES`` bytes (re-exported here as ``AMOUNT_RANGE``,
``ACCOUNTS`` and ``MAX_PROPOSAL_BYTES``).
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from lab import budget, errors, names, protocol
from lab.runtime import backoff, processes, proposal, store, tool, toolclient, toolfaults, worker
from lab.runtime import plan as plans
from lab.runtime.plan import Plan

T = TypeVar("T")

# What an experiment may import (docs/authoring.md, "The public face"; checked by
# tests/test_public_face.py). A package entry admits its modules: the fault and peer
# chapters study those systems themselves. Everything else of ``lab`` (the plugin,
# the recorder, the evidence, the PostgreSQL providers, worker processes) is internal:
# the fixtures of lab.pytest_plugin and the top-level conftest.py reach it for you.
PUBLIC_MODULES = (
    "lab.harness",
    "lab.errors",
    "lab.protocol",
    "lab.names",
    "lab.loopback",
    "lab.runtime.plan",
    "lab.runtime.proposal",
    "lab.runtime.store",
    "lab.runtime.tool",
    "lab.runtime.toolclient",
    "lab.runtime.barrier",
    "lab.runtime.sealing",
    "lab.faults",
    "lab.evidence.crashmatrix",
    "lab.peers",
    "lab.hosts",
)

# Every audit event kind the store writes, for ``lab.count_events(kind)``
# (tests/test_authoring.py checks this against lab/runtime/store/).
EVENT_KINDS = {
    "created": "a proposal was admitted and stored (waiting_approval)",
    "approved": "an approver of the tenant approved the fingerprint, with an expiry",
    "cancel_requested": "a proposer or approver asked to cancel",
    "cancelled": "the workflow was cancelled (in the queue, at claim, before dispatch, "
                 "after a 429, or by a review proving nothing was dispatched)",
    "claimed": "a worker claimed it: fence + 1, attempt + 1, a lease (detail owner=NAME)",
    "approval_expired": "the approval lapsed before dispatch: back to waiting_approval",
    "incompatible": "the plan's version is not supported by this worker",
    "integrity_failed": "the stored plan no longer matches its fingerprint",
    "dispatching": "the start barrier was committed: the tool is about to be called",
    "completed": "the tool's receipt was recorded: succeeded",
    "unknown": "the outcome of the call is not known (lost reply, 5xx, timeout, crash)",
    "retry_scheduled": "a trusted 429: queued again on a persisted timer",
    "failed": "the workflow failed (refused, budget spent, or proven undispatched)",
    "lease_expired": "recover_expired found the lease over: running became unknown",
    "reconciled": "a lookup settled an unknown: lookup=found (succeeded), lookup=absent "
                  "(requeued), or lookup=absent closed_through=F (a fenced lookup's proof: "
                  "requeued, cancelled or failed, idempotent or not)",
    "manual_review": "an unknown waits for a person (detail reason=REVIEW_REASON)",
    "requeued_undispatched": "a review requeued work proven never dispatched",
    "requeue": "a reviewer requeued the workflow",
    "forced_requeue": "a reviewer requeued work with a start barrier (--force, a reason)",
    "resolved_failed": "a reviewer closed it as failed",
    "resolved_succeeded": "a reviewer closed it as succeeded (checked by hand)",
}

# Every ``review_reason`` a workflow can carry (checked against the code the same way).
REVIEW_REASONS = {
    "non_idempotent_dispatched": "unknown, non-idempotent, and a start barrier proves the "
                                 "tool may have been called: never looked up, never replayed",
    "not_dispatched_no_start_barrier": "unknown, non-idempotent, and no start barrier under "
                                       "its fence: the database proves the tool was never "
                                       "called (a reviewer may requeue without --force)",
    "non_idempotent_effect_found": "unknown, non-idempotent, and the fenced lookup found "
                                   "its effect: a person settles it with the receipt in view",
    "cancel_requested": "unknown and cancellation was requested: a person decides",
    "attempt_budget_spent": "the persistent attempt budget is spent (failed, or unknown "
                            "waiting for a person)",
    "integrity": "the stored plan or a sealed result failed its check (quarantined)",
    "tool_refused": "the tool refused the request (4xx): failed",
    "unsupported_plan_version": "incompatible: the worker does not run this plan version",
    "resolved_by_person": "a reviewer resolved it as failed or succeeded",
}

# The admission limits, by name, for experiments and the author's guide.
AMOUNT_RANGE = (plans.MIN_AMOUNT_MINOR, plans.MAX_AMOUNT_MINOR)
ACCOUNTS = plans.ACCOUNTS
MAX_PROPOSAL_BYTES = proposal.MAX_PROPOSAL_BYTES
ROLES = ("proposer", "approver", "reviewer")

PROPOSER = store.Actor(tenant="tenant-a", subject="employee-a", role="proposer")
APPROVER = store.Actor(tenant="tenant-a", subject="manager-a", role="approver")
REVIEWER = store.Actor(tenant="tenant-a", subject="reviewer-a", role="reviewer")
SEED_LEASE = timedelta(seconds=3)
DEFAULT_APPROVAL_TTL = timedelta(minutes=1)
WORKER_BACKOFF = timedelta(milliseconds=20)
# The credit tool's client gives up after this many seconds: the outcome is then unknown.
CLIENT_TIMEOUT_S: float = inspect.signature(toolclient.ToolClient).parameters["timeout"].default
# The aliases an author annotates with, without reaching into internal modules.
WorkerProcess = processes.WorkerProcess
Hook = worker.Hook


def retrying(action: Callable[[], T], within: float = 30.0) -> T:
    """``action()``, retried with jittered backoff while it raises ``errors.StoreError``
    (a database the experiment killed is coming back); re-raises after ``within`` seconds."""
    patience = backoff.Backoff(base=0.1, cap=1.0, patience=within)
    while True:
        try:
            return action()
        except errors.StoreError:
            if patience.exhausted:
                raise
            time.sleep(patience.failed())


def sample_plan(
    idempotent: bool = True, *, amount_minor: int = 500, account: str = "account-a"
) -> Plan:
    """The seed's sample plan: 500 minor units of CNY to account-a.

    ``amount_minor`` must lie in ``AMOUNT_RANGE`` (1..10000) and ``account`` be 1-64
    letters, digits, ``.``, ``_`` or ``-`` (a model's proposal may only name one of
    ``ACCOUNTS``); the store refuses anything else with ``errors.Rejected``.
    """
    return Plan(
        version=1,
        action="issue_credit",
        account=account,
        amount_minor=amount_minor,
        currency="CNY",
        idempotent=idempotent,
    )


def actor(tenant: str, role: str, subject: str | None = None) -> store.Actor:
    """A person of ``tenant`` acting as ``role`` (one of ``ROLES``).

    The subject defaults to ``"<role>-<tenant>"``; give one when two people of the
    same tenant and role must be told apart.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    if not tenant:
        raise ValueError("tenant must not be empty")
    return store.Actor(tenant=tenant, subject=subject or f"{role}-{tenant}", role=role)


@dataclass(frozen=True)
class Claim:
    """One claim of a workflow, from its ``claimed`` audit event."""

    workflow_id: str
    fence: int
    owner: str
    seconds: float  # since the experiment started, on PostgreSQL's clock


def sample_proposal() -> dict[str, Any]:
    """The seed's sample proposal as a model sends it: the plan without the registry's say."""
    fields = sample_plan().to_json()
    del fields["idempotent"]
    return fields


@dataclass
class Rig:
    """A running credit tool, a client for it, and an in-process worker using both."""

    service: tool.ToolService
    client: toolclient.ToolClient
    worker: worker.Worker


class Harness:
    """Helpers bound to one experiment's schema; see the module docstring."""

    def __init__(self, dsn: str, schema: str, db: store.Store):
        self.dsn = dsn
        self.schema = schema
        self.store = db
        self._t0 = time.monotonic()
        self.db_t0 = db.execute("SELECT clock_timestamp() AS now")[0]["now"]
        self.timeline: list[dict[str, Any]] = []
        self._services: list[tool.ToolService] = []
        self._clients: list[toolclient.ToolClient] = []
        self._processes: list[processes.WorkerProcess] = []

    # -- building blocks -------------------------------------------------------

    def credit_tool(self, idempotent: bool = True, fenced_lookup: bool | None = None) -> Rig:
        """Start a credit tool on loopback with a client and a seed-configured worker.

        ``fenced_lookup`` (default: as ``idempotent``) says whether the tool answers the
        fenced lookup that proves absence; a non-idempotent tool with it lets the runtime
        requeue an unknown whose lookup is absent, without a person.
        """
        service = tool.ToolService(self.dsn, self.schema, idempotent=idempotent,
                                   fenced_lookup=fenced_lookup).start()
        self._services.append(service)
        client = toolclient.ToolClient(service.endpoint, service.token)
        self._clients.append(client)
        runner = worker.Worker(
            db=self.store,
            client=client,
            name="worker-a",
            lease=SEED_LEASE,
            backoff=WORKER_BACKOFF,
        )
        return Rig(service=service, client=client, worker=runner)

    def worker_via(
        self, rig: Rig, *, endpoint: str | None = None, timeout: float = 5.0,
        name: str = "worker-b",
    ) -> worker.Worker:
        """Another in-process worker on ``rig``'s tool, whose calls go to ``endpoint`` (a
        proxy in front of the tool; default the tool itself) and give up after ``timeout``
        seconds: a short timeout makes a held request outlive its caller. Its client is
        closed with the experiment."""
        client = toolclient.ToolClient(endpoint or rig.service.endpoint, rig.service.token,
                                 timeout=timeout)
        self._clients.append(client)
        return worker.Worker(db=self.store, client=client, name=name, lease=SEED_LEASE,
                             backoff=WORKER_BACKOFF)

    def approved(
        self,
        idempotent: bool = True,
        plan: Plan | None = None,
        tenant: str = "tenant-a",
        approval_ttl: timedelta = DEFAULT_APPROVAL_TTL,
    ) -> store.Workflow:
        """Create and approve ``plan`` (default: the sample plan) for ``approval_ttl``
        (default a minute, as the seed does), measured on PostgreSQL's clock.

        ``tenant`` other than ``"tenant-a"`` uses that tenant's proposer and approver
        (``actor(tenant, "proposer")``, ``actor(tenant, "approver")``).
        """
        proposer, approver = (
            (PROPOSER, APPROVER)
            if tenant == PROPOSER.tenant
            else (actor(tenant, "proposer"), actor(tenant, "approver"))
        )
        created = self.store.create(proposer, names.new_id("op"), plan or sample_plan(idempotent))
        self.store.approve(approver, created.id, created.fingerprint, approval_ttl)
        return self.store.get(created.id)

    def actor(self, tenant: str, role: str, subject: str | None = None) -> store.Actor:
        """A person of ``tenant`` acting as ``role``; see the module function ``actor``."""
        return actor(tenant, role, subject)

    def spawn_worker(
        self, rig: Rig, name: str, *extra: str, endpoint: str | None = None
    ) -> processes.WorkerProcess:
        """Start ``lab worker`` as an OS process against this schema and ``rig``'s tool.

        ``endpoint`` replaces the tool's own URL, to route the worker's calls through a
        ``lab.faults.proxy.Proxy`` that can partition the link.
        """
        child = processes.spawn_worker(
            self.dsn,
            self.schema,
            endpoint or rig.service.endpoint,
            rig.service.token,
            name,
            *extra,
            on_event=self.mark,
            # The child must seal results with the same keys this experiment reads them with.
            keys=self.store.keys,
        )
        self._processes.append(child)
        self.mark(name, "started")
        return child

    def run_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``lab *args`` as a child process on this experiment's database and keys."""
        return subprocess.run(
            [sys.executable, "-m", "lab.cli", *args],
            env=processes.child_env(self.dsn, self.store.keys),
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip

    # -- reading state ----------------------------------------------------------------

    def state(self, workflow_id: str) -> store.Workflow:
        """The workflow's current snapshot."""
        return self.store.get(workflow_id)

    def effects(self) -> int:
        """How many effects the tool's ledger holds."""
        count: int = self.store.execute("SELECT count(*) AS n FROM tool_effects")[0]["n"]
        return count

    def claims(self, workflow_id: str | None = None) -> list[Claim]:
        """Who claimed what, in order: one ``Claim`` per ``claimed`` event.

        A workflow's ``owner`` is cleared when it leaves ``running``; this history
        keeps every claim, so "which process claimed" is
        ``[c.owner for c in lab.claims(job.id)]``.
        """
        # The store writes the claimed event's detail as exactly "owner=<name>"
        # (store.claim); this is the one place that reads it back.
        rows = self.store.execute(
            "SELECT workflow_id, fence, substring(detail FROM '^owner=(.*)$') AS owner, "
            "extract(epoch FROM created_at - %s) AS t FROM events "
            "WHERE kind = 'claimed' AND (%s::text IS NULL OR workflow_id = %s) ORDER BY seq",
            (self.db_t0, workflow_id, workflow_id),
        )
        return [
            Claim(str(r["workflow_id"]), int(r["fence"]), str(r["owner"] or ""),
                  round(float(r["t"]), 3))
            for r in rows
        ]  # fmt: skip

    def count_events(self, kind: str) -> int:
        """How many audit events of ``kind`` exist."""
        n: int = self.store.execute("SELECT count(*) AS n FROM events WHERE kind = %s", (kind,))[
            0
        ]["n"]
        return n

    # -- the seed's SQL helpers: faults injected on the database clock ------------------

    def expire_lease(self, workflow_id: str) -> None:
        """SQL-injected lease expiry: the lease ended one second ago."""
        self.store.execute(
            "UPDATE workflows SET lease_until = clock_timestamp() - interval '1 second' "
            "WHERE id = %s",
            (workflow_id,),
        )
        self.mark("experiment", "lease expired (SQL-injected)")

    def expire_approval(self, workflow_id: str) -> None:
        """SQL-injected approval expiry: the approval ended one second ago."""
        self.store.execute(
            "UPDATE workflows SET approval_expires = clock_timestamp() - interval '1 second' "
            "WHERE id = %s",
            (workflow_id,),
        )
        self.mark("experiment", "approval expired (SQL-injected)")

    def approval_lapsed(self, workflow_id: str) -> bool:
        """Whether the workflow's approval has expired, on PostgreSQL's clock."""
        rows = self.store.execute(
            "SELECT approval_expires IS NULL OR approval_expires <= clock_timestamp() AS lapsed "
            "FROM workflows WHERE id = %s",
            (workflow_id,),
        )
        if not rows:
            raise errors.NotFound(f"no workflow {workflow_id!r}")
        return bool(rows[0]["lapsed"])

    def make_due(self, workflow_id: str) -> None:
        """Make queued work due now."""
        self.store.execute(
            "UPDATE workflows SET ready_at = clock_timestamp() - interval '1 second' WHERE id = %s",
            (workflow_id,),
        )

    def wait_until(
        self, condition: Callable[[], bool], within: float = 5.0, what: str = "condition"
    ) -> None:
        """Poll ``condition`` every 20 ms; fail the experiment if it is not true in time."""
        deadline = time.monotonic() + within
        with budget.waiting(what):
            while time.monotonic() < deadline:
                if condition():
                    return
                time.sleep(0.02)
        raise AssertionError(f"bounded wait: {what} did not become true within {within}s")

    def recover_by_elapsed_lease(self, workflow_id: str) -> int:
        """Let the real lease run out on PostgreSQL's clock, then recover it to unknown."""
        self.wait_until(
            lambda: self.store.lease_expired(workflow_id),
            within=5.0,
            what="the lease to expire on the PostgreSQL clock",
        )
        self.mark("postgresql", "lease expired (elapsed clock)")
        recovered = self.store.recover_expired()
        assert recovered == 1, f"recovered {recovered} workflows, expected 1"
        assert self.state(workflow_id).state == "unknown", "expired lease skipped unknown"
        return recovered

    # -- timeline and teardown -----------------------------------------------------------

    def mark(self, actor: str, what: str) -> None:
        """Note something the experiment did or saw, with its time since the start."""
        self.timeline.append(
            {"t": round(time.monotonic() - self._t0, 3), "actor": actor, "what": what}
        )

    def event_history(self) -> list[dict[str, Any]]:
        """The audit events, sanitised for the book: kind, fence, detail and relative time."""
        rows = self.store.execute(
            "SELECT workflow_id, kind, fence, detail, "
            "extract(epoch FROM created_at - %s) AS t FROM events ORDER BY seq",
            (self.db_t0,),
        )
        ids: dict[str, str] = {}
        return [
            {
                "t": round(float(row["t"]), 3),
                "workflow": ids.setdefault(row["workflow_id"], f"w{len(ids) + 1}"),
                "kind": row["kind"],
                "fence": row["fence"],
                "detail": row["detail"],
            }
            for row in rows
        ]

    def trace_ids(self) -> list[str]:
        """The W3C trace ids of every workflow of this experiment, for the evidence."""
        rows = self.store.execute("SELECT trace_id FROM workflows ORDER BY created_at, id")
        return [str(row["trace_id"]) for row in rows]

    def close(self) -> None:
        """Kill every process still alive, close clients, stop tool services."""
        for child in self._processes:
            child.cleanup()
        for client in self._clients:
            client.close()
        for service in self._services:
            service.stop()


def reference() -> str:
    """The guide's reference section, generated from the code (tests/test_authoring.py
    requires docs/authoring.md to hold exactly this text between its reference markers)."""
    lines = ["**Workflow states** (`store.STATES`; terminal: `store.TERMINAL_STATES`):",
             ", ".join(f"`{s}`" + (" (terminal)" if s in store.TERMINAL_STATES else "")
                       for s in store.STATES) + ".", "",
             "**Workflow fields** (`lab.state(id)` returns a `store.Workflow`):",
             ", ".join(f"`{f.name}`" for f in dataclasses.fields(store.Workflow)) + ".", "",
             "**Event kinds** (`lab.count_events(kind)`; `harness.EVENT_KINDS`):", ""]
    lines += [f"- `{kind}`: {meaning}" for kind, meaning in EVENT_KINDS.items()]
    lines += ["", "**Review reasons** (`lab.state(id).review_reason`; "
              "`harness.REVIEW_REASONS`):", ""]
    lines += [f"- `{reason}`: {meaning}" for reason, meaning in REVIEW_REASONS.items()]
    lines += ["", "**Defaults and budgets:**", "",
              f"- attempt budget: `store.DEFAULT_MAX_ATTEMPTS` = {store.DEFAULT_MAX_ATTEMPTS} "
              "attempts per workflow, persistent across crashes",
              f"- lease of the in-process worker and of `lab worker`: "
              f"{SEED_LEASE.total_seconds():g} s (`harness.SEED_LEASE`)",
              f"- approval of `lab.approved()`: {DEFAULT_APPROVAL_TTL.total_seconds():g} s "
              "(`harness.DEFAULT_APPROVAL_TTL`; pass `approval_ttl=`)",
              f"- worker backoff after a 429: {WORKER_BACKOFF.total_seconds() * 1000:g} ms "
              "(`harness.WORKER_BACKOFF`)",
              f"- the tool client's timeout: {CLIENT_TIMEOUT_S:g} s (`harness.CLIENT_TIMEOUT_S`)",
              f"- a `hold_next` nobody releases ends after {toolfaults.DEFAULT_HOLD_SECONDS:g} s",
              "- boundaries a `hook` sees (`lab.protocol`): "
              + ", ".join(f"`{b}`" for b in protocol.NAMES
                          if b not in protocol.TOOL_STAGES),
              "- boundaries `rig.service.on_stage` sees: "
              + ", ".join(f"`{b}`" for b in protocol.TOOL_STAGES)]
    return "\n".join(lines) + "\n"
