"""``lab run``: run the experiments in a pytest subprocess and summarise the compiler.

pytest does the work (and the lab plugin writes and signs the evidence); this
module only builds the command, streams pytest's output and then renders the
signed report, with the same function ``lab evidence show`` uses.

``lab run --hermetic [--commit REV]`` runs the committed revision, not the working
tree: it exports REV's files from git's objects into a fresh directory, runs it on the
locked environment
(``install_environment``: a digest-keyed venv under ``.tools/hermetic/`` holding
exactly uv.lock's dependencies, hashes enforced, reused while the lock and the
interpreter are the same, plus a fresh per-run venv whose one path file puts the
tree and those dependencies on ``sys.path``), with the environment
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
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from rich.console import Console

from lab import errors, files, leftovers, protocol, sandbox
from lab.evidence import caller, compiler, dsse, gate, hermetic, provenance, seal, summary, wheels
from lab.evidence import tree as source_tree
from lab.options import option
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
    """What ``lab run`` is asked to do: its flags, declared here."""

    chapter: tuple[str, ...] = option((), help="only this chapter")
    numprocesses: str | None = option(
        None, flags=("-n", "--numprocesses"), metavar="N",
        help="pytest-xdist workers (none: one process, no xdist)")
    evidence: str = option("evidence", help="evidence directory")
    hermetic: bool = option(
        False, help="run the committed revision in a fresh clone on the locked environment, "
                    "isolated (the only publishable kind of run)")
    beside_load: int = option(
        0, metavar="N", help="run beside N busy-loop processes (signed as --lab-beside-load)")
    commit: str | None = option(
        None, metavar="REV", help="with --hermetic: the revision to run (default HEAD)")
    pytest_args: tuple[str, ...] = option((), help="after --: pytest arguments", remainder=True)


# How long an interrupted pytest gets to tear its experiments down (servers, mounts).
INTERRUPT_GRACE_S = 60.0


def pytest_command(options: RunOptions, python: str | None = None) -> list[str]:
    """The pytest invocation of ``lab run`` for its options."""
    chapters: Sequence[str] = options.chapter
    targets = [f"{EXPERIMENTS}/{chapter}" for chapter in chapters] or [EXPERIMENTS]
    # Experiments use no hypothesis; its plugin costs ~1.6 s of imports per process.
    command = [python or sys.executable, "-m", "pytest", *targets, "-p", "no:cacheprovider",
               "-p", "no:hypothesispytest"]
    if python is not None:
        # The hermetic venv installs the dependencies only: the plugin comes from the exported tree.
        command += ["-p", "lab.pytest_plugin"]
    command += ["--lab-evidence", str(options.evidence)]
    if options.numprocesses:
        command += ["-n", str(options.numprocesses)]
    if options.beside_load:
        command += ["--lab-beside-load", str(options.beside_load)]
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
    returncode = run_marked(command, out)
    return _summarise(directory, returncode, out)


def run_marked(command: Sequence[str], out: Console, cwd: Path | None = None,
               env: Mapping[str, str] | None = None,
               wrap: Callable[[Sequence[str], dict[str, str]], list[str]] | None = None) -> int:
    """Run pytest with a fresh run marker; afterwards (passed, failed, interrupted) end
    whatever of the run is left (``lab.leftovers``), saying what it was. An interrupt
    reaches pytest too (same process group): it gets ``INTERRUPT_GRACE_S`` to tear its
    experiments down before it is killed. ``wrap`` turns the command and its marked
    environment into the command line that runs it (the hermetic run's sandbox)."""
    marker = leftovers.new_marker()
    marked = {**(env if env is not None else os.environ), protocol.RUN_MARKER_ENV: marker}
    argv = wrap(command, marked) if wrap is not None else list(command)
    started: list[subprocess.Popen[bytes]] = []
    try:
        try:
            with _interrupts_reach(started):
                # Started once this process handles SIGINT itself: an exec'd child then
                # begins with SIGINT at its default, so the interrupt passed on reaches
                # pytest even where this process inherited SIGINT ignored (as a script's
                # background job, ``lab run &``, does), and pytest tears down.
                started.append(subprocess.Popen(argv, cwd=cwd, env=marked))
                returncode = started[0].wait()
        except KeyboardInterrupt:
            for child in started:
                try:
                    child.wait(timeout=INTERRUPT_GRACE_S)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            raise
    finally:
        left = leftovers.sweep(marker)
        if left:
            out.print(f"[red]left behind by the run, now ended: {left.describe()}[/red]")
    return 1 if left and returncode == 0 else returncode


@contextlib.contextmanager
def _interrupts_reach(children: list[subprocess.Popen[bytes]]) -> Iterator[None]:
    """While the block runs, an interrupt meant for this process reaches ``children``
    (the ones started so far) too.

    Ctrl-C at a terminal reaches the whole foreground process group, pytest included.
    A SIGINT sent to this process alone (``kill -INT``, no terminal) or a SIGTERM (a job
    cancelled, ``timeout``) would not: pytest would run on, orphaned or killed after the
    grace without tearing anything down. Those are passed on as SIGINT, so pytest tears
    its experiments down as after Ctrl-C, and this process takes the interrupt path."""
    def forward(signum: int, frame: object) -> None:
        if signum == signal.SIGTERM or not _from_terminal():
            for child in children:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGINT)
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.signal(signum, forward)
              for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _from_terminal() -> bool:
    """Whether this process is in its terminal's foreground group: a SIGINT then came
    from Ctrl-C, and pytest, in the same group, has it already."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


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
    """The fixed git of ``lab.evidence.tree`` (never the caller's); its stdout, stripped."""
    return source_tree.git(cwd, args, what).decode("utf-8", "replace").strip()


def resolve_commit(origin: Path, rev: str) -> str:
    """The full sha of commit ``rev`` in the repository at ``origin``."""
    if rev.startswith("-"):
        raise errors.UsageError(f"--commit {rev}: not a revision")
    return _git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"],
                origin, f"--commit {rev}: no such commit in {origin}")


