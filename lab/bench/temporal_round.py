"""One Temporal round of ``lab bench throughput``: a backlog drained by Temporal workers.

The same workflow the peer chapter runs (``lab_peer_credit``, one activity calling the
lab's credit tool under the lab's effect key, an idempotent tool), started N times on a
task queue of the round's own, then drained by M worker OS processes
(``python -m lab.peers.temporal_peer worker --start-gate --quiet``), each with the
configuration's ``max_concurrent_activities`` and ``max_concurrent_workflow_tasks``.

Each round starts its own dev server (``lab.peers.temporal_server``: loopback, free
ports, its SQLite file in a temporary directory of its own) and stops it at the end, so
no round inherits another's history and no server outlives the round. The workflows are
started before the workers are released; the window runs from the release to the last
completion Temporal records (its close time), and counts the CPU of every process: the
workers, this process (the tool service, the client polling for the drain), PostgreSQL
(the tool's ledger) and the Temporal server. The server keeps its state in SQLite, not
PostgreSQL: the orchestrator's transactions are not counted (the tool's are).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lab import errors, protocol
from lab.bench import measure
from lab.bench.rounds import (
    Config,
    RunResult,
    release_together,
    round_costs,
    round_result,
)
from lab.bench.window import Window
from lab.peers import temporal_peer, temporal_server
from lab.pg import edge
from lab.runtime import plan, processes, store, tool

T = TypeVar("T")
# One workflow and one workflow task at a time per worker, as a ``lab worker`` runs one item
# at a time (the peer chapter's setting): the default beside the lab without ``--sweep``.
TEMPORAL_ACTIVITIES = 1
TEMPORAL_WORKFLOW_TASKS = 1
# A loaded machine can hold an activity for seconds; a timeout would only add retries (the
# tool is idempotent, so they are safe, but they are not what is measured).
SETTINGS = temporal_peer.Settings(start_to_close_s=60.0)
# How often the bench asks Temporal whether the drain is over; the window ends at the last
# close time Temporal recorded, not at the poll that saw it.
POLL_SECONDS = 0.1
# Starts in flight at once from the bench's client, before the window opens.
STARTS_IN_FLIGHT = 32
# Histories read for the claim-to-done latency (Temporal keeps it there, one call each).
HISTORY_SAMPLE = 50


def _run(call: Awaitable[T]) -> T:
    async def bounded() -> T:
        # Every call has a deadline: a round's starts, drain and reads end or fail.
        return await asyncio.wait_for(call, timeout=3600)

    return asyncio.run(bounded())


async def _client(address: str) -> Any:
    from temporalio.client import Client

    return await Client.connect(address, identity="lab-bench")


async def _start_all(address: str, queue: str, tag: str, workflows: int) -> None:
    """Start ``workflows`` credit workflows on ``queue``, and wait until Temporal's
    visibility lists them all as running (the drain is then watched through it)."""
    from lab.peers import temporal_workflows as flows

    client = await _client(address)
    sample = measure.sample_plan()
    gate = asyncio.Semaphore(STARTS_IN_FLIGHT)

    async def one(index: int) -> None:
        work = temporal_peer.Work(
            effect_key=plan.effect_key(measure.PROPOSER.tenant, f"bench-{tag}-{index}"),
            fingerprint=sample.fingerprint(), plan=sample.to_json(),
        )
        async with gate:
            await client.start_workflow(
                flows.WORKFLOW, {"work": work.to_json(), "settings": SETTINGS.to_json()},
                id=f"{tag}-{index}", task_queue=queue,
            )

    await asyncio.gather(*(one(index) for index in range(workflows)))
    await _until(client, _running(queue), workflows, 60 + workflows * 0.1,
                 "Temporal's visibility did not list the round's started workflows")


def _running(queue: str) -> str:
    return f"TaskQueue = '{queue}' AND ExecutionStatus = 'Running'"


async def _until(client: Any, query: str, count: int, within: float, failure: str) -> int:
    """Poll ``count_workflows(query)`` until it is ``count``; returns the polls made."""
    deadline = time.monotonic() + within
    polls = 0
    while True:
        polls += 1
        if (await client.count_workflows(query)).count == count:
            return polls
        if time.monotonic() > deadline:
            raise errors.CheckFailed(failure)
        await asyncio.sleep(POLL_SECONDS)


async def _drain(address: str, queue: str, within: float) -> int:
    client = await _client(address)
    return await _until(client, _running(queue), 0, within,
                        "Temporal workers did not drain the task queue in time")


async def _times(address: str, queue: str, released: float) -> list[dict[str, Any]]:
    """Each completed workflow's latencies from Temporal's own timestamps: ready (started,
    or released) to closed, the close epoch, and for a sample of histories the first
    workflow task's start (a worker picking the workflow up) to closed."""
    client = await _client(address)
    rows: list[dict[str, Any]] = []
    ids: list[str] = []
    async for found in client.list_workflows(
            f"TaskQueue = '{queue}' AND ExecutionStatus = 'Completed'"):
        done = found.close_time.timestamp()
        rows.append({"ready": done - max(found.start_time.timestamp(), released),
                     "done": done, "claim": None})
        ids.append(found.id)
    step = max(1, len(ids) // HISTORY_SAMPLE)
    for index in range(0, len(ids), step):
        rows[index]["claim"] = await _picked_up_to_done(client, ids[index])
    return rows


async def _picked_up_to_done(client: Any, workflow_id: str) -> float | None:
    from temporalio.api.enums.v1 import EventType

    first = last = None
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        # An epoch from the protobuf timestamp itself: no time zone to get wrong.
        at = event.event_time.seconds + event.event_time.nanos / 1e9
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED and first is None:
            first = at
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
            last = at
    return None if first is None or last is None else last - first


def _worker(server: temporal_server.DevServer, queue: str, name: str, config: Config,
            service: tool.ToolService) -> processes.WorkerProcess:
    argv = temporal_peer.argv(
        "worker", "--address", server.address, "--task-queue", queue, "--name", name,
        "--max-concurrent-activities", str(config.concurrency or TEMPORAL_ACTIVITIES),
        "--max-concurrent-workflow-tasks", str(config.workflow_tasks or TEMPORAL_WORKFLOW_TASKS),
        "--start-gate", "--quiet",
    )
    # Exec'd, as DBOS's are: the meter counts this process's reaped children.
    return processes.WorkerProcess(argv, temporal_peer.worker_env(service.endpoint,
                                                                  service.token), name,
                                   fork=False)


def temporal_round(
    scratch: measure.Scratch, server: temporal_server.DevServer, workflows: int,
    config: Config, postmaster: int | None = None,
) -> RunResult:
    """Drain ``workflows`` Temporal workflows (one activity calling the tool) with
    ``config.processes`` worker processes on ``server``."""
    schema = measure.new_schema("bench_temporal")
    store.create_schema(scratch.tool_dsn, schema)
    tag = uuid.uuid4().hex[:8]
    queue = f"lab-bench-{tag}"
    _run(_start_all(server.address, queue, tag, workflows))
    before = measure.xact_snapshot(scratch.admin_dsn, scratch.databases())
    wal_before = measure.wal_syncs(scratch.admin_dsn)
    service = tool.ToolService(scratch.tool_dsn, schema, idempotent=True).start()
    children: list[processes.WorkerProcess] = []
    meter = measure.CpuMeter(postmaster, peer_server=server.pid)
    window = Window(postmaster, peer_server=server.pid)
    try:
        for index in range(config.processes):
            children.append(_worker(server, queue, f"temporal-{tag}-{index}", config, service))
        released = release_together(children, meter, window)
        for child in children:
            child.wait_for(protocol.LAUNCHED, timeout=60)
        _run(_drain(server.address, queue, 60 + workflows * 0.5))
        for child in children:
            child.release()
        for child in children:
            child.wait_for(protocol.DONE, timeout=60)
            # The SDK's runtime is left without finalizing (``temporal_peer.main``).
            child.finish(timeout=60)
        calls = service.calls + service.lookups
    finally:
        window.stop()
        for child in children:
            child.cleanup()
        service.stop()
    cpu, xacts = round_costs(scratch, meter, window, before, wal_before, None, calls)
    rows = _run(_times(server.address, queue, released))
    edge.drop_schema(scratch.tool_dsn, schema)
    return round_result(config, workflows, rows, calls, xacts, cpu, window)


@dataclass
class TemporalRounds:
    """Temporal's rounds on these scratch databases, each on a dev server of its own
    (started for the round, stopped after it); ``described`` is what the report states
    of the server: its versions and its SQLite persistence."""

    scratch: measure.Scratch
    postmaster: int | None
    described: dict[str, Any] = field(default_factory=dict)
    _known: temporal_server.DevServer | None = None

    def __call__(self, config: Config, workflows: int) -> RunResult:
        """One round of ``config`` on a fresh dev server."""
        with self._server() as server:
            return temporal_round(self.scratch, server, workflows, config, self.postmaster)

    @contextlib.contextmanager
    def _server(self) -> Iterator[temporal_server.DevServer]:
        if self._known is None:
            server = temporal_server.start()
            self._known = server
        else:
            # The binary's versions and sha256 (150 MB hashed) are read once per sitting.
            server = temporal_server.DevServer(
                Path(tempfile.mkdtemp(prefix="lab-temporal-")), self._known.executable,
                cli_version=self._known.cli_version,
                server_version=self._known.server_version, sha256=self._known.sha256)
            try:
                server.start()
            except BaseException:
                server.stop()
                raise
        try:
            self.described = server.describe()
            yield server
        finally:
            # Stopped after the round's meters were read: its CPU, once reaped, would
            # otherwise count as a worker's.
            server.stop()
