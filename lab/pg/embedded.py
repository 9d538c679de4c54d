"""The embedded PostgreSQL cluster: local server binaries behind our own root-safe launcher.

Given the server binaries (``lab.pg.cluster.find_binaries`` finds them), it starts a
throwaway cluster on 127.0.0.1: a free port,
its socket in a private directory, a password generated for the run. Its data directory is a
copy of a cached, initialised template (falling back to ``initdb``), in /dev/shm when that has
room, else /tmp. PostgreSQL refuses to run as root, so as root the cluster runs as
``nobody``. A reaper process outlives this one: if the process that started the cluster
dies, even by SIGKILL, the reaper stops the postmaster and removes the directory.

By default the cluster runs with fsync off (nothing in it must outlive the run). A durable
cluster (``durable=True``) runs with ``fsync=on`` and ``synchronous_commit=on`` on disk, for
runs that crash the server itself: ``Server.crash_restart`` SIGKILLs the postmaster and
starts a new one on the same data directory and port, which must recover from its WAL.

The parts live beside it: ``binaries`` (the programs, who runs them, the cache's
directory), ``template`` (the cached initialised cluster) and ``postmaster`` (one running
cluster and its reaper). ``lab.pg.cluster`` chooses between this and the other providers.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import conninfo, sql

from lab import errors, protocol
from lab.pg.binaries import (
    CACHE_ENV,
    DISK_DIR,
    RAM_DIR,
    SERVER_USER,
    SUPERUSER,
    Runner,
    cache_root,
    discard,
    runner_for,
)
from lab.pg.faketime import find_faketime
from lab.pg.postmaster import Embedded, Volume, free_port
from lab.pg.template import cached_template, copy_tree, initdb

log = logging.getLogger("lab.pg.cluster")

__all__ = ["METHODS", "Server", "Volume", "server_version", "start_embedded"]

METHODS = ("auto", "initdb", "cached-copy")
_MIN_RAM_FREE = 1 << 30  # below this much free in /dev/shm (64 MB in Docker), use /tmp


def _redact(message: str, dsn: str) -> str:
    try:
        password = conninfo.conninfo_to_dict(dsn).get("password")
    except psycopg.Error:
        return "(details withheld: the DSN could not be parsed)"
    if password:
        message = message.replace(str(password), "***")
    return message


def server_version(dsn: str, what: str) -> str:
    """The ``server_version`` the server at ``dsn`` reports; ``errors.ProvisioningError``
    naming ``what`` (the password redacted) when it cannot be read."""
    try:
        with psycopg.connect(dsn, connect_timeout=10, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
    except psycopg.Error as exc:
        raise errors.ProvisioningError(
            f"could not read server_version from {what}: {_redact(str(exc).strip(), dsn)}"
        ) from None
    if row is None:
        raise errors.ProvisioningError(f"{what} returned no server_version")
    return str(row[0])


def start_embedded(
    bindir: Path,
    method: str = "auto",
    cache_dir: Path | None = None,
    environ: Mapping[str, str] | None = None,
    durable: bool = False,
    volume: Volume | None = None,
    faketime: bool = False,
) -> Server:
    """Start a throwaway cluster on 127.0.0.1 from the server binaries in ``bindir``.

    ``durable``: fsync and synchronous commits on, data on disk (see the module).
    ``volume``: the data directory on a size-limited filesystem (disk-full faults; root).
    ``faketime``: the server under libfaketime, its clock steppable (``Server.set_clock``).

    ``method``: ``"cached-copy"`` copies a cached initialised template (built on first use),
    ``"initdb"`` initialises afresh, ``"auto"`` copies when the cache is usable and falls
    back to ``initdb`` otherwise, or when a copied cluster fails to start. The cache lives in
    ``LAB_PG_CACHE`` (``off`` disables it), else ``$XDG_CACHE_HOME/durable-agent-lab``, or
    ``/var/tmp/durable-agent-lab`` for root.
    """
    if method not in METHODS:
        raise errors.ProvisioningError(f"unknown method {method!r}; choose one of {METHODS}")
    env = os.environ if environ is None else environ
    options = _Options(volume, find_faketime(env) if faketime else None)
    if volume is not None:
        volume.validate()
        if os.geteuid() != 0:
            raise errors.ProvisioningError(
                "a size-limited data directory (disk-full faults) needs root to mount a "
                "tmpfs or a loop device; run as root or leave the disk-full fault off"
            )
    root = cache_root(cache_dir, env)
    runner, version = runner_for(bindir, root)
    if method == "cached-copy" and root is None:
        raise errors.ProvisioningError(f"method 'cached-copy' needs a cache, but {CACHE_ENV}=off")
    template: Path | None = None
    if method != "initdb" and root is not None:
        try:
            template = cached_template(runner, version, root)
        except (OSError, errors.ProvisioningError) as exc:
            if method == "cached-copy":
                raise errors.ProvisioningError(f"cannot use the template cache: {exc}") from exc
            log.warning("template cache unusable, using initdb: %s", exc)
    try:
        return _start_cluster(runner, version, template, durable, options)
    except errors.ProvisioningError as exc:
        if template is None or method == "cached-copy" or "mount" in str(exc):
            raise
        log.warning("a copy of %s failed (%s): discarding it, using initdb", template, exc)
        discard(template)
        return _start_cluster(runner, version, None, durable, options)


def run_parent() -> str:
    """Where a run's cluster lives: in RAM when /dev/shm has room, else /tmp.

    Nothing in the cluster has to survive the run, and writing the data directory to disk
    was most of the start time on a busy machine (about 1 s against 0.1 s for the copy).
    Both are short and outside root's home: the socket path must fit in 107 bytes, and the
    server user must be able to reach it.
    """
    try:
        st = os.statvfs(RAM_DIR)
    except OSError:
        return DISK_DIR
    if st.f_bavail * st.f_frsize >= _MIN_RAM_FREE and os.access(RAM_DIR, os.W_OK | os.X_OK):
        return RAM_DIR
    return DISK_DIR


@dataclass(frozen=True)
class Server:
    """A running embedded cluster: where to reach it, how it came to be, how to stop it."""

    dsn: str = field(repr=False)
    server_version: str
    details: dict[str, str]
    cluster: Embedded

    def stop(self) -> None:
        """Stop the postmaster and remove its directory (through the reaper)."""
        self.cluster.stop()

    def crash_restart(self) -> float:
        """SIGKILL the postmaster and restart it on the same data; the seconds it was down."""
        return self.cluster.crash_restart()

    @property
    def volume(self) -> str:
        """The bounded filesystem the data directory is on (tmpfs, loop), or ''."""
        return self.cluster.volume_used

    @property
    def steppable(self) -> bool:
        """Whether the server runs under libfaketime (its clock can be stepped)."""
        return self.cluster.faketime is not None

    def fill_disk(self, leave: int = 0) -> int:
        """Fill the data directory's filesystem with ballast (to ``leave`` bytes free);
        the bytes written."""
        return self.cluster.fill_ballast(leave)

    def free_disk(self) -> None:
        """Delete the ballast."""
        self.cluster.free_ballast()

    def disk_free(self) -> int:
        """Bytes free on the data directory's filesystem."""
        return self.cluster.volume_free()

    def set_clock(self, offset_s: int) -> None:
        """Step the server's wall clock to ``offset_s`` seconds off the real one."""
        self.cluster.set_clock_offset(offset_s)

    def revive(self, recovery_limit: float = 30.0) -> bool:
        """Restart a postmaster that exited by itself, or whose server does not answer
        within ``recovery_limit`` seconds; True when it had to."""
        return self.cluster.revive(self.answers, recovery_limit=recovery_limit)

    def answers(self) -> bool:
        """Whether the server accepts a connection and answers a query now."""
        try:
            with psycopg.connect(self.dsn, connect_timeout=2, autocommit=True) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error:
            return False
        return True

    def alive(self) -> bool:
        """Whether the postmaster runs."""
        return self.cluster.alive()

    def log_from(self, offset: int) -> tuple[str, int]:
        """Server log text written since ``offset``, and the next offset."""
        return self.cluster.log_from(offset)

    def prime_wal(self, switches: int = 3) -> str:
        """Leave the server at the start of a WAL segment that does not exist yet.

        A WAL message and a segment switch, ``switches`` times, while there is room: the
        segments kept ahead are used up and the last switch moves the insert position
        into a new segment no one has written. Filled after this, the disk meets the
        next WAL record, whoever writes it, as a busy server crossing a segment boundary
        on a full disk would. Returns '' or the server's error (one line).
        """
        try:
            with psycopg.connect(self.dsn, connect_timeout=5, autocommit=True) as conn:
                for _ in range(switches):
                    conn.execute("SELECT pg_logical_emit_message(false, 'lab', 'disk full')")
                    conn.execute("SELECT pg_switch_wal()")
        except psycopg.Error as exc:
            text = str(exc).strip()
            return _redact(text.splitlines()[0] if text else type(exc).__name__, self.dsn)
        return ""

    @property
    def postmaster_pid(self) -> int | None:
        """The running postmaster's pid (its backends are its children)."""
        postmaster = self.cluster.postmaster
        return postmaster.pid if postmaster is not None else None


