"""``lab crashpoints``: every named boundary, every fault, every tool kind, not a sample.

For each cell a fresh workflow on its own schema is driven to one boundary of
``lab.protocol.BOUNDARIES`` by a real ``lab worker`` OS process talking to the
credit tool running as its own OS process (``lab.runtime.toolprocess``); the fault is
injected exactly there; recovery then runs as an operator's recoverer would,
with the real lease on PostgreSQL's clock (expired leases become unknown,
unknowns are reconciled through the tool's lookup, requeued work runs again);
and ``lab.faults.invariants`` judges the schema's whole history. Faults:

    worker_sigkill  the process at the boundary dies by SIGKILL: its own
                    self-kill switch (``lab worker --crash-at``) on the worker's
                    and the reconciler's paths; the harness's SIGKILL while the
                    tool holds the request, for the two boundaries inside the
                    tool's request handling
    reply_lost      the next effect reply after the boundary is lost: the tool
                    commits the effect and closes the connection unanswered
    tool_restart    the tool process is SIGKILLed at the boundary (by its own
                    self-kill switch inside request handling, else by the
                    harness while the worker waits there), the worker carries
                    on against the dead endpoint, then the tool restarts
    late_request    the effect request after the boundary is held past the
                    worker's client timeout (in the worker-tool link, in the tool,
                    or in the tool-database link: ``lab.faults.crashlate``), and
                    delivered only once recovery settled the workflow
    postgres_restart  the postmaster is SIGKILLed while the process waits at the
                    boundary and restarted on the same data (``crash_restart`` of
                    a server this run started; left out, with the reason, for
                    any other); these cells run one at a time, after the others

Tool kinds: idempotent; non-idempotent without a fenced lookup (a person decides its
unknowns); non-idempotent with one (its "absent" is a proof, so recovery can requeue).
Rows: every boundary, and a batch stopped with all its requests in the tool.

How each cell is driven (its script) is ``lab.faults.crashscripts``'s.

Each cell is independent (own schema, tool process and workers), so cells run
in parallel (``--jobs``). The seed picks each cell's plan and the order cells
are scheduled in. In the first three columns a cell's outcome does not depend
on timing (runs give the same cells apart from times). In the PostgreSQL
column it may: whether the waiting process's next statement meets a pooled
connection broken by the restart (it exits, its lease expires, recovery
settles it) or a fresh one (it carries on) is up to the pool's timing; either
way the checker judges the history, and the cell records which happened.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab import errors, protocol
from lab.evidence import crashmatrix
from lab.faults import crashlate, crashrecovery, invariants
from lab.faults.crashscripts import (  # the scripts, also named here for callers
    AFTER_REPLY,
    APPROVAL_TTL,
    APPROVER,
    ARM_WORKER,
    AUTOMATIC,
    BACKOFF_S,
    BATCH,
    BATCH_FLAGS,
    BATCH_ROWS,
    BATCH_SIZE,
    BEFORE_CALL,
    CELL_TIMEOUT_S,
    DELIVER_LATE,
    DROP_NEXT_REPLY,
    FAULT_NAMES,
    FAULT_STEPS,
    FAULTS,
    FORMAT,
    FUSED_FLAGS,
    HEARTBEAT_S,
    HOLD_DATABASE_LINK,
    IDEMPOTENT,
    IN_TOOL,
    KILL_TOOL,
    KILL_WORKER,
    KINDS,
    LATE_ANSWERED,
    LATE_TIMED_OUT,
    LEASE_S,
    NO_RESTART,
    NON_IDEMPOTENT,
    NON_IDEMPOTENT_FENCED,
    NOT_APPLICABLE,
    NOT_REACHED,
    PERSON,
    POSTGRES_RESTART,
    PROPOSER,
    REACH,
    RECONCILING,
    RECOVER,
    RELEASE_TOOL,
    RELEASE_WORKER,
    REPLY_LOST,
    RESTART_POSTGRES,
    RESTART_TOOL,
    SLOW_TOOL,
    SLOW_TOOL_HEARTBEAT_S,
    TOOL_DIED,
    TOOL_RESTART,
    TOOL_STAGE,
    VIOLATION,
    WORKER_EXIT,
    WORKER_KILLED_ITSELF,
    WORKER_SIGKILL,
    WORKER_STAGE,
    NotApplicable,
    Script,
    boundary_of,
    cell_id,
    cells,
    missing_cells,
    script,
)
from lab.options import option
from lab.pg import edge, providers
from lab.runtime import plan, processes, sealing, store
from lab.runtime import toolprocess as toolprocesses

__all__ = [  # the scripts' names too: callers read them here
    "AFTER_REPLY", "APPROVAL_TTL", "APPROVER", "ARM_WORKER", "AUTOMATIC", "BACKOFF_S", "BATCH",
    "BATCH_FLAGS", "BATCH_SIZE", "BEFORE_CALL", "CELL_TIMEOUT_S", "DROP_NEXT_REPLY", "FAULTS",
    "FAULT_NAMES", "FAULT_STEPS", "FORMAT", "FUSED_FLAGS", "HEARTBEAT_S", "IDEMPOTENT", "IN_TOOL",
    "KILL_TOOL", "KILL_WORKER", "KINDS", "LEASE_S", "NON_IDEMPOTENT", "NOT_APPLICABLE",
    "NOT_REACHED", "NO_RESTART", "PERSON", "POSTGRES_RESTART", "PROPOSER", "REACH", "RECONCILING",
    "RELEASE_TOOL", "RELEASE_WORKER", "REPLY_LOST", "RESTART_POSTGRES", "RESTART_TOOL",
    "SLOW_TOOL", "SLOW_TOOL_HEARTBEAT_S", "TOOL_DIED", "TOOL_RESTART", "TOOL_STAGE", "VIOLATION",
    "WORKER_EXIT", "WORKER_KILLED_ITSELF", "WORKER_SIGKILL", "WORKER_STAGE", "CrashpointsOptions",
    "NotApplicable", "Script", "assemble", "cell_id", "cells", "cli_main", "missing_cells",
    "print_summary", "run", "script",
]


# --------------------------------------------------------------------------- running


@dataclass
class _Run:
    dsn: str = field(repr=False)
    token: str = field(repr=False)
    seed: int
    keys: sealing.KeyCatalog = field(repr=False)
    keep_schemas: bool
    restart: Callable[[], float] | None


def run(
    dsn: str,
    *,
    seed: int = 17,
    jobs: int = 2,
    only: Sequence[str] = (),
    log: Callable[[str], None] | None = None,
    keep_schemas: bool = False,
    restart: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Run every cell (or those whose id starts with one of ``only``) and return the matrix.

    ``restart`` crash-restarts the server at ``dsn`` (``RunningPostgres.crash_restart``);
    without it the PostgreSQL column is left out and the matrix says why. Its cells kill
    every connection of the server, so they run one at a time after the others.
    """
    if not 1 <= jobs <= 16:
        raise errors.UsageError("--jobs must be between 1 and 16")
    missing = missing_cells()
    if missing:
        raise errors.CheckFailed(f"boundaries without a crash-point cell: {', '.join(missing)}")
    say = log or (lambda message: None)
    began = time.monotonic()
    ctx = _Run(dsn, f"c{secrets.token_hex(3)}", seed, sealing.load_catalog(), keep_schemas,
               restart)
    wanted = [c for c in cells() if (restart is not None or c[1] != POSTGRES_RESTART)
              and (not only or cell_id(*c).startswith(tuple(only)))]
    if not wanted:
        raise errors.UsageError(f"no cell matches {', '.join(only)}")
    order = list(range(len(wanted)))
    random.Random(seed).shuffle(order)
    serial = [i for i in order if wanted[i][1] == POSTGRES_RESTART]
    order = [i for i in order if wanted[i][1] != POSTGRES_RESTART]
    results: dict[int, dict[str, Any]] = {}

    def one(index: int) -> None:
        boundary, fault, kind = wanted[index]
        results[index] = _run_cell(ctx, index, boundary, fault, kind)
        cell = results[index]
        say(f"{cell_id(boundary, fault, kind)}: {cell['status']}"
            + (f" ({cell['why']})" if cell.get("why") else ""))

    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="crashpoint") as pool:
        try:
            # Submitted inside the guard: an interrupt while the queue fills cancels what
            # is queued so far.
            futures = [pool.submit(one, index) for index in order]
            for future in futures:
                future.result()
        except BaseException:
            # Interrupted (Ctrl-C, a run cancelled) or a cell failed: the cells not begun
            # never begin. Leaving the pool would otherwise wait for the whole matrix,
            # past the grace an interrupted run gives its experiments to tear down; the
            # cells in flight end and clean up (``_run_cell``) before this raises. The
            # pool cancels what it holds, so a cell queued by a ``submit`` the interrupt
            # cut short (its future never returned) is cancelled too.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    for index in serial:
        one(index)
    matrix = assemble([results[i] for i in range(len(wanted))], seed=seed, jobs=jobs,
                      complete=not only, restartable=restart is not None)
    matrix["timing"] = {"wall_s": round(time.monotonic() - began, 2)}
    return matrix


