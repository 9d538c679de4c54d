"""The credit tool's client: loopback only, on httpx, every transport error translated.

``ToolClient`` sends effect requests (``POST /effects``, with the start's ``traceparent``,
start id and ``Lab-Fence``; several at once as one ``POST /effects/batch``) and the
authoritative lookup (``GET /effects/KEY?fence=F``).
It decides which failures leave the outcome unknown: a request that never left this
process is ``ToolUnavailable``; one that may have been sent without a complete reply is
``OutcomeUnknown``.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.parse
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any, Protocol

import httpx

from lab import errors, loopback, protocol
from lab.runtime import barrier as barriers
from lab.runtime.plan import Receipt
from lab.runtime.toolwire import (
    BATCH_PATH,
    EFFECTS_PATH,
    FENCE_HEADER,
    MAX_BATCH_ITEMS,
    START_HEADER,
)

# Each caller thread (a `lab worker --concurrency` slot, a heartbeat) has its own httpx
# client and pool, of this many connections: a thread sends one request at a time.
CONNECTIONS_PER_THREAD = 1
# An idle connection older than this is closed rather than reused.
KEEPALIVE_EXPIRY_S = 60.0

# What httpx costs, measured on a loaded 2-core machine (load average 3 to 7) with the same
# command before and after, `lab bench throughput --workflows 3000 --workers 2 --batch 32
# --repeat 2`: all-process CPU per workflow rose from 2.10 / 1.74 ms (rounds 1 / 2, the
# hand-made http.client pool) to 2.97 / 2.71 ms (httpx), the workers' share from 0.84 /
# 0.71 to 2.04 / 1.89 ms: about 1 ms per workflow, ten times the 0.1 ms allowed without a
# note. Why, from a micro-benchmark of 32-request batches against a stdlib server in one
# process (CPU per request, client and server): http.client 0.19 ms; httpx sequential
# 0.71 ms (httpcore's request and response machinery); httpx with one sender thread per
# request 1.10 ms (the thread hand-offs); httpx.AsyncClient on a loop thread 2.55 ms. The
# threaded sync client is the cheapest way to send the batch concurrently through httpx,
# and the cost is paid for httpx's pool, stale-connection check, limits and timeouts.
# Round three (issue 48) sends a batch as one request (POST /effects/batch): one httpx
# request and one tool handler thread per batch instead of one each per workflow. Same
# command, main and this change alternated twice in one sitting (load average 3.9 to 7.0,
# another job on the machine): all-process CPU per workflow 2.02 / 2.05 / 2.26 / 2.11 ms
# -> 0.64 / 0.57 / 0.60 / 0.64 ms; workers 1.27 / 1.30 / 1.40 / 1.32 -> 0.24 / 0.22 /
# 0.23 / 0.24 ms; bench and tool 0.36 / 0.36 / 0.42 / 0.38 -> 0.07 / 0.06 / 0.06 / 0.07 ms.


class Dispatchable(Protocol):
    """What the client needs to know of a claimed workflow."""

    @property
    def effect_key(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def plan(self) -> dict[str, Any]: ...


class _NotDelivered(Exception):
    """The request never left this process (no connection could be had)."""


class _Lost(Exception):
    """The request may have been sent, but no complete reply came back."""


class ToolClient:
    """A client that only talks to a loopback tool over plain HTTP/1.1.

    Each calling thread has its own ``httpx.HTTPTransport`` (httpx's pool, limits and
    timeouts; see ``_request`` for why not an ``httpx.Client``), whose one connection is
    kept open between requests (a pool shared by 32 slots cost each request a pass over every
    connection under the pool's lock, and a readability poll of each idle one). An idle
    connection the tool closed (it restarted) is noticed by httpx before reuse and
    replaced, so a restart of the tool does not turn the next call into an unknown
    outcome. ``timeout`` bounds each request, and a batch as a whole.
    """

    def __init__(self, endpoint: str, token: str, *, timeout: float = protocol.TOOL_TIMEOUT_S):
        self.base = loopback.check_endpoint(endpoint)
        if not token:
            raise errors.ToolError("tool token must not be empty")
        self._timeout = timeout
        self._token = token
        self._local = threading.local()
        self._transports: list[httpx.HTTPTransport] = []
        self._clients_lock = threading.Lock()
        self._closed = False
        # The endpoint is plain http (checked above): no client of this one ever speaks
        # TLS. Left to itself, httpx builds each client a verifying context with the CA
        # bundle loaded, 17 ms of CPU a client: 0.5 s for a `--concurrency 32` worker's
        # clients, paid inside the first requests. One context with no CA serves them all
        # and, were TLS ever attempted, verifies nothing and so fails closed.
        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self._headers = {"Authorization": f"Bearer {token}", "User-Agent": "lab-tool-client"}
        # Requests are sent to this URL: it must name the checked host.
        parsed = httpx.URL(self.base)
        if (parsed.host, parsed.port) != _host_port(self.base):
            raise errors.ToolError("tool endpoint parses differently in the HTTP client")
        # The effect paths' URLs, parsed once: parsing a URL was 15 of the 35 us that
        # building each effect's ``httpx.Request`` took (a micro-benchmark, 20,000 each).
        self._urls = {path: httpx.URL(self.base + path) for path in (EFFECTS_PATH, BATCH_PATH)}

    def _new_transport(self) -> httpx.HTTPTransport:
        return httpx.HTTPTransport(
            verify=self._tls,
            # Loopback only: no proxy or certificate settings from the environment.
            trust_env=False,
            limits=httpx.Limits(max_connections=CONNECTIONS_PER_THREAD,
                                max_keepalive_connections=CONNECTIONS_PER_THREAD,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )

    def _transport(self) -> httpx.HTTPTransport | None:
        """This thread's ``httpx.HTTPTransport`` (made on first use), or None once closed."""
        transport: httpx.HTTPTransport | None = getattr(self._local, "transport", None)
        if transport is not None:
            return None if self._closed else transport
        with self._clients_lock:
            if self._closed:
                return None
            transport = self._new_transport()
            self._transports.append(transport)
        self._local.transport = transport
        return transport

    def close(self) -> None:
        """Close every thread's connections; a request after this is never delivered."""
        with self._clients_lock:
            self._closed = True
            transports, self._transports = self._transports, []
        for transport in transports:
            transport.close()

    def __enter__(self) -> ToolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
                 timeout: float) -> tuple[int, bytes]:
        """Send one request and read its reply: (status, body).

        ``_NotDelivered`` when it never left, ``_Lost`` when its outcome is unknown.
        """
        transport = self._transport()
        if transport is None:
            raise _NotDelivered()
        request = httpx.Request(
            method, self._urls.get(path) or httpx.URL(self.base + path), content=body,
            headers={**self._headers, **headers},
            extensions={"timeout": httpx.Timeout(timeout).as_dict()},
        )
        try:
            # httpx's transport, not its Client: the Client's layers (base URL, cookies,
            # auth, redirects, event hooks) do nothing for this client but cost CPU. Sent
            # through an httpx.Client, a keep-alive POST on loopback took 360 to 390 us of
            # the caller's CPU; through the transport, 210 to 230 us (a micro-benchmark
            # against a stdlib server, 2,000 requests a run, three runs each, idle machine).
            response = transport.handle_request(request)
            try:
                data = response.read()
            finally:
                response.close()
        except httpx.ConnectTimeout as exc:
            # A connect that timed out may have completed on the far side.
            raise _Lost() from exc
        except (httpx.ConnectError, httpx.PoolTimeout) as exc:
            raise _NotDelivered() from exc
        except httpx.TransportError as exc:
            raise _Lost() from exc
        return response.status_code, data

    @staticmethod
    def _effect_item(work: Dispatchable, start: barriers.StartBarrier | None) -> dict[str, Any]:
        """The effect body of ``work`` with its start's fields (a batch item)."""
        item: dict[str, Any] = {
            "effect_key": work.effect_key,
            "fingerprint": work.fingerprint,
            "account": work.plan["account"],
            "amount_minor": work.plan["amount_minor"],
            "currency": work.plan["currency"],
        }
        if start is not None:
            item["traceparent"] = barriers.traceparent(start.trace_id, start.span_id)
            item["start_id"] = start.start_id
        # The fence of the start, or of the claim when a caller sends no barrier: a request
        # without one is treated as fence 0, refused once any lookup closed its key.
        fence = start.fence if start is not None else getattr(work, "fence", None)
        if isinstance(fence, int) and not isinstance(fence, bool) and fence >= 0:
            item["fence"] = fence
        return item

    @classmethod
    def _effect_request(
        cls, work: Dispatchable, start: barriers.StartBarrier | None
    ) -> tuple[bytes, dict[str, str]]:
        body = cls._effect_item(work, start)
        headers = {"Content-Type": "application/json"}
        if "traceparent" in body:
            headers["traceparent"] = body.pop("traceparent")
            headers[START_HEADER] = body.pop("start_id")
        if "fence" in body:
            headers[FENCE_HEADER] = str(body.pop("fence"))
        return json.dumps(body).encode(), headers

    def _effect(self, work: Dispatchable, start: barriers.StartBarrier | None,
                deadline: float) -> Receipt | errors.ToolError:
        """One effect request, answered by ``deadline`` (``time.monotonic()``)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            # It waited for a sender past the batch's deadline: it never left.
            return errors.ToolUnavailable("tool could not be reached before the deadline")
        body, headers = self._effect_request(work, start)
        try:
            return _effect_reply(*self._request("POST", EFFECTS_PATH, body, headers, remaining))
        except _NotDelivered:
            return errors.ToolUnavailable("tool could not be reached")
        except _Lost:
            return errors.OutcomeUnknown("tool reply lost: outcome unknown")
        except errors.ToolError as exc:
            return exc

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

        One request goes alone (``POST /effects``); several go as one batch request
        (``POST /effects/batch``, ``MAX_BATCH_ITEMS`` at most each), so the tool works on
        them together; all of them share one deadline, ``timeout`` from now. Each outcome
        is ``call``'s for that request alone, except that the batch's reply is shared: a
        batch never delivered leaves each item ``ToolUnavailable``, one whose reply was
        lost (or not read by the deadline, or a server error) each ``OutcomeUnknown``.
        """
        deadline = time.monotonic() + self._timeout
        if len(works) == 1:
            return [self._effect(works[0][0], works[0][1], deadline)]
        replies: list[Receipt | errors.ToolError] = []
        for first in range(0, len(works), MAX_BATCH_ITEMS):
            replies.extend(self._batch(works[first:first + MAX_BATCH_ITEMS], deadline))
        return replies

    def _batch(
        self, works: Sequence[tuple[Dispatchable, barriers.StartBarrier | None]],
        deadline: float,
    ) -> list[Receipt | errors.ToolError]:
        """One batch request for ``works``, answered by ``deadline``: each item's outcome."""
        remaining = deadline - time.monotonic()
        count = len(works)
        if remaining <= 0:
            return [errors.ToolUnavailable("tool could not be reached before the deadline")
                    for _ in range(count)]
        body = json.dumps({"items": [self._effect_item(work, start) for work, start in works]})
        try:
            status, data = self._request("POST", BATCH_PATH, body.encode(),
                                         {"Content-Type": "application/json"}, remaining)
        except _NotDelivered:
            return [errors.ToolUnavailable("tool could not be reached") for _ in range(count)]
        except _Lost:
            return [errors.OutcomeUnknown("tool reply lost: outcome unknown")
                    for _ in range(count)]
        if status != HTTPStatus.OK:
            # The batch as a whole was answered, as a single request with that status would be.
            whole: list[Receipt | errors.ToolError] = []
            for _ in range(count):
                try:
                    whole.append(_effect_reply(status, data))
                except errors.ToolError as exc:
                    whole.append(exc)
            return whole
        try:
            results = json.loads(data)["results"]
            if not isinstance(results, list) or len(results) != count:
                raise ValueError("one result per item")
        except (ValueError, KeyError, TypeError):
            return [errors.OutcomeUnknown("tool batch reply was not one result per item")
                    for _ in range(count)]
        replies: list[Receipt | errors.ToolError] = []
        for result in results:
            try:
                replies.append(_item_reply(result))
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
            status, data = self._request("GET", path, None, {}, self._timeout)
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


