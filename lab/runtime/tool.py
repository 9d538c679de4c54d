"""The credit tool: a real HTTP service with its own ledger.

The service is the side effect the lab protects. It authenticates a bearer
token (compared in constant time), writes one ledger row per effect, answers
an authoritative lookup by effect key, and has switches to inject the faults
the experiments need (``lab.runtime.toolfaults``). Its client, which translates every
transport error into the lab's exceptions, is ``lab.runtime.toolclient``; what both
sides agree on is ``lab.runtime.toolwire``.

A batch (``POST /effects/batch``, ``lab.runtime.toolwire``) carries several effect
requests in one HTTP request; each item is treated as its own ``POST /effects`` would be
(its rate limit, faults, fence and ledger outcome), and the reply carries each item's
status and body. Only the dropped reply is the request's: drawn once, it loses every
item's answer. A malformed or oversized batch is refused whole, with nothing written.

The fault switches, each armed for the next effect request(s) (``POST /effects``, or one
item of a batch) and documented with a runnable example in ``docs/authoring.md``:

* ``fail_next(status=500, commit="before"|"after", count=1)``: answer an HTTP
  error, with nothing written (``"before"`` the ledger commit) or with the
  effect written (``"after"``);
* ``hold_next(seconds)``: keep the request in flight until the experiment
  releases the returned ``HeldRequest`` (or ``seconds`` pass), e.g. to SIGKILL
  the caller mid-call;
* ``drop_next_reply(count=1)``: commit the effect and close the connection
  without a reply (``drop_responses = True`` drops every reply while set); one drop
  loses a whole batch's reply;
* ``reject_next(count)``: answer 429 and write nothing;
* ``slow_next(seconds, count=1)``: wait before committing, like a slow tool;
* ``on_lookup``: a callback run during each authoritative lookup.

The counters ``calls``, ``lookups``, ``failed``, ``held``, ``slowed``,
``dropped`` and ``rejected`` say what the service saw and did.
"""

from __future__ import annotations

import difflib
import hmac
import json
import secrets
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from lab import errors, loopback, names, protocol, redact
from lab.runtime import ledger
from lab.runtime.plan import Receipt
from lab.runtime.toolfaults import Faults, FaultSwitches, block_together
from lab.runtime.toolwire import (
    BATCH_PATH,
    EFFECT_FIELDS,
    EFFECTS_PATH,
    FENCE,
    FENCE_HEADER,
    MAX_BATCH_BODY_BYTES,
    MAX_BODY_BYTES,
    START_HEADER,
    START_ID,
    TRACEPARENT,
    batch_items,
    valid_effect_body,
)

# How long a request waits for the ledger's writer and its connection (the database may be
# restarting): shorter than the client's timeout, so a caller gets a 503, not a write that
# lands later.
LEDGER_WAIT_S = 3.0


