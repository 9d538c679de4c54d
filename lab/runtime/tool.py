"""The credit tool: a real HTTP service with its own ledger, and its loopback-only client.

The service is the side effect the lab protects. It authenticates a bearer
token (compared in constant time), writes one ledger row per effect, answers
an authoritative lookup by effect key, and has switches to inject the faults
the experiments need. The client translates every transport error into the lab's
exceptions, deciding which failures leave the outcome unknown.

The fault switches, each armed for the next effect request(s) (``POST /effects``)
and documented with a runnable example in ``docs/authoring.md``:

* ``fail_next(status=500, commit="before"|"after", count=1)``: answer an HTTP
  error, with nothing written (``"before"`` the ledger commit) or with the
  effect written (``"after"``);
* ``hold_next(seconds)``: keep the request in flight until the experiment
  releases the returned ``HeldRequest`` (or ``seconds`` pass), e.g. to SIGKILL
  the caller mid-call;
* ``drop_next_reply(count=1)``: commit the effect and close the connection
  without a reply (``drop_responses = True`` drops every reply while set);
* ``reject_next(count)``: answer 429 and write nothing;
* ``slow_next(seconds, count=1)``: wait before committing, like a slow tool;
* ``on_lookup``: a callback run during each authoritative lookup.

The counters ``calls``, ``lookups``, ``failed``, ``held``, ``slowed``,
``dropped`` and ``rejected`` say what the service saw and did.
"""

from __future__ import annotations

import difflib
import hmac
import http.client
import json
import random
import re
import secrets
import select
import sys
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Protocol

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from lab import errors, loopback, names, protocol, redact
from lab.runtime import barrier as barriers
from lab.runtime import ledger
from lab.runtime.plan import Receipt

MAX_BODY_BYTES = 4096
# How long a request waits for the ledger's writer and its connection (the database may be
# restarting): shorter than the client's timeout, so a caller gets a 503, not a write that
# lands later.
LEDGER_WAIT_S = 3.0
EFFECTS_PATH = "/effects"
START_HEADER = "Lab-Start-Id"
# The fence of the start that sent an effect request; the ledger refuses a write of a key
# whose fenced lookup already answered "absent" at that fence or a later one.
FENCE_HEADER = "Lab-Fence"
_FENCE = re.compile(r"[0-9]{1,18}")
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-[0-9a-f]{16}-0[01]")
_START_ID = re.compile(r"st1_[0-9a-f]{32}")
# A hold that nobody releases ends on its own: a forgotten hold must not hang a run.
DEFAULT_HOLD_SECONDS = 30.0

Commit = Literal["before", "after"]
"""Where an injected fault falls relative to the ledger commit of the effect."""


def _check_commit(commit: str) -> None:
    if commit not in ("before", "after"):
        raise ValueError(f"commit must be 'before' or 'after', not {commit!r}")


def _check_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative integer, not {count!r}")


