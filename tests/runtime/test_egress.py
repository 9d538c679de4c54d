"""The egress guard refuses real connections outside loopback, whatever the code."""

from __future__ import annotations

import socket

import pytest

from lab import errors
from lab.runtime import egress


def test_non_loopback_connect_is_refused_before_any_packet():
    egress.install()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        with pytest.raises(errors.BoundaryViolation, match="loopback only"):
            sock.connect(("192.0.2.1", 9))


def test_loopback_connect_is_allowed():
    egress.install()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname(), timeout=2):
            pass
