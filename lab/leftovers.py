"""What a run left behind: its processes, its ``lab-pg-volume`` mounts, its clusters.

Every process of a run carries ``LAB_RUN_MARKER`` in its environment (the runner or
the plugin sets it; the embedded server's small environment keeps it), and every
embedded cluster directory holds a file naming its run. After the run, passing,
failing, interrupted or timed out, ``find`` lists what is still there and ``sweep``
ends it: SIGKILL for processes, a lazy unmount for mounts, removal for directories.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab import protocol
from lab.pg import binaries

VOLUME_SOURCE = "lab-pg-volume"
# Where embedded clusters are made (``lab.pg.embedded``): RAM first, else the temp dir.
CLUSTER_PARENTS = (Path(binaries.RAM_DIR), Path(binaries.DISK_DIR))


@dataclass
class Leftovers:
    """What one run left: processes (pid, name), mount points, cluster directories."""

    processes: list[tuple[int, str]] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    clusters: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.processes or self.mounts or self.clusters)

    def describe(self) -> str:
        """One line: what is left, or that nothing is."""
        parts = [f"process {pid} ({name})" for pid, name in self.processes]
        parts += [f"mount {point}" for point in self.mounts]
        parts += [f"cluster {path}" for path in self.clusters]
        return "; ".join(parts) if parts else "nothing left behind"


def new_marker() -> str:
    """A fresh marker for a run."""
    return f"run-{os.getpid()}-{os.urandom(6).hex()}"


def _marked(pid: int, needle: bytes) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return needle in environ.split(b"\0")


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text(errors="replace").strip()
    except OSError:
        return "?"


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]


def _ancestors() -> set[int]:
    """This process and its parents: the ones looking are not leftovers."""
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
            pid = int(stat.rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def find(marker: str) -> Leftovers:
    """The processes, mounts and cluster directories of the run ``marker`` still there."""
    needle = f"{protocol.RUN_MARKER_ENV}={marker}".encode()
    left = Leftovers()
    mine = _ancestors()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in mine:
            pid = int(entry.name)
            if _marked(pid, needle) and not _zombie(pid):
                left.processes.append((pid, _name(pid)))
    clusters = [path for parent in CLUSTER_PARENTS if parent.is_dir()
                for path in parent.glob("lab-pg-*") if _made_by(path, marker)]
    left.clusters = sorted(str(path) for path in clusters)
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            source, point = [*line.split(), "", ""][:2]
            if source == VOLUME_SOURCE and any(point.startswith(f"{c}/") for c in left.clusters):
                left.mounts.append(point)
    return left


def _made_by(path: Path, marker: str) -> bool:
    try:
        return (path / protocol.RUN_MARKER_FILE).read_text(encoding="utf-8") == marker
    except OSError:
        return False


# How long a run's own cleanup may take once its pytest process has ended: each embedded
# cluster's reaper (lab.pg.postmaster) stops its server and removes its directory on its
# owner's exit, in its own session, a few milliseconds to seconds later. What is still
# there after this is left behind.
CLEANUP_GRACE_S = 10.0


def sweep(marker: str, grace: float = CLEANUP_GRACE_S) -> Leftovers:
    """End what the run ``marker`` left behind; returns what was found (before the sweep).

    The run's processes get ``grace`` seconds to finish their own cleanup first (a
    reaper that is still stopping its server is not a leftover yet)."""
    deadline = time.monotonic() + grace
    left = find(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = find(marker)
    for pid, _ in left.processes:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for point in left.mounts:
        # Lazy: a process still dying may hold it for a moment.
        subprocess.run(["umount", "-l", point], capture_output=True, check=False, timeout=30)
    for path in left.clusters:
        shutil.rmtree(path, ignore_errors=True)
    return left
