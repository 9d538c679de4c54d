"""LangGraph with its PostgreSQL checkpointer as the lab's peer.

Run as its own OS process: ``python -m lab.peers.langgraph_peer``.

A three-node graph as readers write it: ``plan`` → ``approve`` (``interrupt()`` for a
person's decision) → ``credit``, checkpointed by ``PostgresSaver`` on one
``thread_id``. Two modes of the ``credit`` node:

``alone``     the node calls the lab's credit tool over HTTP itself, under the lab's
              effect key (LangGraph's own durability only)
``delegate``  the node hands the side effect to the lab: the ``plan`` node admits the
              proposal and persists it as a lab workflow (operation = the thread id),
              ``approve`` approves it through the lab's bound approval, and ``credit``
              runs a lab worker (lease, fence, start barrier, effect key), recovering and
              reconciling what a crashed predecessor left instead of calling again

Roles: ``start`` runs the graph up to the approval interrupt; ``resume`` answers it
with ``--value`` (JSON, any value: LangGraph passes it on as given); ``continue``
re-invokes the thread (``invoke(None)``), as after a crash. ``--pause after_tool``
(or ``before_tool``) prints ``BOOK_STAGE <stage>`` in the credit node and waits for a
newline; ``--start-gate`` prints ``BOOK_READY`` and waits before invoking.

Environment: ``LAB_LG_DSN`` (checkpoints and, in delegate mode, the lab's store),
``LAB_LG_SCHEMA`` (checkpoint tables), ``LAB_LG_STORE_SCHEMA``, ``LAB_LG_TOOL``,
``LAB_TOOL_TOKEN``, and for ``start`` ``LAB_LG_PROPOSAL`` (the plan as the model sent it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

from psycopg import sql

from lab import errors, names, protocol
from lab.peers import delegation, extras
from lab.pg import edge
from lab.runtime import plan, processes, proposal, sealing, store, tool, toolclient

DSN_ENV = "LAB_LG_DSN"
SCHEMA_ENV = "LAB_LG_SCHEMA"
STORE_SCHEMA_ENV = "LAB_LG_STORE_SCHEMA"
TOOL_ENV = "LAB_LG_TOOL"
PROPOSAL_ENV = "LAB_LG_PROPOSAL"
TOKEN_ENV = protocol.TOKEN_ENV
TENANT = "tenant-a"
AGENT = store.Actor(tenant=TENANT, subject="langgraph-agent", role="proposer")
# The approval the graph asks for carries an expiry, as the lab's does; LangGraph keeps it
# in the interrupt's payload and nothing of LangGraph reads it again.
APPROVAL_TTL = timedelta(seconds=1)


class State(TypedDict, total=False):
    """The graph's state, checkpointed after every node."""

    plan: dict[str, Any]
    effect_key: str
    fingerprint: str
    workflow_id: str
    approval: Any
    receipt: dict[str, str] | None
    lab_state: str
    review_reason: str | None


def modules() -> tuple[Any, Any, Any]:
    """``(langgraph.graph, langgraph.types, PostgresSaver)``, or an error naming the extra."""
    missing = "LangGraph is not installed: pip install '.[peers]' to compare with it"
    return (extras.imported("langgraph.graph", missing),
            extras.imported("langgraph.types", missing),
            extras.imported("langgraph.checkpoint.postgres", missing).PostgresSaver)


def versions() -> dict[str, str]:
    """The installed LangGraph and checkpointer versions."""
    return {name: extras.installed_version(name)
            for name in ("langgraph", "langgraph-checkpoint-postgres")}


def config(thread: str) -> dict[str, Any]:
    """LangGraph's run configuration for ``thread``."""
    return {"configurable": {"thread_id": thread}}


@contextlib.contextmanager
def checkpointer(dsn: str, schema: str) -> Iterator[Any]:
    """A ``PostgresSaver`` whose tables live in ``schema`` (created when missing)."""
    _, _, saver_class = modules()
    names.check_schema_name(schema)
    with edge.session(dsn, "create the checkpoint schema") as conn:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    with edge.translated("open LangGraph's checkpointer"), \
            saver_class.from_conn_string(edge.with_search_path(dsn, schema)) as saver:
        saver.setup()
        yield saver


# -- the graph ---------------------------------------------------------------------------------


