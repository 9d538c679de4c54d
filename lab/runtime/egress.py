"""A process-wide guard: no socket of this process may connect outside loopback.

``boundaries`` refuses unsafe targets by their spelling; this guard checks
what actually happens. It is a ``sys.addaudithook`` on ``socket.connect``,
installed in the test process and in every worker process, so even code that
bypassed the boundary checks could not reach another host.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
from typing import Any

from lab import errors, loopback

_installed = False
_lock = threading.Lock()
connections = {"loopback": 0, "unix": 0}


def _check(event: str, args: tuple[Any, ...]) -> None:
    if event != "socket.connect":
        return
    sock, address = args[0], args[1]
    family = getattr(sock, "family", None)
    if family == socket.AF_UNIX:
        connections["unix"] += 1
        return
    if family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple):
        try:
            local = ipaddress.ip_address(str(address[0]).split("%")[0]).is_loopback
        except ValueError:
            local = False
        # The run's own lab hosts, exactly their addresses (lab.loopback.host_addresses).
        if not local and str(address[0]) not in loopback.host_addresses():
            raise errors.BoundaryViolation(
                f"egress guard: connection to {address[0]!r} refused (loopback only)"
            )
        connections["loopback"] += 1


def install() -> None:
    """Install the guard once for this process (audit hooks cannot be removed)."""
    global _installed
    with _lock:
        if not _installed:
            sys.addaudithook(_check)
            _installed = True
