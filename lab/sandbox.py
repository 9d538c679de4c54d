"""The sandbox a publishable run runs in: bubblewrap, and the trusted base it leaves.

``lab run --hermetic`` (and so ``lab publish`` and ``lab reproduce``) runs its pytest
process inside ``bwrap`` (bubblewrap, Debian's ``bubblewrap`` package: a small, well-kept
tool that Flatpak relies on, which turns a list of mounts and namespaces into a sandbox
without a daemon). Chosen over a hand-built ``unshare`` + ``chroot`` script because the
sandbox is then a declarative argument list this module builds and a test reads, not a
shell script of mounts that can fail halfway.

Inside:

- new mount, PID, IPC, UTS, cgroup and network namespaces; the network namespace holds
  only its own loopback, so nothing of the run reaches the machine's network;
- a root built from read-only system directories (``/usr``, ``/etc`` and the merged-usr
  links), the interpreter's own prefix read-only, the dependencies' venv read-only, the
  run's scratch directory and the evidence directory writable, a fresh ``/proc``,
  ``/dev``, ``/dev/shm``, ``/tmp``, ``/var/tmp`` and ``/run``, an empty ``/sys`` (a mount
  point for the network namespaces' own sysfs); nothing of ``HOME``, of the
  machine's ``/tmp`` or of the checkout;
- a fixed environment (``fixed_environment``), not a filtered copy of the caller's.

The run keeps root's capabilities inside its namespaces (chapter 11 mounts volumes and
steps clocks, the embedded cluster switches to ``nobody``), so the sandbox is a boundary
against a messy machine, not against a hostile test: the trust model
(docs/explanation/publication.md) says what guards against a dishonest author.

``trusted_base`` records what the run had to trust anyway: the kernel, the distribution
packages behind the system tools, and the sha256 of the interpreter and of the
PostgreSQL binaries. The command-building functions are pure.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab import errors

# The one bwrap a publishable run trusts: the distribution's, by absolute path.
BWRAP = "/usr/bin/bwrap"
INSTALL_HINT = "apt-get install bubblewrap"
# System directories the sandbox sees, read-only (links among them are recreated as links).
SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The sandbox's PATH and locale: fixed, never the caller's.
PATH = "/usr/bin:/bin"
LOCALE = "C.UTF-8"
HOSTNAME = "lab-sandbox"
# Mounted empty in every sandbox (fresh tmpfs, so nothing of the machine's is seen there).
FRESH_TMPFS = ("/dev/shm", "/tmp", "/var/tmp", "/run")  # noqa: S108
# Packages whose files the run executes without hashing each: recorded by version.
BASE_PACKAGES = ("bubblewrap", "libc6", "util-linux", "iproute2", "postgresql-15", "faketime",
                 "libfaketime")
_PROBE_TIMEOUT = 30
_HASH_LIMIT = 512 * 1024 * 1024


@dataclass(frozen=True)
class Layout:
    """What one sandboxed run sees of the machine."""

    read_only: tuple[Path, ...]
    writable: tuple[Path, ...]
    workdir: Path


def available() -> bool:
    """Whether this machine has the distribution's bubblewrap."""
    return os.access(BWRAP, os.X_OK)


def require() -> None:
    """Refuse, in one line, a publishable run on a machine without bubblewrap."""
    if not available():
        raise errors.EnvironmentFailure(
            f"a hermetic run runs in a bubblewrap sandbox and {BWRAP} is missing: "
            f"{INSTALL_HINT}")


def fixed_environment(run_env: Mapping[str, str]) -> dict[str, str]:
    """The sandbox's whole environment: the run's own settings (the hermetic isolation
    names, which the runner sets itself) over a fixed base; the caller's PATH, locale,
    terminal and keys never enter."""
    env = {name: value for name, value in run_env.items()
           if name not in ("PATH", "LANG", "LC_ALL", "TZ", "TERM")}
    env.update(PATH=PATH, LANG=LOCALE, LC_ALL=LOCALE, TZ="UTC")
    return env


def _system_mounts(root: Path = Path("/")) -> list[str]:
    arguments: list[str] = []
    for name in SYSTEM:
        path = root / name.lstrip("/")
        if path.is_symlink():
            arguments += ["--symlink", os.readlink(path), name]
        elif path.is_dir():
            arguments += ["--ro-bind", name, name]
    return arguments


def command(layout: Layout, env: Mapping[str, str], argv: Sequence[str]) -> list[str]:
    """The bwrap command line running ``argv`` in ``layout`` with exactly ``env``."""
    arguments = [
        BWRAP, "--die-with-parent",
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
        "--unshare-cgroup-try", "--hostname", HOSTNAME,
        # root's capabilities inside the namespaces: see the module's docstring.
        "--cap-add", "ALL",
        *_system_mounts(),
        "--proc", "/proc", "--dev", "/dev",
        # An empty mount point, nothing of the machine's sysfs: chapter 17's hosts run
        # `ip netns exec`, which mounts the host namespace's own sysfs there (without it
        # every ch17 experiment failed in a publishable run: "mount of /sys failed").
        "--dir", "/sys",
    ]
    for fresh in FRESH_TMPFS:
        arguments += ["--tmpfs", fresh]
    for path in layout.read_only:
        arguments += ["--ro-bind", str(path), str(path)]
    for path in layout.writable:
        arguments += ["--bind", str(path), str(path)]
    arguments += ["--chdir", str(layout.workdir), "--clearenv"]
    for name, value in sorted(env.items()):
        arguments += ["--setenv", name, value]
    return [*arguments, "--", *argv]


def _sha256(path: Path) -> str | None:
    try:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            read = 0
            while chunk := handle.read(1 << 20):
                read += len(chunk)
                if read > _HASH_LIMIT:
                    return None
                digest.update(chunk)
        return digest.hexdigest()
    except OSError:
        return None


def _packages(names: Sequence[str]) -> dict[str, str]:
    query = shutil.which("dpkg-query", path=PATH)
    if query is None:
        return {}
    found: dict[str, str] = {}
    for name in names:
        try:
            done = subprocess.run([query, "-W", "-f", "${Version}", name], capture_output=True,
                                  text=True, timeout=_PROBE_TIMEOUT, check=False,
                                  env={"PATH": PATH, "LANG": LOCALE})
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip():
            found[name] = done.stdout.strip()
    return found


def trusted_base(interpreter: Path, pg_bindir: Path | None) -> dict[str, Any]:
    """What a sandboxed run trusts of the machine, for the evidence: the kernel, the
    distribution and its packages' versions, the sandbox tool, and the sha256 of the
    interpreter and of the PostgreSQL server's programs."""
    try:
        release = platform.freedesktop_os_release()
    except OSError:  # no /etc/os-release
        release = {}
    binaries: dict[str, str | None] = {}
    if pg_bindir is not None:
        for program in ("postgres", "initdb", "pg_ctl"):
            if (pg_bindir / program).exists():
                binaries[str(pg_bindir / program)] = _sha256(pg_bindir / program)
    return {
        "kernel": f"{platform.system()} {platform.release()} {platform.machine()}",
        "distribution": release.get("PRETTY_NAME", "unknown"),
        "sandbox": {"tool": BWRAP, "sha256": _sha256(Path(BWRAP))},
        "packages": _packages(BASE_PACKAGES),
        "interpreter": {"path": str(interpreter.resolve()),
                        "sha256": _sha256(interpreter.resolve())},
        "postgresql_binaries": binaries,
    }