def _run_cell(ctx: _Run, index: int, boundary: str, fault: str, kind: str) -> dict[str, Any]:
    base: dict[str, Any] = {"boundary": boundary, "fault": fault, "kind": kind,
                            "id": cell_id(boundary, fault, kind)}
    plan_of = script(boundary, fault, kind)
    if isinstance(plan_of, NotApplicable):
        return {**base, "status": NOT_APPLICABLE, "why": plan_of.reason}
    schema = f"cp_{ctx.token}_{index:03d}"
    idempotent = kind == IDEMPOTENT
    children: list[processes.WorkerProcess] = []
    began = time.monotonic()
    # Undone in reverse, each step even when an earlier one is cut short: an interrupt
    # that lands in the clean-up (a serial cell runs in the main thread) must not leave
    # the tool processes running.
    with contextlib.ExitStack() as undo:
        if not ctx.keep_schemas:
            undo.callback(edge.drop_schema, ctx.dsn, schema)
        db = undo.enter_context(store.Store.open(
            ctx.dsn, schema, create=True, keys=ctx.keys, max_connections=2,
            application_name="lab-crashpoints"))
        tools = toolprocesses.ToolProcess(ctx.dsn, schema, idempotent=idempotent,
                                          token=secrets.token_urlsafe(18),
                                          fenced_lookup=kind == NON_IDEMPOTENT_FENCED)
        undo.callback(tools.close)
        rig = crashlate.LateRig.start(plan_of.late, tools, ctx.dsn, plan_of.tool_flags)
        undo.callback(rig.close)
        undo.callback(_clean_up, children)
        cell = _drive(ctx, db, rig, children, plan_of, idempotent, base["id"])
        return {**base, **cell, "cell_s": round(time.monotonic() - began, 2)}


