"""What the lab's processes say to each other, defined once.

Pure names, no I/O:

- the words of the line protocol a ``lab worker`` (and the tool process of
  ``lab crashpoints``) writes on stdout;
- the named durable boundaries of the worker's and the reconciler's paths,
  which a process reports as ``BOOK_STAGE <boundary> <subject> <fence>`` and at
  which ``lab crashpoints`` stops it dead; every boundary is here and nowhere
  else, so a boundary without a crash-point cell fails a test;
- the environment variables that carry the database and the tool token to a
  child process (never argv: both are secrets).

Boundary names keep the ``after_<step>`` form of the first two (``after_claim``,
``after_tool``), which the experiments and the book already use.
"""

from __future__ import annotations

from dataclasses import dataclass

# -- line protocol words (stdout of child processes) ---------------------------------

READY = "BOOK_READY"  # at a start gate: a newline on stdin releases it
STAGE = "BOOK_STAGE"  # BOOK_STAGE <boundary> <workflow or effect key> <fence>
DONE = "BOOK_DONE"  # the process finished its work and exits 0
ITEM = "BOOK_ITEM"  # BOOK_ITEM <workflow> <state> <fence>: a looping worker finished one item
SKIP = "BOOK_SKIP"  # BOOK_SKIP <error>: a looping worker gave up one item
LAUNCHED = "BOOK_LAUNCHED"  # a peer's queue runner is up (bench)
OBSERVATION = "BOOK_OBSERVATION"  # an experiment's observation, printed by the plugin
REQUEST = "BOOK_REQUEST"  # BOOK_REQUEST call|lookup: the tool process received one request
FAILED = "BOOK_FAILED"  # BOOK_FAILED <error type>: a peer's program failed (peer chapters)
ARMED = "BOOK_ARMED"  # BOOK_ARMED <fault>: the tool process armed a fault asked for on stdin
# BOOK_FENCED <effect key>: the tool process refused a request whose start a fenced lookup
# had closed (it never applies).
FENCED = "BOOK_FENCED"
# What a worker started with ``--armed-by-stdin`` says once a stdin line armed its switches.
ARMED_SWITCHES = "switches"

# How long a worker's tool client waits for a reply before the outcome is unknown (``lab
# worker --tool-timeout``): the client's timeout every late-write path is measured against.
TOOL_TIMEOUT_S = 5.0

# The detail of the ``reconciled`` event a fenced lookup's "absent" commits, followed by the
# fence it closed through: the proof the runtime, its checkers and the book read.
FENCED_ABSENT = "lookup=absent closed_through="

# -- environment of child processes ---------------------------------------------------

DSN_ENV = "BOOK_LAB_DSN"
TOKEN_ENV = "LAB_TOOL_TOKEN"  # noqa: S105 - a variable name, not a secret
# Every process of one run carries it (lab.leftovers finds what a run left behind by it).
RUN_MARKER_ENV = "LAB_RUN_MARKER"
# A private account chapter 8 runs a workflow with, so that a caller (CI) that knows it can
# search everything the run wrote for it; unset, the chapter draws a fresh one. It is
# never a literal in the source, because the book quotes the source.
CANARY_ACCOUNT_ENV = "LAB_CANARY_ACCOUNT"
# The file in an embedded cluster's directory that names the run which made it.
RUN_MARKER_FILE = "lab-run-marker"

# -- named durable boundaries -----------------------------------------------------------

WORKER = "worker"
TOOL = "tool"
RECONCILER = "reconciler"


@dataclass(frozen=True)
class Boundary:
    """One durable boundary: its name, whose path it is on, who reports it, what holds there."""

    name: str
    path: str  # WORKER, TOOL (inside the tool's request handling) or RECONCILER
    meaning: str


AFTER_CLAIM = "after_claim"
AFTER_BARRIER = "after_barrier"
AFTER_CLAIM_BARRIER = "after_claim_barrier"
AFTER_BATCH = "after_batch"
AFTER_REQUEST = "after_request"
AFTER_EFFECT = "after_effect"
AFTER_TOOL = "after_tool"
AFTER_COMPLETE = "after_complete"
AFTER_HEARTBEAT = "after_heartbeat"
AFTER_LOOKUP = "after_lookup"
AFTER_SETTLE = "after_settle"

BOUNDARIES: tuple[Boundary, ...] = (
    Boundary(AFTER_CLAIM, WORKER, "claim committed; no start barrier yet"),
    Boundary(AFTER_BARRIER, WORKER, "start barrier committed; request not yet sent"),
    Boundary(AFTER_CLAIM_BARRIER, WORKER,
             "claim and start barrier committed in one transaction (a looping worker's "
             "idempotent claim); request not yet sent"),
    Boundary(AFTER_BATCH, WORKER,
             "a batch committed in one transaction (a looping worker's --batch: several "
             "claims, idempotent ones with their start barriers, and the last batch's "
             "completions); no request of it sent yet"),
    Boundary(AFTER_REQUEST, TOOL, "request received by the tool; effect not yet committed"),
    Boundary(AFTER_EFFECT, TOOL, "tool effect committed; reply not yet sent"),
    Boundary(AFTER_TOOL, WORKER, "reply received; completion not yet committed"),
    Boundary(AFTER_COMPLETE, WORKER, "completion committed; worker not yet done"),
    Boundary(AFTER_HEARTBEAT, WORKER, "heartbeat committed: the lease was extended"),
    Boundary(AFTER_LOOKUP, RECONCILER, "lookup answered; settlement not yet committed"),
    Boundary(AFTER_SETTLE, RECONCILER, "settlement committed (found, requeued or review)"),
)
NAMES: tuple[str, ...] = tuple(b.name for b in BOUNDARIES)
# Reported by a worker process (``lab worker``), on its own path or as a reconciler.
PROCESS_STAGES: tuple[str, ...] = tuple(b.name for b in BOUNDARIES if b.path != TOOL)
# Reported from inside the tool service's request handling.
TOOL_STAGES: tuple[str, ...] = tuple(b.name for b in BOUNDARIES if b.path == TOOL)

# The most workflows a looping worker's step may have in flight (``lab worker --batch``,
# one open tool connection each); ``lab bench`` and ``lab chaos`` pass it on to their workers.
MAX_BATCH = 64
#: The most workflows a `lab worker --concurrency` keeps in flight (one thread each).
MAX_CONCURRENCY = 64


def boundary(name: str) -> Boundary:
    """The boundary called ``name``; ``KeyError`` for a name that is not one."""
    for candidate in BOUNDARIES:
        if candidate.name == name:
            return candidate
    raise KeyError(name)


def stage_line(stage: str, subject: str, fence: int) -> str:
    """The line a process writes when it reaches ``stage``."""
    return f"{STAGE} {stage} {subject} {fence}"
