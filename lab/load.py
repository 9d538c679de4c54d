"""Load beside a run: N processes, each spinning on a core, for as long as the run lasts.

One implementation for ``lab run --beside-load N`` (the plugin starts them for the
whole session, and the run's signed command line says how many) and the bench's
``--noise`` (one busy neighbour). The spinners carry the run's marker like every
other process of the run, so a run that dies leaves none that ``lab.leftovers`` misses.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

MAX_BUSY = 64


def start(count: int) -> list[subprocess.Popen[bytes]]:
    """Start ``count`` busy-loop processes (0 to ``MAX_BUSY``)."""
    if not 0 <= count <= MAX_BUSY:
        raise ValueError(f"between 0 and {MAX_BUSY} busy processes")
    spinners: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            spinners.append(subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", "while True: pass"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    except BaseException:
        # Cut short (Ctrl-C, no process left to fork): the caller never holds these, and
        # a busy loop left behind would load the machine until someone found it.
        stop(spinners)
        raise
    return spinners


def stop(spinners: list[subprocess.Popen[bytes]]) -> None:
    """Kill and reap the busy processes."""
    for spinner in spinners:
        with contextlib.suppress(ProcessLookupError):
            spinner.kill()
    for spinner in spinners:
        spinner.wait(timeout=10)


@contextlib.contextmanager
def busy(count: int) -> Iterator[list[int]]:
    """``count`` busy processes for the block; yields their pids."""
    spinners = start(count)
    try:
        yield [spinner.pid for spinner in spinners]
    finally:
        stop(spinners)