def _host_port(base: str) -> tuple[str | None, int | None]:
    address = urllib.parse.urlsplit(base)
    return (address.hostname or "").strip("[]") or None, address.port


def _closed_through(data: bytes) -> int | None:
    """The fence a 404 lookup answer says it closed, if any."""
    try:
        value = json.loads(data).get("closed_through")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _effect_reply(status: int, data: bytes) -> Receipt:
    """The receipt in an effect request's reply, or the tool error its status means."""
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = None
    return _answer(status, parsed)


def _item_reply(result: object) -> Receipt:
    """The receipt in one batch item's result, or the tool error its status means."""
    if not isinstance(result, dict) or type(result.get("status")) is not int:
        raise errors.OutcomeUnknown("tool batch result was not a status and body")
    return _answer(result["status"], result.get("body"))


def _answer(status: int, parsed: object) -> Receipt:
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        raise errors.RateLimited()
    if status >= 500:
        raise errors.OutcomeUnknown(f"tool failed with HTTP {status}")
    if status == HTTPStatus.CONFLICT and isinstance(parsed, dict) and _is_fence(
            parsed.get("closed_through")):
        raise errors.StartFenced("tool refused the effect: a fenced lookup closed its start")
    if status != HTTPStatus.OK:
        detail = parsed.get("detail") if isinstance(parsed, dict) else None
        raise errors.ToolRefused(f"tool refused the effect with HTTP {status}"
                                 + (f": {detail}" if isinstance(detail, str) else ""))
    return _parsed_receipt(parsed)


def _is_fence(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _receipt(data: bytes) -> Receipt:
    try:
        parsed = json.loads(data)
    except ValueError as exc:
        raise errors.OutcomeUnknown("tool reply was not a receipt") from exc
    return _parsed_receipt(parsed)


def _parsed_receipt(parsed: object) -> Receipt:
    if not isinstance(parsed, dict):
        raise errors.OutcomeUnknown("tool reply was not a receipt")
    try:
        return Receipt(str(parsed["receipt_id"]), str(parsed["effect_key"]),
                       str(parsed["fingerprint"]))
    except (KeyError, TypeError) as exc:
        raise errors.OutcomeUnknown("tool reply was not a receipt") from exc