@dataclass(frozen=True)
class _Options:
    volume: Volume | None = None
    faketime: Path | None = None


def _start_cluster(
    runner: Runner, version: str, template: Path | None, durable: bool = False,
    options: _Options | None = None,
) -> Server:
    options = options or _Options()
    # A durable cluster keeps its WAL on disk: in RAM, fsync would promise nothing.
    parent = DISK_DIR if durable else run_parent()
    base = Path(tempfile.mkdtemp(prefix="lab-pg-", dir=parent))
    marker = os.environ.get(protocol.RUN_MARKER_ENV)
    if marker:  # which run made it, should it outlive the run (lab.leftovers)
        (base / protocol.RUN_MARKER_FILE).write_text(marker, encoding="utf-8")
    runner.give(base)
    try:
        cluster = Embedded(runner, base, durable, options.volume, options.faketime)
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise
    try:
        if options.faketime is not None:
            cluster.set_clock_offset(0)
        if options.volume is not None:
            cluster.mount_volume()
        if template is not None:
            copy_tree(runner, template / "data", cluster.data)
        else:
            if options.volume is None:  # else ``mount_volume`` made it, on the volume
                cluster.data.mkdir(mode=0o700)
                runner.give(cluster.data)
            initdb(runner, cluster.data)
        port = _launch_on_free_port(cluster)
        password = secrets.token_urlsafe(24)
        _set_password(base, port, password)
        dsn = conninfo.make_conninfo(
            host="127.0.0.1", port=str(port), user=SUPERUSER, password=password, dbname="postgres"
        )
        version_seen = server_version(dsn, "the embedded cluster")
        if options.volume is not None:
            _checkpoint(dsn)  # drops the WAL segments the template carried ahead
    except BaseException:
        cluster.stop()
        raise
    details = {
        "binaries": str(runner.origin or runner.bindir),
        "binaries_version": version,
        "method": "initdb" if template is None else "cached-copy",
        "run_as": SERVER_USER if runner.uid is not None else "current user",
        "storage": "ram" if parent == RAM_DIR else "disk",
    }
    if runner.origin is not None:
        details["binaries_copy"] = str(runner.bindir)
    details["durability"] = "fsync=on synchronous_commit=on" if durable else "fsync=off"
    if options.volume is not None:
        details["volume"] = f"{cluster.volume_used} {options.volume.size_mb} MB"
    if options.faketime is not None:
        details["clock"] = f"libfaketime {options.faketime}"
    return Server(dsn, version_seen, details, cluster)


