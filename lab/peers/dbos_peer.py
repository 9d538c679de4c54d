"""DBOS Transact as the lab's peer, run as its own OS process: ``python -m lab.peers.dbos_peer``.

One DBOS workflow, ``lab_peer_credit``, with one ``@DBOS.step`` that calls the
lab's credit tool over HTTP under the same effect key the lab would use. The same
program serves the throughput benchmark and the peer chapter (``ch13_peer_dbos``):

``prepare``   create and migrate DBOS's system tables, register the benchmark queue
``worker``    a benchmark queue worker speaking the lab's line protocol: ``BOOK_READY``
              (a newline launches DBOS), ``BOOK_LAUNCHED``, and ``BOOK_DONE`` after a
              second newline has shut DBOS down
``run``       start one credit workflow and wait for it (``BOOK_DONE <status>``)
``recover``   launch DBOS, which recovers this executor's pending workflows of its own
              application version, then report one workflow's status after a bounded wait

The step prints ``BOOK_STAGE after_tool <attempt>`` once the tool answered (or failed)
and, with ``--pause after_tool``, waits for a newline there: after the effect, before
DBOS checkpoints the step's output. SIGKILL in that pause is the peer's crash window.

Configuration travels in the environment (the system database URL holds a password):
``LAB_DBOS_URL``, ``LAB_DBOS_SCHEMA``, ``LAB_DBOS_TOOL``, ``LAB_TOOL_TOKEN`` and, for
``run``, ``LAB_DBOS_WORK`` (the step's JSON input).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql

from lab import errors, names, protocol
from lab.peers import extras
from lab.pg import edge
from lab.runtime import processes, tool, toolclient

APP = "labpeer"
QUEUE = "lab_bench"
WORKFLOW = "lab_peer_credit"
STEP = "lab_peer_credit_step"
DEFAULT_VERSION = "v1"
URL_ENV = "LAB_DBOS_URL"
SCHEMA_ENV = "LAB_DBOS_SCHEMA"
TOOL_ENV = "LAB_DBOS_TOOL"
WORK_ENV = "LAB_DBOS_WORK"
TOKEN_ENV = protocol.TOKEN_ENV  # the same variable `lab worker` reads
TERMINAL = frozenset({"SUCCESS", "ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED"})


def module() -> Any:
    """The ``dbos`` package, or ``MissingExtra`` when the ``peers`` extra is not installed."""
    return extras.imported("dbos", "DBOS is not installed: pip install '.[peers]' to compare "
                                   "with it")


def version() -> str:
    """The installed DBOS Transact version."""
    return extras.installed_version("dbos")


@dataclass(frozen=True)
class Work:
    """What the step hands the credit tool: the lab's own effect key, fingerprint and plan."""

    effect_key: str
    fingerprint: str
    plan: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The step's input as DBOS serialises it."""
        return {"effect_key": self.effect_key, "fingerprint": self.fingerprint,
                "plan": self.plan}


def child_env(
    dsn: str, schema: str, endpoint: str, token: str, work: Work | None = None
) -> dict[str, str]:
    """The environment of a DBOS child process (secrets stay out of argv)."""
    env = {
        **os.environ,
        URL_ENV: edge.sqlalchemy_url(dsn),
        SCHEMA_ENV: names.check_schema_name(schema),
        TOOL_ENV: endpoint,
        TOKEN_ENV: token,
        "PYTHONUNBUFFERED": "1",
    }
    if work is not None:
        env[WORK_ENV] = json.dumps(work.to_json())
    return env


def argv(role: str, *extra: str) -> list[str]:
    """The command line of a DBOS child process of ``role``."""
    return [sys.executable, "-m", "lab.peers.dbos_peer", role, *extra]


# -- what DBOS itself says: its status tables ---------------------------------------------------


