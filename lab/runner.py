"""``lab run``: run the experiments in a pytest subprocess and summarise the compiler.

pytest does the work (and the lab plugin writes and signs the evidence); this
module only builds the command, streams pytest's output and then renders the
signed report, with the same function ``lab evidence show`` uses.

``lab run --hermetic [--commit REV]`` runs the committed revision, not the working
tree: it clones REV into a fresh directory, runs it on the locked environment
(``install_environment``: a digest-keyed venv under ``.tools/hermetic/`` holding
exactly uv.lock's dependencies, hashes enforced, reused while the lock and the
interpreter are the same, plus a fresh per-run venv whose one path file puts the
clone and those dependencies on ``sys.path``), with the environment
``lab.evidence.hermetic`` allows and nothing else, and writes the evidence into the
caller's ``--evidence`` directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console

from lab import errors, files
from lab.evidence import compiler, environment, gate, hermetic, provenance, summary
from lab.pg import cluster, providers

EXPERIMENTS = "experiments"
pytest_usage_error = 4  # pytest.ExitCode.USAGE_ERROR, without importing pytest here


# Where the digest-keyed dependency venvs of hermetic runs live, under the checkout.
HERMETIC_CACHE = ".tools/hermetic"
_STAMP = "lab-hermetic.json"
_GIT_TIMEOUT = 300
_INSTALL_TIMEOUT = 3600


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What ``lab run`` is asked to do (its flags)."""

    chapter: tuple[str, ...] = ()
    numprocesses: str | None = None
    evidence: str = "evidence"
    hermetic: bool = False
    commit: str | None = None
    pytest_args: tuple[str, ...] = ()


