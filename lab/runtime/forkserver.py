"""Lab child processes forked from a warm server process, not exec'd afresh.

Starting ``python -m lab.cli worker`` costs about half a second of CPU: the interpreter,
psycopg and the lab's own modules. An experiment that crashes a worker at every boundary
starts hundreds of them, and on a 2-core machine that start-up CPU is most of the main
job's time. The fork server pays it once: it is started as ``python -m
lab.runtime.forkserver`` by the same interpreter, imports the worker's modules, and then
forks one child per request.

What it imports first is its caller's to say (``spawn``'s ``preload``), and the caller
names only modules the layer table lets it import: the runtime's own, or below. A
program of a higher floor (``lab.cli``) is not preloaded here; its child imports it by
name after the fork, as ``python -m`` would, from modules already warm.

Each child is a real OS process like an exec'd one: its own pid, its own stdin, stdout
and stderr pipes (passed as file descriptors), exactly the environment and working
directory asked for, and the asked module's entry point called with the asked
arguments, as its ``__main__`` block does under ``python -m``. SIGKILL ends it
mid-window with no cleanup code run. What it does not redo is importing: its modules
are the ones the server imported, from the same interpreter and the same files. No
preloaded module reads the environment at import time, so a child sees its own.

The server forks from one thread and holds no connection, no thread and no lock when it
does. It reaps its children and reports each one's exit code (``-N`` for signal N, as
``subprocess`` does) on the child's own control socket. The parent signals a child
through a pidfd, so a signal can never reach a recycled pid.

``spawn`` is the entry point: it returns a ``Child`` with the part of ``subprocess.Popen``
that ``lab.runtime.processes`` uses, or ``None`` where no fork server can run (then the
caller execs as before).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

# Requests are one datagram each (SOCK_SEQPACKET keeps message boundaries).
MAX_REQUEST = 256 * 1024
PR_SET_NAME = 15  # prctl(2)
ENV_SWITCH = "LAB_FORKSERVER"  # "0": exec every child (the pre-fork-server behaviour)
# How long an interrupted ``spawn`` waits for the pid of the child it must then end.
UNRETURNED_PID_S = 10.0


class Child:
    """A forked child: ``pid``, text ``stdin``/``stdout``/``stderr``, ``poll``, ``wait``,
    ``send_signal``, ``kill`` and ``returncode``, as ``subprocess.Popen`` has them."""

    def __init__(self, pid: int, control: socket.socket, stdin: IO[str], stdout: IO[str],
                 stderr: IO[str], early: bytes = b"") -> None:
        self.pid = pid
        self.stdin: IO[str] | None = stdin
        self.stdout: IO[str] | None = stdout
        self.stderr: IO[str] | None = stderr
        self.returncode: int | None = None
        self._control = control
        self._report = early  # the exit code's bytes read so far
        # Reading the exit code may block (``wait``); signalling must not wait for it, so
        # the state a signal needs (exited yet? the pidfd) has a lock of its own.
        self._reading = threading.Lock()
        self._state = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None  # the child exited already, or no pidfd here: kill by pid

    def _collect(self, timeout: float | None) -> int | None:
        with self._reading:
            if self.returncode is not None:
                return self.returncode
            # The server writes the exit code, then closes: read to the end.
            while True:
                ready, _, _ = select.select([self._control], [], [], timeout)
                if not ready:
                    return None
                chunk = self._control.recv(64)
                if not chunk:
                    break
                self._report += chunk
            self._control.close()
            # Nothing: the server died before it could report (the child went with it or
            # was orphaned); its exit code is lost, so it reads as killed.
            text = self._report.strip()
            with self._state:
                self.returncode = int(text) if text else -signal.SIGKILL
                if self._pidfd is not None:
                    os.close(self._pidfd)
                    self._pidfd = None
            return self.returncode

    def poll(self) -> int | None:
        """The exit code if the child has exited, else None."""
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit code; ``subprocess.TimeoutExpired`` after ``timeout``."""
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        """Signal the child unless it has been reaped (never a recycled pid)."""
        with self._state:
            if self.returncode is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, signum)
                else:
                    os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL the child."""
        self.send_signal(signal.SIGKILL)


class _Server:
    """The parent's end of one fork server process."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lab.runtime.forkserver", str(theirs.fileno()), *preload],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.channel = ours
        self.lock = threading.Lock()
        ours.settimeout(60)  # a server that cannot import its modules is no server
        try:
            ready = ours.recv(16)
        except TimeoutError:
            ready = b""
        ours.settimeout(None)
        if ready != b"ready":
            self.process.kill()
            self.process.wait()
            raise OSError("the fork server did not start")

    def spawn(self, module: str, entry: str, args: list[str], env: dict[str, str],
              name: str) -> Child:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        control, control_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = json.dumps({"module": module, "entry": entry, "args": args, "env": env,
                              "cwd": os.getcwd(), "name": name}).encode()
        try:
            with self.lock:
                socket.send_fds(self.channel, [request],
                                [in_r, out_w, err_w, control_theirs.fileno()])
        except OSError:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            control.close()
            control_theirs.close()
            raise
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        control_theirs.close()
        received = bytearray()
        try:
            _read_pid_line(control, received)
        except BaseException:
            # Interrupted (Ctrl-C, or a SIGTERM turned KeyboardInterrupt) before the pid
            # came back: the server may have forked already, and no caller would ever
            # know this child to end it (a run torn down left a worker running).
            _end_unreturned(control, received)
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise
        first, _, rest = bytes(received).partition(b"\n")
        pid = _pid_of(first)
        if pid is None:
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            control.close()
            raise OSError(f"the fork server could not fork: {first.decode(errors='replace')}")
        return Child(
            pid, control,
            open(in_w, "w", buffering=1, encoding="utf-8"),
            open(out_r, encoding="utf-8"),
            open(err_r, encoding="utf-8"),
            early=rest,
        )