@dataclass
class Nodes:
    """The graph's node functions, bound to a tool client and (delegate mode) the lab store."""

    mode: str
    client: toolclient.ToolClient | None
    interrupt: Callable[[Any], Any]
    pause: str | None = None
    db: store.Store | None = None
    contract: str = proposal.DEFAULT_TOOL
    log: list[str] = field(default_factory=list)

    def _peer_stage(self, stage: str) -> None:
        print(f"{protocol.STAGE} {stage}", flush=True)
        if self.pause == stage:
            sys.stdin.readline()

    def plan(self, state: State) -> State:
        """Admit the proposal (delegate: and persist it as a lab workflow, once per thread)."""
        contract = proposal.TOOL_REGISTRY[self.contract]
        admitted = proposal.admit(os.environ.get(PROPOSAL_ENV, "").encode(), contract)
        thread = os.environ["LAB_LG_THREAD"]
        out: State = {"plan": admitted.to_json(), "fingerprint": admitted.fingerprint(),
                      "effect_key": plan.effect_key(TENANT, thread)}
        if self.db is not None:
            created = self.db.create(AGENT, thread, admitted)
            out["workflow_id"] = created.id
        return out

    def approve(self, state: State) -> State:
        """Ask a person; delegate mode turns the answer into the lab's bound approval."""
        expires = datetime.now(UTC) + APPROVAL_TTL
        decision = self.interrupt({"plan": state["plan"], "fingerprint": state["fingerprint"],
                                   "expires_at": expires.isoformat()})
        if self.db is not None:
            answer = decision if isinstance(decision, dict) else {}
            approver = store.Actor(tenant=str(answer.get("tenant", "")),
                                   subject=str(answer.get("approver", "")), role="approver")
            self.db.approve(approver, state["workflow_id"], str(answer.get("fingerprint", "")),
                            timedelta(minutes=1))
        return {"approval": decision}

    def credit(self, state: State) -> State:
        """Carry out the credit: call the tool (alone) or run a lab worker (delegate)."""
        if self.client is None:
            raise errors.UsageError("this graph was built for reading state, not for running")
        if self.db is not None:
            return self._delegated(state, self.client)
        self._peer_stage("before_tool")
        work = _Work(state["effect_key"], state["fingerprint"], state["plan"])
        receipt = self.client.call(work)
        self._peer_stage("after_tool")
        return {"receipt": receipt.to_json()}

    def _delegated(self, state: State, client: toolclient.ToolClient) -> State:
        assert self.db is not None
        settled = delegation.carry_out(self.db, client, state["workflow_id"],
                                       name="langgraph-node",
                                       after_tool=lambda: self._peer_stage(protocol.AFTER_TOOL))
        return {"lab_state": settled["lab_state"], "review_reason": settled["review_reason"],
                "receipt": settled["receipt"]}


@dataclass(frozen=True)
class _Work:
    effect_key: str
    fingerprint: str
    plan: dict[str, Any]


def build(nodes: Nodes, saver: Any) -> Any:
    """The compiled graph: plan → approve → credit, or END when the decision is falsy."""
    graph_module, _, _ = modules()
    graph = graph_module.StateGraph(State)
    graph.add_node("plan", nodes.plan)
    graph.add_node("approve", nodes.approve)
    graph.add_node("credit", nodes.credit)
    graph.add_edge(graph_module.START, "plan")
    graph.add_edge("plan", "approve")
    graph.add_conditional_edges(
        "approve", lambda state: "credit" if state.get("approval") else graph_module.END
    )
    graph.add_edge("credit", graph_module.END)
    return graph.compile(checkpointer=saver)


# -- what LangGraph itself says: the thread's checkpoints -------------------------------------


def snapshot(dsn: str, schema: str, thread: str) -> dict[str, Any]:
    """The thread's state as LangGraph reports it: next nodes, checkpoints, pending writes."""
    _, types, _ = modules()
    with checkpointer(dsn, schema) as saver:
        # Reading the state runs no node: a graph without a tool client is enough.
        nodes = Nodes(mode="alone", client=None, interrupt=types.interrupt)
        graph = build(nodes, saver)
        state = graph.get_state(config(thread))
        history = list(graph.get_state_history(config(thread)))
    interrupts = [i.value for task in state.tasks for i in task.interrupts]
    values = dict(state.values)
    receipt = values.get("receipt")
    return {
        "next": list(state.next),
        "checkpoints": len(history),
        "interrupts": interrupts,
        "approval": values.get("approval"),
        "receipt_id": receipt.get("receipt_id") if isinstance(receipt, dict) else None,
        "lab_state": values.get("lab_state"),
        "review_reason": values.get("review_reason"),
        "errors": [str(task.error) for task in state.tasks if task.error is not None],
    }


