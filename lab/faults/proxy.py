"""A loopback TCP proxy that can cut, reset or slow one link, for network-fault chaos.

``Proxy`` listens on 127.0.0.1 and forwards every connection to one loopback
target (PostgreSQL or the credit tool), on an asyncio event loop in its own
thread, so the process that owns it keeps working while it runs. Its faults:

- ``blackhole``: nothing moves in either direction and new connections are
  accepted but not forwarded, as when packets are dropped. TCP would
  retransmit: when the link heals, what was held is delivered.
- ``reset``: every open connection is aborted with an RST (both sides) and new
  ones are reset at once, as when a middlebox forgets the flows.
- ``latency``: every chunk waits this long before it is forwarded.

Both ends must be loopback: the proxy is a fault injector for
this machine, never a relay to anywhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import random
import socket
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from lab import errors
from lab.pg import edge

T = TypeVar("T")

BLACKHOLE = "blackhole"
RESET = "reset"
FAULT_MODES = (BLACKHOLE, RESET)
_CHUNK = 65536


@dataclass(eq=False)  # hashed by identity: links live in a set
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None


class Proxy:
    """One loopback link with switchable faults; ``start()`` then use ``port``."""

    def __init__(self, target_host: str, target_port: int, name: str = "proxy") -> None:
        if not _loopback(target_host):
            raise errors.BoundaryViolation(f"proxy target {target_host!r} is not loopback")
        self.name = name
        self._target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"proxy-{name}",
                                        daemon=True)
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._flowing: asyncio.Event | None = None
        self._mode: str | None = None
        self._latency = 0.0
        self.connections = 0
        self.resets = 0
        self.port = 0

    # -- lifecycle (called from any thread) ----------------------------------------------

    def start(self) -> Proxy:
        """Listen on a free 127.0.0.1 port; returns self."""
        self._thread.start()
        self.port = self._call(self._listen())
        return self

    def stop(self) -> None:
        """Close every link and the listener, and end the loop's thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- faults (called from any thread) -------------------------------------------------

    def partition(self, mode: str) -> None:
        """Start a fault: ``blackhole`` holds everything, ``reset`` aborts every link."""
        if mode not in FAULT_MODES:
            raise errors.UsageError(f"unknown partition mode {mode!r}")
        self._call(self._partition(mode))

    def heal(self) -> None:
        """End the fault: held data flows again, new connections are forwarded."""
        self._call(self._heal())

    def set_latency(self, seconds: float) -> None:
        """Delay every forwarded chunk by ``seconds`` (0 for none)."""
        if seconds < 0:
            raise errors.UsageError("latency must not be negative")
        self._latency = seconds

    @property
    def mode(self) -> str | None:
        """The fault in force, or None."""
        return self._mode

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    # -- on the loop -----------------------------------------------------------------------

    async def _listen(self) -> int:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            _abort(link.client)
            if link.upstream is not None:
                _abort(link.upstream)
        self._links.clear()

    async def _partition(self, mode: str) -> None:
        assert self._flowing is not None
        self._mode = mode
        if mode == BLACKHOLE:
            self._flowing.clear()
            return
        for link in list(self._links):
            self.resets += 1
            _abort(link.client)
            if link.upstream is not None:
                _abort(link.upstream)
        self._links.clear()

    async def _heal(self) -> None:
        assert self._flowing is not None
        self._mode = None
        self._flowing.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        self.connections += 1
        if self._mode == RESET:
            self.resets += 1
            _abort(writer)
            return
        link = _Link(writer)
        self._links.add(link)
        try:
            await self._flowing.wait()  # a blackhole holds the connection attempt too
            if link not in self._links:  # reset while held
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self._target)
            except OSError:
                _abort(writer)
                return
            link.upstream = up_writer
            if link not in self._links:
                _abort(up_writer)
                return
            await asyncio.gather(
                self._pump(reader, up_writer, link), self._pump(up_reader, writer, link)
            )
        finally:
            self._links.discard(link)
            for end in (writer, link.upstream):
                if end is not None:
                    with contextlib.suppress(Exception):
                        end.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        assert self._flowing is not None
        try:
            while data := await reader.read(_CHUNK):
                if self._latency > 0:
                    await asyncio.sleep(self._latency)
                await self._flowing.wait()
                if link not in self._links:
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # One side ended: end the other, so neither waits on a dead peer.
            for end in (link.client, link.upstream):
                if end is not None:
                    with contextlib.suppress(Exception):
                        end.close()


def for_database(dsn: str, name: str = "database") -> tuple[Proxy, str]:
    """A started proxy in front of ``dsn``'s server, and the DSN that goes through it."""
    link = Proxy(*edge.dsn_address(dsn), name).start()
    return link, edge.dsn_via(dsn, "127.0.0.1", link.port)


class Partitions:
    """Seeded partitions over named links: one cut at a time, each healed in time and logged.

    ``cut(now)`` picks a link and a mode (blackhole or reset) from ``rng`` and cuts
    it for ``lasts`` seconds; ``heal(now)`` ends a cut whose time is up (``force``
    ends it regardless). ``log`` holds every cut with its offset from ``origin``.
    """

    def __init__(
        self, links: dict[str, Proxy], rng: random.Random, lasts: float, origin: float
    ) -> None:
        self.links = links
        self.rng = rng
        self.lasts = lasts
        self.origin = origin
        self.log: list[dict[str, Any]] = []
        self._open: tuple[str, float] | None = None  # the cut link, healing at (monotonic)

    @property
    def cut_now(self) -> bool:
        """Whether a cut is in force."""
        return self._open is not None

    @property
    def heals_at(self) -> float:
        """When the cut in force heals (infinity when none is)."""
        return self._open[1] if self._open else math.inf

    def cut(self, now: float) -> bool:
        """Cut one link now, unless one is already cut or there are none; whether it did."""
        if not self.links or self._open is not None:
            return False
        link = self.rng.choice(sorted(self.links))
        mode = self.rng.choice(FAULT_MODES)
        self.links[link].partition(mode)
        self._open = (link, now + self.lasts)
        self.log.append({"at_s": round(now - self.origin, 2), "for_s": self.lasts,
                         "link": link, "mode": mode})
        return True

    def heal(self, now: float, force: bool = False) -> None:
        """End the cut in force when its time is up (or at once with ``force``)."""
        if self._open is not None and (force or now >= self._open[1]):
            self.links[self._open[0]].heal()
            self._open = None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), as a reset link would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
