"""One population of a chaos round (``lab.faults.chaos``): a schema with its tool
service, its worker processes' slots and an in-process reconciler; the workflows it
approves, and the items its workers report.
"""

from __future__ import annotations

import functools
import queue
import random
import signal
import time
from collections.abc import Callable
from datetime import timedelta

from lab import errors, protocol
from lab.faults import invariants, proxy
from lab.faults.chaos_settings import LEASE_S, Counts, Settings
from lab.faults.traffic import Pending
from lab.pg import edge
from lab.runtime import backoff, plan, processes, sealing, store, tool, toolclient, worker

# How long cleanup retries a database that is still coming back before it reports failure.
CLEANUP_PATIENCE_S = 30.0
APPROVAL_TTL = timedelta(hours=6)  # far beyond any run: expiry is not a fault of this run
TENANTS = ("tenant-a", "tenant-b")


class Population:
    """One schema: its tool service, its workers, and an in-process reconciler.

    ``ledger_dsn`` is how the tool reaches its ledger (through a proxy when the
    run has network faults); the controller's own store connects directly.
    """

    def __init__(
        self, dsn: str, token: str, keys: sealing.KeyCatalog, idempotent: bool, size: int,
        slots: int, ledger_dsn: str | None = None, fenced_lookup: bool | None = None,
    ):
        self.label = "idempotent" if idempotent else "non_idempotent"
        self.code = "i" if idempotent else "n"
        self.schema = f"chaos_{token}_{self.code}"
        self.idempotent = idempotent
        self.size = size
        self.slots: list[processes.WorkerProcess | None] = [None] * slots
        self.generation = 0
        self.dsn = dsn
        self.ledger_dsn = ledger_dsn or dsn
        self.fenced_lookup = fenced_lookup
        self.keys = keys
        self.tool_proxy: proxy.Proxy | None = None
        self.acknowledged: list[invariants.Acknowledged] = []
        self.service: tool.ToolService | None = None
        self.db: store.Store | None = None
        self.client: toolclient.ToolClient | None = None
        self.reconciler: worker.Worker | None = None
        self.open = {"ready": size, "running": 0, "unreviewed_unknown": 0}

    def start(self, serve: Callable[[tool.ToolService], str] | None = None) -> None:
        """Open the store, start the tool service and the reconciler. ``serve`` starts the
        service itself (on a lab host) and says where this process reaches it."""
        self.db = store.Store.open(
            self.dsn, self.schema, create=True, application_name="lab-chaos", keys=self.keys
        )
        service = tool.ToolService(
            self.ledger_dsn, self.schema, idempotent=self.idempotent,
            fenced_lookup=self.fenced_lookup,
        )
        endpoint = serve(service) if serve is not None else service.start().endpoint
        self.service = service
        self.client = toolclient.ToolClient(endpoint, service.token)
        self.reconciler = worker.Worker(
            db=self.db, client=self.client, name="chaos-recoverer",
            lease=timedelta(seconds=LEASE_S),
        )

    @property
    def worker_endpoint(self) -> str:
        """Where this population's workers reach the tool (its proxy, when there is one)."""
        assert self.service is not None
        if self.tool_proxy is not None:
            return f"http://127.0.0.1:{self.tool_proxy.port}"
        return self.service.endpoint

    def close(self, drop: bool) -> list[str]:
        """Stop everything; drop the schema when asked. Returns what could not be done."""
        problems: list[str] = []
        for child in self.slots:
            if child is not None:
                child.cleanup()
        if self.client is not None:
            self.client.close()
        if self.tool_proxy is not None:
            self.tool_proxy.stop()
        if self.service is not None:
            self.service.stop()
        if self.db is not None:
            self.db.close()
        if drop:
            # The database may just be coming back from a restart: retry for a while.
            patience = backoff.Backoff(base=0.1, cap=2.0, patience=CLEANUP_PATIENCE_S)
            while True:
                try:
                    edge.drop_schema(self.dsn, self.schema)
                    break
                except errors.StoreError as exc:
                    if patience.exhausted:
                        problems.append(f"schema {self.schema} was not dropped: {exc}")
                        break
                    time.sleep(patience.failed())
        return problems

    def refresh(self) -> dict[str, int]:
        """Count what is still open: due or delayed ready work, running, unreviewed unknown.

        A database that cannot be reached (restarting, partitioned) leaves the last
        counts in place: raises ``errors.StoreError`` for the caller to count.
        """
        assert self.db is not None
        self.open = self.db.open_counts()
        return self.open

    def create_workflows(self, plans: random.Random, approve: bool = True) -> list[Pending]:
        """Create this population's workflows, plans drawn from ``plans``, and approve
        them; with ``approve`` false, leave each to its returned ``Pending`` approval."""
        assert self.db is not None
        pending: list[Pending] = []
        if not approve:
            self.open["ready"] = 0  # each approval counts itself
        for index in range(self.size):
            tenant = plans.choice(TENANTS)
            proposer = store.Actor(tenant, f"employee-{tenant}", "proposer")
            approver = store.Actor(tenant, f"manager-{tenant}", "approver")
            proposed = plan.Plan(
                version=plan.SUPPORTED_PLAN_VERSION,
                action=plan.ACTION,
                account=plans.choice(plan.ACCOUNTS),
                amount_minor=plans.randint(plan.MIN_AMOUNT_MINOR, plan.MAX_AMOUNT_MINOR),
                currency=plan.CURRENCY,
                idempotent=self.idempotent,
            )
            created = self.db.create(proposer, f"chaos-{self.code}-{index}", proposed)
            if approve:
                self.db.approve(approver, created.id, created.fingerprint, APPROVAL_TTL)
            else:
                pending.append(Pending(created.id, functools.partial(
                    self.approve, approver, created.id, created.fingerprint)))
        return pending

    def approve(self, approver: store.Actor, workflow_id: str, fingerprint: str) -> None:
        """Approve one workflow, once: an approval whose commit was acknowledged to no one
        (the database went away after it) is found approved the next time and left so."""
        assert self.db is not None
        try:
            self.db.approve(approver, workflow_id, fingerprint, APPROVAL_TTL)
        except errors.Conflict:
            if self.db.get(workflow_id).state == "waiting_approval":
                raise
        self.open["ready"] += 1  # until the next count: the supervisor starts a worker for it

    def recover(self, counts: Counts) -> None:
        """Expired leases become unknown; unreviewed unknowns are reconciled by lookup;
        work in review that the database proves was never dispatched leaves review."""
        assert self.db is not None and self.reconciler is not None
        try:
            counts.leases_expired += self.db.recover_expired()
            ids = self.db.unreviewed_unknown()
        except errors.LabError as exc:
            counts.recoverer_errors[type(exc).__name__] += 1
            return
        for workflow_id in ids:
            try:
                settled = self.reconciler.reconcile(workflow_id)
            except errors.ManualReview as exc:
                counts.reconciled[f"manual_review:{exc.reason}"] += 1
            except errors.LabError as exc:  # a race (Stale) or a lookup that failed: next pass
                counts.recoverer_errors[type(exc).__name__] += 1
            else:
                counts.reconciled[{"succeeded": "found", "ready": "requeued"}.get(
                    settled.state, settled.state)] += 1
        try:
            for workflow_id in self.db.undispatched_in_review():
                moved = self.db.settle_undispatched(workflow_id)
                if moved is not None:
                    counts.undispatched[moved.state] += 1
        except errors.LabError as exc:
            counts.recoverer_errors[type(exc).__name__] += 1

    def spawn(self, slot: int, dsn: str, token: str, s: Settings,
              keys: sealing.KeyCatalog) -> None:
        """Start a looping, fused worker process in ``slot`` (named for the round)."""
        assert self.service is not None
        self.generation += 1
        name = f"{token}{self.code}{slot}-{self.generation}"
        self.slots[slot] = processes.spawn_worker(
            dsn, self.schema, self.worker_endpoint, self.service.token,
            name, *worker_flags(s), keys=keys,
        )

    def reap(self, slot: int, counts: Counts, items_done: dict[str, int]) -> None:
        """End the worker in ``slot`` (SIGKILL if it still runs), count how it ended and
        the items it reported last."""
        child = self.slots[slot]
        assert child is not None
        self.slots[slot] = None
        code = child.cleanup()  # SIGKILLs it if it still runs: -SIGKILL either way
        if code == -signal.SIGKILL:
            cause = "sigkill"
        elif code == 0:
            cause = "idle_exit"
        else:
            last = (child.stderr.strip().splitlines() or ["?"])[-1]
            cause = f"exit_{code}:{last.split(':')[0]}"
        counts.worker_exits[cause] += 1
        self.read_lines(child, counts, items_done)
        items_done.pop(child.name, None)

    def read_lines(self, child: processes.WorkerProcess, counts: Counts,
                   items_done: dict[str, int]) -> None:
        """Count the items a worker of this population reported so far (its stdout, read
        without blocking).

        ``BOOK_ITEM id state fence`` is printed after the item's transaction committed:
        each is kept as an acknowledged outcome for the ``lost_after_restart`` check.
        """
        while True:
            try:
                line = child.lines.get_nowait()
            except queue.Empty:
                return
            if line and line.startswith(f"{protocol.ITEM} "):
                _, workflow_id, state, fence = line.split()[:4]
                self.acknowledged.append(invariants.Acknowledged(workflow_id, state, int(fence)))
                counts.worker_items[state] += 1
                items_done[child.name] = items_done.get(child.name, 0) + 1
            elif line and line.startswith(f"{protocol.SKIP} "):
                counts.worker_items[f"skip:{line.split()[1]}"] += 1


def worker_flags(s: Settings) -> list[str]:
    """A chaos worker's flags: looping and fused, with the round's lease and work."""
    return ["--loop", "--fused", "--idle-exit", str(s.idle_exit), "--lease", str(s.lease),
            "--heartbeat", str(s.heartbeat), "--backoff", str(s.backoff),
            "--batch", str(s.batch), "--concurrency", str(s.concurrency)]
