"""Every wait has a deadline and nothing is left behind: an experiment past its budget
fails naming what it waited for, a server that dies mid-chaos fails chapter 11 at once
with the reason, an interrupted run tears itself down; each time no process of the run,
no ``lab-pg-volume`` mount and no cluster directory is left (``lab.leftovers``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import errors, leftovers, protocol
from lab.evidence import manifest
from tests.support.signals import sigint_ignored, sigint_raises

ROOT = Path(__file__).resolve().parent.parent
CH05 = "experiments/ch05_crashes/test_crashes.py::test_sigkill_after_claim_queries_404_and_restarts"
CH11 = ("experiments/ch11_database_faults/test_database_faults.py::"
        "test_chaos_round_with_database_restarts_and_partitions_keeps_every_invariant")


def _pytest(target: str, tmp_path: Path, marker: str, *extra: str) -> subprocess.Popen[str]:
    """A child pytest of one experiment, carrying ``marker``, in its own session."""
    command = [sys.executable, "-m", "pytest", target, "-p", "no:cacheprovider",
               "-p", "no:randomly", "-q", "--lab-evidence", str(tmp_path / "evidence"), *extra]
    env = {**os.environ, protocol.RUN_MARKER_ENV: marker}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _budgeted_manifest(tmp_path: Path, chapter: str, name: str, seconds: float) -> Path:
    """The repository's manifest with one experiment's budget set to ``seconds``."""
    path = tmp_path / "manifest.json"
    text = manifest.render(manifest.load(ROOT / "experiments" / "manifest.json"))
    raw = json.loads(text)
    for entry in raw["experiments"]:
        if (entry["chapter"], entry["name"]) == (chapter, name):
            entry["budget_s"] = seconds
    path.write_text(json.dumps(raw))
    return path


def test_an_experiment_past_its_budget_fails_naming_its_wait_and_leaves_nothing(tmp_path):
    """Chapter 5's SIGKILL experiment with a 1 s budget (it waits about 3 s for a lease to
    run out on PostgreSQL's clock): it fails naming its budget and what it waited for,
    and its worker processes and server are gone afterwards."""
    marker = leftovers.new_marker()
    budget = _budgeted_manifest(tmp_path, "ch05_crashes",
                                "test_sigkill_after_claim_queries_404_and_restarts", 1)
    began = time.monotonic()
    child = _pytest(CH05, tmp_path, marker, "--lab-manifest", str(budget))
    out, _ = child.communicate(timeout=300)
    assert child.returncode != 0, out
    assert "its budget of 1 s ran out while waiting for" in out, out[-3000:]
    assert time.monotonic() - began < 240
    left = leftovers.sweep(marker)
    assert not left, left.describe()


def test_a_server_that_dies_mid_chaos_fails_chapter_11_at_once_with_the_reason(tmp_path):
    """Chapter 11's chaos round (restarts, partitions) whose postmaster is SIGKILLed from
    outside, not by the round's restarter: the round fails at once saying the postmaster
    died, within the experiment's budget, and nothing of the run is left."""
    marker = leftovers.new_marker()
    budget = _budgeted_manifest(
        tmp_path, "ch11_database_faults",
        "test_chaos_round_with_database_restarts_and_partitions_keeps_every_invariant", 240)
    began = time.monotonic()
    child = _pytest(CH11, tmp_path, marker, "--lab-manifest", str(budget))
    killed = _kill_a_postmaster_once_workers_run(marker, child, within=180)
    out, _ = child.communicate(timeout=300)
    assert killed, out[-3000:]
    assert child.returncode != 0, out[-3000:]
    assert "postmaster died" in out, out[-3000:]
    assert time.monotonic() - began < 240 + 60
    left = leftovers.sweep(marker)
    assert not left, left.describe()