class ToolService(FaultSwitches):
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
        super().__init__()
        self.token = token or secrets.token_urlsafe(24)
        redact.remember(self.token)  # kept out of this process's test reports
        #: Called with the effect key during each authoritative lookup, before the ledger
        #: is read: an experiment can act while a lookup is in flight.
        self.on_lookup: Callable[[str], None] | None = None
        # Called with (boundary, effect key) at the named boundaries inside request
        # handling (``protocol.TOOL_STAGES``), in the handler's thread: it may hold it.
        self.on_stage: Callable[[str, str], None] | None = None
        #: Called with the effect key when a write is refused because a fenced lookup
        #: closed its start (a late request that never applies).
        self.on_fenced: Callable[[str], None] | None = None
        # Called with (boundary, effect keys) for a batch's items reaching a boundary
        # together; without it, ``on_stage`` is called for each key in turn.
        self.on_stages: Callable[[str, list[str]], None] | None = None
        #: With ``batch_split = N``: a batch writes its first N items, calls
        #: ``on_batch_split`` with the keys written, then writes the rest (``lab
        #: crashpoints``' tool dies there: a batch split by a crash).
        self.batch_split: int | None = None
        self.on_batch_split: Callable[[list[str]], None] | None = None
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

    # -- lifecycle --

    @property
    def endpoint(self) -> str:
        """The base URL, ``http://ADDRESS:PORT`` (``127.0.0.1`` unless started on a lab
        host's address)."""
        if self._server is None:
            raise errors.ToolError("tool service is not started")
        address, port = self._server.server_address[:2]
        return f"http://{address!s}:{port}"

    def start(self, port: int = 0, address: str = "127.0.0.1") -> ToolService:
        """Open the ledger connections and serve on loopback ``port`` (0: a free one), or
        on ``address``: a lab host's own, when started from a thread inside that host
        (``lab chaos --hosts``).

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

        self._server = _QuietServer((address, port), Handler)
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
        return self._answer(body["effect_key"], self._ledger.record(
            _effect(body, trace_id, start_id, fence)))

    def record_effects(
        self, items: list[tuple[dict[str, Any], str | None, str | None, int]],
    ) -> list[tuple[HTTPStatus, Receipt | ledger.Fenced | None] | psycopg.Error
              | ledger.LedgerBusy]:
        """``record_effect`` for each (body, trace id, start id, fence) of a batch, together:
        each one's answer, or the error ``record_effect`` would have raised, in order."""
        effects = [_effect(*item) for item in items]
        split = self.batch_split
        if split is not None and 0 < split < len(effects):
            first = self._ledger.record_all(effects[:split])
            if self.on_batch_split is not None:
                self.on_batch_split([effect.effect_key for effect, outcome
                                     in zip(effects, first, strict=False)
                                     if isinstance(outcome, Receipt)])
            outcomes = first + self._ledger.record_all(effects[split:])
        else:
            outcomes = self._ledger.record_all(effects)
        return [outcome if isinstance(outcome, psycopg.Error | ledger.LedgerBusy)
                else self._answer(effect.effect_key, outcome)
                for effect, outcome in zip(effects, outcomes, strict=True)]

    def _answer(
        self, effect_key: str, outcome: ledger.Outcome
    ) -> tuple[HTTPStatus, Receipt | ledger.Fenced | None]:
        if isinstance(outcome, ledger.Fenced):
            with self._lock:
                self._fenced += 1
            if self.on_fenced is not None:
                self.on_fenced(effect_key)
            return HTTPStatus.CONFLICT, outcome
        if outcome is None:
            return HTTPStatus.CONFLICT, None
        return HTTPStatus.OK, outcome

    def find_effect(self, effect_key: str, fence: int | None = None) -> Receipt | ledger.Absent:
        """The authoritative lookup: the effect recorded under ``effect_key``, or ``Absent``
        (final when ``fence`` is given: see ``ledger.Ledger.find``)."""
        return self._ledger.find(effect_key, fence)


def _effect(body: dict[str, Any], trace_id: str | None, start_id: str | None,
            fence: int) -> ledger.Effect:
    return ledger.Effect(
        effect_key=body["effect_key"], fingerprint=body["fingerprint"],
        account=body["account"], amount_minor=body["amount_minor"],
        currency=body["currency"], trace_id=trace_id, start_id=start_id, fence=fence,
    )