def _clean_up(children: list[processes.WorkerProcess]) -> None:
    """Kill and reap every child, each even when cleaning an earlier one is cut short."""
    with contextlib.ExitStack() as each:
        for child in children:
            each.callback(child.cleanup)


def _drive(
    ctx: _Run,
    db: store.Store,
    rig: crashlate.LateRig,
    children: list[processes.WorkerProcess],
    cell: Script,
    idempotent: bool,
    name: str,
) -> dict[str, Any]:
    """One cell: approve its workflow, run a worker through the cell's script (a
    reconciler after a prelude that leaves the workflow unknown) against its started tool,
    recover as an operator would, and judge the history."""
    jobs = [_approved_workflow(ctx, db, idempotent, name if index == 0 else f"{name}#{index}")
            for index in range(cell.workflows)]
    job = jobs[0]
    tools = rig.tools

    def spawn(label: str, *flags: str) -> processes.WorkerProcess:
        child = processes.spawn_worker(
            ctx.dsn, db.schema, rig.endpoint(), tools.token, label,
            "--lease", str(LEASE_S), "--heartbeat", str(HEARTBEAT_S),
            "--backoff", str(BACKOFF_S), *flags, keys=ctx.keys,
        )
        children.append(child)
        return child

    if cell.reconciler:
        # Prelude: the effect is committed, its reply lost, the workflow unknown.
        tools.current.send(toolprocesses.DROP_COMMAND)
        tools.current.wait_for(protocol.ARMED)
        prelude = spawn("prelude")
        prelude.finish(timeout=CELL_TIMEOUT_S)
        if db.get(job.id).state != "unknown":
            raise errors.CheckFailed(f"{name}: the prelude did not leave the workflow unknown")
    flags = (*cell.worker_flags, "--reconcile", job.id) if cell.reconciler else cell.worker_flags
    subject = spawn("reconciler" if cell.reconciler else "worker", *flags)
    finals: list[store.Workflow] = []
    actions: list[str] = []

    def recover() -> None:
        for each in jobs:
            final, done = crashrecovery.recover(db, tools, each.id)
            finals.append(final)
            actions.extend(done)

    try:
        fault_at, exits = _play(ctx, rig, subject, cell, recover)
    except TimeoutError as exc:
        # Name the cell and show both sides: a stall is the tool's or the worker's.
        said = " | ".join(subject.all_lines()[-8:]) or "(nothing)"
        raise TimeoutError(f"{name}: {exc}; {subject.name} alive={subject.alive()} said: "
                           f"{said}; {subject.name} {subject.tail()}") from exc
    if subject.alive():
        exits.append(crashrecovery.exit_code(subject))
    recovered_from = fault_at if fault_at is not None else time.monotonic()
    if not finals:
        recover()
    recovery_s = time.monotonic() - recovered_from
    reported = [line.split()[1] for child in children for line in child.all_lines()
                if line.startswith(f"{protocol.STAGE} ")] + rig.answering.stages()
    if rig.answering is not tools:
        reported += tools.stages()
    late = {} if cell.late is None else {"late": {"placement": cell.late,
                                                  "answers": rig.answers()}}
    return _judge(ctx, db, rig, name, reported, finals, {
        "recovery_s": round(recovery_s, 2), "recovery": actions, "process_exits": exits,
        **late,
    })


