"""Workers as real OS processes, and the handle an experiment uses to drive one.

The child speaks a line protocol on stdout (the words are in ``lab.protocol``):
``BOOK_READY`` at its start gate, ``BOOK_STAGE <boundary> <workflow> <fence>`` at
each named boundary, ``BOOK_DONE`` at the end. A newline on stdin releases a
pause. SIGKILL ends it mid-window, which is the point: no cleanup code runs,
exactly as in a real crash. ``--crash-at BOUNDARY`` is the self-kill switch:
the child SIGKILLs itself the moment it reports that boundary. With
``--armed-by-stdin`` both switches act only once a line on stdin armed them (the
child answers ``BOOK_ARMED switches``): the experiment decides when a boundary that
recurs (a heartbeat) may stop the process, so the order it needs is created, not hoped for.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import IO

from lab import budget, errors, protocol
from lab.options import option
from lab.runtime import backoff, egress, forkserver, sealing, store, toolclient, worker

# Worker sessions are named this prefix plus the worker's name (chaos finds their backends).
WORKER_APP_PREFIX = "lab-worker:"
# How long a worker waits for a lost database (failures in a row) before it gives up.
DB_PATIENCE_S = 60.0
# The lab programs a child may be forked as (``python -m MODULE``), each with its entry
# point: what its ``__main__`` block calls with the command line's arguments.
FORKED = {"lab.cli": "main", "lab.runtime.toolprocess": "serve_main"}
# What the fork server imports before it forks: what this module may import itself (the
# runtime and below; the tool process brings the command-line parser), never a program of
# a higher floor: a ``lab.cli`` child imports that module after its fork.
PRELOAD = ("lab.runtime.processes", "lab.runtime.toolprocess")


def forked(argv: list[str], env: dict[str, str]) -> forkserver.Child | None:
    """``argv`` forked from this process's fork server (see ``FORKED`` and ``PRELOAD``), or
    None when it cannot be (the caller execs instead)."""
    return forkserver.spawn(argv, env, FORKED, PRELOAD,
                            name=command_name(argv[2], argv[3:]) if len(argv) > 2 else "")


def command_name(module: str, args: list[str]) -> str:
    """The name a forked child shows in ``/proc/PID/comm`` (at most 15 bytes): ``lab
    worker`` for ``lab.cli worker ...``, the module's last part otherwise."""
    if module == "lab.cli" and args:
        return f"lab {args[0]}"[:15]
    return module.rsplit(".", 1)[-1][:15]


@dataclass(frozen=True)
class WorkerOptions:
    """What ``lab worker`` is asked to do: its flags, declared here (times in seconds)."""

    schema: str = option(help="the experiment's isolated schema")
    tool: str = option(help="loopback tool endpoint")
    name: str = option("worker-process", help="owner name for claims")
    pause: str | None = option(None, help="wait for a stdin newline at this boundary",
                               choices=protocol.PROCESS_STAGES)
    crash_at: str | None = option(
        None, help="SIGKILL itself the moment it reaches this boundary",
        choices=protocol.PROCESS_STAGES)
    armed_by_stdin: bool = option(
        False, help="--crash-at and --pause act once a stdin line armed them")
    start_gate: bool = option(False, help="wait for a stdin newline")
    reconcile: str | None = option(None, help="reconcile this unknown workflow first")
    lease: float = option(3.0, help="lease seconds")
    loop: bool = option(False, help="keep running items until idle for --idle-exit")
    idle_exit: float = option(2.0, help="seconds idle before exit")
    max_items: int = option(0, help="stop after N items (0: none)")
    heartbeat: float = option(0.5, help="heartbeat seconds")
    backoff: float = option(0.1, help="429 backoff seconds")
    tool_timeout: float = option(
        protocol.TOOL_TIMEOUT_S,
        help="seconds to wait for the tool's reply before its outcome is unknown")
    fused: bool = option(
        False, help="with --loop: complete each item in the next claim's transaction, and "
                    "commit an idempotent claim with its start barrier (boundary "
                    "after_claim_barrier)")
    quiet: bool = option(
        False, help=f"print no {protocol.STAGE} or {protocol.ITEM} lines (a production "
                    "worker: --crash-at and --pause still act at their boundary)")
    batch: int = option(
        1, help="with --fused: claim up to N items per transaction and send their requests "
                "together (boundary after_batch); a crash leaves all N to recovery")
    concurrency: int = option(
        1, help="with --loop: keep N items in flight, one per thread, each with its own "
                "claim, barrier and completion transactions (owner NAME.K); a crash leaves "
                "all N to recovery, a refused transaction one")


