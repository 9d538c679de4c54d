"""One running embedded cluster: its directory, its postmaster and the reaper that
outlives this process.

We launch ``postgres`` ourselves and watch ``postmaster.pid`` rather than use
``pg_ctl``. The cluster can be crash-restarted on the same data, put on a size-limited
filesystem for disk-full faults (``Volume``), and run under libfaketime for clock steps.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lab import errors
from lab.pg.binaries import DISK_DIR, Runner
from lab.pg.faketime import readable_by_all

log = logging.getLogger("lab.pg.cluster")

_START_TIMEOUT = 60.0
VOLUME_KINDS = ("auto", "tmpfs", "loop")
BALLAST = "lab-ballast"  # the disk-full fault's file, beside (not in) the data directory


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


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
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


class Embedded:
    """One running embedded cluster: its directory, postmaster and reaper.

    With a ``volume`` the data directory (WAL included) lives on a size-limited
    filesystem mounted at ``base/vol`` (see ``Volume``), next to a ballast file a
    disk-full fault fills it with. With ``faketime`` the server runs under
    libfaketime, its wall clock offset by what ``base/faketime`` says.
    """

    def __init__(
        self, runner: Runner, base: Path, durable: bool = False,
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
        if faketime is not None and runner.uid is not None and not readable_by_all(faketime):
            # The server user could not preload it (a venv under /root, say): the loader
            # would skip it with a warning and the clock would never step. Copy it here.
            self.faketime = base / faketime.name
            shutil.copyfile(faketime, self.faketime)
            self.faketime.chmod(0o644)
        self.clock_file = base / "faketime"
        self.clock_offset_s = 0
        self.postmaster: subprocess.Popen[bytes] | None = None
        # Where it listens, and settings given after ours (a later -c wins): a server on a
        # lab host listens on the host's address and may replicate (lab.hosts.replication).
        self.listen = "127.0.0.1"
        self.settings: list[str] = []
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

    def revive(self, answers: Callable[[], bool], patience: float = 60.0,
               recovery_limit: float = 30.0) -> bool:
        """Start the postmaster again if it exited by itself (a failed crash recovery), or
        if the server does not answer within ``recovery_limit`` seconds; True when it had to.
        A server that answers, or gets there, is left alone.

        ``answers`` asks the server itself (a connection and a query): ``postmaster.pid``
        cannot say, since a postmaster reinitializing after a crash leaves it at "ready"
        (seen with PostgreSQL 18). A postmaster that never acts on its startup process's
        exit, as seen with PostgreSQL 18 on a loaded machine, is stopped dead and started
        again on the same data, as an operator would.
        """
        with self._restart_lock:
            if self.postmaster is None or self.port == 0:
                return False
            if self.alive():
                if self._answers_within(answers, recovery_limit):
                    return False
                self._kill_postmaster()
            self._launch_again(time.monotonic() + patience)
            return True

    def _answers_within(self, answers: Callable[[], bool], seconds: float) -> bool:
        """Whether the running server answers (``answers()``) within ``seconds``; False if
        the postmaster exits first."""
        assert self.postmaster is not None
        deadline = time.monotonic() + seconds
        while self.postmaster.poll() is None:
            if answers():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
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
                    f"listen_addresses={self.listen}",
                    "-c",
                    "unix_socket_permissions=0700",
                    *self.settings,
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
        """The end of the server log, for an error message."""
        try:
            return (self.base / "postgres.log").read_text(errors="replace").strip()[-2000:]
        except OSError:
            return "(no server log)"

    def stop(self) -> None:
        """Stop the postmaster and remove the directory, through the reaper (or in the
        foreground when the reaper is gone)."""
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
