"""The crash-point matrix's cells as scripts: for each (boundary, fault, tool kind),
the worker's flags, the tool's flags and the harness's steps, or why the cell cannot
happen. Pure data: ``lab.faults.crashpoints`` plays them on real processes.

``after_heartbeat`` is reached with the tool holding the request (a slow
tool), so the worker's heartbeats run. Heartbeats start with the claim, before the
request is sent, and under load one can come first: so the worker's switch at this
boundary (``--crash-at`` or ``--pause``) is armed through its stdin
(``lab worker --armed-by-stdin``) only once the tool reported ``after_request``. The
order is then certain: the tool holds the request until the script releases it, the
worker's call is blocked on it meanwhile, and its heartbeat thread keeps beating
(lease 1 s, beat 0.1 s), so the first heartbeat the armed switch acts on (the first
stage line after the worker's ``BOOK_ARMED``) is one with the request in the tool.
Reconciler boundaries are reached by a
``lab worker --reconcile`` process after a prelude worker left the workflow
``unknown`` with its effect committed (its reply lost). A cell that cannot
happen is recorded as not applicable with the reason, never left out, so
every boundary has a cell for every fault and tool kind (a test enforces it).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from lab import protocol
from lab.evidence import crashmatrix
from lab.runtime import store

WORKER_SIGKILL = "worker_sigkill"
REPLY_LOST = "reply_lost"
TOOL_RESTART = "tool_restart"
POSTGRES_RESTART = "postgres_restart"
LATE_REQUEST = "late_request"
FAULTS: tuple[tuple[str, str], ...] = (
    (WORKER_SIGKILL, "the process at the boundary is SIGKILLed"),
    (REPLY_LOST, "the next effect reply after the boundary is lost (effect committed)"),
    (TOOL_RESTART, "the tool process is SIGKILLed at the boundary, then restarted"),
    (LATE_REQUEST, "the effect request after the boundary is held past the client's timeout "
                   "(in the worker-tool link, in the tool, or in the tool-database link), "
                   "then delivered once recovery has settled the workflow"),
    (POSTGRES_RESTART, "the PostgreSQL postmaster is SIGKILLed at the boundary and restarted "
                       "on the same data (WAL recovery)"),
)
FAULT_NAMES: tuple[str, ...] = tuple(name for name, _ in FAULTS)
NO_RESTART = (
    "this run's PostgreSQL cannot be crash-restarted (only an embedded server the run "
    "started itself can): the column is left out"
)
IDEMPOTENT = "idempotent"
NON_IDEMPOTENT = crashmatrix.NON_IDEMPOTENT  # no fenced lookup: a person decides
NON_IDEMPOTENT_FENCED = crashmatrix.NON_IDEMPOTENT_FENCED  # offers the fenced lookup
KINDS: tuple[str, ...] = (IDEMPOTENT, NON_IDEMPOTENT, NON_IDEMPOTENT_FENCED)

# Where a late request is held (the LATE_REQUEST column), by the boundary it follows.
LATE_NETWORK = "worker_tool_link"  # a partitioned proxy between worker and tool
LATE_IN_TOOL = "in_the_tool"  # a slow tool holding it before its ledger
LATE_DATABASE = "tool_database_link"  # a partitioned proxy between tool and PostgreSQL
# Far below the default 5 s: each late cell the harness need not arm waits about this long
# for its timeout (the slow-tool cell, armed mid-way, keeps the full timeout).
LATE_CLIENT_TIMEOUT_S = 1.0

FORMAT = crashmatrix.FORMAT
AUTOMATIC = crashmatrix.AUTOMATIC
PERSON = crashmatrix.PERSON
VIOLATION = crashmatrix.VIOLATION
NOT_REACHED = crashmatrix.NOT_REACHED
NOT_APPLICABLE = crashmatrix.NOT_APPLICABLE

LEASE_S = 1.0
HEARTBEAT_S = 0.25
SLOW_TOOL_HEARTBEAT_S = 0.1
BACKOFF_S = 0.05
CELL_TIMEOUT_S = 60.0
APPROVAL_TTL = timedelta(hours=1)
PROPOSER = store.Actor("tenant-a", "employee-a", "proposer")
APPROVER = store.Actor("tenant-a", "manager-a", "approver")

# Steps of a cell's script. The ones marked as faults start the recovery clock.
WORKER_STAGE = "worker_stage"  # wait for the process to report the boundary
TOOL_STAGE = "tool_stage"  # wait for the tool to report the boundary
KILL_WORKER = "kill_worker"  # harness SIGKILL of the process (fault)
WORKER_KILLED_ITSELF = "worker_killed_itself"  # wait for its self-kill (fault)
WORKER_EXIT = "worker_exit"  # wait for the process to exit
RELEASE_WORKER = "release_worker"
ARM_WORKER = "arm_worker"  # arm the process's switches (--armed-by-stdin), wait for its answer
RELEASE_TOOL = "release_tool"
DROP_NEXT_REPLY = "drop_next_reply"  # (fault)
KILL_TOOL = "kill_tool"  # harness SIGKILL of the tool process (fault)
TOOL_DIED = "tool_died"  # wait for the tool's self-kill (fault)
RESTART_TOOL = "restart_tool"
RESTART_POSTGRES = "restart_postgres"  # SIGKILL the postmaster, restart it (fault)
HOLD_DATABASE_LINK = "hold_database_link"  # partition the late tool's database link
LATE_TIMED_OUT = "late_timed_out"  # wait for the process to give up on the held request (fault)
RECOVER = "recover"  # recover as an operator would, while the late request is still held
DELIVER_LATE = "deliver_late"  # heal the link or release the tool: the held request goes on
LATE_ANSWERED = "late_answered"  # wait for the tool to refuse or apply each late request
FAULT_STEPS = frozenset({KILL_WORKER, WORKER_KILLED_ITSELF, DROP_NEXT_REPLY, KILL_TOOL, TOOL_DIED,
                         RESTART_POSTGRES, LATE_TIMED_OUT})


@dataclass(frozen=True)
class Script:
    """How one cell is driven: the process's flags, the tool's flags, the harness's steps."""

    reconciler: bool
    worker_flags: tuple[str, ...]
    tool_flags: tuple[str, ...]
    steps: tuple[tuple[str, ...], ...]
    workflows: int = 1  # a batch's cells approve several; each must settle
    late: str | None = None  # where a LATE_REQUEST cell holds the request


