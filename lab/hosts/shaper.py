"""A user-space link shaper between lab hosts, for a kernel without ``sch_netem``.

``tc netem`` delays, jitters and reorders a host's packets in the kernel; where the kernel
lacks ``sch_netem`` (``netfaults.netem_available``), ``lab chaos --hosts`` puts a
``Shaper`` on each path it shapes instead: a small TCP forwarder whose listening socket is
made inside one network namespace (a worker's host, on that host's loopback) and whose
upstream sockets are made inside another (the same host: partitions of that host still
cut its traffic; or a lab host, for the controller's own way to the tool). Each chunk read
from one side is handed to the other side's deliverer with a due time:

- ``delay``: every chunk waits ``delay_ms``;
- ``jitter``: every chunk waits ``delay_ms`` give or take ``jitter_ms`` (uniform);
- ``reorder``: a share of chunks waits ``delay_ms``, the others go at once, so chunks of
  different connections overtake each other (one stream's bytes keep their order, as TCP
  would restore it anyway: a chunk is never delivered before its stream's previous one).

``reordered`` counts deliveries that overtook a chunk read earlier on any connection of
the shaper: the reordering measured, not assumed. Loss is not here: an nftables rule
drops real packets without netem (``netfaults.Faults.shape``). Every socket is closed by
``stop``; a connection whose other side fails is closed on both sides.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from lab import errors

_CHUNK = 65536
_CONNECT_TIMEOUT_S = 2.0
# Upstream sockets give up on a peer that acknowledges nothing for this long, as the
# workers' own libpq settings would (``tcp_user_timeout``): a partition longer than this
# closes both sides instead of hanging the client on a healthy loopback socket.
_USER_TIMEOUT_MS = 4000
_TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)
_JOIN_S = 5.0


@dataclass(frozen=True)
class Shape:
    """What the shaper does now (times in ms; ``reorder_share`` 0..1). All 0: forward."""

    kind: str = ""
    delay_ms: int = 0
    jitter_ms: int = 0
    reorder_share: float = 0.0

    def wait_s(self, rng: random.Random) -> float:
        """How long one chunk waits under this shape, in seconds."""
        if self.kind == "reorder":
            return self.delay_ms / 1000.0 if rng.random() < self.reorder_share else 0.0
        spread = rng.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms else 0.0
        return max(0.0, self.delay_ms + spread) / 1000.0

    def describe(self) -> str:
        """The shape in one line, for the evidence."""
        if not self.kind:
            return "forwarding"
        if self.kind == "reorder":
            return f"reorder: {self.reorder_share:.0%} of chunks held {self.delay_ms} ms"
        return f"{self.kind}: {self.delay_ms} ms" + (
            f" +/- {self.jitter_ms} ms" if self.jitter_ms else "")


class _Direction:
    """One direction of one connection: chunks waiting to be sent to ``sink``."""

    def __init__(self, shaper: Shaper, sink: socket.socket) -> None:
        self.shaper, self.sink = shaper, sink
        self.queue: deque[tuple[float, int, bytes]] = deque()
        self.ready = threading.Condition()
        self.last_due = 0.0
        self.closed = False

    def put(self, data: bytes) -> None:
        shaper = self.shaper
        with shaper.lock:
            shaper.read_seq += 1
            seq = shaper.read_seq
            wait = shaper.shape.wait_s(shaper.rng)
        with self.ready:
            self.last_due = max(self.last_due, time.monotonic() + wait)
            self.queue.append((self.last_due, seq, data))
            self.ready.notify()

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify()

    def deliver(self) -> None:
        """Send each chunk once it is due; stop on close (after what is queued) or error."""
        try:
            while True:
                with self.ready:
                    while not self.queue and not self.closed:
                        self.ready.wait()
                    if not self.queue:
                        return
                    due, seq, data = self.queue[0]
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                with self.ready:
                    self.queue.popleft()
                with self.shaper.lock:
                    if seq < self.shaper.delivered_seq:
                        self.shaper.reordered += 1
                    self.shaper.delivered_seq = max(self.shaper.delivered_seq, seq)
                self.sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                self.sink.shutdown(socket.SHUT_WR)


class Shaper:
    """Forwards connections from ``listen`` (a bound, listening socket) to ``target``
    through sockets ``make_socket`` makes (in the namespace it chooses); see the module."""

    def __init__(self, name: str, listen: socket.socket, target: tuple[str, int],
                 make_socket: Callable[[], socket.socket], seed: int) -> None:
        self.name, self.target = name, target
        self._listen, self._make_socket = listen, make_socket
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.shape = Shape()
        self.read_seq = 0
        self.delivered_seq = 0
        self.reordered = 0
        self.connections = 0
        self.refused = 0
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._accepter = threading.Thread(target=self._accept, name=f"shaper-{name}",
                                          daemon=True)

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._listen.getsockname()[1])

    def start(self) -> Shaper:
        """Accept connections on a thread of its own."""
        self._accepter.start()
        return self

    def set_shape(self, shape: Shape) -> None:
        """Shape every chunk read from now on (``Shape()``: forward at once)."""
        with self.lock:
            self.shape = shape

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(client,),
                                      name=f"shaper-{self.name}-conn", daemon=True)
            with self.lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _upstream(self) -> socket.socket | None:
        upstream = self._make_socket()
        try:
            upstream.setsockopt(socket.IPPROTO_TCP, _TCP_USER_TIMEOUT, _USER_TIMEOUT_MS)
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            upstream.settimeout(_CONNECT_TIMEOUT_S)
            upstream.connect(self.target)
            upstream.settimeout(None)
        except OSError:
            upstream.close()
            return None
        return upstream

    def _serve(self, client: socket.socket) -> None:
        upstream = self._upstream()
        if upstream is None:  # refused or unreachable: the client sees its connection close
            with self.lock:
                self.refused += 1
            client.close()
            return
        with self.lock:
            self.connections += 1
            self._open.update((client, upstream))
        outbound, inbound = _Direction(self, upstream), _Direction(self, client)
        deliverers = [threading.Thread(target=d.deliver, daemon=True,
                                       name=f"shaper-{self.name}-out") for d in (outbound,
                                                                                 inbound)]
        for thread in deliverers:
            thread.start()
        reader = threading.Thread(target=self._pump, args=(upstream, inbound), daemon=True,
                                  name=f"shaper-{self.name}-in")
        reader.start()
        self._pump(client, outbound)
        reader.join()
        for thread in deliverers:
            thread.join(timeout=_JOIN_S)
        with self.lock:
            self._open.difference_update((client, upstream))
        for sock in (client, upstream):
            sock.close()

    @staticmethod
    def _pump(source: socket.socket, direction: _Direction) -> None:
        try:
            while True:
                data = source.recv(_CHUNK)
                if not data:
                    break
                direction.put(data)
        except OSError:
            pass
        direction.close()
        # The other side learns of the end once what is queued went out (``deliver``).

    def stop(self) -> None:
        """Close the listener and every connection; join the threads (bounded)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listen.shutdown(socket.SHUT_RDWR)
        self._listen.close()
        with self.lock:
            sockets, threads = list(self._open), list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._accepter.join(timeout=_JOIN_S)
        for thread in threads:
            thread.join(timeout=_JOIN_S)
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck or self._accepter.is_alive():
            raise errors.ProvisioningError(f"shaper {self.name}: threads did not stop within "
                                           f"{_JOIN_S:g} s: {stuck[:3]}")

    def report(self) -> dict[str, int]:
        """What it forwarded, for the evidence."""
        with self.lock:
            return {"connections": self.connections, "refused": self.refused,
                    "chunks": self.read_seq, "reordered": self.reordered}