MAX_TOOL_TIMEOUT_S = 300.0

# One line at a time on stdout, from every slot and heartbeat thread (and nothing after a
# self-kill decision: the hook holds it while it kills).
_SAY = threading.Lock()


def _say(line: str) -> None:
    with _SAY:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _usage(options: WorkerOptions) -> str | None:
    """Why these flags cannot run together, or None."""
    if not 0 < options.tool_timeout <= MAX_TOOL_TIMEOUT_S:
        return f"--tool-timeout must be above 0 and at most {MAX_TOOL_TIMEOUT_S:g} seconds"
    if not 1 <= options.batch <= protocol.MAX_BATCH:
        return f"--batch must be between 1 and {protocol.MAX_BATCH}"
    if options.batch > 1 and not (options.fused and options.loop):
        return "--batch needs --loop and --fused"
    if not 1 <= options.concurrency <= protocol.MAX_CONCURRENCY:
        return f"--concurrency must be between 1 and {protocol.MAX_CONCURRENCY}"
    if options.concurrency > 1:
        if not options.loop:
            return "--concurrency needs --loop"
        if options.batch > 1:
            return "--concurrency and --batch are alternatives (own or shared transactions)"
        if options.max_items > 0:
            return "--max-items counts one loop's items: not with --concurrency"
    return None


def _runners(options: WorkerOptions, db: store.Store, client: toolclient.ToolClient,
             hook: Callable[[str, store.Workflow], None]) -> list[worker.Worker]:
    """One ``worker.Worker`` per ``--concurrency`` slot, sharing the store, the client and
    the clock of lease-recovery sweeps."""
    sweeps = worker.Sweeps()
    return [
        worker.Worker(
            db=db,
            client=client,
            name=_slot_name(options.name, slot, options.concurrency),
            lease=timedelta(seconds=options.lease),
            heartbeat_every=timedelta(seconds=options.heartbeat),
            backoff=timedelta(seconds=options.backoff),
            hook=hook,
            fused=options.fused,
            batch=options.batch,
            sweeps=sweeps,
        )
        for slot in range(options.concurrency)
    ]