def _approved_workflow(
    ctx: _Run, db: store.Store, idempotent: bool, name: str
) -> store.Workflow:
    """The cell's workflow, created from a plan drawn from the cell's seed and approved."""
    rng = random.Random(f"{ctx.seed}:{name}")
    proposed = plan.Plan(
        version=plan.SUPPORTED_PLAN_VERSION, action=plan.ACTION,
        account=rng.choice(plan.ACCOUNTS),
        amount_minor=rng.randint(plan.MIN_AMOUNT_MINOR, plan.MAX_AMOUNT_MINOR),
        currency=plan.CURRENCY, idempotent=idempotent,
    )
    created = db.create(PROPOSER, f"crashpoint-{name}", proposed)
    return db.approve(APPROVER, created.id, created.fingerprint, APPROVAL_TTL)


def _play(
    ctx: _Run, rig: crashlate.LateRig, subject: processes.WorkerProcess,
    cell: Script, recover: Callable[[], None],
) -> tuple[float | None, list[int]]:
    """Run the cell's script against ``subject`` and the tool: when its first fault
    happened (None: no fault step) and the exit codes of the processes it ended.
    ``recover`` settles the cell's workflows (a late cell's script calls it mid-way)."""
    fault_at: float | None = None
    exits: list[int] = []
    tools = rig.answering  # the tool process the worker's request reaches
    for step in cell.steps:
        verb = step[0]
        if verb == WORKER_STAGE:
            subject.wait_for(f"{protocol.STAGE} {step[1]} ", timeout=CELL_TIMEOUT_S)
        elif verb == TOOL_STAGE:
            # A batch's step waits for each of its requests to reach the boundary.
            for _ in range(int(step[2]) if len(step) > 2 else 1):
                tools.current.wait_for(f"{protocol.STAGE} {step[1]} ", timeout=CELL_TIMEOUT_S)
        elif verb == KILL_WORKER:
            exits.append(subject.kill())
        elif verb in (WORKER_KILLED_ITSELF, WORKER_EXIT, LATE_TIMED_OUT):
            exits.append(crashrecovery.exit_code(subject))
        elif verb == HOLD_DATABASE_LINK:
            rig.hold_database_link()
        elif verb == RECOVER:
            recover()
        elif verb == DELIVER_LATE:
            rig.deliver()
        elif verb == LATE_ANSWERED:
            rig.wait_answered(cell.workflows, CELL_TIMEOUT_S)
        elif verb == RELEASE_WORKER:
            subject.release()
        elif verb == ARM_WORKER:
            subject.send(ARM_WORKER)
            subject.wait_for(f"{protocol.ARMED} {protocol.ARMED_SWITCHES}",
                             timeout=CELL_TIMEOUT_S)
        elif verb == RELEASE_TOOL:
            tools.current.release()
        elif verb == DROP_NEXT_REPLY:
            tools.current.send(toolprocesses.DROP_COMMAND)
            tools.current.wait_for(protocol.ARMED, timeout=CELL_TIMEOUT_S)
        elif verb == KILL_TOOL:
            tools.current.kill()
        elif verb == TOOL_DIED:
            crashrecovery.exit_code(tools.current)
        elif verb == RESTART_TOOL:
            tools.start()
        elif verb == RESTART_POSTGRES:
            assert ctx.restart is not None
            ctx.restart()
        else:  # pragma: no cover - the scripts above use only these verbs
            raise AssertionError(verb)
        if verb in FAULT_STEPS and fault_at is None:
            fault_at = time.monotonic()
    return fault_at, exits


