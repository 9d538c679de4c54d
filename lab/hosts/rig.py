"""Beyond one host: the workflow database replicated across two lab hosts, the credit tool
and its ledger on a host of their own, and worker processes on hosts of theirs.

``HostRig`` builds, for one experiment:

- hosts ``db1`` and ``db2``: the workflow database, a primary and a streaming standby
  (``lab.hosts.replication``, synchronous or not);
- host ``ledger``: the credit tool's own server, a separate failure domain, and the tool
  as an OS process (``lab.runtime.toolprocess``). The tool serves on its host's
  loopback; a relay process inside the same host publishes that port on the host's
  address (the tool itself is unchanged);
- hosts ``w1`` and ``w2``: ``lab worker`` processes, exec'd from a thread inside their
  host (never forked from the fork server, which lives outside every host), reaching the
  database through the multi-host read-write DSN.

The experiment reaches both servers over unix sockets (it lives on no host).
``close`` stops everything in reverse order, pass or fail.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from lab import errors, protocol, redact
from lab.hosts import netfaults, network, replication
from lab.pg import faketime
from lab.runtime import processes, sealing, store

# What each host holds, as the evidence states it (the book draws the hosts from it).
ROLES = {
    "db1": "workflow database: primary at the start",
    "db2": "workflow database: streaming standby",
    "ledger": "credit tool and its ledger's server",
    "w1": "lab worker",
    "w2": "lab worker",
}
HOSTS = list(ROLES)
_READY_S = 60.0

# Publishes a port of the host's loopback on the host's address, one thread per direction
# of each connection; a refused upstream (the tool is down) closes the client's connection.
_RELAY = r"""
import socket, sys, threading
address, target = sys.argv[1], int(sys.argv[2])
server = socket.create_server((address, 0))
def orphaned():
    sys.stdin.read()  # EOF: whoever started the relay closed the pipe or died
    import os
    os._exit(0)