@dataclass(frozen=True)
class NotApplicable:
    """A cell that cannot happen, and why."""

    reason: str


# How the harness gets a process to each boundary. A boundary added to ``lab.protocol``
# has no entry here until someone decides how its cells run: ``script`` raises
# ``KeyError`` for it and the coverage test fails.
BEFORE_CALL = "before_call"  # worker path, before the effect request is sent
IN_TOOL = "in_tool"  # inside the tool's request handling
AFTER_REPLY = "after_reply"  # worker path, the effect reply already in hand
SLOW_TOOL = "slow_tool"  # worker's heartbeat thread, while the tool holds the request
RECONCILING = "reconciling"  # a ``lab worker --reconcile`` process on an unknown workflow
BATCH = "batch"  # a ``--batch`` worker's step over several workflows, before any request
BATCH_IN_TOOL = "batch_in_tool"  # a ``--batch`` worker's requests, all held inside the tool
BATCH_SPLIT = "batch_split"  # a ``--batch`` worker's batch request, split by the tool's death

# Rows beyond the protocol's boundaries: a batch stopped after its requests were sent (the
# tool holds all of them at the boundary), which ``after_batch`` (before any request) is not;
# and a batch request the tool dies in after committing only its first items' effects.
BATCH_AFTER_REQUEST = f"batch_{protocol.AFTER_REQUEST}"
BATCH_AFTER_EFFECT = f"batch_{protocol.AFTER_EFFECT}"
BATCH_SPLIT_AFTER_EFFECT = f"batch_split_{protocol.AFTER_EFFECT}"
BATCH_ROWS: tuple[tuple[str, str, str], ...] = (
    (BATCH_AFTER_REQUEST, protocol.AFTER_REQUEST,
     "a --batch worker's requests all received by the tool; no effect of them committed"),
    (BATCH_AFTER_EFFECT, protocol.AFTER_EFFECT,
     "a --batch worker's requests all received and their effects committed; no reply sent"),
    (BATCH_SPLIT_AFTER_EFFECT, protocol.AFTER_EFFECT,
     "a --batch worker's batch request received; the tool committed its first item's effect "
     "and died before the others' and before any reply"),
)
_ROW_BOUNDARY = {row: boundary for row, boundary, _ in BATCH_ROWS}