def _kill_a_postmaster_once_workers_run(marker: str, child: subprocess.Popen[str],
                                        within: float) -> bool:
    """SIGKILL the killable server's postmaster of run ``marker`` once chaos workers run
    (the run's second postmaster: the first is the shared server)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and child.poll() is None:
        found = leftovers.find(marker).processes
        names = [name for _, name in found]
        postmasters = [pid for pid, name in found if name == "postgres"
                       and _parent_name(pid) != "postgres"]
        if names.count("lab worker") >= 3 and len(postmasters) >= 2:
            time.sleep(2.0)  # into the fault phase
            os.kill(max(postmasters), signal.SIGKILL)
            return True
        time.sleep(0.2)
    return False


def _parent_name(pid: int) -> str:
    try:
        ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1]
        return Path(f"/proc/{ppid}/comm").read_text().strip()
    except (OSError, IndexError):
        return "?"


def test_an_interrupted_chapter_11_run_leaves_nothing_behind(tmp_path):
    """SIGINT (Ctrl-C) to a run in the middle of chapter 11's chaos round: pytest tears
    the round down and says it was interrupted; no process of the run, no mount, no
    cluster directory remains."""
    marker = leftovers.new_marker()
    with sigint_raises():  # the child's SIGINT at its default, as at a terminal
        child = _pytest(CH11, tmp_path, marker)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and child.poll() is None:
        if [name for _, name in leftovers.find(marker).processes].count("lab worker") >= 3:
            break
        time.sleep(0.2)
    assert child.poll() is None, "the run ended before chaos began"
    time.sleep(2.0)
    os.killpg(child.pid, signal.SIGINT)
    out, _ = child.communicate(timeout=180)
    time.sleep(1.0)  # the reaper of a stopped cluster removes its directory
    left = leftovers.sweep(marker)
    assert not left, f"{left.describe()}\n{out[-2000:]}"
    # Interrupted, not a round that ran to its end while the signal went unheard.
    assert child.returncode == pytest.ExitCode.INTERRUPTED, out[-2000:]


def _carrying(token: str) -> list[int]:
    """The processes whose environment holds ``LAB_TEST_PROBE=token``."""
    needle = f"LAB_TEST_PROBE={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                environ = (entry / "environ").read_bytes()
                stat = (entry / "stat").read_text(errors="replace")
            except OSError:
                continue
            if needle in environ.split(b"\0") and stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]:
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize(("chapter", "experiment", "workers"), [
    ("ch11_database_faults",
     "test_chaos_round_with_database_restarts_and_partitions_keeps_every_invariant", 3),
    # Cells run in threads, four at a time: an interrupt must not wait for the rest.
    ("ch12_crashpoints", "test_every_crash_point_keeps_every_invariant", 2),
])
def test_a_lab_run_terminated_from_outside_tears_its_experiments_down(
    tmp_path, chapter, experiment, workers
):
    """SIGTERM to ``lab run`` alone (a cancelled job, ``timeout``), not to its process
    group, in the middle of chapter 11's chaos round or chapter 12's crash-point matrix:
    the run passes it on to pytest as an interrupt, pytest tears down and says so, and no
    process is left behind. ``lab run`` is started as a script's background job is, with
    SIGINT ignored: the interrupt it passes on must still reach pytest."""
    token = os.urandom(6).hex()
    env = {**os.environ, "LAB_TEST_PROBE": token}
    env.pop("PYTEST_XDIST_WORKER", None)
    with sigint_ignored():
        run = subprocess.Popen(
            [sys.executable, "-m", "lab.cli", "run", "--evidence", str(tmp_path / "evidence"),
             "--chapter", chapter, "--", "-k", experiment, "-p", "no:randomly"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and run.poll() is None:
        if [_name(pid) for pid in _carrying(token)].count("lab worker") >= workers:
            break
        time.sleep(0.2)
    assert run.poll() is None, f"the run ended before {experiment} began"
    time.sleep(2.0)
    os.kill(run.pid, signal.SIGTERM)
    out, _ = run.communicate(timeout=180)
    assert run.returncode == errors.EXIT_INTERRUPTED, out[-2000:]
    assert "lab run: interrupted" in out, out[-2000:]
    assert "KeyboardInterrupt" in out, "pytest never heard the interrupt: " + out[-2000:]
    # pytest tore its experiments down itself: nothing was left for the runner to end.
    assert "left behind by the run" not in out, out[-2000:]
    assert _carrying(token) == [], out[-2000:]


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