def _judge(
    ctx: _Run, db: store.Store, rig: crashlate.LateRig, name: str,
    reported: list[str], finals: list[store.Workflow], recovery: dict[str, Any],
) -> dict[str, Any]:
    """The cell's result: its status from the invariants over its history and whether its
    boundary was reported, with what happened (``recovery``: time, actions, exits) and,
    over its workflows (several for a batch), their final states and how many wait for a
    person: the fault's blast radius."""
    boundary = boundary_of(name.split("/")[0])
    history = invariants.load(ctx.dsn, db.schema, open_result=ctx.keys.open)
    found = invariants.check(history)
    requests = rig.tools.requests()
    if rig.answering is not rig.tools:
        for kind, count in rig.answering.requests().items():
            requests[kind] = requests.get(kind, 0) + count
    waiting = [f for f in finals if f.state == "unknown" and f.review_reason]
    needs_person = bool(waiting)
    states = Counter(f.state for f in finals)
    final_state = finals[0].state if len(states) == 1 else ", ".join(
        f"{count} {state}" for state, count in sorted(states.items()))
    if found:
        status = VIOLATION
    elif boundary not in reported:
        status = NOT_REACHED
    else:
        status = PERSON if needs_person else AUTOMATIC
    return {
        "status": status,
        "reached": boundary in reported,
        "final_state": final_state,
        "attempts": max(f.attempt for f in finals),
        "needs_person": needs_person,
        "why": ", ".join(sorted({f.review_reason for f in waiting})),
        "workflows": len(finals),
        "waiting_for_person": len(waiting),
        "effects": len(history.effects),
        "tool_calls": requests.get("call", 0),
        "lookups": requests.get("lookup", 0),
        **recovery,
        "events": [e.kind for e in sorted(history.events, key=lambda e: e.seq)],
        # The same events with their workflow and detail: a batch's figure names each
        # workflow, and a manual review its reason.
        "history": [{"workflow": e.workflow_id, "kind": e.kind, "detail": e.detail}
                    for e in sorted(history.events, key=lambda e: e.seq)],
        "violations": [v.to_json() for v in found],
    }


# --------------------------------------------------------------------------- the matrix


def assemble(
    results: list[dict[str, Any]], *, seed: int, jobs: int, complete: bool,
    restartable: bool = True,
) -> dict[str, Any]:
    """The matrix document from its cells: coverage, counts by status, the fault table."""
    reached = sorted({boundary_of(c["boundary"]) for c in results if c.get("reached")},
                     key=protocol.NAMES.index)
    statuses = Counter(c["status"] for c in results)
    return {
        "format": FORMAT,
        "seed": seed,
        "jobs": jobs,
        "complete": complete,
        "lease_s": LEASE_S,
        "heartbeat_s": HEARTBEAT_S,
        "boundaries": [
            {"name": b.name, "path": b.path, "meaning": b.meaning} for b in protocol.BOUNDARIES
        ] + [{"name": row, "path": BATCH, "meaning": meaning} for row, _, meaning in BATCH_ROWS],
        "faults": [{"name": n, "meaning": m} for n, m in FAULTS
                   if restartable or n != POSTGRES_RESTART],
        "omitted_faults": [] if restartable else [{"name": POSTGRES_RESTART, "why": NO_RESTART}],
        "kinds": list(KINDS),
        "cells": results,
        "coverage": {
            "defined": len(protocol.NAMES),
            "reached": len(reached),
            "missing": [n for n in protocol.NAMES if n not in reached],
        },
        "summary": {status: statuses.get(status, 0) for status in
                    (AUTOMATIC, PERSON, VIOLATION, NOT_REACHED, NOT_APPLICABLE)},
        "violation_count": sum(len(c.get("violations", [])) for c in results),
    }


