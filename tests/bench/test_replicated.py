"""``lab bench throughput --replicated``: its refusals, and one tiny synchronous round for
real (a primary and a standby on two lab hosts). No timing asserts: the figures are printed."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from lab import cli, errors
from lab.bench import replicated
from lab.hosts import network


def test_modes_are_named_once_among_none_sync_async() -> None:
    assert replicated.modes("none,sync,async") == ("none", "sync", "async")
    assert replicated.modes("") == ()
    with pytest.raises(errors.UsageError, match="among"):
        replicated.modes("none,remote_apply")
    with pytest.raises(errors.UsageError, match="once"):
        replicated.modes("sync,sync")


@pytest.mark.parametrize("extra", [
    ["--replicated", "sync", "--peer", "dbos"],
    ["--replicated", "sync", "--sweep", "--peer", "dbos"],
    ["--replicated", "sync", "--lab-postgres", "dsn"],
    ["--replicated", "quorum"],
])
def test_what_replicated_cannot_do_is_refused_in_one_line(extra, capsys) -> None:
    assert cli.main(["bench", "throughput", *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_without_root_replicated_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(replicated, "servers", lambda _: pytest.fail("a server was started"))
    assert cli.main(["bench", "throughput", "--replicated", "none,sync"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "need root" in err


def _our_namespaces() -> set[str]:
    listed = subprocess.run([network.program("ip"), "netns", "list"], capture_output=True,
                            text=True, timeout=20, check=False).stdout
    return {line.split()[0] for line in listed.splitlines()
            if line.split() and line.split()[0].endswith(("-syncp", "-syncs"))}


@pytest.mark.slow  # two servers made on disk: about 19 s alone on a busy 2-core machine
@pytest.mark.skipif(os.geteuid() != 0, reason="lab hosts need root")
def test_a_synchronous_round_names_its_mode_and_its_standby_received_the_wal(
    tmp_path, capsys
) -> None:
    before = _our_namespaces()
    assert cli.main(["bench", "--output-dir", str(tmp_path), "throughput", "--replicated",
                     "sync", "--workflows", "24", "--min-seconds", "0", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "replicated sync:" in out and "sync_state sync" in out, out
    report = json.loads((tmp_path / "throughput-replicated.json").read_text())
    assert report["replicated"] == ["sync"]
    assert [run["mode"] for turn in report["rounds"] for run in turn] == ["sync"]
    assert report["summary"]["sync"]["all_succeeded"]
    assert report["environment"]["postgres"]["fsync"] == "on"
    assert report["environment"]["postgres"]["provisioned"]["storage"].startswith("disk")
    standby = report["standby"]["sync"]
    # The primary waited for this standby, and the standby replayed the rounds' WAL.
    assert standby["state"] == "streaming" and standby["sync_state"] == "sync", standby
    assert standby["replayed_bytes"] > 0, standby
    # Every host (namespace) it made is gone.
    assert _our_namespaces() <= before