def rows() -> tuple[str, ...]:
    """The matrix's rows: every boundary ``lab.protocol`` names, then the batch rows."""
    return (*protocol.NAMES, *(row for row, _, _ in BATCH_ROWS))


def boundary_of(row: str) -> str:
    """The protocol boundary a matrix row stops at (a batch row's is its plain row's)."""
    return _ROW_BOUNDARY.get(row, row)


REACH: dict[str, str] = {
    BATCH_AFTER_REQUEST: BATCH_IN_TOOL,
    BATCH_AFTER_EFFECT: BATCH_IN_TOOL,
    BATCH_SPLIT_AFTER_EFFECT: BATCH_SPLIT,
    protocol.AFTER_CLAIM: BEFORE_CALL,
    protocol.AFTER_BARRIER: BEFORE_CALL,
    protocol.AFTER_CLAIM_BARRIER: BEFORE_CALL,
    protocol.AFTER_BATCH: BATCH,
    protocol.AFTER_REQUEST: IN_TOOL,
    protocol.AFTER_EFFECT: IN_TOOL,
    protocol.AFTER_TOOL: AFTER_REPLY,
    protocol.AFTER_COMPLETE: AFTER_REPLY,
    protocol.AFTER_HEARTBEAT: SLOW_TOOL,
    protocol.AFTER_LOOKUP: RECONCILING,
    protocol.AFTER_SETTLE: RECONCILING,
}


# Only a looping ``--fused`` worker commits a claim with its start barrier; one item is
# enough to reach the boundary (and ``--max-items`` stops it retrying a dead tool).
FUSED_FLAGS = ("--loop", "--fused", "--max-items", "1", "--idle-exit", "1")
# A batch's cells: one step claims all of them (with barriers when idempotent) and has them
# in flight together, so the fault meets every workflow of the batch at once.
BATCH_SIZE = 3
BATCH_FLAGS = ("--loop", "--fused", "--batch", str(BATCH_SIZE), "--max-items", str(BATCH_SIZE),
               "--idle-exit", "1")