def _pid_of(line: bytes) -> int | None:
    """The pid in the server's ``pid N`` line, or None for any other line."""
    if line.startswith(b"pid ") and line[4:].isdigit():
        return int(line[4:])
    return None


def _read_pid_line(control: socket.socket, received: bytearray) -> None:
    """Read the server's first line for a request (``pid N`` or ``error ...``) into
    ``received``, kept by the caller when this is interrupted."""
    while b"\n" not in received:
        chunk = control.recv(64)
        if not chunk:
            return
        received += chunk


def _end_unreturned(control: socket.socket, received: bytearray) -> None:
    """SIGKILL a child whose ``spawn`` never returned: read the rest of its pid line (the
    server sends it once the child is set up), then kill it; the server reaps it."""
    with contextlib.suppress(OSError):
        control.settimeout(UNRETURNED_PID_S)
        _read_pid_line(control, received)
    first, _, report = bytes(received).partition(b"\n")
    with contextlib.suppress(OSError):
        control.setblocking(False)
        report += control.recv(64) or b"gone"
    # The server writes the exit code here as soon as it reaps the child: with none yet,
    # the pid is still the child's, not one the system could have handed out again.
    pid = _pid_of(first)
    if pid is not None and not report:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    control.close()


_servers: dict[tuple[int, tuple[str, ...]], _Server] = {}
_servers_lock = threading.Lock()


def enabled() -> bool:
    """True unless ``LAB_FORKSERVER=0`` asks for exec'd children, or this is no Linux."""
    return (os.environ.get(ENV_SWITCH, "1") != "0" and sys.platform == "linux"
            and hasattr(socket, "send_fds"))


def spawn(
    argv: list[str], env: dict[str, str], entry_points: Mapping[str, str],
    preload: Sequence[str] = (), name: str = "",
) -> Child | None:
    """Fork ``argv`` (``[sys.executable, "-m", module, *args]``) from this process's fork
    server for ``preload``, started on first use; None when it cannot be (the caller
    execs instead).

    ``entry_points``: the modules that may be forked, each with its entry point (what
    its ``__main__`` block calls with the command line's arguments). ``preload``: the
    modules the server imports before it forks, named by the caller from what the layer
    table lets it import; a forked module not among them is imported by its child.
    ``name``: what the child shows in ``/proc/PID/comm`` (at most 15 bytes; by default the
    module's last part). An exec'd child shows its command line; a forked one would show
    the server's without it.
    """
    if (not enabled() or len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m"
            or argv[2] not in entry_points):
        return None
    key = (os.getpid(), tuple(preload))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server.process.poll() is not None:
            try:
                server = _Server(key[1])
            except OSError:
                return None
            _servers[key] = server
    try:
        return server.spawn(argv[2], entry_points[argv[2]], argv[3:], env,
                            (name or argv[2].rsplit(".", 1)[-1])[:15])
    except OSError:
        return None


