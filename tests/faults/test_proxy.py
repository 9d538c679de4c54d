"""The fault proxy forwards, holds (blackhole), resets and delays a real loopback link."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from lab import errors
from lab.faults.proxy import BLACKHOLE, RESET, Proxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(4096):
                self.request.sendall(data)
        except ConnectionResetError:  # the proxy's reset reached us: that is the test
            return


@pytest.fixture
def echo() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture
def proxy(echo: int) -> Iterator[Proxy]:
    with Proxy("127.0.0.1", echo, "test") as running:
        yield running


def _connect(proxy: Proxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    sock.settimeout(5)
    return sock


def _was_reset(sock: socket.socket | None, proxy: Proxy | None = None) -> bool:
    """Whether a round trip (on ``sock``, or a new connection to ``proxy``) is cut off."""
    try:
        if sock is None:
            assert proxy is not None
            sock = _connect(proxy)
        sock.sendall(b"y")
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_it_forwards_both_ways(proxy: Proxy) -> None:
    with _connect(proxy) as sock:
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"
    assert proxy.connections == 1


def test_a_blackhole_holds_data_until_the_link_heals(proxy: Proxy) -> None:
    with _connect(proxy) as sock:
        sock.sendall(b"one")
        assert sock.recv(3) == b"one"
        proxy.partition(BLACKHOLE)
        sock.sendall(b"two")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(3)
        proxy.heal()
        sock.settimeout(5)
        assert sock.recv(3) == b"two"


def test_a_reset_aborts_open_links_and_refuses_new_ones_until_healed(proxy: Proxy) -> None:
    with _connect(proxy) as sock:
        sock.sendall(b"x")
        assert sock.recv(1) == b"x"
        proxy.partition(RESET)
        assert _was_reset(sock)
    assert _was_reset(None, proxy)
    proxy.heal()
    with _connect(proxy) as after:
        after.sendall(b"ok")
        assert after.recv(2) == b"ok"
    assert proxy.resets >= 2


def test_latency_delays_each_chunk(proxy: Proxy) -> None:
    proxy.set_latency(0.2)
    with _connect(proxy) as sock:
        began = time.monotonic()
        sock.sendall(b"slow")
        assert sock.recv(4) == b"slow"
        # One delay each way: a lower bound that the fault was applied, not a speed target.
        assert time.monotonic() - began >= 0.4


def test_only_loopback_targets_and_known_modes(proxy: Proxy) -> None:
    with pytest.raises(errors.BoundaryViolation):
        Proxy("10.1.2.3", 5432)
    with pytest.raises(errors.UsageError):
        proxy.partition("flood")
