"""A replicated PostgreSQL on lab hosts: a primary and a streaming standby, and failover.

Each server is the lab's own embedded cluster (``lab.pg.postmaster.Embedded``: root-safe,
run as ``nobody`` when we are root, reaped if we die; in RAM with fsync off unless
``durable``: on disk with fsync on, which ``lab bench throughput --replicated`` asks for,
since it measures commits), launched from a thread inside its lab host, so it listens on
that host's address. The standby is made with ``pg_basebackup`` from the primary and
streams from it over the bridge.

- ``sync``: the primary's ``synchronous_standby_names`` names the standby and
  ``synchronous_commit=on``: a commit is acknowledged once the standby has flushed it.
  ``remote_apply``: once the standby has applied it. ``async``: once the primary alone has.
- Clients on hosts reach it through ``client_dsn()``: a libpq multi-host DSN with
  ``target_session_attrs=read-write``, so after a failover they find the new primary. The
  experiment itself, outside every host, reaches the servers by their unix sockets
  (``local_dsn()``, the same multi-host form).
- ``failover()`` is performed and recorded step by step: the old primary is fenced
  (its whole process group SIGKILLed, as a host dies), the standby promoted, and, with
  no standby left, the new primary told to commit alone (recorded as such); ``rejoin()``
  then brings the old primary back as a standby with ``pg_rewind``.

The administrative statements here (promote, replication state) are the server's own
functions, not the workflow store's SQL, which stays in ``lab.runtime.store``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo, sql

from lab import errors
from lab.hosts.network import Host, Hosts
from lab.pg.binaries import DISK_DIR, SUPERUSER, Runner, cache_root, runner_for
from lab.pg.cluster import find_binaries
from lab.pg.embedded import run_parent
from lab.pg.postmaster import Embedded
from lab.pg.template import cached_template, copy_tree, initdb

PORT = 5432
MODES = ("sync", "remote_apply", "async")
_READY_TIMEOUT = 60.0
# Replication over the bridge; the unix socket for pg_basebackup, as the server user.
_HBA = ("local replication all trust\n"
        "host replication postgres 169.254.0.0/16 scram-sha-256\n"
        "host all all 169.254.0.0/16 scram-sha-256\n")
# Quick to notice a dead peer: a failover in a test must not wait a minute for a timeout.
_SETTINGS = ("wal_level = replica", "max_wal_senders = 8", "wal_keep_size = '64MB'",
             "wal_log_hints = on", "hot_standby = on", "wal_sender_timeout = '5s'",
             "wal_receiver_timeout = '5s'", "wal_retrieve_retry_interval = '200ms'")


@dataclass
class Node:
    """One server of the pair: its name (the host's), host, cluster and role."""

    name: str
    host: Host
    cluster: Embedded
    role: str  # primary, standby or fenced

    @property
    def socket_dir(self) -> str:
        """Where its unix socket is (reachable from outside every host)."""
        return str(self.cluster.base)


@dataclass
class Replicated:
    """A primary and a standby on two lab hosts; see the module. Use as a context manager."""

    hosts: Hosts
    primary_host: str
    standby_host: str | None  # None: a server alone (the credit tool's ledger, say)
    mode: str = "sync"
    environ: Mapping[str, str] | None = None
    durable: bool = False  # fsync and synchronous commits on, on disk: a benchmark's servers
    nodes: list[Node] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    _password: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    _version: str = ""
    _t0: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise errors.UsageError(f"replication mode must be one of {', '.join(MODES)}")
        if self.primary_host == self.standby_host:
            raise errors.UsageError("the primary and the standby need hosts of their own")

    # -- reading ---------------------------------------------------------------------------

    @property
    def primary(self) -> Node:
        """The node that is primary now."""
        return next(node for node in self.nodes if node.role == "primary")

    def client_dsn(self, **extra: str) -> str:
        """The multi-host DSN a process on a lab host uses (read-write sessions only)."""
        return conninfo.make_conninfo(
            host=",".join(node.host.address for node in self.nodes),
            port=",".join(str(PORT) for _ in self.nodes), user=SUPERUSER,
            password=self._password, dbname="postgres", target_session_attrs="read-write",
            connect_timeout="2", keepalives_idle="2", keepalives_interval="1",
            keepalives_count="2", tcp_user_timeout="4000", **extra)

    def local_dsn(self, node: Node | None = None) -> str:
        """A DSN over unix sockets for the experiment itself: ``node`` only, or every node
        with ``target_session_attrs=read-write`` (it follows the primary)."""
        chosen = [node] if node is not None else self.nodes
        extra = {} if node is not None else {"target_session_attrs": "read-write"}
        return conninfo.make_conninfo(
            host=",".join(n.socket_dir for n in chosen), port=",".join(str(PORT) for _ in chosen),
            user=SUPERUSER, dbname="postgres", connect_timeout="5", **extra)

    def describe(self) -> dict[str, Any]:
        """What the pair is, for the evidence (no password)."""
        return {"mode": self.mode, "nodes": {n.name: {"host": n.host.address, "role": n.role}
                                            for n in self.nodes},
                "server_version": self._version}

    # -- starting --------------------------------------------------------------------------

    def __enter__(self) -> Replicated:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record(self, step: str, **detail: Any) -> None:
        """Note one step (seconds since the pair was asked for)."""
        self.steps.append({"t": round(time.monotonic() - self._t0, 3), "step": step, **detail})

    def _start(self) -> None:
        env = os.environ if self.environ is None else self.environ
        bindir = find_binaries(env)
        if bindir is None:
            raise errors.ProvisioningError("no PostgreSQL server binaries found for the "
                                           "replicated pair")
        root = cache_root(None, env)
        runner, self._version = runner_for(bindir, root)
        template = cached_template(runner, self._version, root) if root is not None else None
        primary = self._node(runner, self.primary_host, "primary")
        if template is not None:
            copy_tree(runner, template / "data", primary.cluster.data)
        else:
            self._empty_data(runner, primary.cluster)
            initdb(runner, primary.cluster.data)
        with open(primary.cluster.data / "pg_hba.conf", "a", encoding="ascii") as hba:
            hba.write(_HBA)
        # In the data directory, not on the command line: pg_basebackup carries them to the
        # standby, and pg_rewind's own crash recovery reads them (wal_log_hints above all).
        with open(primary.cluster.data / "postgresql.auto.conf", "a", encoding="ascii") as conf:
            conf.write("".join(f"{setting}\n" for setting in _SETTINGS))
        self._launch(primary)
        self._sql(primary, sql.SQL("ALTER ROLE {} PASSWORD {}").format(
            sql.Identifier(SUPERUSER), sql.Literal(self._password)))
        self.record("primary started", node=primary.name)
        if self.standby_host is None:
            return
        standby = self._node(runner, self.standby_host, "standby")
        self._empty_data(runner, standby.cluster)
        runner.run("pg_basebackup", "-D", str(standby.cluster.data), "-h", primary.socket_dir,
                   "-p", str(PORT), "-U", SUPERUSER, "-X", "stream", "-c", "fast", "-N",
                   timeout=_READY_TIMEOUT)
        self.record("pg_basebackup", source=primary.name, target=standby.name)
        self._follow(runner, standby, primary)
        self._launch(standby)
        self._wait_streaming(primary, standby)
        if self.mode != "async":
            self._set_sync(primary, standby.name)
        self.record("replicating", mode=self.mode, primary=primary.name, standby=standby.name)

    def _node(self, runner: Runner, host_name: str, role: str) -> Node:
        # A durable server on disk, as the lab's own durable embedded server: in RAM an
        # fsync costs nothing and a benchmark would understate every commit.
        parent = DISK_DIR if self.durable else run_parent()
        base = Path(tempfile.mkdtemp(prefix="lab-pg-", dir=parent))
        runner.give(base)
        cluster = Embedded(runner, base, durable=self.durable)
        host = self.hosts[host_name]
        cluster.listen = f"127.0.0.1,{host.address}"
        node = Node(host_name, host, cluster, role)
        self.nodes.append(node)
        return node

    @staticmethod
    def _empty_data(runner: Runner, cluster: Embedded) -> None:
        cluster.data.mkdir(mode=0o700)
        runner.give(cluster.data)

    @staticmethod
    def _launch(node: Node) -> None:
        node.host.inside(lambda: node.cluster.launch(PORT))

    def _follow(self, runner: Runner, standby: Node, primary: Node) -> None:
        """Make ``standby`` a standby of ``primary``: ``standby.signal`` and its
        ``primary_conninfo`` (in a file only the server user reads: it holds the password)."""
        follow = conninfo.make_conninfo(
            host=primary.host.address, port=str(PORT), user=SUPERUSER, password=self._password,
            application_name=standby.name, connect_timeout="2")
        auto = standby.cluster.data / "postgresql.auto.conf"
        with open(auto, "a", encoding="utf-8") as conf:
            conf.write(f"primary_conninfo = '{_quote(follow)}'\n")
        signal_file = standby.cluster.data / "standby.signal"
        signal_file.touch(mode=0o600)
        runner.give(signal_file)
        runner.give(auto)

    # -- the servers' own functions --------------------------------------------------------

    def _sql(self, node: Node, statement: sql.Composed | str,
             params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        try:
            with psycopg.connect(self.local_dsn(node), autocommit=True) as conn:
                cursor = conn.execute(statement, params)
                return cursor.fetchall() if cursor.description else []
        except psycopg.Error as exc:
            text = str(exc).strip().splitlines() or [type(exc).__name__]
            raise errors.ProvisioningError(
                f"replicated PostgreSQL, {node.name}: {text[0].replace(self._password, '***')}"
            ) from None

    def wait_until(self, what: str, check: Any, within: float = _READY_TIMEOUT) -> None:
        """Poll ``check()`` every 50 ms until true; a one-line error naming ``what`` after
        ``within`` seconds."""
        deadline = time.monotonic() + within
        while not check():
            if time.monotonic() >= deadline:
                raise errors.ProvisioningError(f"replicated PostgreSQL: {what} did not happen "
                                               f"within {within:g} s")
            time.sleep(0.05)

    def _wait_streaming(self, primary: Node, standby: Node, sync: bool = False) -> None:
        state = "sync" if sync else "async"

        def streaming() -> bool:
            rows = self._sql(primary, "SELECT sync_state FROM pg_stat_replication "
                             "WHERE application_name = %s AND state = 'streaming'",
                             (standby.name,))
            return bool(rows) and (not sync or rows[0][0] == state)

        self.wait_until(f"{standby.name} streaming from {primary.name}", streaming)

    def _set_sync(self, primary: Node, standby_name: str) -> None:
        level = "remote_apply" if self.mode == "remote_apply" else "on"
        self._sql(primary, sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(
            sql.Literal(standby_name)))
        self._sql(primary, sql.SQL("ALTER SYSTEM SET synchronous_commit = {}").format(
            sql.Literal(level)))
        self._sql(primary, "SELECT pg_reload_conf()")
        standby = next(node for node in self.nodes if node.name == standby_name)
        self._wait_streaming(primary, standby, sync=True)

    def replay_lag_bytes(self) -> int:
        """How many bytes of WAL the primary has written that the standby has not replayed."""
        rows = self._sql(self.primary, "SELECT coalesce(max(pg_wal_lsn_diff("
                         "pg_current_wal_lsn(), replay_lsn)), 0)::bigint FROM pg_stat_replication")
        return int(rows[0][0]) if rows else 0

    # -- failover --------------------------------------------------------------------------

    def fence(self) -> Node:
        """Step 1: the old primary is killed, with every backend (its process group): it
        acknowledges nothing from now on. This is weaker than its host dying: the host's
        kernel lives on and still delivers what the server had already written to its
        sockets, WAL on its way to the standby included, once the network lets it. A
        failover that must lose that too partitions the old primary first and keeps it
        cut off until it rejoins (as chapter 17's asynchronous failover does)."""
        old = self.primary
        postmaster = old.cluster.postmaster
        if postmaster is not None and postmaster.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(postmaster.pid, signal.SIGKILL)
            postmaster.wait(timeout=30)
        old.role = "fenced"
        self.record("fenced", node=old.name, how="SIGKILL of its process group")
        return old

    def promote(self) -> Node:
        """Step 2: the standby is promoted (``pg_promote``) and, alone now, told to commit
        without waiting for a standby (recorded: the pair no longer replicates)."""
        new = next(node for node in self.nodes if node.role == "standby")
        self._sql(new, "SELECT pg_promote(true, 30)")
        self.wait_until(f"{new.name} to leave recovery",
                   lambda: not self._sql(new, "SELECT pg_is_in_recovery()")[0][0])
        new.role = "primary"
        self.record("promoted", node=new.name)
        if self.mode != "async":
            # Else every commit would wait for a standby that is gone: the pair is one now.
            self._sql(new, "ALTER SYSTEM SET synchronous_standby_names = ''")
            self._sql(new, "SELECT pg_reload_conf()")
            self.record("commits alone", node=new.name, why="no standby left to wait for")
        return new

    def rejoin(self) -> Node:
        """Step 3: the fenced old primary rejoins as a standby of the new one: ``pg_rewind``
        (after the crash recovery it runs itself) winds its data back to where the timelines
        forked, it follows the new primary, and a synchronous pair is synchronous again."""
        old = next(node for node in self.nodes if node.role == "fenced")
        new = self.primary
        runner = old.cluster.runner
        # Until the new primary checkpoints, its control file still names the old timeline
        # and pg_rewind would find "no rewind required" on a history that forked.
        self._sql(new, "CHECKPOINT")
        source = conninfo.make_conninfo(host=new.socket_dir, port=str(PORT), user=SUPERUSER,
                                        dbname="postgres")
        runner.run("pg_rewind", "--target-pgdata", str(old.cluster.data),
                   "--source-server", source, timeout=_READY_TIMEOUT)
        self.record("pg_rewind", node=old.name, source=new.name)
        self._follow(runner, old, new)
        self._launch(old)
        old.role = "standby"
        self._wait_streaming(new, old)
        if self.mode != "async":
            self._set_sync(new, old.name)
        # Streaming is not following: a standby on the wrong timeline streams and stalls.
        self.wait_until(f"{old.name} to replay everything {new.name} wrote",
                        lambda: self.replay_lag_bytes() == 0)
        self.record("rejoined", node=old.name, primary=new.name, mode=self.mode)
        return old

    def failover(self) -> list[dict[str, Any]]:
        """Fence the primary, promote the standby; the steps recorded (``steps``)."""
        self.fence()
        self.promote()
        return [step for step in self.steps if step["step"] in ("fenced", "promoted",
                                                               "commits alone")]

    # -- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every server and remove its directory (through its reaper)."""
        for node in self.nodes:
            node.cluster.stop()


def _quote(value: str) -> str:
    """A value inside single quotes of a PostgreSQL configuration file."""
    return value.replace("\\", "\\\\").replace("'", "''")
