"""Temporal as the lab's peer: worker OS processes (``python -m lab.peers.temporal_peer``) and
the client calls an experiment makes, against the run's Temporal dev server.

A worker process polls one task queue with one version of the ``lab_peer_credit``
workflow (``lab.peers.temporal_workflows``) and its activities; the credit activity calls
the lab's credit tool over HTTP under the lab's effect key. It prints ``BOOK_READY`` once
it polls, and ``BOOK_STAGE after_tool <attempt>`` once the tool answered (or failed),
where ``<attempt>`` is Temporal's own attempt number of the activity; with ``--pause
after_tool`` it waits there for a newline on the attempt ``--pause-attempt``: after the
effect, before the activity's completion reaches the server. SIGKILL in that pause is the
crash window. With ``--mode delegate`` the credit activity hands the effect to the lab
(``lab.peers.delegation``): its input names an approved lab workflow, and the activity runs
a lab worker on it (lease, fence, start barrier, effect key), or reconciles what a killed
predecessor left, instead of calling the tool itself. Workers run until they are killed,
except the throughput bench's: with ``--start-gate`` a worker polls from a first newline
(``BOOK_LAUNCHED``) and shuts down at a second (``BOOK_DONE``), and ``--quiet`` drops the
per-activity line.

The experiment's side (``Peer``) starts workflows, signals, cancels and reads Temporal's
own view of them (status, history) through the SDK's client. Configuration that holds a
secret (the tool's token, the lab's DSN and keys) travels in the environment:
``LAB_TEMPORAL_TOOL``, ``LAB_TOOL_TOKEN``, and in delegate mode ``BOOK_LAB_DSN``,
``LAB_RESULT_KEYS`` and ``LAB_TEMPORAL_STORE_SCHEMA``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lab import errors, protocol
from lab.peers import delegation, extras
from lab.runtime import processes, sealing, store, tool, toolclient

TOOL_ENV = "LAB_TEMPORAL_TOOL"
STORE_SCHEMA_ENV = "LAB_TEMPORAL_STORE_SCHEMA"
TOKEN_ENV = protocol.TOKEN_ENV  # the same variable `lab worker` reads
T = TypeVar("T")
# Every client call has a deadline: the server is local, an answer takes milliseconds.
RPC_TIMEOUT_S = 30.0


def module() -> Any:
    """The ``temporalio`` package, or ``MissingExtra`` when it is not installed."""
    return extras.imported("temporalio", "temporalio is not installed: scripts/ensure-venv "
                                         "installs the lab's main set")


def version() -> str:
    """The installed Temporal Python SDK version."""
    return extras.installed_version("temporalio")


@dataclass(frozen=True)
class Settings:
    """The credit activity's configuration, carried in the workflow's input (and history)."""

    start_to_close_s: float = 5.0
    max_attempts: int = 0  # 0: Temporal's default, unlimited
    retry_initial_s: float = 0.2
    await_approval: bool = False

    def to_json(self) -> dict[str, Any]:
        """As the workflow reads it."""
        return {"start_to_close_s": self.start_to_close_s, "max_attempts": self.max_attempts,
                "retry_initial_s": self.retry_initial_s, "await_approval": self.await_approval}

    def describe(self) -> dict[str, str]:
        """The settings as the evidence states them (strings, so no key holds a float)."""
        return {
            "start_to_close_timeout": f"{self.start_to_close_s:g}s",
            "retry_policy": (f"maximum_attempts={self.max_attempts}" if self.max_attempts
                             else "maximum_attempts=unlimited (default)")
                            + f", initial_interval={self.retry_initial_s:g}s, backoff=1.0",
            "heartbeat_timeout": "none",
            "approval_signal": "awaited" if self.await_approval else "not asked",
        }


def argv(role: str, *extra: str) -> list[str]:
    """The command line of a Temporal child process of ``role``."""
    return [sys.executable, "-m", "lab.peers.temporal_peer", role, *extra]


def worker_env(endpoint: str, token: str) -> dict[str, str]:
    """The environment of a worker process: the tool's endpoint and token (never argv)."""
    return {**os.environ, TOOL_ENV: endpoint, TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class LabStore:
    """The lab store a delegating worker hands its effects to (DSN and keys are secrets:
    they reach the worker through its environment, and no repr shows them)."""

    dsn: str = field(repr=False)
    schema: str
    keys: sealing.KeyCatalog = field(repr=False)

    def env(self) -> dict[str, str]:
        """What a worker process needs in its environment to open this store."""
        return {**processes.child_env(self.dsn, self.keys), STORE_SCHEMA_ENV: self.schema}


def _run(call: Awaitable[T], within: float = RPC_TIMEOUT_S) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(call, timeout=within)

    return asyncio.run(bounded())


@dataclass
class Peer:
    """Temporal worker processes of one experiment on a task queue of its own, and the
    client calls it makes; ``close`` kills every worker it started."""

    address: str
    task_queue: str
    on_event: Callable[[str, str], None] | None = None
    children: list[processes.WorkerProcess] = field(default_factory=list)

    def spawn(self, name: str, service: tool.ToolService, *extra: str,
              variant: str = "v1", concurrency: int = 1,
              delegate_to: LabStore | None = None) -> processes.WorkerProcess:
        """Start a worker process running ``variant`` of the workflow; ``name`` labels it.
        With ``delegate_to``, its credit activity hands the effect to that lab store."""
        env = worker_env(service.endpoint, service.token)
        mode = "alone"
        if delegate_to is not None:
            env, mode = {**env, **delegate_to.env()}, "delegate"
        child = processes.WorkerProcess(
            argv("worker", "--address", self.address, "--task-queue", self.task_queue,
                 "--name", name, "--variant", variant, "--mode", mode,
                 "--max-concurrent-activities", str(concurrency), *extra),
            env, name, self.on_event, fork=False,
        )
        self.children.append(child)
        if self.on_event is not None:
            self.on_event(name, "started")
        return child

    async def _client(self) -> Any:
        client_module = importlib.import_module("temporalio.client")
        return await client_module.Client.connect(self.address)

    def start(self, workflow_id: str, work: dict[str, Any], settings: Settings) -> None:
        """Start ``lab_peer_credit`` as ``workflow_id`` on this peer's task queue."""
        from lab.peers import temporal_workflows as flows

        async def go() -> None:
            client = await self._client()
            await client.start_workflow(
                flows.WORKFLOW, {"work": work, "settings": settings.to_json()},
                id=workflow_id, task_queue=self.task_queue,
            )

        _run(go())
        if self.on_event is not None:
            self.on_event("experiment", "Temporal start_workflow")

    def result(self, workflow_id: str, within: float) -> str:
        """Wait (at most ``within`` seconds) for the workflow to close; its status name.

        A workflow still open at the deadline fails naming it.
        """
        async def go() -> str:
            client = await self._client()
            handle = client.get_workflow_handle(workflow_id)
            try:
                await asyncio.wait_for(handle.result(), timeout=within)
            except TimeoutError as exc:
                raise TimeoutError(
                    f"Temporal workflow {workflow_id} did not close within {within:g}s"
                ) from exc
            except Exception:  # noqa: S110 - the workflow's own failure: its status says it
                pass
            described = await handle.describe()
            return str(described.status.name)

        return _run(go(), within + RPC_TIMEOUT_S)

    def status(self, workflow_id: str) -> str:
        """The workflow's status name as Temporal reports it (RUNNING, COMPLETED, ...)."""
        async def go() -> str:
            client = await self._client()
            described = await client.get_workflow_handle(workflow_id).describe()
            return str(described.status.name)

        return _run(go())

    def cancel(self, workflow_id: str) -> None:
        """Request cancellation of the workflow, as a Temporal operator would."""
        async def go() -> None:
            client = await self._client()
            await client.get_workflow_handle(workflow_id).cancel()

        _run(go())
        if self.on_event is not None:
            self.on_event("experiment", "Temporal cancel")

    def signal(self, workflow_id: str, name: str, payload: dict[str, Any]) -> None:
        """Send the signal ``name`` with ``payload`` to the workflow."""
        async def go() -> None:
            client = await self._client()
            await client.get_workflow_handle(workflow_id).signal(name, payload)

        _run(go())
        if self.on_event is not None:
            self.on_event("experiment", f"Temporal signal {name}")

    def history(self, workflow_id: str) -> list[dict[str, Any]]:
        """The workflow's event history, one entry per event: its type and, for activity
        events, the activity type, attempt and failure message."""
        async def go() -> list[dict[str, Any]]:
            client = await self._client()
            found: list[dict[str, Any]] = []
            async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
                found.append(_event(event))
            return found

        return _run(go())

    def close(self) -> None:
        """Kill every worker process still alive."""
        for child in self.children:
            child.cleanup()


def _event(event: Any) -> dict[str, Any]:
    """One history event as plain data (``lab.peers.temporal_history`` reads it)."""
    from temporalio.api.enums.v1 import EventType

    name = EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")
    entry: dict[str, Any] = {"type": name}
    if event.HasField("activity_task_scheduled_event_attributes"):
        entry["activity"] = event.activity_task_scheduled_event_attributes.activity_type.name
    if event.HasField("workflow_execution_signaled_event_attributes"):
        signaled = event.workflow_execution_signaled_event_attributes
        entry["signal"] = signaled.signal_name
        entry["payload"] = [p.data.decode("utf-8", "replace")[:500]
                            for p in signaled.input.payloads]
    if event.HasField("activity_task_started_event_attributes"):
        entry["attempt"] = int(event.activity_task_started_event_attributes.attempt)
    for field_name in ("activity_task_failed_event_attributes",
                       "activity_task_timed_out_event_attributes",
                       "workflow_task_failed_event_attributes",
                       "workflow_execution_failed_event_attributes"):
        if event.HasField(field_name):
            attributes = getattr(event, field_name)
            entry["failure"] = str(attributes.failure.message)[:300]
            if field_name == "workflow_task_failed_event_attributes":
                from temporalio.api.enums.v1 import WorkflowTaskFailedCause

                entry["cause"] = WorkflowTaskFailedCause.Name(attributes.cause).removeprefix(
                    "WORKFLOW_TASK_FAILED_CAUSE_")
    return entry


# -- the worker process -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab.peers.temporal_peer",
                                     description=__doc__)
    parser.add_argument("role", choices=["worker"])
    parser.add_argument("--address", required=True, help="the Temporal frontend, host:port")
    parser.add_argument("--task-queue", required=True, help="the task queue to poll")
    parser.add_argument("--name", default="worker", help="the worker's identity")
    parser.add_argument("--variant", choices=["v1", "v2", "v2-patched"], default="v1",
                        help="which version of the workflow's code this worker runs")
    parser.add_argument("--mode", choices=["alone", "delegate"], default="alone",
                        help="alone: the credit activity calls the tool; delegate: it hands "
                             "the effect to the lab (the input names a lab workflow)")
    parser.add_argument("--pause", choices=[protocol.AFTER_TOOL], default=None,
                        help="wait for a newline after the tool answered")
    parser.add_argument("--pause-attempt", type=int, default=1,
                        help="pause on this attempt of the credit activity")
    parser.add_argument("--max-concurrent-activities", type=int, default=1,
                        help="the worker's max_concurrent_activities")
    parser.add_argument("--max-concurrent-workflow-tasks", type=int, default=1,
                        help="the worker's max_concurrent_workflow_tasks")
    parser.add_argument("--start-gate", action="store_true",
                        help=f"the bench's gate: poll only after a newline, print "
                             f"{protocol.LAUNCHED}, and shut down after a second newline "
                             f"({protocol.DONE})")
    parser.add_argument("--quiet", action="store_true",
                        help=f"print no {protocol.STAGE} line per activity (the bench's setting)")
    return parser