def _trace_id(traceparent: object) -> str | None:
    trace = TRACEPARENT.fullmatch(traceparent) if isinstance(traceparent, str) else None
    return trace.group(1) if trace else None


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

    def _read_json(self, limit: int) -> tuple[bool, Any]:
        """(True, the request's JSON body), or (False, None) once the refusal is answered."""
        # Until the body is read, an early answer must close the connection: the
        # unread body would otherwise be parsed as the next request.
        self.close_connection = True
        if not self._authenticated():
            return False, None
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._reply(HTTPStatus.LENGTH_REQUIRED, {"error": "length_required"})
            return False, None
        if not 0 < length <= limit:
            self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        {"error": "body_too_large", "detail": f"at most {limit} bytes"})
            return False, None
        raw = self.rfile.read(length)
        self.close_connection = False
        try:
            return True, json.loads(raw)
        except ValueError:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": "malformed_json"})
            return False, None

    def do_POST(self) -> None:
        if self.path == BATCH_PATH:
            self._batch_post()
            return
        if self.path != EFFECTS_PATH:
            self.close_connection = True
            self._reply(HTTPStatus.NOT_FOUND, {"error": "not_found"})
            return
        read, body = self._read_json(MAX_BODY_BYTES)
        if not read:
            return
        if not valid_effect_body(body):
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

    def _effect(self, body: dict[str, Any], faults: Faults) -> None:
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
        trace = TRACEPARENT.fullmatch(self.headers.get("traceparent", ""))
        start = self.headers.get(START_HEADER, "")
        fence = self.headers.get(FENCE_HEADER, "")
        try:
            status, receipt = self.tool.record_effect(
                body,
                trace_id=trace.group(1) if trace else None,
                start_id=start if START_ID.fullmatch(start) else None,
                fence=int(fence) if FENCE.fullmatch(fence) else 0,
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

    def _batch_post(self) -> None:
        """``POST /effects/batch``: each item as its own ``POST /effects``, one reply."""
        read, body = self._read_json(MAX_BATCH_BODY_BYTES)
        if not read:
            return
        items = batch_items(body)
        if isinstance(items, str):
            self._reply(HTTPStatus.UNPROCESSABLE_ENTITY,
                        {"error": "invalid_batch", "detail": items})
            return
        answers: list[tuple[int, dict[str, Any]] | None] = [None] * len(items)
        faults: dict[int, Faults] = {}
        for index in range(len(items)):
            # Each item is counted, rate limited and given its faults as a request would be.
            if self.tool._count_call():
                answers[index] = (HTTPStatus.TOO_MANY_REQUESTS, {"error": "rate_limited"})
            else:
                faults[index] = self.tool._take_faults()
        try:
            self._batch(items, answers, faults)
        finally:
            for each in faults.values():
                if each.hold is not None:
                    each.hold._finish()

    def _stages(self, stage: str, keys: list[str]) -> None:
        if not keys:
            return
        if self.tool.on_stages is not None:
            self.tool.on_stages(stage, keys)
        elif self.tool.on_stage is not None:
            each = self.tool.on_stage  # ``_stages``' callers name the boundary
            for key in keys:
                each(stage, key)

    def _batch(self, items: list[dict[str, Any]], answers: list[tuple[int, dict[str, Any]] | None],
               faults: dict[int, Faults]) -> None:
        """Perform a validated batch's items (those not rate limited) with their faults."""
        live = sorted(faults)
        self._stages(protocol.AFTER_REQUEST, [items[i]["effect_key"] for i in live])
        delay = max((faults[i].delay for i in live), default=0.0)
        if delay:
            time.sleep(delay)  # the items' waits overlap, as concurrent requests' would
        block_together([hold for i in live if (hold := faults[i].hold) is not None
                        and hold.commit == "before"])
        for i in live:
            failure = faults[i].failure
            if failure is not None and failure[1] == "before":
                answers[i] = (failure[0], {"error": "injected_failure"})
        writable = [i for i in live if answers[i] is None]
        outcomes = self.tool.record_effects([
            ({name: items[i][name] for name in EFFECT_FIELDS},
             _trace_id(items[i].get("traceparent")), items[i].get("start_id"),
             items[i].get("fence", 0)) for i in writable])
        block_together([hold for i in live if (hold := faults[i].hold) is not None
                        and hold.commit == "after"])
        written = []
        for i, outcome in zip(writable, outcomes, strict=True):
            if isinstance(outcome, psycopg.Error | ledger.LedgerBusy):
                answers[i] = (HTTPStatus.SERVICE_UNAVAILABLE, {"error": "ledger_unavailable"})
            elif isinstance(outcome[1], ledger.Fenced):
                answers[i] = (outcome[0], {"error": "start_fenced_by_lookup",
                                           "closed_through": outcome[1].closed_through})
            elif outcome[1] is None:
                answers[i] = (outcome[0], {"error": "effect_key_reused_with_other_plan"})
            else:
                answers[i] = (outcome[0], outcome[1].to_json())
                written.append(i)
        self._stages(protocol.AFTER_EFFECT, [items[i]["effect_key"] for i in written])
        confirmed = False
        for i in written:
            failure = faults[i].failure
            if failure is not None:
                answers[i] = (failure[0], {"error": "injected_failure"})
            else:
                confirmed = True
        if confirmed and self.tool._drop_this_reply():
            # One draw for the request: every item's answer is lost with its reply.
            self.close_connection = True
            return
        unanswered = (HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "unanswered"})
        self._reply(HTTPStatus.OK, {"results": [
            {"status": int(status), "body": body}
            for status, body in (answer or unanswered for answer in answers)]})

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
        if len(fences) > 1 or (fences and not FENCE.fullmatch(fences[0])):
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