def script(boundary: str, fault: str, kind: str) -> Script | NotApplicable:
    """The script of the cell (``boundary``, ``fault``, ``kind``), or why there is none.

    Raises ``KeyError`` for a boundary, fault or kind this module does not know:
    a boundary added to ``lab.protocol`` without a cell here fails the coverage test.
    """
    reach = REACH[boundary]
    if fault not in FAULT_NAMES or kind not in KINDS:
        raise KeyError(f"{fault}/{kind}")
    if boundary == protocol.AFTER_LOOKUP and kind == NON_IDEMPOTENT:
        return NotApplicable(
            "a non-idempotent tool has no authoritative lookup: the reconciler never asks, "
            "it records a review"
        )
    borrowed = _borrowed(boundary, fault, kind)
    if borrowed is not None:
        return borrowed
    if reach == BATCH_IN_TOOL:
        return _batch_in_tool(boundary_of(boundary), fault)
    if reach == BATCH_SPLIT:
        return _batch_split(fault)
    if fault == LATE_REQUEST:
        return _late(boundary, reach)
    reconciler = reach == RECONCILING
    slow_tool = ("--pause", protocol.AFTER_REQUEST)
    # The heartbeat switch is armed only once the tool holds the request (see above).
    fast_beats = ("--heartbeat", str(SLOW_TOOL_HEARTBEAT_S), "--armed-by-stdin")
    held = ((TOOL_STAGE, protocol.AFTER_REQUEST), (ARM_WORKER,))
    pause = ("--pause", boundary)
    if fault == WORKER_SIGKILL:
        if reach == IN_TOOL:
            return Script(False, (), ("--pause", boundary), (
                (TOOL_STAGE, boundary), (KILL_WORKER,), (RELEASE_TOOL,)))
        if reach == SLOW_TOOL:
            return Script(False, ("--crash-at", boundary, *fast_beats), slow_tool, (
                *held, (WORKER_KILLED_ITSELF,), (RELEASE_TOOL,)))
        return Script(reconciler, ("--crash-at", boundary), (), ((WORKER_KILLED_ITSELF,),))
    if fault == REPLY_LOST:
        if reach == BEFORE_CALL:
            return Script(False, pause, (), (
                (WORKER_STAGE, boundary), (DROP_NEXT_REPLY,), (RELEASE_WORKER,), (WORKER_EXIT,)))
        if reach == IN_TOOL:
            return Script(False, (), ("--pause", boundary), (
                (TOOL_STAGE, boundary), (DROP_NEXT_REPLY,), (RELEASE_TOOL,), (WORKER_EXIT,)))
        if reach == SLOW_TOOL:
            return Script(False, (*pause, *fast_beats), slow_tool, (
                *held, (WORKER_STAGE, boundary), (DROP_NEXT_REPLY,), (RELEASE_TOOL,),
                (RELEASE_WORKER,), (WORKER_EXIT,)))
        if boundary == protocol.AFTER_TOOL:
            return NotApplicable("the reply has already arrived at this boundary")
        return NotApplicable("no effect reply follows this boundary")
    if fault == POSTGRES_RESTART:
        if reach == IN_TOOL:
            return Script(False, (), ("--pause", boundary), (
                (TOOL_STAGE, boundary), (RESTART_POSTGRES,), (RELEASE_TOOL,), (WORKER_EXIT,)))
        if reach == SLOW_TOOL:
            return Script(False, (*pause, *fast_beats), slow_tool, (
                *held, (WORKER_STAGE, boundary), (RESTART_POSTGRES,), (RELEASE_TOOL,),
                (RELEASE_WORKER,), (WORKER_EXIT,)))
        return Script(reconciler, pause, (), (
            (WORKER_STAGE, boundary), (RESTART_POSTGRES,), (RELEASE_WORKER,), (WORKER_EXIT,)))
    # TOOL_RESTART
    if reach == IN_TOOL:
        return Script(False, (), ("--die-at", boundary), (
            (TOOL_DIED,), (WORKER_EXIT,), (RESTART_TOOL,)))
    if reach == SLOW_TOOL:
        return Script(False, (*pause, *fast_beats), slow_tool, (
            *held, (WORKER_STAGE, boundary), (KILL_TOOL,),
            (RELEASE_WORKER,), (WORKER_EXIT,), (RESTART_TOOL,)))
    return Script(reconciler, pause, (), (
        (WORKER_STAGE, boundary), (KILL_TOOL,), (RELEASE_WORKER,), (WORKER_EXIT,),
        (RESTART_TOOL,)))