def export(origin: Path, sha: str, target: Path) -> str:
    """The files of commit ``sha`` of ``origin`` in the new directory ``target``, from
    git's objects, each checked against its id (``lab.evidence.tree.export``); the
    commit's tree id."""
    return source_tree.export(origin, sha, target)


def lock_of(tree: Path) -> tuple[str, str]:
    """``(file name, sha256)`` of the lock the tree at ``tree`` commits."""
    found = provenance.lock_digest(tree, None)
    if found is None:
        raise errors.UsageError(f"{tree}: no lock file ({', '.join(provenance.LOCK_FILES)})")
    return str(found["path"]), str(found["sha256"])


def _uv(tree: Path, scratch: Path) -> str:
    """The pinned uv, installed afresh for this run into ``scratch``, from ``tree``'s own
    ``scripts/uv-requirements.txt`` (git objects) by pip with every wheel's sha256.

    Never the caller's ``.tools/uv-venv``: a file planted there (a uv, or the pip beside
    it) would run before the sandbox and could write the hashes the lock is judged by.
    """
    requirements = tree / "scripts" / "uv-requirements.txt"
    if not requirements.is_file():
        raise errors.EnvironmentFailure(f"installing uv: {requirements.name} is not in the tree")
    tools = scratch / "uv-venv"
    _run([_base_python(), "-m", "venv", str(tools)], "installing uv: creating its venv",
         quiet=True)
    _run([str(tools / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
          "--disable-pip-version-check", "--only-binary", ":all:", "--require-hashes",
          "-r", str(requirements)],
         "installing uv", {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INPUT": "1"})
    return str(tools / "bin" / "uv")


def locked_requirements(uv: str, tree: Path, scratch: Path) -> Path:
    """The tree's ``uv.lock`` as a hashed requirements file (what ``uv sync --locked
    --no-install-project`` would install: the default set, the lab itself left out)."""
    requirements = scratch / "requirements.txt"
    # From a copy: nothing uv does may leave a file in the exported tree.
    with tempfile.TemporaryDirectory(prefix="lab-hermetic-build-") as build:
        copy = Path(build) / "project"
        shutil.copytree(tree, copy, ignore=shutil.ignore_patterns(".git"))
        _run([uv, "export", "--project", str(copy), "--locked", "--no-emit-project",
              "--format", "requirements-txt", "--no-header", "--no-annotate", "--quiet",
              "--output-file", str(requirements)],
             "exporting the lock's requirements", {"UV_CACHE_DIR": str(Path(build) / "uv")})
    return requirements


def fetch_wheels(uv: str, requirements: Path, wheelhouse: Path, scratch: Path) -> list[Path]:
    """A wheel for every locked requirement of this interpreter, each verified against the
    lock's sha256 (``wheels.verified``), in a fresh directory of ``scratch``.

    Taken from ``wheelhouse`` (wheels kept from earlier runs) when it has them, else
    downloaded; pip refuses any file whose digest the requirements do not list, and the
    lab checks every one again itself. Verified downloads are kept in ``wheelhouse``.
    """
    pip = [str(Path(uv).parent / "python"), "-m", "pip", "download", "--no-deps",
           "--only-binary=:all:", "--require-hashes", "--disable-pip-version-check",
           "--quiet", "-r", str(requirements)]
    target = scratch / "wheels"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    settings = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INPUT": "1"}
    try:
        _run([*pip, "--no-index", "--find-links", str(wheelhouse), "-d", str(target)],
             "wheels from the wheelhouse", settings, quiet=True)
    except errors.EnvironmentFailure:
        shutil.rmtree(target, ignore_errors=True)
        _run([*pip, "-d", str(target)], "downloading the locked wheels", settings)
    locked = wheels.locked_hashes(requirements.read_text(encoding="utf-8"))
    found = wheels.verified(target.glob("*.whl"), locked)
    for wheel in found:
        kept = wheelhouse / wheel.name
        if not kept.is_file() or wheels.sha256_of(kept) != wheels.sha256_of(wheel):
            shutil.copyfile(wheel, kept)
    return found


def _install_locked(venv: Path, uv: str, requirements: Path, found: Sequence[Path]) -> None:
    """Install the verified wheels ``found`` (and nothing else: no index, a uv cache made
    for this install) into the new venv ``venv``; uv checks each wheel's hash again."""
    _run([_base_python(), "-m", "venv", "--without-pip", str(venv)],
         "creating the dependencies' venv")
    # A cache of this install's own, and copies out of it rather than hardlinks: no file
    # of this venv shares an inode with any uv cache, so an edit to one (a tamper, a
    # test) never reaches another venv (scripts/ensure-venv installs by copy too).
    with tempfile.TemporaryDirectory(prefix="lab-hermetic-uv-") as uv_cache:
        _run([uv, "pip", "install", "--python", str(venv / "bin" / "python"), "--no-deps",
              "--no-index", "--offline", "--require-hashes", "--no-build", "--quiet",
              "--find-links", str(found[0].parent) if found else str(venv),
              "-r", str(requirements)],
             "installing the locked wheels",
             {"UV_CACHE_DIR": uv_cache, "UV_LINK_MODE": "copy"})


def _install_environ(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment for the installers, without what would run code of its
    own in an interpreter they start (``PYTHONPATH``'s ``sitecustomize``, a start-up file,
    a preloaded library), nor the caller's settings for pip and uv (an index, a config
    file, a cache): the install of a hermetic run is no place for them either."""
    kept = {name: value for name, value in os.environ.items()
            if not name.startswith(("PYTHON", "LD_", "PIP_", "UV_"))}
    return {**kept, **extra}


def _run(command: Sequence[str], what: str, env: dict[str, str] | None = None,
         *, quiet: bool = False) -> None:
    try:
        done = subprocess.run(command, timeout=_INSTALL_TIMEOUT, check=False,
                              env=_install_environ(env or {}),
                              capture_output=quiet)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise errors.EnvironmentFailure(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise errors.EnvironmentFailure(f"{what}: {command[0]} exited {done.returncode}")


def environment_key(lock_sha256: str) -> str:
    """The dependency venv's digest: the lock's, the interpreter's version and platform."""
    parts = [lock_sha256, sys.version, platform.machine(), sys.implementation.cache_tag or ""]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def install_environment(
    tree: Path, cache: Path, scratch: Path, out: Console | None = None
) -> tuple[Path, str]:
    """The site-packages of the locked dependencies of ``tree``, and the lock's digest.

    The lock's wheels are fetched and verified against its sha256 every time
    (``fetch_wheels``). A venv in ``cache`` with this key (lock digest + python) is
    reused only when every file in it is one those wheels install, with the wheel's
    digest (``wheels.venv_problems``: the wheels' own RECORDs decide, never the venv's);
    otherwise it is removed and built afresh from the verified wheels, and the new venv
    must pass the same check or the run fails naming the first difference.
    """
    _lock_name, lock_sha256 = lock_of(tree)
    key = environment_key(lock_sha256)
    venv = cache / key[:24]
    uv = _uv(tree, scratch)
    requirements = locked_requirements(uv, tree, scratch)
    found = fetch_wheels(uv, requirements, cache / "wheels", scratch)
    try:
        reusable = json.loads((venv / _STAMP).read_text(encoding="utf-8")).get("key") == key
    except (OSError, ValueError, AttributeError):
        reusable = False
    if reusable:
        problems = wheels.venv_problems(venv, _site_packages(venv), found, _STAMP)
        if problems and out is not None:
            out.print(f"[yellow]hermetic: rebuilding the dependencies' venv: {problems[0]}"
                      "[/yellow]")
        reusable = not problems
    if not reusable:
        shutil.rmtree(venv, ignore_errors=True)
        cache.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f"{key[:24]}.", dir=cache)) / "venv"
        try:
            _install_locked(building, uv, requirements, found)
            problems = wheels.venv_problems(building, _site_packages(building), found)
            if problems:
                raise errors.EnvironmentFailure(
                    f"the venv installed from the lock's wheels differs from them: "
                    f"{problems[0]}")
            (building / _STAMP).write_text(json.dumps({"key": key, "lock": lock_sha256}),
                                           encoding="utf-8")
            with contextlib.suppress(OSError):  # another run built it meanwhile
                building.rename(venv)
        finally:
            shutil.rmtree(building.parent, ignore_errors=True)
        problems = wheels.venv_problems(venv, _site_packages(venv), found, _STAMP)
        if problems:
            raise errors.EnvironmentFailure(f"the dependencies' venv differs from the lock's "
                                            f"wheels: {problems[0]}")
    return _site_packages(venv), lock_sha256


def _base_python() -> str:
    """The interpreter this lab runs on, outside any venv."""
    base = getattr(sys, "_base_executable", None)
    return base if isinstance(base, str) and base else sys.executable


def _site_packages(venv: Path) -> Path:
    relative = Path(sysconfig.get_path("purelib", vars={"base": "."}))
    return (venv / relative).resolve()


def run_venv(scratch: Path, tree: Path, dependencies: Path) -> Path:
    """A fresh venv for one run whose one path file (no code) puts the exported tree and the
    dependency venv on ``sys.path``; its python."""
    venv = scratch / "venv"
    _run([_base_python(), "-m", "venv", "--without-pip", str(venv)], "creating the run's venv")
    (_site_packages(venv) / "lab-hermetic.pth").write_text(
        f"{tree}\n{dependencies}\n", encoding="utf-8"
    )
    return venv / "bin" / "python"


def run_hermetic(options: RunOptions, out: Console) -> int:
    """``lab run --hermetic``: the committed revision's files exported from git's objects,
    on the locked environment, isolated; the evidence lands in the caller's ``--evidence``."""
    origin = Path(_git(["rev-parse", "--show-toplevel"], Path.cwd(),
                       "--hermetic runs a commit of a git repository"))
    sha = resolve_commit(origin, options.commit or "HEAD")
    key_file = os.environ.get(dsse.KEY_ENV)
    if key_file and not Path(key_file).is_file():
        raise errors.UsageError(f"{dsse.KEY_ENV} names no file: {key_file}")
    # This process seals the run's evidence with the key: before anything is written,
    # the interpreter it runs on must be the lock's, file by file (lab.evidence.caller).
    caller.require()
    sandbox.require()
    directory = Path(options.evidence).resolve()
    for name in compiler.RUN_FILES:
        (directory / name).unlink(missing_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lab-hermetic-") as scratch_name:
        scratch = Path(scratch_name)
        tree = scratch / "src"
        out.print(f"[dim]hermetic: exporting {sha[:12]} of {origin} from git's objects[/dim]")
        tree_id = export(origin, sha, tree)
        chapters: Sequence[str] = options.chapter
        missing = [c for c in chapters if not (tree / EXPERIMENTS / c).is_dir()]
        if missing:
            raise errors.UsageError(f"no such experiments directory at {sha[:12]}: "
                                    f"{', '.join(missing)}")
        dependencies, lock_sha256 = install_environment(tree, origin / HERMETIC_CACHE, scratch, out)
        python = run_venv(scratch, tree, dependencies)
        for name in ("pycache", "home", "tmp"):
            (scratch / name).mkdir()
        # The key stays with this process: the run signs with an ephemeral key, and
        # ``seal`` re-signs once the sandbox has ended (lab.evidence.seal).
        run_env = {k: v for k, v in os.environ.items() if k != dsse.KEY_ENV}
        env = sandbox.fixed_environment(hermetic.environment(
            run_env, pycache=str(scratch / "pycache"), home=str(scratch / "home"),
            tmp=str(scratch / "tmp"), lock_sha256=lock_sha256, commit=sha, tree=tree_id,
        ))
        layout = sandbox.Layout(
            read_only=_read_only_paths(dependencies, env),
            writable=(scratch, directory), workdir=tree)
        # Fill the fresh bytecode prefix from the sources this run runs, before any test:
        # otherwise every worker, tool and peer process starts by compiling its imports,
        # and the experiments' start-up timeouts measure the compiler.
        try:
            subprocess.run(sandbox.command(layout, env, [
                str(python), "-m", "compileall", "-q", "-j", "0", str(dependencies),
                str(tree / "lab")]), cwd=tree, capture_output=True,
                timeout=_INSTALL_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise errors.EnvironmentFailure(f"compiling the run's bytecode: {exc}") from exc
        run_options = dataclasses.replace(options, evidence=str(directory))
        command = pytest_command(run_options, python=str(python))
        out.print(f"[dim]$ {' '.join(command)}  (in the exported tree, in a bubblewrap "
                  f"sandbox, {len(env)} fixed variables)[/dim]")
        returncode = run_marked(command, out, cwd=tree, env=env,
                                wrap=lambda argv, marked: sandbox.command(layout, marked, argv))
        if (directory / compiler.REPORT_FILE).is_file():
            _seal(directory, key_file)
    return _summarise(directory, returncode, out)


def _read_only_paths(dependencies: Path, env: Mapping[str, str]) -> tuple[Path, ...]:
    """What a sandboxed run reads of the machine besides the system directories: the
    interpreter's prefix, the dependencies' venv, and PostgreSQL binaries named by path."""
    # ``dependencies`` is the venv's site-packages (lib/pythonX.Y/site-packages): the
    # whole venv is read, its scripts and headers included.
    paths = [Path(sys.base_prefix).resolve(), dependencies.resolve().parents[2]]
    named = env.get(cluster.BINARIES_ENV, "")
    if named.startswith("/") and Path(named).is_dir():
        paths.append(Path(named).resolve())
    return tuple(p for p in dict.fromkeys(paths) if not str(p).startswith("/usr/"))


def _seal(directory: Path, key_file: str | None) -> None:
    """Re-sign the sandboxed run's evidence here, with the key the run never saw."""
    report = files.read_json(directory / compiler.REPORT_FILE, files.REPORT_LIMIT,
                             compiler.REPORT_FILE)
    binaries = (report.get("postgresql", {}).get("details", {}).get("binaries")
                if isinstance(report, dict) else None)
    base = sandbox.trusted_base(Path(_base_python()),
                                Path(binaries) if isinstance(binaries, str) else None)
    signer = dsse.load_signer({dsse.KEY_ENV: key_file} if key_file else {})
    seal.seal(directory, signer, base)