def worker_main(options: WorkerOptions) -> int:
    """Body of ``lab worker``: optionally reconcile one workflow, then run one item (or,
    with ``--loop``, items until idle, in ``--concurrency`` slots)."""
    refusal = _usage(options)
    if refusal is not None:
        print(f"lab worker: {refusal}", file=sys.stderr)
        return 2
    egress.install()
    dsn = os.environ.get(protocol.DSN_ENV, "")
    token = os.environ.get(protocol.TOKEN_ENV, "")
    if not dsn or not token:
        print(
            f"lab worker needs {protocol.DSN_ENV} and {protocol.TOKEN_ENV} in its environment",
            file=sys.stderr,
        )
        return 2
    crash_at = options.crash_at
    # The switches (--crash-at, --pause) act from the start, or once stdin armed them.
    armed = threading.Event()
    if not options.armed_by_stdin:
        armed.set()

    def wait_for_newline() -> None:
        sys.stdin.readline()

    def arm() -> None:
        wait_for_newline()
        # Under the lock that orders stage lines: every line after BOOK_ARMED was acted on.
        with _SAY:
            armed.set()
            sys.stdout.write(f"{protocol.ARMED} {protocol.ARMED_SWITCHES}\n")
            sys.stdout.flush()

    def hook(stage: str, claim: store.Workflow) -> None:
        # Heartbeat threads and slots report too: one line at a time.
        with _SAY:
            acting = armed.is_set()
            if not options.quiet:
                sys.stdout.write(protocol.stage_line(stage, claim.id, claim.fence) + "\n")
                sys.stdout.flush()
            if acting and crash_at == stage:
                # Stop dead at the boundary: no other thread runs another line.
                os.kill(os.getpid(), signal.SIGKILL)
        if acting and options.pause == stage:
            wait_for_newline()

    try:
        with _open_store(dsn, options.schema, options.name,
                         connections=_connections(options.concurrency)) as db, \
                toolclient.ToolClient(options.tool, token, timeout=options.tool_timeout) as client:
            runners = _runners(options, db, client, hook)
            if options.start_gate:
                _say(protocol.READY)
                wait_for_newline()
            if options.armed_by_stdin:
                # After the start gate: one reader of stdin at a time.
                threading.Thread(target=arm, name="arm", daemon=True).start()
            if options.reconcile:
                runners[0].reconcile(options.reconcile)
            if options.loop and len(runners) > 1:
                _slots(runners, idle_exit=options.idle_exit, quiet=options.quiet)
            elif options.loop:
                _loop(runners[0], idle_exit=options.idle_exit, max_items=options.max_items,
                      quiet=options.quiet)
            else:
                runners[0].run_one()
    except errors.LabError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    _say(protocol.DONE)
    return 0


# A slot holds a connection only inside a transaction (the tool's request is made without
# one), so a few serve many slots; their heartbeat threads share them too.
MAX_SLOT_CONNECTIONS = 8


def _connections(concurrency: int) -> int:
    """The pool's size for ``concurrency`` slots: two for one, at most a few more."""
    return 2 if concurrency <= 1 else min(concurrency + 1, MAX_SLOT_CONNECTIONS)


def _slot_name(name: str, slot: int, concurrency: int) -> str:
    """Each slot claims under its own owner name (``NAME.K``); a lone slot under ``NAME``."""
    return name if concurrency <= 1 else f"{name}.{slot}"


def _slots(runners: list[worker.Worker], *, idle_exit: float, quiet: bool) -> None:
    """``lab worker --concurrency N``: N loops in threads, each its own workflow in flight
    with its own claim, barrier and completion transactions (a transaction carries one
    workflow's claim or completion, never a shared batch); together until each is idle.

    A slot that gives up (the database away past ``DB_PATIENCE_S``) ends; the first such
    error is raised once every slot has ended. A crash (``--crash-at``) kills the process
    with every slot's workflow in flight: each is left to recovery, as one worker's is.
    """
    failures: list[errors.LabError] = []

    def run(runner: worker.Worker) -> None:
        try:
            _loop(runner, idle_exit=idle_exit, max_items=0, quiet=quiet)
        except errors.LabError as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(runner,), name=f"slot-{runner.name}",
                                daemon=True) for runner in runners]
    for thread in threads:
        thread.start()
    for thread in threads:
        # Each loop ends by itself (idle, or the database's patience spent): no deadline
        # here that a slow drain could hit.
        thread.join()
    if failures:
        raise failures[0]


def _open_store(dsn: str, schema: str, name: str, *, connections: int = 2) -> store.Store:
    """Connect, riding out a database that is away (restarting) with jittered backoff."""
    patience = backoff.Backoff(patience=DB_PATIENCE_S)
    while True:
        try:
            return store.Store.open(
                dsn, schema, max_connections=connections,
                application_name=f"{WORKER_APP_PREFIX}{name}",
            )
        except errors.StoreError:
            if patience.exhausted:
                raise
            time.sleep(patience.failed())