threading.Thread(target=orphaned, daemon=True).start()
print(server.getsockname()[1], flush=True)
def pipe(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
def serve(client):
    try:
        upstream = socket.create_connection(("127.0.0.1", target), timeout=5)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
    pipe(upstream, client)
    client.close()
    upstream.close()
while True:
    client, _ = server.accept()
    threading.Thread(target=serve, args=(client,), daemon=True).start()
"""


class HostRig:
    """The hosts, the replicated database, the ledger and the tool; see the module."""

    def __init__(self, mode: str, *, idempotent: bool = True) -> None:
        self.mode = mode
        self.idempotent = idempotent
        self.token = secrets.token_urlsafe(24)
        redact.remember(self.token)
        self.hosts = network.Hosts(HOSTS)
        self.faults = netfaults.Faults(self.hosts)
        self.pair: replication.Replicated | None = None
        self.ledger: replication.Replicated | None = None
        self.tool: processes.WorkerProcess | None = None
        self.endpoint = ""
        self.workers: list[processes.WorkerProcess] = []
        self._stack = contextlib.ExitStack()
        self._schema = ""
        self._keys: sealing.KeyCatalog | None = None
        self._on_event: Callable[[str, str], None] | None = None

    def __enter__(self) -> HostRig:
        try:
            self._stack.enter_context(self.hosts)
            self.pair = self._stack.enter_context(
                replication.Replicated(self.hosts, "db1", "db2", mode=self.mode))
            self.ledger = self._stack.enter_context(
                replication.Replicated(self.hosts, "ledger", None))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the workers and the tool, stop the servers, tear the hosts down."""
        for child in [*self.workers, *([self.tool] if self.tool else [])]:
            child.cleanup()
        self._stack.close()

    # -- the database and the ledger -------------------------------------------------------

    def database_dsn(self) -> str:
        """The workflow database for the experiment: unix sockets, the primary's."""
        assert self.pair is not None
        return self.pair.local_dsn()

    def ledger_dsn(self) -> str:
        """The tool's ledger for the experiment: its server's unix socket."""
        assert self.ledger is not None
        return self.ledger.local_dsn()

    # -- the tool and the workers ----------------------------------------------------------

    def start_tool(self, schema: str, keys: sealing.KeyCatalog,
                   on_event: Callable[[str, str], None] | None = None,
                   *flags: str) -> processes.WorkerProcess:
        """The credit tool on host ``ledger`` (its ledger in ``schema`` of the ledger's
        server), published on the host's address; ``flags`` as ``toolprocess`` takes."""
        assert self.ledger is not None
        self._schema, self._keys, self._on_event = schema, keys, on_event
        host = self.hosts["ledger"]
        argv = [sys.executable, "-m", "lab.runtime.toolprocess", "--schema", schema,
                "--port", "0", *([] if self.idempotent else ["--non-idempotent"]), *flags]
        inside = self.ledger.client_dsn().replace(host.address, "127.0.0.1")
        env = {**processes.child_env(inside), protocol.TOKEN_ENV: self.token,
               "PYTHONUNBUFFERED": "1", **self.hosts.env()}
        self.tool = host.inside(lambda: processes.WorkerProcess(argv, env, "tool", on_event,
                                                                fork=False))
        port = int(self.tool.wait_for(protocol.READY, timeout=_READY_S).split()[1])
        relay = host.popen([sys.executable, "-I", "-S", "-c", _RELAY, host.address, str(port)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        self.endpoint = f"http://{host.address}:{_first_line(relay, 'the tool relay')}"
        self.hosts.record("tool", host="ledger", endpoint=self.endpoint)
        return self.tool

    def spawn_worker(self, host: str, name: str, *extra: str,
                     clock_offset_s: int = 0) -> processes.WorkerProcess:
        """``lab worker`` as an OS process on lab host ``host``, on the replicated database
        (multi-host, read-write) and the tool's published endpoint; with
        ``clock_offset_s``, its wall clock (and its host's, for it) that far from real time
        (``clock_env``)."""
        assert self.pair is not None and self.endpoint, "start the tool first"
        argv = [sys.executable, "-m", "lab.cli", "worker", "--schema", self._schema,
                "--tool", self.endpoint, "--name", name, *extra]
        env = {**processes.child_env(self.pair.client_dsn(), self._keys),
               protocol.TOKEN_ENV: self.token, "PYTHONUNBUFFERED": "1", **self.hosts.env(),
               **self.clock_env(clock_offset_s)}
        if clock_offset_s:
            self.hosts.record("clock", host=host, process=name,
                              offset=f"{clock_offset_s:+d} s")
        child = self.hosts[host].inside(
            lambda: processes.WorkerProcess(argv, env, name, self._on_event, fork=False))
        self.workers.append(child)
        return child

    @staticmethod
    def clock_env(offset_s: int) -> dict[str, str]:
        """What a process needs in its environment for its wall clock to run ``offset_s``
        seconds from real time: libfaketime preloaded (``lab.pg.faketime``). Its monotonic
        clock stays real, so its timeouts and deadlines still measure real seconds.
        Nothing for 0."""
        if not offset_s:
            return {}
        return {"LD_PRELOAD": str(faketime.find_faketime()), "FAKETIME": f"{offset_s:+d}",
                "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}

    def wall_clock_offset(self, host: str, offset_s: int) -> float:
        """How far from real time a process started on ``host`` with ``clock_env(offset_s)``
        finds its wall clock, in seconds: the skew checked, not assumed."""
        probe = self.hosts[host].popen(
            [sys.executable, "-I", "-S", "-c", "import time; print(time.time())"],
            env={**os.environ, **self.clock_env(offset_s)}, stdout=subprocess.PIPE,
            text=True)
        before = time.time()
        out, _ = probe.communicate(timeout=_READY_S)
        return float(out.strip()) - (before + time.time()) / 2

    def tool_requests(self) -> dict[str, int]:
        """``{"call": n, "lookup": m}``: what the tool process said it received."""
        counts = {"call": 0, "lookup": 0}
        if self.tool is not None:
            for text in self.tool.all_lines():
                if text.startswith(f"{protocol.REQUEST} "):
                    counts[text.split()[1]] = counts.get(text.split()[1], 0) + 1
        return counts

    def ledger_effects(self) -> int:
        """How many effects the tool's ledger holds (on its own server)."""
        db = store.Store.open(self.ledger_dsn(), self._schema, max_connections=1)
        try:
            return int(db.execute("SELECT count(*) AS n FROM tool_effects")[0]["n"])
        finally:
            db.close()

    def topology(self) -> dict[str, Any]:
        """Hosts, addresses, roles and what happened to the network, for the evidence."""
        assert self.pair is not None
        return {**self.hosts.topology(), "roles": dict(ROLES),
                "replication": self.pair.describe(),
                "events": list(self.hosts.events), "failover": list(self.pair.steps)}


def _first_line(child: subprocess.Popen[str], what: str) -> str:
    """The first line ``child`` writes, waited for with a deadline."""
    assert child.stdout is not None
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([child.stdout], [], [], 0.1)
        if ready:
            line = child.stdout.readline().strip()
            if line:
                return line
            break
        if child.poll() is not None:
            break
    raise errors.ProvisioningError(f"{what} did not start within {_READY_S:g} s")