def _late(boundary: str, reach: str) -> Script | NotApplicable:
    """A LATE_REQUEST cell: the request after ``boundary`` is held past the worker's client
    timeout, where that boundary puts it, and let go only once recovery has settled the
    workflow (so a fenced lookup, if the tool offers one, has closed its start)."""
    timeout = ("--tool-timeout", str(LATE_CLIENT_TIMEOUT_S))
    after = ((LATE_TIMED_OUT,), (RECOVER,), (DELIVER_LATE,), (LATE_ANSWERED,))
    if reach == BEFORE_CALL:
        # The worker's link to the tool is cut from the start: its request waits in it.
        return Script(False, timeout, (), ((WORKER_STAGE, boundary), *after), late=LATE_NETWORK)
    if boundary == protocol.AFTER_REQUEST:
        # In the tool, the write's statement waits in the cut link to its database.
        return Script(False, timeout, ("--pause", boundary), (
            (TOOL_STAGE, boundary), (HOLD_DATABASE_LINK,), (RELEASE_TOOL,), *after),
            late=LATE_DATABASE)
    if reach == SLOW_TOOL:
        # A slow tool holds the request before its ledger while the heartbeats run. The
        # harness arms the worker once the tool holds the request, and must do so before
        # the worker gives up on it: this cell keeps the client's full timeout, as every
        # other slow-tool cell does (with 1 s a loaded run saw the worker exit first).
        slow = ("--tool-timeout", str(protocol.TOOL_TIMEOUT_S))
        return Script(False, ("--pause", boundary, "--heartbeat", str(SLOW_TOOL_HEARTBEAT_S),
                              "--armed-by-stdin", *slow),
                      ("--pause", protocol.AFTER_REQUEST), (
            (TOOL_STAGE, protocol.AFTER_REQUEST), (ARM_WORKER,), (WORKER_STAGE, boundary),
            (RELEASE_WORKER,), *after), late=LATE_IN_TOOL)
    if boundary == protocol.AFTER_EFFECT:
        return NotApplicable("the effect is committed before the reply: nothing is left for a "
                             "late request to write (a late reply is the reply_lost column)")
    if reach == AFTER_REPLY:
        return NotApplicable("the reply has arrived: no request is left to arrive late")
    return NotApplicable("the reconciler sends no effect request: its fenced lookup is what "
                         "a late request meets")


def _batch_in_tool(boundary: str, fault: str) -> Script | NotApplicable:
    """A batch row's cell: a ``--batch`` worker's requests all held by the tool at
    ``boundary`` (so every one of them was sent), then the fault."""
    tool = ("--pause", boundary, "--hold-count", str(BATCH_SIZE))
    held = (TOOL_STAGE, boundary, str(BATCH_SIZE))
    if fault == WORKER_SIGKILL:
        steps: tuple[tuple[str, ...], ...] = (held, (KILL_WORKER,), (RELEASE_TOOL,))
    elif fault == REPLY_LOST:
        steps = (held, (DROP_NEXT_REPLY,), (RELEASE_TOOL,), (WORKER_EXIT,))
    elif fault == TOOL_RESTART:
        steps = (held, (KILL_TOOL,), (WORKER_EXIT,), (RESTART_TOOL,))
    elif fault == POSTGRES_RESTART:
        steps = (held, (RESTART_POSTGRES,), (RELEASE_TOOL,), (WORKER_EXIT,))
    elif boundary == protocol.AFTER_EFFECT:
        return NotApplicable("the effects are committed before the replies: nothing is left "
                             "for a late request to write")
    else:
        return Script(False, (*BATCH_FLAGS, "--tool-timeout", str(LATE_CLIENT_TIMEOUT_S)), tool,
                      (held, (LATE_TIMED_OUT,), (RECOVER,), (DELIVER_LATE,), (LATE_ANSWERED,)),
                      workflows=BATCH_SIZE, late=LATE_IN_TOOL)
    return Script(False, BATCH_FLAGS, tool, steps, workflows=BATCH_SIZE)


# How many of a split batch's items the tool commits before it dies (``--fail-before``).
SPLIT_WRITTEN = 1