def _launch_on_free_port(cluster: Embedded) -> int:
    # A free port can be taken between our probe and the postmaster's bind: try a few.
    last: errors.ProvisioningError | None = None
    for _ in range(5):
        port = free_port()
        try:
            cluster.launch(port)
            return port
        except errors.ProvisioningError as exc:
            if "could not bind" not in str(exc) and "in use" not in str(exc):
                raise
            last = exc
    assert last is not None
    raise last


def _checkpoint(dsn: str) -> None:
    try:
        with psycopg.connect(dsn, connect_timeout=10, autocommit=True) as conn:
            conn.execute("CHECKPOINT")
    except psycopg.Error as exc:
        raise errors.ProvisioningError(
            f"could not checkpoint the embedded cluster: {_redact(str(exc).strip(), dsn)}"
        ) from None


def _set_password(socket_dir: Path, port: int, password: str) -> None:
    try:
        with psycopg.connect(
            host=str(socket_dir),
            port=port,
            user=SUPERUSER,
            dbname="postgres",
            autocommit=True,
            connect_timeout=10,
        ) as conn:
            conn.execute(
                sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                    sql.Identifier(SUPERUSER), sql.Literal(password)
                )
            )
    except psycopg.Error as exc:
        raise errors.ProvisioningError(
            f"could not set the embedded cluster's password: {str(exc).replace(password, '***')}"
        ) from None
