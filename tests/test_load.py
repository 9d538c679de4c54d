"""``lab.load``: busy processes beside a run, and none of them outliving it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from lab import load


def _running(pid: int) -> bool:
    """True while ``pid`` is a live (not zombie, not reaped) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


def test_busy_processes_run_for_the_block_and_are_gone_after_it() -> None:
    with load.busy(2) as pids:
        assert len(pids) == 2
        assert all(_running(pid) for pid in pids)
    assert not any(_running(pid) for pid in pids)


def test_a_start_cut_short_stops_the_ones_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted after two of four: the caller never holds those two, so start ends them."""
    started: list[subprocess.Popen[bytes]] = []
    real = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        if len(started) == 2:
            raise KeyboardInterrupt
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(load.subprocess, "Popen", popen)
    with pytest.raises(KeyboardInterrupt):
        load.start(4)
    assert len(started) == 2
    assert not any(_running(spinner.pid) for spinner in started)


@pytest.mark.parametrize("count", [-1, load.MAX_BUSY + 1])
def test_a_count_out_of_range_starts_nothing(count: int) -> None:
    with pytest.raises(ValueError, match=f"between 0 and {load.MAX_BUSY}"):
        load.start(count)