class HeldRequest:
    """One effect request the tool keeps in flight until it is released.

    Returned by ``ToolService.hold_next``. The request is held before the ledger
    commit (``commit="before"``: nothing is written until it is released) or
    after it (``"after"``: the effect is written, the reply waits). A hold ends
    when ``release()`` is called or ``seconds`` have passed, whichever is first;
    the request then carries on as usual, even if its caller is gone by then.
    """

    def __init__(self, seconds: float, commit: Commit) -> None:
        self.seconds = seconds
        self.commit: Commit = commit
        self._arrived = threading.Event()
        self._released = threading.Event()
        self._finished = threading.Event()

    @property
    def arrived(self) -> bool:
        """True once a request has reached the hold."""
        return self._arrived.is_set()

    @property
    def finished(self) -> bool:
        """True once the held request has been answered (or its caller was gone)."""
        return self._finished.is_set()

    def wait_held(self, timeout: float = 15.0) -> None:
        """Block until a request is being held; raise ``TimeoutError`` if none came."""
        if not self._arrived.wait(timeout):
            raise TimeoutError(f"no effect request reached the hold within {timeout}s")

    def release(self) -> None:
        """Let the held request carry on."""
        self._released.set()

    def wait_finished(self, timeout: float = 15.0) -> None:
        """Block until the released request has been handled (its effect written or not)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the held request was not handled within {timeout}s")

    def _block(self) -> None:
        self._arrived.set()
        self._released.wait(self.seconds)

    def _finish(self) -> None:
        self._finished.set()


class _Faults:
    """The faults armed for one effect request, taken together when it arrives."""

    def __init__(
        self,
        failure: tuple[HTTPStatus, Commit] | None,
        hold: HeldRequest | None,
        delay: float,
    ) -> None:
        self.failure = failure
        self.hold = hold
        self.delay = delay


class Dispatchable(Protocol):
    """What the client needs to know of a claimed workflow."""

    @property
    def effect_key(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def plan(self) -> dict[str, Any]: ...


class ToolService:
    """The credit service on 127.0.0.1, writing its ledger in ``schema``.

    ``idempotent`` services keep one effect per key; non-idempotent ones record every
    call. ``fenced_lookup`` says whether the service answers the authoritative lookup
    (``GET /effects/KEY?fence=F``, whose "absent" is final for starts at fence F or older):
    by default an idempotent service does and a non-idempotent one does not (it answers
    501, so a person decides its unknown outcomes).
    """

    def __init__(self, dsn: str, schema: str, *, idempotent: bool, token: str | None = None,
                 fenced_lookup: bool | None = None):
        names.check_schema_name(schema)
        self.idempotent = idempotent
        self.fenced_lookup = idempotent if fenced_lookup is None else fenced_lookup
        self.token = token or secrets.token_urlsafe(24)
        redact.remember(self.token)  # kept out of this process's test reports
        #: While True, every effect reply is dropped after the commit (see ``drop_next_reply``).
        self.drop_responses = False
        #: Called with the effect key during each authoritative lookup, before the ledger
        #: is read: an experiment can act while a lookup is in flight.
        self.on_lookup: Callable[[str], None] | None = None
        # Called with (boundary, effect key) at the named boundaries inside request
        # handling (``protocol.TOOL_STAGES``), in the handler's thread: it may hold it.
        self.on_stage: Callable[[str, str], None] | None = None
        self._lock = threading.Lock()
        self._reject_remaining = 0
        self._drop_remaining = 0
        self._failures: deque[tuple[HTTPStatus, Commit]] = deque()
        self._holds: deque[HeldRequest] = deque()
        self._all_holds: list[HeldRequest] = []
        self._delays: deque[float] = deque()
        self._calls = 0
        self._lookups = 0
        self._dropped = 0
        self._rejected = 0
        self._failed = 0
        self._held = 0
        self._slowed = 0
        self._fenced = 0
        self._drop_rate = 0.0
        self._reject_rate = 0.0
        self._random = random.Random(0)
        self._pool: ConnectionPool[psycopg.Connection[dict[str, Any]]] = ConnectionPool(
            loopback.check_dsn(dsn),
            # One connection for the ledger's writer, the others for lookups.
            min_size=1,
            max_size=4,
            kwargs={
                "autocommit": True,
                "row_factory": dict_row,
                # A statement that runs past the ledger's wait is cancelled (nothing of it
                # commits): defence in depth; the fence is what makes "absent" final.
                "options": f"-c search_path={schema}"
                           f" -c statement_timeout={int(LEDGER_WAIT_S * 1000)}",
                "application_name": "lab-tool",
            },
            connection_class=psycopg.Connection[dict[str, Any]],
            open=False,
        )
        self._ledger = ledger.Ledger(self._pool, idempotent=idempotent, wait_s=LEDGER_WAIT_S)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def __getattr__(self, name: str) -> Any:
        # Only reached for a name the service does not have: a mistyped fault switch or
        # counter gets the nearest real name instead of a bare AttributeError.
        if name.startswith("__"):
            raise AttributeError(name)
        public = sorted(n for n in {*dir(type(self)), *vars(self)} if not n.startswith("_"))
        near = difflib.get_close_matches(name, public, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else f" (switches: {', '.join(public)})"
        raise AttributeError(f"no fault switch {name!r}{hint}", name=name, obj=self)

    # -- counters and fault switches, safe across handler threads --

    @property
    def calls(self) -> int:
        """Authenticated, well-formed effect requests received (429s and failures included)."""
        with self._lock:
            return self._calls

    @property
    def lookups(self) -> int:
        """Authenticated lookups received."""
        with self._lock:
            return self._lookups

    @property
    def fenced(self) -> int:
        """Effect requests refused because a fenced lookup had closed their start."""
        with self._lock:
            return self._fenced

    @property
    def dropped(self) -> int:
        """Replies dropped after the effect was committed."""
        with self._lock:
            return self._dropped

    @property
    def rejected(self) -> int:
        """Requests answered with 429 (nothing written)."""
        with self._lock:
            return self._rejected

    @property
    def failed(self) -> int:
        """Requests answered with an injected error status by ``fail_next``."""
        with self._lock:
            return self._failed

    @property
    def held(self) -> int:
        """Requests that reached a ``hold_next`` hold."""
        with self._lock:
            return self._held

    @property
    def slowed(self) -> int:
        """Requests delayed by ``slow_next``."""
        with self._lock:
            return self._slowed

    def fail_next(self, status: int = 500, commit: Commit = "before", count: int = 1) -> None:
        """Answer the next ``count`` effect requests with HTTP ``status`` (500..599).

        ``commit="before"``: the failure comes before the ledger commit, so nothing
        is written. ``commit="after"``: the effect is committed, then the error is
        answered; the caller cannot tell the two apart (``OutcomeUnknown``).
        """
        if isinstance(status, bool) or not isinstance(status, int) or not 500 <= status <= 599:
            raise ValueError(f"status must be a server error from 500 to 599, not {status!r}")
        _check_commit(commit)
        _check_count(count)
        with self._lock:
            self._failures.extend([(HTTPStatus(status), commit)] * count)

    def hold_next(
        self, seconds: float = DEFAULT_HOLD_SECONDS, commit: Commit = "before"
    ) -> HeldRequest:
        """Keep the next effect request in flight; returns the hold to wait on and release.

        The request is held at most ``seconds``. ``commit="before"`` holds it before
        the ledger commit (kill the caller now and the effect is still written once
        the hold ends, as a real service finishes a request whose client vanished);
        ``"after"`` holds the reply of an effect already written. A caller held past
        its client's timeout (5 s) sees ``OutcomeUnknown``. ``stop()`` releases every
        hold, so a forgotten one never outlives the experiment.
        """
        if not 0 < seconds <= 300:
            raise ValueError(f"seconds must lie in (0, 300], not {seconds!r}")
        _check_commit(commit)
        hold = HeldRequest(seconds, commit)
        with self._lock:
            self._holds.append(hold)
            self._all_holds.append(hold)
        return hold

    def drop_next_reply(self, count: int = 1) -> None:
        """Commit the next ``count`` effects, then close the connection without a reply."""
        _check_count(count)
        with self._lock:
            self._drop_remaining += count

    def slow_next(self, seconds: float, count: int = 1) -> None:
        """Wait ``seconds`` before committing each of the next ``count`` effects.

        Past the client's timeout (5 s) the caller sees ``OutcomeUnknown`` while the
        effect is still written afterwards.
        """
        if not 0 < seconds <= 300:
            raise ValueError(f"seconds must lie in (0, 300], not {seconds!r}")
        _check_count(count)
        with self._lock:
            self._delays.extend([float(seconds)] * count)

    def _take_faults(self) -> _Faults:
        with self._lock:
            failure = self._failures.popleft() if self._failures else None
            hold = self._holds.popleft() if self._holds else None
            delay = self._delays.popleft() if self._delays else 0.0
            if failure is not None:
                self._failed += 1
            if hold is not None:
                self._held += 1
            if delay:
                self._slowed += 1
        return _Faults(failure, hold, delay)

    def randomize_faults(self, *, drop_reply_rate: float, reject_rate: float, seed: int) -> None:
        """Drop replies after commit and answer 429 at random, reproducibly from ``seed``."""
        if not (0.0 <= drop_reply_rate <= 1.0 and 0.0 <= reject_rate <= 1.0):
            raise errors.Rejected("fault rates must lie between 0 and 1")
        with self._lock:
            self._drop_rate = drop_reply_rate
            self._reject_rate = reject_rate
            self._random = random.Random(seed)

    def _drop_this_reply(self) -> bool:
        with self._lock:
            drop = self.drop_responses or self._drop_remaining > 0 or (
                self._drop_rate > 0 and self._random.random() < self._drop_rate
            )
            if self._drop_remaining > 0:
                self._drop_remaining -= 1
            if drop:
                self._dropped += 1
            return drop

    def reject_next(self, count: int) -> None:
        """Answer the next ``count`` effect requests with 429, writing nothing.

        The client raises ``RateLimited``; the worker queues the work again on a
        persisted timer and spends one attempt of the persistent budget.
        """
        _check_count(count)
        with self._lock:
            self._reject_remaining = count

    def _count_call(self) -> bool:
        """Count one call; True when it must be rejected with 429."""
        with self._lock:
            self._calls += 1
            if self._reject_remaining > 0:
                self._reject_remaining -= 1
                self._rejected += 1
                return True
            if self._reject_rate > 0 and self._random.random() < self._reject_rate:
                self._rejected += 1
                return True
            return False

    def _count_lookup(self) -> None:
        with self._lock:
            self._lookups += 1

    # -- lifecycle --

    @property
    def endpoint(self) -> str:
        """The base URL, ``http://127.0.0.1:PORT``."""
        if self._server is None:
            raise errors.ToolError("tool service is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self, port: int = 0) -> ToolService:
        """Open the ledger connections and serve on loopback ``port`` (0: a free one).

        A service already serving is returned as it is.
        """
        if self._server is not None:
            return self
        try:
            self._pool.open(wait=True, timeout=10)
        except psycopg.Error as exc:
            raise errors.StoreError("tool ledger could not connect") from exc
        self._ledger.start()
        service = self

        class Handler(_Handler):
            tool = service

        self._server = _QuietServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="credit-tool", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Release every hold, stop serving and close the ledger connections."""
        with self._lock:
            holds = list(self._all_holds)
        for hold in holds:
            hold.release()
        for hold in holds:
            # A released request still uses the ledger pool: let it finish before closing.
            if hold.arrived:
                hold._finished.wait(5)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ledger.stop()
        self._pool.close()

    def __enter__(self) -> ToolService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the ledger --

    def record_effect(
        self, body: dict[str, Any], trace_id: str | None = None, start_id: str | None = None,
        fence: int = 0,
    ) -> tuple[HTTPStatus, Receipt | ledger.Fenced | None]:
        """Write the effect for ``body`` (once per key when idempotent), with its trace and
        its start's ``fence``.

        Returns (200, receipt), (409, None) for a key holding another plan's effect, or
        (409, ``Fenced``) when a fenced lookup already answered "absent" for this start.
        Raises ``psycopg.Error`` when the ledger's database failed (the write may have
        committed) and ``ledger.LedgerBusy`` when nothing was written.
        """
        outcome = self._ledger.record(ledger.Effect(
            effect_key=body["effect_key"], fingerprint=body["fingerprint"],
            account=body["account"], amount_minor=body["amount_minor"],
            currency=body["currency"], trace_id=trace_id, start_id=start_id, fence=fence,
        ))
        if isinstance(outcome, ledger.Fenced):
            with self._lock:
                self._fenced += 1
            return HTTPStatus.CONFLICT, outcome
        if outcome is None:
            return HTTPStatus.CONFLICT, None
        return HTTPStatus.OK, outcome

    def find_effect(self, effect_key: str, fence: int | None = None) -> Receipt | ledger.Absent:
        """The authoritative lookup: the effect recorded under ``effect_key``, or ``Absent``
        (final when ``fence`` is given: see ``ledger.Ledger.find``)."""
        return self._ledger.find(effect_key, fence)


class _QuietServer(ThreadingHTTPServer):
    """A threading server that does not print a traceback when a client vanishes.

    Killed workers drop their connections mid-request by design; anything else
    is still reported.
    """

    # Workers with batches open many connections at once; the default listen backlog of 5
    # drops their SYNs, and each dropped one costs a one-second retransmit.
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionResetError | BrokenPipeError):
            return
        super().handle_error(request, client_address)


_EFFECT_FIELDS = {
    "effect_key": str,
    "fingerprint": str,
    "account": str,
    "amount_minor": int,
    "currency": str,
}


def _valid_effect_body(body: object) -> bool:
    if not isinstance(body, dict) or set(body) != set(_EFFECT_FIELDS):
        return False
    for name, kind in _EFFECT_FIELDS.items():
        value = body[name]
        if type(value) is not kind:
            return False
        if isinstance(value, str) and not (0 < len(value) <= 200 and _storable(value)):
            return False
    amount: int = body["amount_minor"]
    return 0 < amount <= _MAX_AMOUNT_MINOR


# The ledger's bigint: a larger amount is refused here (422), not by the database, where
# it would fail the whole group of requests it was written with.
_MAX_AMOUNT_MINOR = 2**63 - 1


def _storable(text: str) -> bool:
    """Whether PostgreSQL's text can hold ``text``: UTF-8 (no lone surrogate), no NUL."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Handler(BaseHTTPRequestHandler):
    tool: ToolService
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes; with Nagle on, the second waits for the
    # client's delayed ACK (about 40 ms per call on Linux). Measured in lab bench.
    disable_nagle_algorithm = True
    server_version = "credit-tool"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: request lines would carry effect keys into test output."""

    def _authenticated(self) -> bool:
        supplied = self.headers.get("Authorization", "")
        expected = f"Bearer {self.tool.token}"
        if hmac.compare_digest(supplied.encode(), expected.encode()):
            return True
        self._reply(HTTPStatus.UNAUTHORIZED, {"error": "unauthorized"})
        return False

    def _reply(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        if status == HTTPStatus.TOO_MANY_REQUESTS:
            self.send_header("Retry-After", "0")
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        # Until the body is read, an early answer must close the connection: the
        # unread body would otherwise be parsed as the next request.
        self.close_connection = True
        if self.path != EFFECTS_PATH:
            self._reply(HTTPStatus.NOT_FOUND, {"error": "not_found"})
            return
        if not self._authenticated():
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._reply(HTTPStatus.LENGTH_REQUIRED, {"error": "length_required"})
            return
        if not 0 < length <= MAX_BODY_BYTES:
            self.close_connection = True
            self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": "body_too_large"})
            return
        raw = self.rfile.read(length)
        self.close_connection = False
        try:
            body = json.loads(raw)
        except ValueError:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": "malformed_json"})
            return
        if not _valid_effect_body(body):
            self._reply(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": "invalid_effect"})
            return
        if self.tool._count_call():
            self._reply(HTTPStatus.TOO_MANY_REQUESTS, {"error": "rate_limited"})
            return
        faults = self.tool._take_faults()
        try:
            self._effect(body, faults)
        finally:
            if faults.hold is not None:
                faults.hold._finish()

    def _effect(self, body: dict[str, Any], faults: _Faults) -> None:
        """Perform one validated effect request with the faults armed for it."""
        if self.tool.on_stage is not None:
            self.tool.on_stage(protocol.AFTER_REQUEST, body["effect_key"])
        if faults.delay:
            time.sleep(faults.delay)
        if faults.hold is not None and faults.hold.commit == "before":
            faults.hold._block()
        if faults.failure is not None and faults.failure[1] == "before":
            self._reply(faults.failure[0], {"error": "injected_failure"})
            return
        trace = _TRACEPARENT.fullmatch(self.headers.get("traceparent", ""))
        start = self.headers.get(START_HEADER, "")
        fence = self.headers.get(FENCE_HEADER, "")
        try:
            status, receipt = self.tool.record_effect(
                body,
                trace_id=trace.group(1) if trace else None,
                start_id=start if _START_ID.fullmatch(start) else None,
                fence=int(fence) if _FENCE.fullmatch(fence) else 0,
            )
        except (psycopg.Error, ledger.LedgerBusy):
            # The ledger's database is away (its pool reconnects) or busy. The write may
            # have committed before the connection died, so the caller must reconcile (5xx).
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "ledger_unavailable"})
            return
        if faults.hold is not None and faults.hold.commit == "after":
            faults.hold._block()
        if isinstance(receipt, ledger.Fenced):
            # A fenced lookup answered "absent" for this start: the request never applies.
            self._reply(status, {"error": "start_fenced_by_lookup",
                                 "closed_through": receipt.closed_through})
            return
        if receipt is None:
            self._reply(status, {"error": "effect_key_reused_with_other_plan"})
            return
        if self.tool.on_stage is not None:
            self.tool.on_stage(protocol.AFTER_EFFECT, body["effect_key"])
        if faults.failure is not None:
            # The effect is committed; the caller gets a server error.
            self._reply(faults.failure[0], {"error": "injected_failure"})
            return
        if self.tool._drop_this_reply():
            # The effect is committed; the caller never learns it.
            self.close_connection = True
            return
        self._reply(status, receipt.to_json())

    def do_GET(self) -> None:
        prefix = EFFECTS_PATH + "/"
        address = urllib.parse.urlsplit(self.path)
        if not address.path.startswith(prefix):
            self._reply(HTTPStatus.NOT_FOUND, {"error": "not_found"})
            return
        if not self._authenticated():
            return
        if not self.tool.fenced_lookup and not self.tool.idempotent:
            self._reply(HTTPStatus.NOT_IMPLEMENTED, {"error": "no_authoritative_lookup"})
            return
        query = urllib.parse.parse_qs(address.query)
        fences = query.get("fence", [])
        if len(fences) > 1 or (fences and not _FENCE.fullmatch(fences[0])):
            self._reply(HTTPStatus.BAD_REQUEST, {"error": "bad_fence"})
            return
        if fences and not self.tool.fenced_lookup:
            self._reply(HTTPStatus.NOT_IMPLEMENTED, {"error": "no_fenced_lookup"})
            return
        self.tool._count_lookup()
        key = urllib.parse.unquote(address.path[len(prefix):])
        if self.tool.on_lookup is not None:
            self.tool.on_lookup(key)
        try:
            answer = self.tool.find_effect(key, int(fences[0]) if fences else None)
        except (psycopg.Error, ledger.LedgerBusy):
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "ledger_unavailable"})
            return
        if isinstance(answer, ledger.Absent):
            body: dict[str, Any] = {"error": "no_effect"}
            if answer.final:
                # Recorded with the answer: no request of a start at this fence or older
                # can take effect from now on.
                body["closed_through"] = answer.fence
            self._reply(HTTPStatus.NOT_FOUND, body)
            return
        self._reply(HTTPStatus.OK, answer.to_json())


class _NotDelivered(Exception):
    """The connection could not be opened: the request never left this process."""


class _Lost(Exception):
    """The request may have been sent, but no complete reply came back."""


class ToolClient:
    """A client that only talks to a loopback tool over plain HTTP/1.1, keeping its
    connections open between requests (one per concurrent caller).

    It uses the standard library's ``http.client``: a request costs a fraction of
    the CPU of a general-purpose client, which counts when the tool is called once
    per workflow. An idle connection the tool closed (it restarted) is noticed
    before reuse (the socket reads as ready: end of file) and replaced, so a
    restart of the tool does not turn the next call into an unknown outcome.
    """

    def __init__(self, endpoint: str, token: str, *, timeout: float = 5.0):
        self.base = loopback.check_endpoint(endpoint)
        if not token:
            raise errors.ToolError("tool token must not be empty")
        address = urllib.parse.urlsplit(self.base)
        assert address.hostname is not None and address.port is not None  # checked above
        self._host, self._port = address.hostname, address.port
        self._authorization = f"Bearer {token}"
        self._timeout = timeout
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Close every idle connection (one in use closes when its request ends)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __enter__(self) -> ToolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self) -> http.client.HTTPConnection:
        """An open idle connection still usable, or a new (unconnected) one."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            sock = conn.sock
            # An idle HTTP/1.1 connection has nothing to read: readable means the
            # tool closed it (or wrote out of turn). Either way it is not reused.
            if sock is not None and not select.select([sock], [], [], 0)[0]:
                return conn
            conn.close()

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def _send(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> http.client.HTTPConnection:
        """Send one request on an idle or new connection, and return that connection.

        ``_NotDelivered`` when no connection could be opened, ``_Lost`` when sending failed.
        """
        conn = self._take()
        if conn.sock is None:
            try:
                conn.connect()
            except TimeoutError as exc:
                conn.close()
                # A connect that timed out may have completed on the far side.
                raise _Lost() from exc
            except OSError as exc:
                conn.close()
                raise _NotDelivered() from exc
        try:
            conn.request(method, path, body=body,
                         headers={"Authorization": self._authorization, **headers})
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _Lost() from exc
        return conn

    def _receive(
        self, conn: http.client.HTTPConnection, deadline: float | None = None
    ) -> tuple[int, bytes]:
        """Read the reply to the request just sent on ``conn``: (status, body), or ``_Lost``.

        With a ``deadline`` (``time.monotonic()``), the wait ends then rather than after the
        connection's own timeout: a batch's requests all left together, so each may take
        as long as one request would, counted from the same moment.
        """
        try:
            if deadline is not None and conn.sock is not None:
                conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _Lost() from exc
        if deadline is not None and conn.sock is not None:
            conn.sock.settimeout(self._timeout)
        if response.will_close:
            conn.close()
        else:
            self._give(conn)
        return response.status, data

    def _request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """Send one request; (status, body). ``_NotDelivered`` or ``_Lost`` on failure."""
        return self._receive(self._send(method, path, body, headers))

    @staticmethod
    def _effect_request(
        work: Dispatchable, start: barriers.StartBarrier | None
    ) -> tuple[bytes, dict[str, str]]:
        body = {
            "effect_key": work.effect_key,
            "fingerprint": work.fingerprint,
            "account": work.plan["account"],
            "amount_minor": work.plan["amount_minor"],
            "currency": work.plan["currency"],
        }
        headers = {"Content-Type": "application/json"}
        if start is not None:
            headers["traceparent"] = barriers.traceparent(start.trace_id, start.span_id)
            headers[START_HEADER] = start.start_id
        # The fence of the start, or of the claim when a caller sends no barrier: a request
        # without one is treated as fence 0, refused once any lookup closed its key.
        fence = start.fence if start is not None else getattr(work, "fence", None)
        if isinstance(fence, int) and not isinstance(fence, bool) and fence >= 0:
            headers[FENCE_HEADER] = str(fence)
        return json.dumps(body).encode(), headers

    def call(self, work: Dispatchable, start: barriers.StartBarrier | None = None) -> Receipt:
        """Ask the tool to perform ``work``'s effect under its stable effect key.

        With the committed ``start`` barrier, the request carries its W3C
        ``traceparent`` and start id, which the tool's ledger records.

        Raises ``RateLimited`` (nothing happened), ``ToolUnavailable`` (never
        delivered), ``OutcomeUnknown`` (it may have happened) or ``ToolRefused``.
        """
        (reply,) = self.call_all([(work, start)])
        if isinstance(reply, errors.ToolError):
            raise reply
        return reply

    def call_all(
        self, works: Sequence[tuple[Dispatchable, barriers.StartBarrier | None]]
    ) -> list[Receipt | errors.ToolError]:
        """``call`` for each of ``works`` at once: each one's receipt or tool error, in order.

        Every request is sent (each on its own connection) before any reply is read, so
        the tool works on them together while this thread waits; no thread is started.
        Each outcome is ``call``'s for that request alone.
        """
        sent: list[http.client.HTTPConnection | errors.ToolError] = []
        deadline = time.monotonic() + self._timeout
        for work, start in works:
            body, headers = self._effect_request(work, start)
            try:
                sent.append(self._send("POST", EFFECTS_PATH, body, headers))
            except _NotDelivered:
                sent.append(errors.ToolUnavailable("tool could not be reached"))
            except _Lost:
                sent.append(errors.OutcomeUnknown("tool reply lost: outcome unknown"))
        replies: list[Receipt | errors.ToolError] = []
        for conn in sent:
            if isinstance(conn, errors.ToolError):
                replies.append(conn)
                continue
            try:
                replies.append(_effect_reply(*self._receive(conn, deadline)))
            except _Lost:
                replies.append(errors.OutcomeUnknown("tool reply lost: outcome unknown"))
            except errors.ToolError as exc:
                replies.append(exc)
        return replies

    def lookup(self, effect_key: str, fence: int | None = None) -> Receipt | None:
        """The tool's authoritative answer: the receipt for ``effect_key`` or None.

        With ``fence`` (the fence of the start in question) the lookup is fenced: None
        then proves that no request of a start at that fence or older will ever take
        effect. A tool that answered "absent" without that proof, or that offers no
        fenced lookup, raises ``errors.NoFencedLookup``.
        """
        path = f"{EFFECTS_PATH}/{urllib.parse.quote(effect_key, safe='')}"
        if fence is not None:
            path += f"?fence={int(fence)}"
        try:
            status, data = self._request("GET", path, None, {})
        except (_NotDelivered, _Lost) as exc:
            raise errors.ToolUnavailable("tool lookup failed") from exc
        if status == HTTPStatus.NOT_FOUND:
            if fence is not None and _closed_through(data) != fence:
                raise errors.NoFencedLookup("tool answered absent without closing the start")
            return None
        if status == HTTPStatus.SERVICE_UNAVAILABLE:
            # The ledger is away for now (a 501, no authoritative lookup, stays a refusal).
            raise errors.ToolUnavailable("tool lookup answered HTTP 503: try again later")
        if status == HTTPStatus.NOT_IMPLEMENTED and fence is not None:
            raise errors.NoFencedLookup("tool offers no fenced lookup")
        if status != HTTPStatus.OK:
            raise errors.ToolRefused(f"tool lookup answered HTTP {status}")
        return _receipt(data)


def _closed_through(data: bytes) -> int | None:
    """The fence a 404 lookup answer says it closed, if any."""
    try:
        value = json.loads(data).get("closed_through")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _effect_reply(status: int, data: bytes) -> Receipt:
    """The receipt in an effect request's reply, or the tool error its status means."""
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        raise errors.RateLimited()
    if status >= 500:
        raise errors.OutcomeUnknown(f"tool failed with HTTP {status}")
    if status == HTTPStatus.CONFLICT and _closed_through(data) is not None:
        raise errors.StartFenced("tool refused the effect: a fenced lookup closed its start")
    if status != HTTPStatus.OK:
        raise errors.ToolRefused(f"tool refused the effect with HTTP {status}")
    return _receipt(data)


def _receipt(data: bytes) -> Receipt:
    try:
        parsed = json.loads(data)
        return Receipt(str(parsed["receipt_id"]), str(parsed["effect_key"]),
                       str(parsed["fingerprint"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise errors.OutcomeUnknown("tool reply was not a receipt") from exc