def main(args_in: Sequence[str] | None = None) -> int:
    """Body of a Temporal worker process: poll until killed."""
    args = _parser().parse_args(args_in)
    module()
    endpoint = os.environ.get(TOOL_ENV, "")
    token = os.environ.get(TOKEN_ENV, "")
    try:
        asyncio.run(_serve(args, endpoint, token))
    finally:
        sys.stdout.flush()
        # The SDK's native runtime can abort an interpreter that finalizes under it:
        # a worker that stops (it is normally killed) leaves without finalizing.
        os._exit(0)


async def _serve(args: argparse.Namespace, endpoint: str, token: str) -> None:
    from temporalio import activity
    from temporalio.client import Client
    from temporalio.worker import Worker

    from lab.peers import temporal_workflows as flows

    clients: list[toolclient.ToolClient] = []
    stores: list[store.Store] = []

    def after_tool(attempt: int) -> None:
        if not args.quiet:
            print(f"{protocol.STAGE} {protocol.AFTER_TOOL} {attempt}", flush=True)
        if args.pause is not None and attempt == args.pause_attempt:
            sys.stdin.readline()

    def delegated(body: dict[str, Any], attempt: int) -> dict[str, Any]:
        if not stores:
            stores.append(store.Store.open(
                os.environ[protocol.DSN_ENV], os.environ[STORE_SCHEMA_ENV], max_connections=2,
                application_name=f"{processes.WORKER_APP_PREFIX}temporal"))
        return delegation.carry_out(stores[0], clients[0], str(body["lab_workflow"]),
                                    name=args.name, after_tool=lambda: after_tool(attempt))

    @activity.defn(name=flows.CREDIT_ACTIVITY)
    def credit(body: dict[str, Any]) -> dict[str, Any]:
        if not clients:
            clients.append(toolclient.ToolClient(endpoint, token))
        attempt = activity.info().attempt
        if args.mode == "delegate":
            return delegated(body, attempt)
        work = Work(body["effect_key"], body["fingerprint"], body["plan"])
        failure: errors.ToolError | None = None
        try:
            receipt = clients[0].call(work)
        except errors.ToolError as exc:
            failure = exc
        after_tool(attempt)
        if failure is not None:
            raise failure
        return receipt.to_json()

    @activity.defn(name=flows.NOTIFY_ACTIVITY)
    def notify(what: str) -> str:
        print(f"{protocol.STAGE} notify {activity.info().attempt}", flush=True)
        return what

    client = await Client.connect(args.address, identity=args.name)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.max_concurrent_activities) as pool:
        worker = Worker(
            client,
            task_queue=args.task_queue,
            workflows=[flows.VARIANTS[args.variant]],
            activities=[credit, notify],
            activity_executor=pool,
            max_concurrent_activities=args.max_concurrent_activities,
            max_concurrent_workflow_tasks=args.max_concurrent_workflow_tasks,
        )
        print(protocol.READY, flush=True)
        if not args.start_gate:
            await worker.run()
            return
        await _gated(worker)


async def _gated(worker: Any) -> None:
    """The bench's worker, as DBOS's: connected and built before ``BOOK_READY``, so the
    round's window (from the release) holds the drain and not the start-up; polling from
    the first newline (``BOOK_LAUNCHED``), a graceful shutdown at the second (``BOOK_DONE``)."""
    await asyncio.to_thread(sys.stdin.readline)
    running = asyncio.create_task(worker.run())
    print(protocol.LAUNCHED, flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    await worker.shutdown()
    await running
    print(protocol.DONE, flush=True)


@dataclass(frozen=True)
class Work:
    """What the activity hands the credit tool: the lab's effect key, fingerprint and plan."""

    effect_key: str
    fingerprint: str
    plan: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The activity's input as Temporal serialises it."""
        return {"effect_key": self.effect_key, "fingerprint": self.fingerprint,
                "plan": self.plan}


if __name__ == "__main__":
    sys.exit(main())