def status_rows(dsn: str, schema: str, workflow_id: str) -> list[dict[str, Any]]:
    """DBOS's own ``workflow_status`` row for ``workflow_id`` (status, recoveries, version)."""
    query = sql.SQL(
        "SELECT status, recovery_attempts, application_version, executor_id, "
        "error IS NOT NULL AS has_error FROM {} WHERE workflow_uuid = %s"
    ).format(sql.Identifier(names.check_schema_name(schema), "workflow_status"))
    found = edge.rows(dsn, query, (workflow_id,), action="read DBOS's workflow status")
    return [{**row, "recovery_attempts": int(row["recovery_attempts"] or 0)} for row in found]


def step_rows(dsn: str, schema: str, workflow_id: str) -> list[dict[str, Any]]:
    """DBOS's checkpointed steps of ``workflow_id``: name, and whether output or error."""
    query = sql.SQL(
        "SELECT function_id, function_name, output IS NOT NULL AS has_output, "
        "error IS NOT NULL AS has_error FROM {} WHERE workflow_uuid = %s ORDER BY function_id"
    ).format(sql.Identifier(names.check_schema_name(schema), "operation_outputs"))
    return edge.rows(dsn, query, (workflow_id,), action="read DBOS's step outputs")


def status_of(dsn: str, schema: str, workflow_id: str) -> str | None:
    """The workflow's DBOS status, or None when DBOS holds no row for it."""
    found = status_rows(dsn, schema, workflow_id)
    return str(found[0]["status"]) if found else None


def cancel(dsn: str, schema: str, workflow_id: str) -> None:
    """Cancel ``workflow_id`` through DBOS's own client, as a DBOS operator would."""
    dbos = module()
    client = dbos.DBOSClient(system_database_url=edge.sqlalchemy_url(dsn),
                             dbos_system_schema=schema, application_name=APP)
    try:
        client.cancel_workflow(workflow_id)
    finally:
        client.destroy()


# -- driving DBOS processes from an experiment -----------------------------------------------------


@dataclass
class Peer:
    """DBOS processes of one experiment: its own system schema, the experiment's credit tool.

    Owns every process it starts and its schema; ``close`` kills and drops them.
    """

    dsn: str = field(repr=False)
    schema: str
    on_event: Callable[[str, str], None] | None = None
    children: list[processes.WorkerProcess] = field(default_factory=list)

    def spawn(
        self, role: str, name: str, service: tool.ToolService, workflow_id: str, *extra: str,
        work: Work | None = None,
    ) -> processes.WorkerProcess:
        """Start a DBOS child process of ``role`` on ``workflow_id``; ``name`` labels it."""
        env = child_env(self.dsn, self.schema, service.endpoint, service.token, work)
        child = processes.WorkerProcess(
            argv(role, "--workflow-id", workflow_id, *extra), env, name, self.on_event
        )
        self.children.append(child)
        if self.on_event is not None:
            self.on_event(name, "started")
        return child

    def status(self, workflow_id: str) -> list[dict[str, Any]]:
        """DBOS's ``workflow_status`` row of ``workflow_id``."""
        return status_rows(self.dsn, self.schema, workflow_id)

    def steps(self, workflow_id: str) -> list[dict[str, Any]]:
        """DBOS's checkpointed step rows of ``workflow_id``."""
        return step_rows(self.dsn, self.schema, workflow_id)

    def close(self) -> None:
        """Kill every child still alive and drop DBOS's schema."""
        for child in self.children:
            child.cleanup()
        edge.drop_schema(self.dsn, self.schema)


# -- the child process ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab.peers.dbos_peer", description=__doc__)
    parser.add_argument("role", choices=["prepare", "worker", "run", "recover"])
    parser.add_argument("--name", default="local", help="DBOS executor id")
    parser.add_argument("--workflow-id", default=None)
    parser.add_argument("--app-version", default=DEFAULT_VERSION)
    parser.add_argument("--pause", choices=["after_tool"], default=None)
    parser.add_argument("--pause-attempt", type=int, default=1,
                        help="pause after this attempt of the step")
    parser.add_argument("--max-attempts", type=int, default=0,
                        help="DBOS step retries: attempts in all (0: retries off)")
    parser.add_argument("--retry-interval", type=float, default=0.05)
    parser.add_argument("--concurrency", type=int, default=1, help="queue worker_concurrency")
    parser.add_argument("--poll", type=float, default=0.005, help="queue polling interval, s")
    parser.add_argument("--wait", type=float, default=30.0,
                        help="recover: seconds to wait for the workflow to end")
    return parser