# -- driving LangGraph processes from an experiment -----------------------------------------------


@dataclass
class Peer:
    """LangGraph processes of one experiment on one checkpoint schema; ``close`` cleans up."""

    dsn: str = field(repr=False)
    schema: str
    store_schema: str
    keys: sealing.KeyCatalog = field(repr=False)
    on_event: Callable[[str, str], None] | None = None
    children: list[processes.WorkerProcess] = field(default_factory=list)

    def spawn(
        self, role: str, name: str, service: tool.ToolService, thread: str, *extra: str,
        proposal_json: str = "",
    ) -> processes.WorkerProcess:
        """Start a LangGraph child process of ``role`` on ``thread``."""
        env = {
            **processes.child_env(self.dsn, self.keys),
            DSN_ENV: self.dsn,
            SCHEMA_ENV: self.schema,
            STORE_SCHEMA_ENV: self.store_schema,
            TOOL_ENV: service.endpoint,
            TOKEN_ENV: service.token,
            PROPOSAL_ENV: proposal_json,
            "PYTHONUNBUFFERED": "1",
        }
        argv = [sys.executable, "-m", "lab.peers.langgraph_peer", role, "--thread", thread, *extra]
        child = processes.WorkerProcess(argv, env, name, self.on_event)
        self.children.append(child)
        if self.on_event is not None:
            self.on_event(name, "started")
        return child

    def snapshot(self, thread: str) -> dict[str, Any]:
        """LangGraph's own view of ``thread``."""
        return snapshot(self.dsn, self.schema, thread)

    def close(self) -> None:
        """Kill every child still alive and drop the checkpoint schema."""
        for child in self.children:
            child.cleanup()
        edge.drop_schema(self.dsn, self.schema)


# -- the child process ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab.peers.langgraph_peer", description=__doc__)
    parser.add_argument("role", choices=["start", "resume", "continue"])
    parser.add_argument("--thread", required=True)
    parser.add_argument("--mode", choices=["alone", "delegate"], default="alone")
    parser.add_argument("--value", default="true", help="resume: the decision, as JSON")
    parser.add_argument("--pause", choices=["before_tool", "after_tool"], default=None)
    parser.add_argument("--start-gate", action="store_true")
    parser.add_argument("--contract", choices=sorted(proposal.TOOL_REGISTRY),
                        default=proposal.DEFAULT_TOOL, help="the trusted tool contract")
    return parser


def main(args_in: Sequence[str] | None = None) -> int:
    """Body of a LangGraph child process; see the module docstring."""
    args = _parser().parse_args(args_in)
    _, types, _ = modules()
    os.environ["LAB_LG_THREAD"] = args.thread
    dsn = os.environ[DSN_ENV]
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(
            toolclient.ToolClient(os.environ[TOOL_ENV], os.environ[TOKEN_ENV]))
        db = None
        if args.mode == "delegate":
            db = stack.enter_context(store.Store.open(
                dsn, os.environ[STORE_SCHEMA_ENV], max_connections=2,
                application_name=f"{processes.WORKER_APP_PREFIX}langgraph"))
        saver = stack.enter_context(checkpointer(dsn, os.environ[SCHEMA_ENV]))
        nodes = Nodes(mode=args.mode, client=client, interrupt=types.interrupt,
                      pause=args.pause, db=db, contract=args.contract)
        graph = build(nodes, saver)
        if args.start_gate:
            print(protocol.READY, flush=True)
            sys.stdin.readline()
        if args.role == "start":
            given: Any = {}
        elif args.role == "resume":
            given = types.Command(resume=json.loads(args.value))
        else:
            given = None
        try:
            with edge.translated("checkpoint the graph"):
                graph.invoke(given, config(args.thread))
        except errors.LabError as exc:
            print(f"{protocol.FAILED} {type(exc).__name__}", flush=True)
    print(protocol.DONE, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
