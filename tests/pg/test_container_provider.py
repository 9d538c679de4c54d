"""The container provider end to end: testcontainers, the Docker API, a real PostgreSQL.

Where a Docker daemon answers, these tests drive it (and pull the pinned image). Where none
does, as on the machines this lab is built on, they drive ``docker_standin``, a Docker Engine
API stand-in that runs a real PostgreSQL for a ``postgres`` image and emulates Ryuk. Either
way the code under test is the same: ``lab.pg.cluster`` through testcontainers and the Docker SDK
over HTTP, in a process of its own as a run would be. What the tests check goes through the
Docker API too, so it holds for both engines.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import psycopg
import pytest

from lab import loopback
from lab.pg import cluster
from tests.support.docker_standin import DockerStandIn

ROOT = Path(__file__).resolve().parents[2]
HOLDER = ROOT / "tests" / "support" / "hold_postgres.py"
PINNED_DIGEST = cluster.POSTGRES_IMAGE.partition("@")[2]
SESSION_LABEL = "org.testcontainers.session-id"


@dataclass
class Engine:
    """The Docker engine the tests drive: a real daemon, or the stand-in where none runs."""

    host: str
    stand_in: DockerStandIn | None

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.host, version="auto", timeout=30)

    def session_containers(self, session_id: str) -> list[Any]:
        return self._listed({"label": f"{SESSION_LABEL}={session_id}"})

    def reaper_containers(self, session_id: str) -> list[Any]:
        return self._listed({"name": f"testcontainers-ryuk-{session_id}"})

    def _listed(self, filters: dict[str, str]) -> list[Any]:
        # ignore_removed: one removed between the listing and its inspection is gone, as
        # the tests expect, not an error.
        with contextlib.closing(self.client()) as client:
            return list(client.containers.list(all=True, ignore_removed=True, filters=filters))


@pytest.fixture
def engine() -> Iterator[Engine]:
    """A Docker daemon that answers, else the stand-in (``LAB_DOCKER_STAND_IN=1`` forces it:
    a daemon that cannot pull from Docker Hub, say)."""
    if cluster.docker_answers() and os.environ.get("LAB_DOCKER_STAND_IN") != "1":
        yield Engine(os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock", None)
        return
    with DockerStandIn() as stand_in:
        yield Engine(stand_in.host, stand_in)


def _env(engine: Engine, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (cluster.DSN_ENV, cluster.IMAGE_ENV) and not k.startswith("PYTEST_")
    }
    env.update(DOCKER_HOST=engine.host, PYTHONPATH=str(ROOT), RYUK_RECONNECTION_TIMEOUT="1s")
    env.update(extra)
    return env


@dataclass
class Holder:
    process: subprocess.Popen[str]
    report: dict[str, Any]

    def release(self) -> tuple[int, str]:
        """Close the holder's input (it stops its server), return its exit code and log."""
        _, err = self.process.communicate("", timeout=60)
        return self.process.returncode, err


