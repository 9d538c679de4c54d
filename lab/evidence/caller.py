"""The caller's own interpreter: is the process that seals a hermetic run the lock's?

``lab run --hermetic`` (and ``lab publish``, which runs it) runs the experiments in a
venv built from the lock's verified wheels, in a sandbox; but the process that starts
that run and then seals its evidence with the publication key (``lab.evidence.seal``)
is the caller's ``lab``, on the caller's ``.venv``. Code planted there (an installed
module edited in place, a ``sitecustomize``, a ``.pth`` line that imports) would run
inside the very process that signs, so ``require`` refuses, before the run writes
anything, unless:

- ``sys.path`` holds only the base interpreter's standard library, this interpreter's
  site directories, the lab's own checkout and the directory of the script or ``-c``
  (nothing added by ``PYTHONPATH`` or a path file);
- no start-up hook runs code that an installed distribution's RECORD does not list
  with its current sha256: a ``.pth`` with an ``import`` line in a site directory, a
  ``sitecustomize`` or ``usercustomize`` imported or waiting on the path (the base
  interpreter's own standard library is trusted as it is);
- every module already imported is a file git tracks in the lab's checkout, a file an
  installed distribution's RECORD lists with its current sha256, or the base
  interpreter's standard library, and its cached bytecode is its source's
  (``provenance.ran_modules`` and ``provenance.vouch``: the gate's own judgement of the
  pytest process);
- every distribution on ``sys.path`` is in the checkout's ``uv.lock`` at its version
  and every file its RECORD hashes still has that hash (``environment.check``).

What it cannot see: a RECORD sits in the same writable directory as the files it
vouches for, so a file planted together with a matching RECORD line passes (the run's
own venv is judged by the lock's wheels instead, ``lab.evidence.wheels``); the base
interpreter and its standard library are trusted as they are; and a module first
imported after the check is judged only by where ``sys.path`` finds it.
"""

from __future__ import annotations

import importlib.machinery
import os
import site
import sys
from collections.abc import Callable, Iterator
from functools import cache, partial
from pathlib import Path

from lab import errors
from lab.evidence import environment, provenance, tree

# The checkout the running lab's own files come from (``lab/evidence/caller.py``).
ROOT = Path(__file__).resolve().parents[2]
LOCK = "uv.lock"
_HOOK_MODULES = ("sitecustomize", "usercustomize")


def _site_directories() -> list[str]:
    directories = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        directories.append(site.getusersitepackages())
    return directories


def path_problems(root: Path) -> Iterator[str]:
    """Entries of ``sys.path`` that are neither the base interpreter's library, a site
    directory of this interpreter nor the checkout ``root``."""
    allowed = {Path(p).resolve() for p in _site_directories()} | {root.resolve()}
    # Python puts the script's directory (or the working directory) first unless -P.
    entries = sys.path if sys.flags.safe_path else sys.path[1:]
    for entry in entries:
        path = Path(entry or os.curdir).resolve()
        if path not in allowed and not provenance.is_stdlib(path):
            yield (f"sys.path entry {entry} is neither the standard library, a site "
                   f"directory nor the lab's checkout (PYTHONPATH or a path file put it there)")


def _vouched(file: str) -> bool:
    """An installed distribution's file with its RECORD digest, or the base library."""
    if provenance.recorded_by(file, provenance.sha256_file(Path(file))) is not None:
        return True
    return provenance.is_stdlib(Path(file).resolve())


def hook_problems() -> Iterator[str]:
    """Start-up code nothing vouches for: a ``.pth`` that executes code, a
    ``sitecustomize`` or ``usercustomize`` that ran, or one the next start would run."""
    seen: set[str] = set()
    for hook in provenance.startup_hooks():
        file = str(hook["file"])
        seen.add(file)
        if hook["kind"] == "pth":
            if not isinstance(hook.get("distribution"), str):
                yield (f"start-up hook {file}: a .pth that executes code, listed by no "
                       f"installed distribution's RECORD")
        elif not _vouched(file):
            yield f"start-up hook {file}: a {hook['kind']} no installed distribution's RECORD lists"
    for name in _HOOK_MODULES:
        # Found without importing it: one that removed itself from sys.modules after
        # running, or one waiting for the next interpreter, is named all the same.
        spec = importlib.machinery.PathFinder.find_spec(name, sys.path)
        origin = spec.origin if spec is not None else None
        if origin and origin not in seen and os.path.isfile(origin) and not _vouched(origin):
            yield f"start-up hook {origin}: a {name} no installed distribution's RECORD lists"


def module_problems(root: Path) -> Iterator[str]:
    """Modules of ``sys.modules`` that are neither a tracked file of ``root``, an
    installed distribution's file with its RECORD digest, nor the base library; or
    whose bytecode is not their source's."""
    ran = provenance.ran_modules()
    snapshot = tree.sources(root)
    imported = {os.path.realpath(str(m["file"])) for m in ran}
    # Only the imported files: ``vouch`` checks the bytecode of every source it is given.
    sources = {} if snapshot is None else {
        name: digest for name, digest in snapshot.sha256.items()
        if os.path.realpath(root / name) in imported}
    verdict = provenance.vouch(ran, [], root=root, sources=sources)
    for item in verdict["unvouched"]:
        yield f"module {item['module']} from {item['file']} {item['reason']}"


def lock_problems(root: Path) -> Iterator[str]:
    """``environment.check`` of ``sys.path`` against ``root``'s lock: each difference."""
    lock = root / LOCK
    if not lock.is_file():
        yield f"no {LOCK} in {root} to check the interpreter's distributions against"
        return
    # Every difference, so the refusal can say how many there are besides the first.
    yield from environment.check(lock, max_differences=sys.maxsize).differences


def problems(root: Path = ROOT) -> list[str]:
    """What ``require`` would refuse, cheapest check first; only the first check that
    finds anything is listed in full."""
    checks: tuple[Callable[[], Iterator[str]], ...] = (
        partial(path_problems, root), hook_problems, partial(module_problems, root),
        partial(lock_problems, root))
    for check in checks:
        found = list(check())
        if found:
            return found
    return []


@cache
def require(root: Path = ROOT) -> None:
    """Refuse (``errors.EnvironmentFailure``, one line naming the first offending file)
    unless this interpreter is the lock's environment, as the module docstring says.

    A pass is remembered for the process: ``lab publish`` checks before it starts and
    the hermetic run it starts would check the same interpreter again.
    """
    found = problems(root)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise errors.EnvironmentFailure(
            f"this interpreter ({sys.executable}) is not the lock's environment, so it "
            f"may not run or seal a hermetic run: {found[0]}{more}")