def _loop(
    runner: worker.Worker, *, idle_exit: float, max_items: int, quiet: bool = False
) -> None:
    """Run items until none was due for ``idle_exit`` seconds (or ``max_items`` ran).

    A stale fence, a manual-review decision, a tool failure or a lost database
    connection ends one item, not the loop: the database has already refused or
    recorded what it must, and the pool replaces a terminated backend. A database
    that is away is waited for with bounded, jittered backoff (its outage does not
    count as idle time) until ``DB_PATIENCE_S`` of failures in a row.
    """
    done = 0
    idle_since = time.monotonic()
    lost = backoff.Backoff(patience=DB_PATIENCE_S)
    while max_items <= 0 or done < max_items:
        try:
            items = _items(runner, left=max_items - done if max_items > 0 else None)
            lost.reset()
        except errors.StoreError as exc:
            _say(f"{protocol.SKIP} {type(exc).__name__}")
            if lost.exhausted:
                raise
            time.sleep(lost.failed())
            idle_since = time.monotonic()
            continue
        except (errors.Stale, errors.ManualReview, errors.ToolError) as exc:
            _say(f"{protocol.SKIP} {type(exc).__name__}")
            items = []
            idle_since = time.monotonic()
        for item in items:
            done += 1
            if not quiet:
                _say(f"{protocol.ITEM} {item.id} {item.state} {item.fence}")
            idle_since = time.monotonic()
        if items or runner.pending:
            continue
        if time.monotonic() - idle_since >= idle_exit:
            return
        time.sleep(0.02)
    # ``max_items`` ran: a fused worker still owes the last one's completion.
    for item in runner.flush():
        if not quiet:
            _say(f"{protocol.ITEM} {item.id} {item.state} {item.fence}")


def _items(runner: worker.Worker, *, left: int | None) -> list[store.Workflow]:
    """One round of the loop: a fused ``step`` claiming no more than the ``left`` items
    allowed (a ``flush`` when the pending ones use them all), or one ``run_one``."""
    if runner.fused:
        if left is None:
            return runner.step()
        room = left - runner.pending
        return runner.step(limit=room) if room > 0 else runner.flush()
    item = runner.run_one()
    return [] if item is None else [item]


