"""The peers' pure parts: what a peer child process is given, and a missing extra's error."""

from __future__ import annotations

import importlib

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