def _hold(engine: Engine, mode: str, **extra: str) -> Holder:
    process = subprocess.Popen(
        [sys.executable, str(HOLDER), mode],
        env=_env(engine, **extra),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    # Pulling and starting take seconds; a holder silent for minutes is stuck, not slow.
    ready, _, _ = select.select([process.stdout], [], [], 300)
    line = process.stdout.readline() if ready else ""
    if not line:
        process.kill()
        _, err = process.communicate(timeout=30)
        pytest.fail(f"the holder exited before reporting:\n{err}")
    return Holder(process, json.loads(line))


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        if holder.process.poll() is None:
            holder.process.kill()
        for pipe in (holder.process.stdin, holder.process.stdout, holder.process.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
        holder.process.wait(timeout=30)


def _refused(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, connect_timeout=3):
            return False
    except psycopg.OperationalError:
        return True


def _wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def test_the_pinned_image_runs_as_a_loopback_server_and_stopping_removes_it(
    engine: Engine, holders: list[Holder]
) -> None:
    holder = _hold(engine, "container")
    holders.append(holder)
    report, dsn = holder.report, holder.report["dsn"]

    described = report["describe"]
    assert described["provider"] == "container"
    assert described["details"]["image"] == cluster.POSTGRES_IMAGE
    assert f"postgres@{PINNED_DIGEST}" in described["details"]["image_digest"].split(",")
    loopback.check_dsn(dsn)  # raises unless every host is loopback, as the rules require
    assert psycopg.conninfo.conninfo_to_dict(dsn)["host"] in ("127.0.0.1", "localhost", "::1")

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('server_version'), current_user, current_database(), "
            "current_setting('fsync'), current_setting('full_page_writes')"
        ).fetchone()
        conn.execute("CREATE TABLE probe (id int PRIMARY KEY)")
        conn.execute("INSERT INTO probe VALUES (1)")
    # The version recorded is the server's own; the run's command reached the server.
    assert row == (described["server_version"], "lab", "lab", "off", "off")

    (container,) = engine.session_containers(report["session_id"])
    assert container.status == "running"
    assert container.attrs["Config"]["Image"] == cluster.POSTGRES_IMAGE
    assert container.labels["org.testcontainers.lang"] == "python"

    code, log = holder.release()
    assert code == 0, log
    assert engine.session_containers(report["session_id"]) == []
    assert engine.reaper_containers(report["session_id"]) == []
    assert _refused(dsn)
    assert "PostgreSQL provider: container" in log
    assert report["dsn"].split("password=")[1].split()[0] not in log  # no secret in the log


def test_auto_takes_the_container_when_a_daemon_answers_and_no_dsn_is_given(
    engine: Engine, holders: list[Holder]
) -> None:
    holder = _hold(engine, "auto")
    holders.append(holder)
    assert holder.report["describe"]["provider"] == "container"
    code, log = holder.release()
    assert code == 0, log
    assert log.count("PostgreSQL provider:") == 1
    assert "PostgreSQL provider: container" in log and "(mode auto)" in log


def test_an_image_the_registry_lacks_is_a_clear_error_that_leaves_nothing(
    engine: Engine, holders: list[Holder]
) -> None:
    missing = "postgres:16-alpine@sha256:" + "0" * 64
    holder = _hold(engine, "container", LAB_POSTGRES_IMAGE=missing)
    holders.append(holder)
    assert holder.process.wait(timeout=60) == 3
    error = holder.report["error"]
    assert error.startswith(f"could not start a container from {missing}: ")
    assert "manifest unknown" in error
    assert engine.session_containers(holder.report["session_id"]) == []


def test_ryuk_removes_the_container_of_a_killed_run(engine: Engine, holders: list[Holder]) -> None:
    holder = _hold(engine, "container", RYUK_RECONNECTION_TIMEOUT="1s")
    holders.append(holder)
    session, dsn = holder.report["session_id"], holder.report["dsn"]
    assert not _refused(dsn)

    holder.process.send_signal(signal.SIGKILL)  # no atexit hook, no stop(): only Ryuk is left
    holder.process.wait(timeout=30)
    _wait_until(lambda: engine.session_containers(session) == [], 60, "Ryuk to remove it")
    _wait_until(lambda: engine.reaper_containers(session) == [], 30, "Ryuk to exit")
    assert _refused(dsn)


def test_without_ryuk_a_killed_run_leaves_its_container_behind(
    engine: Engine, holders: list[Holder]
) -> None:
    """Why the documentation says to keep Ryuk on."""
    holder = _hold(engine, "container", TESTCONTAINERS_RYUK_DISABLED="true")
    holders.append(holder)
    session, dsn = holder.report["session_id"], holder.report["dsn"]
    assert engine.reaper_containers(session) == []

    holder.process.send_signal(signal.SIGKILL)
    holder.process.wait(timeout=30)
    time.sleep(3)  # three times the reconnection timeout a reaper would have waited
    (left,) = engine.session_containers(session)
    assert left.status == "running"
    assert not _refused(dsn)
    left.remove(force=True)
    assert _refused(dsn)


def test_a_parallel_run_shares_one_container_and_records_it_in_the_evidence(
    engine: Engine, tmp_path: Path
) -> None:
    evidence_dir = tmp_path / "evidence"
    run = subprocess.run(
        [
            sys.executable, "-m", "pytest", "experiments/ch02_approval", "-n", "2",
            "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
            "--lab-postgres", "container", "--lab-evidence", str(evidence_dir),
        ],
        cwd=ROOT, env=_env(engine), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert "failed" not in out.lower().split("gate")[0], out
    results = [json.loads(line) for line in (evidence_dir / "tests.jsonl").read_text().splitlines()]
    calls = [r for r in results if r.get("$report_type") == "TestReport" and r["when"] == "call"]
    assert calls and all(r["outcome"] == "passed" for r in calls), out
    # One report header, the controller's: the server it started, named by its digest.
    assert out.count("via container") == 1
    assert f"via container (postgres@{PINNED_DIGEST}" in out

    runtime = json.loads((evidence_dir / "runtime.json").read_text())
    database = runtime["postgresql"]
    assert database["provider"] == "container"
    assert database["details"]["image"] == cluster.POSTGRES_IMAGE
    assert f"postgres@{PINNED_DIGEST}" in database["details"]["image_digest"]

    show = subprocess.run(
        [sys.executable, "-m", "lab.cli", "evidence", "show", str(evidence_dir)],
        cwd=ROOT, env=_env(engine), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert f"PostgreSQL: container, {database['server_version']}" in show.stdout
    assert f"image_digest: postgres@{PINNED_DIGEST}" in show.stdout

    if engine.stand_in is not None:  # what the engine saw: one server for two workers, gone
        servers = [ref for ref in engine.stand_in.created if ref == cluster.POSTGRES_IMAGE]
        assert len(servers) == 1
        assert engine.stand_in.containers() == []


def test_a_container_reachable_only_off_loopback_is_refused_and_removed(
    engine: Engine, holders: list[Holder]
) -> None:
    """A Docker host elsewhere (TC_HOST here) gives an address the loopback rule refuses.

    Ryuk is off: it would first try, for about 50 s, to reach its port at that address.
    """
    holder = _hold(engine, "container", TC_HOST="198.51.100.7", TESTCONTAINERS_RYUK_DISABLED="1")
    holders.append(holder)
    assert holder.process.wait(timeout=60) == 3
    error = holder.report["error"]
    assert "reachable only at '198.51.100.7', not on loopback" in error
    assert "--lab-allow-remote-dsn" in error and "TESTCONTAINERS_HOST_OVERRIDE" in error
    assert engine.session_containers(holder.report["session_id"]) == []


def test_the_stand_in_refuses_what_it_does_not_emulate() -> None:
    """A new SDK call must fail loudly against the stand-in, never be half-served."""
    with DockerStandIn() as stand_in, contextlib.closing(
        docker.DockerClient(base_url=stand_in.host, version="auto", timeout=30)
    ) as client:
        with pytest.raises(docker.errors.APIError, match="does not emulate POST /volumes/create"):
            client.volumes.create("data")
        with pytest.raises(docker.errors.NotFound, match="repository unknown"):
            client.images.pull("example/unknown", tag="1")
        ryuk = stand_in.pull("testcontainers/ryuk", "0.8.1")
        client.containers.create(ryuk.tags[0], name="one")
        with pytest.raises(docker.errors.APIError, match="already in use"):
            client.containers.create(ryuk.tags[0], name="one")
