"""The credit tool as its own OS process, so a fault can kill it and a restart can follow.

``python -m lab.runtime.toolprocess --schema S [--port P] [--non-idempotent]
[--fenced-lookup] [--pause B] [--die-at B] [--fail-before N]``
serves ``tool.ToolService`` on loopback with the DSN and the token from the
environment (``protocol.DSN_ENV``, ``protocol.TOKEN_ENV``). On stdout it says
``BOOK_READY <port>`` once serving, ``BOOK_REQUEST call|lookup`` for every
authenticated request and ``BOOK_STAGE <boundary> <effect key> 0`` at the
boundaries inside its request handling (``protocol.TOOL_STAGES``), and
``BOOK_FENCED <effect key>`` for each write it refused because a fenced lookup had
closed its start.

Fault switches, each for the first time the boundary is reached:

- ``--pause B`` holds the request at ``B`` until an empty line arrives on stdin (with
  ``--hold-count N``, the first N requests to reach it: a batch's, all at once);
- ``--die-at B`` is the self-kill switch: the process SIGKILLs itself at ``B``,
  inside the request handling (before the effect commits, or after it and
  before the reply);
- ``--fail-before N`` splits a batch by a crash: the process commits the first N items
  of a batch request (reporting ``after_effect`` for each), then SIGKILLs itself before
  writing the rest or answering any;
- a line ``drop`` on stdin arms the loss of the next effect reply (the effect
  is committed, the connection closed without an answer); ``BOOK_ARMED drop``
  confirms it;
- a line ``mark`` on stdin is answered ``BOOK_ARMED mark`` and changes nothing: a
  harness that reads the tool's output later knows which lines came after it.

A restart is a new process on the same port with the same token, so a worker
that was given the endpoint before the crash reaches the new incarnation.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable

from lab import errors, protocol, redact
from lab.runtime import egress, processes, tool

DROP_COMMAND = "drop"
# Asks for a mark in the tool's output (BOOK_ARMED mark), releasing nothing: what the
# tool says after it happened after the command arrived.
MARK_COMMAND = "mark"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lab.runtime.toolprocess")
    parser.add_argument("--schema", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--non-idempotent", action="store_true")
    parser.add_argument("--fenced-lookup", action="store_true",
                        help="a non-idempotent tool offers the fenced lookup too")
    parser.add_argument("--pause", choices=protocol.TOOL_STAGES, default=None)
    parser.add_argument("--die-at", choices=protocol.TOOL_STAGES, default=None)
    parser.add_argument("--hold-count", type=int, default=1,
                        help="--pause holds the first N requests to reach its boundary")
    parser.add_argument("--fail-before", type=int, default=None, metavar="N",
                        help="commit a batch's first N items, then SIGKILL this process")
    return parser


def serve_main(argv: list[str] | None = None) -> int:
    """Body of ``python -m lab.runtime.toolprocess``: serve until killed or stdin closes."""
    args = _parser().parse_args(argv)
    egress.install()
    dsn = os.environ.get(protocol.DSN_ENV, "")
    token = os.environ.get(protocol.TOKEN_ENV, "")
    if not dsn or not token:
        print(f"the tool process needs {protocol.DSN_ENV} and {protocol.TOKEN_ENV}",
              file=sys.stderr)
        return 2
    say = threading.Lock()
    released = threading.Event()
    reached: dict[str, int] = {}

    def line(text: str) -> None:
        with say:
            print(text, flush=True)

    def commands() -> None:
        for raw in sys.stdin:
            if raw.strip() == DROP_COMMAND:
                service.drop_next_reply()
                line(f"{protocol.ARMED} {DROP_COMMAND}")
            elif raw.strip() == MARK_COMMAND:
                line(f"{protocol.ARMED} {MARK_COMMAND}")
            else:
                released.set()
        released.set()  # stdin closed: never hold a request forever

    service = tool.ToolService(dsn, args.schema, idempotent=not args.non_idempotent, token=token,
                               fenced_lookup=True if args.fenced_lookup else None)

    def on_stages(stage: str, effect_keys: list[str]) -> None:
        # A batch's items reach the boundary together: all reported, then held once.
        for effect_key in effect_keys:
            if stage == protocol.AFTER_REQUEST:
                line(f"{protocol.REQUEST} call")
            line(protocol.stage_line(stage, effect_key, 0))
        with say:
            before = reached.get(stage, 0)
            reached[stage] = before + len(effect_keys)
        if before == 0 and args.die_at == stage:
            os.kill(os.getpid(), signal.SIGKILL)
        if before < args.hold_count and args.pause == stage:
            released.wait()

    def on_stage(stage: str, effect_key: str) -> None:
        on_stages(stage, [effect_key])

    def on_batch_split(written: list[str]) -> None:
        for effect_key in written:
            line(protocol.stage_line(protocol.AFTER_EFFECT, effect_key, 0))
        os.kill(os.getpid(), signal.SIGKILL)

    def on_lookup(effect_key: str) -> None:
        line(f"{protocol.REQUEST} lookup")

    service.on_stage = on_stage
    service.on_stages = on_stages
    if args.fail_before is not None:
        service.batch_split = args.fail_before
        service.on_batch_split = on_batch_split
    service.on_fenced = lambda effect_key: line(f"{protocol.FENCED} {effect_key}")
    service.on_lookup = on_lookup
    threading.Thread(target=commands, name="tool-commands", daemon=True).start()
    try:
        service.start(port=args.port)
    except (errors.LabError, OSError) as exc:
        print(f"tool process: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    port = service.endpoint.rsplit(":", 1)[1]
    line(f"{protocol.READY} {port}")
    try:
        threading.Event().wait()
    finally:
        service.stop()
    return 0


class ToolProcess:
    """Handle of a tool process and its restarts; counts requests across incarnations."""

    def __init__(
        self,
        dsn: str,
        schema: str,
        *,
        idempotent: bool,
        token: str,
        fenced_lookup: bool = False,
        name: str = "tool",
        on_event: Callable[[str, str], None] | None = None,
    ):
        self.dsn = dsn
        self.schema = schema
        self.idempotent = idempotent
        # A non-idempotent tool that offers the fenced lookup (an idempotent one always does).
        self.fenced_lookup = fenced_lookup
        self.token = token
        redact.remember(token)  # kept out of this process's test reports
        self.name = name
        self._on_event = on_event
        self.port = 0
        self.incarnations: list[processes.WorkerProcess] = []

    @property
    def current(self) -> processes.WorkerProcess:
        """The latest incarnation."""
        return self.incarnations[-1]

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``, the same across restarts."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, *flags: str, timeout: float = 30.0) -> ToolProcess:
        """Start an incarnation (on the previous port, if any) and wait until it serves."""
        argv = [sys.executable, "-m", "lab.runtime.toolprocess", "--schema", self.schema,
                "--port", str(self.port)]
        if not self.idempotent:
            argv.append("--non-idempotent")
        if self.fenced_lookup:
            argv.append("--fenced-lookup")
        env = {**processes.child_env(self.dsn), protocol.TOKEN_ENV: self.token,
               "PYTHONUNBUFFERED": "1"}
        name = f"{self.name}-{len(self.incarnations) + 1}"
        child = processes.WorkerProcess([*argv, *flags], env, name, self._on_event)
        self.incarnations.append(child)
        ready = child.wait_for(protocol.READY, timeout=timeout)
        self.port = int(ready.split()[1])
        return self

    def requests(self) -> dict[str, int]:
        """``{"call": n, "lookup": m}`` over every incarnation (read what each has written)."""
        counts = {"call": 0, "lookup": 0}
        for child in self.incarnations:
            for text in child.all_lines():
                if text.startswith(f"{protocol.REQUEST} "):
                    kind = text.split()[1]
                    counts[kind] = counts.get(kind, 0) + 1
        return counts

    def stages(self) -> list[str]:
        """Every boundary the tool's incarnations reported so far."""
        return [text.split()[1] for child in self.incarnations for text in child.all_lines()
                if text.startswith(f"{protocol.STAGE} ")]

    def close(self) -> None:
        """Kill every incarnation still alive and reap it."""
        for child in self.incarnations:
            child.cleanup()


if __name__ == "__main__":
    sys.exit(serve_main())