def _batch_split(fault: str) -> Script | NotApplicable:
    """The split batch's row: the tool commits the first of the batch's items and SIGKILLs
    itself before the others and before any reply; then it restarts. Only the tool's death
    splits a batch, so the other columns are the ``batch_after_effect`` row's."""
    if fault == TOOL_RESTART:
        return Script(False, BATCH_FLAGS, ("--fail-before", str(SPLIT_WRITTEN)), (
            (TOOL_DIED,), (WORKER_EXIT,), (RESTART_TOOL,)), workflows=BATCH_SIZE)
    reasons = {
        WORKER_SIGKILL: "the split is the tool's own death; a worker killed with its batch "
                        "in the tool is the batch_after_effect row's cell",
        REPLY_LOST: "the tool dies before answering: no reply is left to lose",
        LATE_REQUEST: "the request has reached the tool, which dies in it: nothing is left "
                      "in flight to arrive late (the unwritten items die with the process)",
        POSTGRES_RESTART: "the split is the tool's own death; a server restart with the "
                          "batch's effects committed is the batch_after_effect row's cell",
    }
    return NotApplicable(reasons[fault])


def _borrowed(boundary: str, fault: str, kind: str) -> Script | NotApplicable | None:
    """The cells of the looping worker's own boundaries, borrowed from the plain ones
    they stand in for (None for any other boundary)."""
    if boundary == protocol.AFTER_BATCH:
        # Before any barrier of a non-idempotent batch and before any request of either
        # kind, as after a claim: the same scripts, with the batch's worker and workflows.
        found = script(protocol.AFTER_CLAIM, fault, kind)
        if isinstance(found, NotApplicable):
            return found
        return Script(found.reconciler,
                      (*BATCH_FLAGS, *_renamed(found.worker_flags, protocol.AFTER_CLAIM,
                                               boundary)),
                      found.tool_flags,
                      tuple(_renamed(step, protocol.AFTER_CLAIM, boundary)
                            for step in found.steps),
                      workflows=BATCH_SIZE, late=found.late)
    if boundary == protocol.AFTER_CLAIM_BARRIER:
        if kind != IDEMPOTENT:
            return NotApplicable(
                "a non-idempotent claim is never fused with its start barrier: they commit "
                "apart (after_claim, after_barrier), so a crash between keeps the proof that "
                "nothing was dispatched"
            )
        found = script(protocol.AFTER_BARRIER, fault, kind)
        if isinstance(found, NotApplicable):
            return found
        flags = _renamed(found.worker_flags, protocol.AFTER_BARRIER, boundary)
        steps = tuple(_renamed(step, protocol.AFTER_BARRIER, boundary) for step in found.steps)
        return Script(found.reconciler, (*FUSED_FLAGS, *flags), found.tool_flags, steps,
                      late=found.late)
    return None


def _renamed(words: tuple[str, ...], old: str, new: str) -> tuple[str, ...]:
    """``words`` with the boundary ``old`` named ``new`` (a script borrowed from another)."""
    return tuple(new if word == old else word for word in words)


def missing_cells() -> list[str]:
    """Cells of the matrix with neither a script nor a reason they cannot happen."""
    missing = []
    for boundary, fault, kind in cells():
        try:
            found = script(boundary, fault, kind)
        except KeyError:
            missing.append(cell_id(boundary, fault, kind))
            continue
        if isinstance(found, NotApplicable) and not found.reason.strip():
            missing.append(cell_id(boundary, fault, kind))
    return missing


def cells() -> list[tuple[str, str, str]]:
    """Every (row, fault, kind) of the matrix, in table order: a row is a boundary, or a
    batch stopped at one (``BATCH_ROWS``)."""
    return [(b, f, k) for b in rows() for f in FAULT_NAMES for k in KINDS]


def cell_id(boundary: str, fault: str, kind: str) -> str:
    """The cell's name in the JSON and on the command line."""
    return f"{boundary}/{fault}/{kind}"