def main(args_in: Sequence[str] | None = None) -> int:
    """Body of a DBOS child process; see the module docstring for the roles."""
    args = _parser().parse_args(args_in)
    dbos = module()
    endpoint = os.environ.get(TOOL_ENV, "")
    token = os.environ.get(TOKEN_ENV, "")
    clients: list[toolclient.ToolClient] = []
    attempts = [0]

    def credit_step(body: dict[str, Any]) -> dict[str, str]:
        if not clients:
            clients.append(toolclient.ToolClient(endpoint, token))
        attempts[0] += 1
        work = Work(body["effect_key"], body["fingerprint"], body["plan"])
        failure: errors.ToolError | None = None
        try:
            receipt = clients[0].call(work)
        except errors.ToolError as exc:
            failure = exc
        if args.pause is not None:
            print(f"{protocol.STAGE} {protocol.AFTER_TOOL} {attempts[0]}", flush=True)
            if attempts[0] == args.pause_attempt:
                sys.stdin.readline()
        if failure is not None:
            raise failure
        return receipt.to_json()

    options: dict[str, Any] = {"name": STEP}
    if args.max_attempts > 0:
        options.update(retries_allowed=True, max_attempts=args.max_attempts,
                       interval_seconds=args.retry_interval, backoff_rate=1.0)
    step = dbos.DBOS.step(**options)(credit_step)

    def credit(body: dict[str, Any]) -> dict[str, str]:
        result: dict[str, str] = step(body)
        return result

    workflow = dbos.DBOS.workflow(name=WORKFLOW)(credit)
    dbos.DBOS(config={
        "name": APP,
        "system_database_url": os.environ[URL_ENV],
        "dbos_system_schema": os.environ[SCHEMA_ENV],
        "executor_id": args.name,
        "application_version": args.app_version,
        "run_admin_server": False,
        "log_level": "CRITICAL",
    })
    try:
        return _role(dbos, args, workflow)
    finally:
        for client in clients:
            client.close()


def _role(dbos: Any, args: argparse.Namespace, workflow: Any) -> int:
    if args.role == "prepare":
        dbos.DBOS.launch()
        dbos.DBOS.register_queue(QUEUE, worker_concurrency=args.concurrency,
                                 polling_interval_sec=args.poll)
        dbos.DBOS.destroy()
        return 0
    if args.role == "worker":
        print(protocol.READY, flush=True)
        sys.stdin.readline()
        dbos.DBOS.launch()
        print(protocol.LAUNCHED, flush=True)
        sys.stdin.readline()
        dbos.DBOS.destroy(workflow_completion_timeout_sec=10)
        print(protocol.DONE, flush=True)
        return 0
    if not args.workflow_id:
        _parser().error(f"{args.role} needs --workflow-id")
    dbos.DBOS.launch()
    if args.role == "run":
        body = json.loads(os.environ[WORK_ENV])
        with dbos.SetWorkflowID(args.workflow_id):
            handle = dbos.DBOS.start_workflow(workflow, body)
        try:
            handle.get_result()
        except Exception as exc:  # the workflow's own error: DBOS has recorded it
            print(f"{protocol.FAILED} {type(exc).__name__}", flush=True)
    print(protocol.LAUNCHED, flush=True)
    status = _wait_terminal(dbos, args.workflow_id, args.wait)
    dbos.DBOS.destroy(workflow_completion_timeout_sec=1)
    print(f"{protocol.DONE} {status}", flush=True)
    return 0


def _wait_terminal(dbos: Any, workflow_id: str, seconds: float) -> str:
    """The workflow's status once terminal, or as it stands after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        status = dbos.DBOS.get_workflow_status(workflow_id)
        current = "NONE" if status is None else str(status.status)
        if current in TERMINAL or time.monotonic() >= deadline:
            return current
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