class WorkerProcess:
    """A running ``lab worker`` child, with its stdout lines in a queue."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        name: str,
        on_event: Callable[[str, str], None] | None = None,
        *,
        fork: bool = True,
    ):
        """Start ``argv`` with ``env``; ``fork``: from the fork server when it can be."""
        self.name = name
        self._on_event = on_event or (lambda actor, what: None)
        self.started = time.monotonic()
        # Forked from the warm fork server where there is one (half a second of start-up
        # CPU less per child), else exec'd; either way a real process with its own pipes.
        self._proc: subprocess.Popen[str] | forkserver.Child = (
            forked(argv, env) if fork else None
        ) or subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._stderr: list[str] = []
        assert self._proc.stdout is not None
        assert self._proc.stderr is not None
        try:
            self._readers = [
                threading.Thread(target=self._pump, args=(self._proc.stdout,), daemon=True),
                threading.Thread(target=self._drain, args=(self._proc.stderr,), daemon=True),
            ]
            for reader in self._readers:
                reader.start()
        except BaseException:
            # Interrupted before the caller holds this object: nobody else could end it.
            self._proc.kill()
            raise

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            self._stderr.append(line)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    @property
    def stderr(self) -> str:
        """What the child wrote to stderr so far."""
        return "".join(self._stderr)

    def alive(self) -> bool:
        """True while the child has not exited."""
        return self._proc.poll() is None

    def wait_for(self, prefix: str, timeout: float = 15.0) -> str:
        """Return the next stdout line starting with ``prefix``; fail on exit or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.name}: no {prefix!r} within {timeout}s; {self.tail()}")
            try:
                with budget.waiting(f"{self.name} to say {prefix!r}"):
                    line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                self._proc.wait(timeout=5)
                raise AssertionError(
                    f"{self.name} exited ({self._proc.returncode}) before {prefix!r}; "
                    f"{self.tail()}"
                )
            self.seen.append(line)
            if line.startswith(prefix):
                self._on_event(self.name, line.split(" wf_")[0])
                return line

    def release(self) -> None:
        """Write the newline that releases a start gate or a pause."""
        assert self._proc.stdin is not None
        self._proc.stdin.write("\n")
        self._proc.stdin.flush()
        self._on_event("experiment", f"release {self.name}")

    def all_lines(self) -> list[str]:
        """Every stdout line so far, the ones ``wait_for`` passed over included.

        Moves what is queued into ``seen``: call it once the waiting is over.
        """
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return list(self.seen)
            if line is not None:
                self.seen.append(line)

    def send(self, line: str) -> None:
        """Write one command line to the child's stdin."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"{line}\n")
        self._proc.stdin.flush()

    def finish(self, timeout: float = 30.0, expect_exit: int | None = 0) -> int:
        """Wait for the child to exit and return its exit code.

        Raise (with the child's stderr) unless the code is ``expect_exit``: 0 for a
        clean run, 1 for a worker that stopped on a lab error such as ``ManualReview``
        (its stderr names it), ``None`` to accept any code.
        """
        try:
            code = self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"{self.name} did not exit within {timeout}s") from exc
        for reader in self._readers:
            reader.join(timeout=5)
        if expect_exit is not None and code != expect_exit:
            raise AssertionError(
                f"{self.name} exited {code}, expected {expect_exit}; {self.tail()}"
            )
        self._on_event(self.name, f"exited {code}")
        return code

    def kill(self) -> int:
        """SIGKILL the child and reap it; returns the (negative) return code."""
        self._on_event("experiment", f"SIGKILL {self.name}")
        self._proc.send_signal(signal.SIGKILL)
        code = self._proc.wait(timeout=10)
        for reader in self._readers:
            reader.join(timeout=5)
        self._on_event(self.name, f"killed (exit {code})")
        return code

    def cleanup(self) -> int:
        """Kill the child if it is still alive, reap it, close its pipes; return its exit code.

        The output readers are joined first, so every line the child wrote is read.
        """
        if self.alive():
            self._proc.kill()
        try:
            code = self._proc.wait(timeout=10)
            for reader in self._readers:
                reader.join(timeout=5)
            return code
        finally:
            for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    def tail(self) -> str:
        """The end of what the process wrote to stderr, for an error message."""
        return f"stderr: {self.stderr.strip()[-2000:] or '(empty)'}"


def spawn_worker(
    dsn: str,
    schema: str,
    endpoint: str,
    token: str,
    name: str,
    *extra: str,
    on_event: Callable[[str, str], None] | None = None,
    keys: sealing.KeyCatalog | None = None,
    fork: bool = True,
) -> WorkerProcess:
    """Start ``lab worker`` as a child of this interpreter (not whatever is on PATH).

    ``keys``: the catalog the child seals results with (else it loads its own from the
    environment). ``fork``: forked from the fork server (``lab.runtime.forkserver``)
    where there is one; ``False`` execs a fresh interpreter.
    """
    argv = [
        sys.executable,
        "-m",
        "lab.cli",
        "worker",
        "--schema",
        schema,
        "--tool",
        endpoint,
        "--name",
        name,
        *extra,
    ]
    env = {**child_env(dsn, keys), protocol.TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}
    return WorkerProcess(argv, env, name, on_event, fork=fork)


def child_env(dsn: str, keys: sealing.KeyCatalog | None = None) -> dict[str, str]:
    """The environment of a ``lab`` child process: ours, plus the database and, when
    given, the key catalog to seal and open results with (never argv: both are secrets)."""
    env = {**os.environ, protocol.DSN_ENV: dsn}
    if keys is not None:
        env[sealing.KEYS_ENV] = keys.to_env()
    return env