def print_summary(matrix: Mapping[str, Any]) -> None:
    """Print one row per cell, the coverage line and any violation."""
    from rich.console import Console
    from rich.table import Table

    # Wide enough for one line per cell in a CI log too (rich assumes 80 columns there).
    console = Console(width=max(Console().width, 150))
    table = Table(title="crash points: boundary / fault / tool kind")
    for column, justify in (("cell", "left"), ("outcome", "left"), ("effects", "right"),
                            ("calls", "right"), ("lookups", "right"), ("recovery", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    style = {AUTOMATIC: "green", PERSON: "yellow", VIOLATION: "bold red",
             NOT_REACHED: "bold red", NOT_APPLICABLE: "dim"}
    for cell in matrix["cells"]:
        text = (crashmatrix.outcome(cell) if cell["status"] != NOT_APPLICABLE
                else f"n/a: {cell['why']}")
        numbers = [str(cell.get(k, "")) for k in ("effects", "tool_calls", "lookups")]
        recovery = f"{cell['recovery_s']:.2f}s" if "recovery_s" in cell else ""
        table.add_row(cell["id"], f"[{style[cell['status']]}]{text}[/]", *numbers, recovery)
    console.print(table)
    coverage = matrix["coverage"]
    console.print(f"coverage: {coverage['reached']}/{coverage['defined']} boundaries reached"
                  + (f" (missing: {', '.join(coverage['missing'])})" if coverage["missing"]
                     else ""))
    for omitted in matrix.get("omitted_faults", []):
        console.print(f"fault column left out: {omitted['name']}: {omitted['why']}")
    for cell in matrix["cells"]:
        for violation in cell.get("violations", []):
            console.print(f"[red]{cell['id']}: {violation['kind']}[/red] {violation['detail']}")
    console.print(f"cells: {dict(matrix['summary'])}; violations: {matrix['violation_count']}; "
                  f"wall {matrix.get('timing', {}).get('wall_s')}s with {matrix['jobs']} jobs",
                  style="bold green" if crashmatrix.passed(matrix) else "bold red")


@dataclass(frozen=True)
class CrashpointsOptions:
    """What ``lab crashpoints`` is asked to do: its flags, declared here."""

    jobs: int = option(2, help="cells run in parallel")
    seed: int = option(17, help="seed of the cells' workloads")
    only: tuple[str, ...] = option(
        (), help="only cells whose id (boundary/fault/kind) starts with this")
    output: str = option("evidence/crashpoints.json", help="the matrix (JSON)")
    lab_postgres: str = providers.mode_option()


def cli_main(options: CrashpointsOptions) -> int:
    """Body of ``lab crashpoints``: provision PostgreSQL, run the matrix, print, write JSON.

    Exit 0 when every cell reached its boundary with no violation and every
    boundary is covered, 1 otherwise.
    """
    from rich.console import Console

    from lab.pg import cluster

    progress = Console(stderr=True)
    if not 1 <= options.jobs <= 16:
        raise errors.UsageError("--jobs must be between 1 and 16")
    if not any(cell_id(*c).startswith(options.only or ("",)) for c in cells()):
        raise errors.UsageError(f"--only {' '.join(options.only)} matches no cell")
    # Durable (fsync and synchronous commits on), as every run that crashes the server is.
    running = cluster.start(mode=options.lab_postgres, durable=True)
    try:
        database = running.provisioned.describe()
        restart = running.crash_restart if running.can_crash_restart else None
        progress.log(f"PostgreSQL {database.get('server_version')} via "
                     f"{database.get('provider')}; {options.jobs} jobs; server restarts "
                     f"{'on' if restart else 'impossible: no PostgreSQL column'}")
        matrix = run(running.provisioned.dsn, seed=options.seed, jobs=options.jobs,
                     only=list(options.only), log=progress.log, restart=restart)
    finally:
        running.stop()
    matrix["postgres"] = database
    print_summary(matrix)
    output = Path(options.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(crashmatrix.canonical_json(matrix))
    progress.log(f"matrix written to {output}")
    return 0 if crashmatrix.passed(matrix) else 1