# -- the server process -----------------------------------------------------------------------


def _child(request: dict[str, Any], fds: list[int], closing: list[int], set_up: int) -> None:
    """In the forked child: become ``python -m module args`` with the asked stdio and env;
    close ``set_up`` once it has (its server reports the pid only then)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        # The signal dispositions an exec'd interpreter starts with.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in closing:
            with contextlib.suppress(OSError):
                os.close(fd)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # The streams wrap fds 0-2, which now are the child's pipes (the server never
        # read or buffered anything): unbuffered, as the exec'd children run.
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(line_buffering=True, write_through=True)
        _name_process(request["name"])
        os.close(set_up)  # from here on the child is what its parent asked for
        try:
            # Preloaded, or imported here by name as ``python -m`` would: a module above
            # the server's floor is the child's to import, never the server's.
            module = importlib.import_module(request["module"])
            sys.argv = [module.__file__ or request["module"], *request["args"]]
            code = getattr(module, request["entry"])(request["args"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:  # a child reports a crash as an exec'd interpreter does
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
    finally:
        os._exit(code)


def _name_process(name: str) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def serve(channel_fd: int, preload: Sequence[str] = ()) -> None:
    """The server loop: import ``preload``, then fork a child per request and report each
    one's exit code."""
    for name in preload:
        importlib.import_module(name)
    channel = socket.socket(fileno=channel_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the parent
    controls: dict[int, socket.socket] = {}
    channel.send(b"ready")
    open_ = True
    while open_ or controls:
        try:
            ready, _, _ = select.select([channel.fileno(), wake_r] if open_ else [wake_r],
                                        [], [], 1.0)
        except InterruptedError:
            ready = []
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        if channel.fileno() in ready:
            try:
                data, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST, 4)
            except OSError:
                data, fds = b"", []
            if not data:
                open_ = False  # the parent is gone: serve the children left, then stop
            else:
                _fork(json.loads(data), fds, controls,
                      closing=[channel.fileno(), wake_r, wake_w])
        _reap(controls)


def _fork(request: dict[str, Any], fds: list[int], controls: dict[int, socket.socket],
          closing: list[int]) -> None:
    control = socket.socket(fileno=fds[3])
    sys.stdout.flush()
    sys.stderr.flush()
    set_up_r, set_up_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(set_up_r)
        os.close(set_up_w)
        with contextlib.suppress(OSError):
            control.sendall(f"error {errno.errorcode.get(exc.errno or 0, 'fork')}\n".encode())
        control.close()
        for fd in fds[:3]:
            os.close(fd)
        return
    if pid == 0:
        _child(request, fds[:3],
               closing + [fds[3], set_up_r] + [c.fileno() for c in controls.values()],
               set_up_w)
    for fd in fds[:3]:
        os.close(fd)
    # Report the pid once the child has its stdio, environment, directory and name (or
    # is gone), as Popen returns after the exec: a caller never sees a half-made child.
    os.close(set_up_w)
    with contextlib.suppress(OSError):
        os.read(set_up_r, 1)
    os.close(set_up_r)
    with contextlib.suppress(OSError):
        control.sendall(f"pid {pid}\n".encode())
    controls[pid] = control


def _reap(controls: dict[int, socket.socket]) -> None:
    while controls:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        control = controls.pop(pid, None)
        if control is not None:
            with contextlib.suppress(OSError):
                control.sendall(str(os.waitstatus_to_exitcode(status)).encode())
            control.close()


def main() -> None:
    """``python -m lab.runtime.forkserver FD [MODULE...]``: import the modules, then serve
    the parent on the socket ``FD``."""
    serve(int(sys.argv[1]), sys.argv[2:])


if __name__ == "__main__":
    main()