def pytest_command(options: RunOptions, python: str | None = None) -> list[str]:
    """The pytest invocation of ``lab run`` for its options."""
    chapters: Sequence[str] = options.chapter
    targets = [f"{EXPERIMENTS}/{chapter}" for chapter in chapters] or [EXPERIMENTS]
    # Experiments use no hypothesis; its plugin costs ~1.6 s of imports per process.
    command = [python or sys.executable, "-m", "pytest", *targets, "-p", "no:cacheprovider",
               "-p", "no:hypothesispytest"]
    if python is not None:
        # The hermetic venv installs the dependencies only: the plugin comes from the clone.
        command += ["-p", "lab.pytest_plugin"]
    command += ["--lab-evidence", str(options.evidence)]
    if options.numprocesses:
        command += ["-n", str(options.numprocesses)]
    extra = list(options.pytest_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return command + extra


def run_main(options: RunOptions, console: Console | None = None) -> int:
    """Run the experiments, print the summary; exit 0 only when the gate says PASS."""
    out = console or summary.console_for_output()
    if options.commit and not options.hermetic:
        raise errors.UsageError("--commit needs --hermetic: only a hermetic run runs a commit")
    if options.hermetic:
        return run_hermetic(options, out)
    chapters: Sequence[str] = options.chapter
    missing = [c for c in chapters if not (Path(EXPERIMENTS) / c).is_dir()]
    if not Path(EXPERIMENTS).is_dir() or missing:
        named = ", ".join(missing) or EXPERIMENTS
        raise errors.UsageError(f"no such experiments directory: {named}")
    if chapters:
        out.print(
            f"[yellow]Only {', '.join(chapters)}: a narrowed run is PARTIAL by design and "
            "never passes the gate.[/yellow]"
        )
    check_database(options.pytest_args, os.environ)
    command = pytest_command(options)
    out.print(f"[dim]$ {' '.join(command)}[/dim]")
    directory = Path(options.evidence)
    # Evidence of an earlier run must not survive a run that writes none (a usage
    # error, a crash): whatever is in the directory afterwards is this run's.
    for name in compiler.RUN_FILES:
        (directory / name).unlink(missing_ok=True)
    # pytest's own progress streams straight to the terminal.
    completed = subprocess.run(command, check=False)
    return _summarise(directory, completed.returncode, out)


def requested_database(arguments: Sequence[str]) -> tuple[str, str | None, bool]:
    """The PostgreSQL a run's pytest arguments ask for: (mode, DSN, remote allowed).

    Read as the plugin reads them (``--lab-postgres``, ``--lab-dsn``,
    ``--lab-allow-remote-dsn``, the last one given wins), without starting pytest.
    """
    mode, dsn, remote = providers.AUTO, None, False
    words = iter(arguments)
    for word in words:
        name, equals, value = word.partition("=")
        if name in ("--lab-postgres", "--lab-dsn"):
            given = value if equals else next(words, "")
            if name == "--lab-postgres":
                mode = given
            else:
                dsn = given or None
        elif word == "--lab-allow-remote-dsn":
            remote = True
    return mode, dsn, remote


def check_database(pytest_args: Sequence[str], environ: Mapping[str, str]) -> None:
    """Stop ``lab run`` before pytest starts when it could get no PostgreSQL.

    The provider is chosen as the plugin will choose it (``cluster.choose_provider``,
    which says in one paragraph what was tried when nothing fits), and a given DSN is
    connected to once; a server the run starts itself is the plugin's to start. Raises
    ``errors.ProvisioningError`` (exit 3) in one line.
    """
    arguments = [*shlex.split(environ.get("PYTEST_ADDOPTS", "")), *pytest_args]
    mode, dsn, remote = requested_database(arguments)
    if mode not in providers.MODES:
        return  # none (no server, by request), or a word pytest itself will refuse
    chosen = cluster.choose_provider(mode, dsn, lambda: cluster.docker_answers(environ),
                                     lambda: cluster.find_binaries(environ), environ)
    given = cluster.given_dsn(dsn, environ)
    if chosen == providers.DSN and given is not None:
        cluster.reach(given, allow_remote=remote, environ=environ)


def _summarise(directory: Path, returncode: int, out: Console) -> int:
    report_path = directory / compiler.REPORT_FILE
    if not report_path.is_file():
        message = f"pytest exited {returncode} without writing {report_path}"
        if returncode == pytest_usage_error:
            raise errors.UsageError(message)
        raise errors.CheckFailed(message)
    report = files.read_json(report_path, files.REPORT_LIMIT, "report")
    summary.print_summary(report, directory, out)
    if report.get("status") != gate.PASS:
        return returncode or 1
    return returncode


# --------------------------------------------------------------------------- hermetic


def _git(args: Sequence[str], cwd: Path, what: str) -> str:
    """Run git with no hooks; its stdout, or ``UsageError`` naming ``what``."""
    try:
        done = subprocess.run(
            ["git", "-c", "core.hooksPath=/dev/null", *args], cwd=cwd, capture_output=True,
            text=True, timeout=_GIT_TIMEOUT, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise errors.EnvironmentFailure(f"{what}: git failed: {exc}") from exc
    if done.returncode != 0:
        detail = (done.stderr.strip().splitlines() or ["git failed"])[-1]
        raise errors.UsageError(f"{what}: {detail}")
    return done.stdout.strip()


def resolve_commit(origin: Path, rev: str) -> str:
    """The full sha of commit ``rev`` in the repository at ``origin``."""
    if rev.startswith("-"):
        raise errors.UsageError(f"--commit {rev}: not a revision")
    return _git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"],
                origin, f"--commit {rev}: no such commit in {origin}")


def clone(origin: Path, sha: str, target: Path) -> None:
    """A fresh clone of ``origin`` at ``sha`` in ``target``: committed files only."""
    _git(["clone", "--quiet", "--no-checkout", "--no-hardlinks", str(origin), str(target)],
         origin, f"cannot clone {origin}")
    _git(["checkout", "--quiet", "--detach", sha], target, f"cannot check out {sha}")


def lock_of(tree: Path) -> tuple[str, str]:
    """``(file name, sha256)`` of the lock the tree at ``tree`` commits."""
    found = provenance.lock_digest(tree, None)
    if found is None:
        raise errors.UsageError(f"{tree}: no lock file ({', '.join(provenance.LOCK_FILES)})")
    return str(found["path"]), str(found["sha256"])


def _install_locked(venv: Path, tree: Path, origin: Path, uv_cache: Path) -> None:
    """Install exactly the tree's uv.lock (hashes enforced, the lab itself left out) as
    the venv ``venv``, with the pinned uv of the origin's ``scripts/ensure-uv``.

    The one place that knows how the locked environment is installed. Files are copied
    from a uv cache of the hermetic runs' own (``uv_cache``), never hard-linked: uv links
    a venv's files to its cache by default, so a dependency edited in place in the
    author's own ``.venv`` edits the shared cache, and every venv linked to it.
    """
    try:
        done = subprocess.run([str(origin / "scripts" / "ensure-uv")], capture_output=True,
                              text=True, timeout=_INSTALL_TIMEOUT, check=False,
                              env=_install_environ({}))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise errors.EnvironmentFailure(f"installing uv: {exc}") from exc
    if done.returncode != 0 or not done.stdout.strip():
        raise errors.EnvironmentFailure(f"installing uv: scripts/ensure-uv exited "
                                        f"{done.returncode}")
    uv = done.stdout.strip().splitlines()[-1]
    # From a copy: nothing uv does may leave a file in the fresh clone.
    with tempfile.TemporaryDirectory(prefix="lab-hermetic-build-") as build:
        copy = Path(build) / "project"
        shutil.copytree(tree, copy, ignore=shutil.ignore_patterns(".git"))
        _run([uv, "sync", "--project", str(copy), "--locked", "--no-install-project",
              "--no-python-downloads", "--python", _base_python(), "--quiet"],
             "installing the locked environment",
             {"UV_PROJECT_ENVIRONMENT": str(venv), "UV_CACHE_DIR": str(uv_cache),
              "UV_LINK_MODE": "copy"})


def _install_environ(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment for the installers, without what would run code of its
    own in an interpreter they start (``PYTHONPATH``'s ``sitecustomize``, a start-up file,
    a preloaded library): the install of a hermetic run is no place for them either."""
    kept = {name: value for name, value in os.environ.items()
            if not name.startswith(("PYTHON", "LD_"))}
    return {**kept, **extra}


def _run(command: Sequence[str], what: str, env: dict[str, str] | None = None) -> None:
    try:
        done = subprocess.run(command, timeout=_INSTALL_TIMEOUT, check=False,
                              env=_install_environ(env or {}))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise errors.EnvironmentFailure(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise errors.EnvironmentFailure(f"{what}: {command[0]} exited {done.returncode}")


def environment_key(lock_sha256: str) -> str:
    """The dependency venv's digest: the lock's, the interpreter's version and platform."""
    parts = [lock_sha256, sys.version, platform.machine(), sys.implementation.cache_tag or ""]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def install_environment(tree: Path, cache: Path, origin: Path) -> tuple[Path, str]:
    """The site-packages of the locked dependencies of ``tree``, and the lock's digest.

    Reused from ``cache`` when a venv there carries this key (lock digest + python)
    *and* still matches the lock file by file (every distribution's version and the
    hashes its RECORD lists); built afresh otherwise, from a uv cache of the hermetic
    runs' own, which is emptied first when a venv built from it failed that check. A
    fresh build that does not match the lock is an ``EnvironmentFailure`` naming the
    first difference. Its files are checked again at run time: every module that runs
    must match its distribution's RECORD (``provenance.vouch``).
    """
    lock_name, lock_sha256 = lock_of(tree)
    key = environment_key(lock_sha256)
    venv = cache / key[:24]
    uv_cache = cache / "uv-cache"
    stamp = venv / _STAMP
    try:
        reusable = json.loads(stamp.read_text(encoding="utf-8")).get("key") == key
    except (OSError, ValueError, AttributeError):
        reusable = False
    if reusable and _differences(tree / lock_name, venv):
        # Edited since it was built: neither it nor the cache it came from is trusted.
        reusable = False
        shutil.rmtree(uv_cache, ignore_errors=True)
    if not reusable:
        shutil.rmtree(venv, ignore_errors=True)
        cache.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f"{key[:24]}.", dir=cache)) / "venv"
        try:
            _install_locked(building, tree, origin, uv_cache)
            found = _differences(tree / lock_name, building)
            if found:
                shutil.rmtree(uv_cache, ignore_errors=True)
                raise errors.EnvironmentFailure(
                    f"the locked environment as installed differs from {lock_name}: "
                    f"{found[0]}")
            (building / _STAMP).write_text(json.dumps({"key": key, "lock": lock_sha256}),
                                           encoding="utf-8")
            with contextlib.suppress(OSError):  # another run built it meanwhile
                building.rename(venv)
        finally:
            shutil.rmtree(building.parent, ignore_errors=True)
    site = _site_packages(venv)
    return site, lock_sha256


