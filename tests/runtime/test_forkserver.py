"""Children forked from the fork server behave as exec'd ones: same output, same exit
codes, their own environment, and a SIGKILL that reads as -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from lab import protocol
from lab.runtime import forkserver, processes

WORKER = [sys.executable, "-m", "lab.cli", "worker", "--schema", "s", "--tool",
          "http://127.0.0.1:9"]


def _forked(argv: list[str], env: dict[str, str]) -> forkserver.Child:
    child = processes.forked(argv, env)
    assert child is not None, "no fork server on this Linux machine"
    return child


def _exec(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    return done.returncode, done.stdout, done.stderr


def test_a_forked_child_prints_and_exits_as_an_execd_one() -> None:
    env = {"PATH": os.environ.get("PATH", "")}
    for argv in ([*WORKER[:4], "--help"], WORKER, [*WORKER, "--lease", "x"]):
        child = _forked(argv, env)
        assert child.stdout is not None and child.stderr is not None
        forked = (child.wait(60), child.stdout.read(), child.stderr.read())
        assert forked == _exec(argv, env)


def test_a_forked_child_sees_the_environment_it_was_given_not_the_servers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The server inherits this process's environment; the child must not.
    monkeypatch.setenv(protocol.DSN_ENV, "postgresql://127.0.0.1:9/x")
    monkeypatch.setenv(protocol.TOKEN_ENV, "token")
    child = _forked(WORKER, {"PATH": os.environ.get("PATH", "")})
    assert child.wait(60) == 2
    assert child.stderr is not None
    assert f"needs {protocol.DSN_ENV} and {protocol.TOKEN_ENV}" in child.stderr.read()


def test_a_forked_child_is_its_own_process_and_signals_end_it_as_an_execd_one() -> None:
    env = {"PATH": os.environ.get("PATH", ""), protocol.DSN_ENV: "postgresql://127.0.0.1:9/x",
           protocol.TOKEN_ENV: "token"}
    first, second = _forked(WORKER, env), _forked(WORKER, env)  # retrying a dead database
    try:
        assert len({os.getpid(), first.pid, second.pid}) == 3
        with open(f"/proc/{first.pid}/comm", encoding="utf-8") as comm:
            assert comm.read().strip() == "lab worker"
        assert first.poll() is None
        first.kill()
        assert first.wait(30) == -signal.SIGKILL
        assert second.poll() is None  # one child's death is not another's
        first.kill()  # reaped: a no-op, never a signal to a recycled pid
        # A Ctrl-C is the exec'd interpreter's: KeyboardInterrupt, mapped to 130.
        time.sleep(1.0)  # past start-up: the child is in its own code, retrying
        second.send_signal(signal.SIGINT)
        assert second.wait(30) == 130
    finally:
        second.kill()
        second.wait(30)


def test_only_the_lab_entry_points_are_forked_and_the_switch_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env: dict[str, Any] = {}
    assert processes.forked([sys.executable, "-c", "pass"], env) is None
    assert processes.forked(["/bin/true", "-m", "lab.cli"], env) is None
    assert processes.forked([sys.executable, "-m", "lab.runtime.forkserver"], env) is None
    monkeypatch.setenv(forkserver.ENV_SWITCH, "0")
    assert processes.forked([*WORKER, "--help"], env) is None
    child = processes.WorkerProcess([*WORKER[:4], "--help"], {}, "exec'd")
    assert isinstance(child._proc, subprocess.Popen)
    assert child.finish(timeout=60) == 0


def test_a_kill_is_not_held_up_by_a_wait_in_another_thread() -> None:
    env = {"PATH": os.environ.get("PATH", ""), protocol.DSN_ENV: "postgresql://127.0.0.1:9/x",
           protocol.TOKEN_ENV: "token"}
    child = _forked(WORKER, env)
    codes: list[int] = []
    waiter = threading.Thread(target=lambda: codes.append(child.wait(120)))
    waiter.start()
    try:
        time.sleep(0.5)  # the waiter is blocked reading the exit code
        child.kill()
        waiter.join(60)  # a kill that waited for the wait would come after 120 s
        assert codes == [-signal.SIGKILL]
    finally:
        child.kill()
        waiter.join(130)


def _carrying(token: str) -> list[int]:
    """The live processes whose environment holds ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if token.encode() in environ.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("when", ["before_the_pid", "with_the_pid_read"])
def test_a_spawn_interrupted_before_it_returns_leaves_no_child_running(
    monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    # A SIGTERM to `lab run` arrived as KeyboardInterrupt while a chaos round was forking a
    # worker: the child was forked, its parent never learnt its pid, and it ran on.
    token = os.urandom(6).hex()
    env = {"PATH": os.environ.get("PATH", ""), protocol.DSN_ENV: "postgresql://127.0.0.1:9/x",
           protocol.TOKEN_ENV: "token", "LAB_TEST_PROBE": token}
    read = forkserver._read_pid_line
    calls = []

    def interrupted(control: Any, received: bytearray) -> None:
        calls.append(when)
        if len(calls) == 1:
            if when == "with_the_pid_read":
                read(control, received)
            raise KeyboardInterrupt
        read(control, received)

    monkeypatch.setattr(forkserver, "_read_pid_line", interrupted)
    with pytest.raises(KeyboardInterrupt):
        processes.forked(WORKER, env)
    assert calls, "the interruption was never injected"
    deadline = time.monotonic() + 30
    while _carrying(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _carrying(token) == [], "an interrupted spawn left its child running"
