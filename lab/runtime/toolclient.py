"""The credit tool's client: loopback only, on httpx, every transport error translated.

``ToolClient`` sends effect requests (``POST /effects``, with the start's ``traceparent``,
start id and ``Lab-Fence``) and the authoritative lookup (``GET /effects/KEY?fence=F``).
It decides which failures leave the outcome unknown: a request that never left this
process is ``ToolUnavailable``; one that may have been sent without a complete reply is
``OutcomeUnknown``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from http import HTTPStatus
from typing import Any, Protocol

import httpx

from lab import errors, loopback, protocol
from lab.runtime import barrier as barriers
from lab.runtime.plan import Receipt
from lab.runtime.toolwire import EFFECTS_PATH, FENCE_HEADER, START_HEADER

# The most requests in flight at once, and so the pool's connection limit: a worker's
# batch larger than this waits for a connection (within its deadline).
MAX_IN_FLIGHT = 64
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

    One ``httpx.Client`` holds the connections (up to ``MAX_IN_FLIGHT``), kept open
    between requests. An idle connection the tool closed (it restarted) is noticed by
    httpx before reuse and replaced, so a restart of the tool does not turn the next
    call into an unknown outcome. ``timeout`` bounds each request, and a batch as a whole.
    """

    def __init__(self, endpoint: str, token: str, *, timeout: float = protocol.TOOL_TIMEOUT_S):
        self.base = loopback.check_endpoint(endpoint)
        if not token:
            raise errors.ToolError("tool token must not be empty")
        self._timeout = timeout
        self._http = httpx.Client(
            base_url=self.base,
            headers={"Authorization": f"Bearer {token}", "User-Agent": "lab-tool-client"},
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=MAX_IN_FLIGHT,
                                max_keepalive_connections=MAX_IN_FLIGHT,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
            # Loopback only: no proxy or certificate settings from the environment.
            trust_env=False,
            follow_redirects=False,
        )
        if (self._http.base_url.host, self._http.base_url.port) != _host_port(self.base):
            self._http.close()
            raise errors.ToolError("tool endpoint parses differently in the HTTP client")
        self._senders: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the pool's connections and the batch's sender threads."""
        with self._lock:
            senders, self._senders = self._senders, None
        if senders is not None:
            senders.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> ToolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
                 timeout: float) -> tuple[int, bytes]:
        """Send one request and read its reply: (status, body).

        ``_NotDelivered`` when it never left, ``_Lost`` when its outcome is unknown.
        """
        if self._http.is_closed:
            raise _NotDelivered()
        try:
            response = self._http.request(method, path, content=body, headers=headers,
                                          timeout=httpx.Timeout(timeout))
        except httpx.ConnectTimeout as exc:
            # A connect that timed out may have completed on the far side.
            raise _Lost() from exc
        except (httpx.ConnectError, httpx.PoolTimeout) as exc:
            raise _NotDelivered() from exc
        except httpx.TransportError as exc:
            raise _Lost() from exc
        return response.status_code, response.content

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

        The requests go out together through the pool (one sender thread each, up to
        ``MAX_IN_FLIGHT``), so the tool works on them together; all of them share one
        deadline, ``timeout`` from now. Each outcome is ``call``'s for that request alone;
        a reply not read by the deadline is an unknown outcome.
        """
        deadline = time.monotonic() + self._timeout
        if len(works) == 1:
            # One request needs no sender thread: it goes from the caller's.
            return [self._effect(works[0][0], works[0][1], deadline)]
        senders = self._sender_pool()
        pending: list[Future[Receipt | errors.ToolError]] = [
            senders.submit(self._effect, work, start, deadline) for work, start in works
        ]
        replies: list[Receipt | errors.ToolError] = []
        for future in pending:
            try:
                replies.append(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
            except FutureTimeout:
                replies.append(errors.OutcomeUnknown("tool reply not read by the deadline"))
        return replies

    def _sender_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._senders is None:
                self._senders = ThreadPoolExecutor(MAX_IN_FLIGHT, "tool-client")
            return self._senders

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