def _differences(lock: Path, venv: Path) -> tuple[str, ...]:
    """How the venv's installed files differ from ``lock`` (empty: they match)."""
    return environment.check(lock, [str(_site_packages(venv))]).differences


def _base_python() -> str:
    """The interpreter this lab runs on, outside any venv."""
    base = getattr(sys, "_base_executable", None)
    return base if isinstance(base, str) and base else sys.executable


def _site_packages(venv: Path) -> Path:
    relative = Path(sysconfig.get_path("purelib", vars={"base": "."}))
    return (venv / relative).resolve()


def run_venv(scratch: Path, tree: Path, dependencies: Path) -> Path:
    """A fresh venv for one run whose one path file (no code) puts the clone and the
    dependency venv on ``sys.path``; its python."""
    venv = scratch / "venv"
    _run([_base_python(), "-m", "venv", "--without-pip", str(venv)], "creating the run's venv")
    (_site_packages(venv) / "lab-hermetic.pth").write_text(
        f"{tree}\n{dependencies}\n", encoding="utf-8"
    )
    return venv / "bin" / "python"


def run_hermetic(options: RunOptions, out: Console) -> int:
    """``lab run --hermetic``: the committed revision in a fresh clone, on the locked
    environment, isolated; the evidence lands in the caller's ``--evidence``."""
    origin = Path(_git(["rev-parse", "--show-toplevel"], Path.cwd(),
                       "--hermetic runs a commit of a git repository"))
    sha = resolve_commit(origin, options.commit or "HEAD")
    directory = Path(options.evidence).resolve()
    for name in compiler.RUN_FILES:
        (directory / name).unlink(missing_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lab-hermetic-") as scratch_name:
        scratch = Path(scratch_name)
        tree = scratch / "src"
        out.print(f"[dim]hermetic: cloning {sha[:12]} of {origin}[/dim]")
        clone(origin, sha, tree)
        chapters: Sequence[str] = options.chapter
        missing = [c for c in chapters if not (tree / EXPERIMENTS / c).is_dir()]
        if missing:
            raise errors.UsageError(f"no such experiments directory at {sha[:12]}: "
                                    f"{', '.join(missing)}")
        dependencies, lock_sha256 = install_environment(tree, origin / HERMETIC_CACHE, origin)
        python = run_venv(scratch, tree, dependencies)
        for name in ("pycache", "home", "tmp"):
            (scratch / name).mkdir()
        env = hermetic.environment(
            os.environ, pycache=str(scratch / "pycache"), home=str(scratch / "home"),
            tmp=str(scratch / "tmp"), lock_sha256=lock_sha256,
        )
        # Fill the fresh bytecode prefix from the sources this run runs, before any test:
        # otherwise every worker, tool and peer process starts by compiling its imports,
        # and the experiments' start-up timeouts measure the compiler.
        try:
            subprocess.run([str(python), "-m", "compileall", "-q", "-j", "0", str(dependencies),
                            str(tree / "lab")], cwd=tree, env=env, capture_output=True,
                           timeout=_INSTALL_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise errors.EnvironmentFailure(f"compiling the run's bytecode: {exc}") from exc
        run_options = dataclasses.replace(options, evidence=str(directory))
        command = pytest_command(run_options, python=str(python))
        out.print(f"[dim]$ {' '.join(command)}  (in the clone, {len(env)} allowlisted "
                  "variables)[/dim]")
        completed = subprocess.run(command, cwd=tree, env=env, check=False)
    return _summarise(directory, completed.returncode, out)
