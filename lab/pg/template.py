"""The cached, initialised template an embedded cluster's data directory is copied from.

Built once per set of binaries by ``initdb`` under a temporary name and renamed into
place, so concurrent runs share one complete template; checked before every use (its
marker, its owner, its version, a clean shutdown) and discarded when it fails.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from lab import errors
from lab.pg.binaries import (
    SUPERUSER,
    Runner,
    discard,
    open_cache_root,
    remove_abandoned,
    safe_dir,
)

log = logging.getLogger("lab.pg.cluster")

_TEMPLATE_FORMAT = 1
# Loopback TCP needs the run's password; the unix socket lives in a directory only the server
# user (and root) can enter, and is how the password gets set after a cached copy starts.
_PG_HBA = (
    "# written by lab.pg.cluster\nlocal all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
)


_INITDB_ARGS = (
    f"--username={SUPERUSER}",
    "--auth=trust",  # replaced by _PG_HBA straight after
    "--encoding=UTF8",
    "--locale=C",
    "--no-sync",  # a throwaway cluster: durability of its files is not the point
    "--wal-segsize=1",  # 1 MB instead of 16 MB of WAL to copy from the template
    "--no-instructions",
)


def initdb(runner: Runner, data: Path) -> None:
    """Initialise a cluster in ``data`` and replace its ``pg_hba.conf`` with ours."""
    runner.run("initdb", "-D", str(data), *_INITDB_ARGS)
    hba = data / "pg_hba.conf"
    hba.write_text(_PG_HBA)
    hba.chmod(0o600)
    runner.give(hba)


def _template_marker(runner: Runner, version: str) -> dict[str, object]:
    return {
        "format": _TEMPLATE_FORMAT,
        "bindir": str(runner.bindir),
        "binaries_version": version,
        "initdb_args": list(_INITDB_ARGS),
        "pg_hba": hashlib.sha256(_PG_HBA.encode()).hexdigest(),
    }


def _template_valid(template: Path, runner: Runner, version: str) -> bool:
    data = template / "data"
    try:
        marker = json.loads((template / "lab-template.json").read_text())
        st = data.lstat()
    except (OSError, ValueError):
        return False
    if not safe_dir(template) or marker != _template_marker(runner, version):
        return False
    if runner.uid is not None and st.st_uid != runner.uid:
        return False
    if (data / "postmaster.pid").exists():
        return False
    try:
        major = (data / "PG_VERSION").read_text().strip()
    except OSError:
        return False
    if not version.startswith(major + ".") and version != major:
        return False
    if not os.access(runner.bindir / "pg_controldata", os.X_OK):
        return True  # nothing more to ask; a copy that fails to start falls back to initdb
    try:
        control = runner.run("pg_controldata", "-D", str(data), timeout=30)
    except errors.ProvisioningError:
        return False
    return re.search(r"^Database cluster state:\s+shut down$", control, re.MULTILINE) is not None


def cached_template(runner: Runner, version: str, root: Path) -> Path:
    """Return a valid cached template for these binaries, building it atomically if needed."""
    open_cache_root(root)
    remove_abandoned(root)
    digest = hashlib.sha256(str(runner.bindir).encode()).hexdigest()[:10]
    template = root / f"pg-{version}-{digest}-template"
    if template.exists():
        if _template_valid(template, runner, version):
            return template
        log.warning("discarding invalid PostgreSQL template %s", template)
        discard(template)
    build = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        build.chmod(0o755)  # the server user copies from it
        data = build / "data"
        data.mkdir(mode=0o700)
        runner.give(data)
        initdb(runner, data)
        (build / "lab-template.json").write_text(json.dumps(_template_marker(runner, version)))
        try:
            build.rename(template)
        except OSError:
            # Another run built it first; theirs is as good as ours.
            if not _template_valid(template, runner, version):
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    log.info("built PostgreSQL template %s", template)
    return template


def copy_tree(runner: Runner, source: Path, target: Path) -> None:
    """Copy the template's data directory to ``target`` as the server user."""
    # cp -a keeps modes and ownership, and GNU cp 9 clones where the filesystem can.
    cp = shutil.which("cp")
    if cp is None:
        if runner.uid is not None:
            raise errors.ProvisioningError("copying the template as the server user needs cp")
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        return
    # A target that exists (a mounted volume's data directory) receives the contents.
    arguments = [f"{source}/.", str(target)] if target.exists() else [str(source), str(target)]
    try:
        subprocess.run(
            [cp, "-a", *arguments],
            check=True,
            capture_output=True,
            timeout=120,
            **runner.user_kwargs(),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise errors.ProvisioningError(f"could not copy the template cluster: {exc}") from exc
