"""Hermetic runs: the one environment allowlist, and what makes a recorded run hermetic.

``lab run --hermetic`` (``lab.runner``) exports the committed revision's files from
git's objects into a fresh directory (``lab.evidence.tree``), installs the lock's
verified wheels into a venv checked file by file against them (``lab.evidence.wheels``),
runs pytest there with only the variables of ``ALLOWLIST`` (plus the isolation
settings of ``ISOLATION``): no ``PYTHONPATH``, ``PYTHONSTARTUP``, ``PYTHONHOME``,
``LD_PRELOAD``, no ``PYTEST_ADDOPTS`` nor any other pytest option from the
environment, no user site, and bytecode in a fresh directory. Every child process
(xdist workers, lab workers, the tool, the peers) inherits that environment, so the
isolation holds in every process, not only in the first interpreter.

The pytest process does not take the runner's word for it: ``observe`` records what
it sees of itself (its flags, its environment's names, the clone's ignored files),
and ``failures`` decides from those recorded facts alone, so the gate and the
verifier reach the same answer from the signed report. A run that is not hermetic is
*local*: it still gets a verdict (authors need one), but it is never publishable.

Pure: the caller hands in the environment and the interpreter's flags.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

HERMETIC = "hermetic"
LOCAL = "local"
# Set by ``lab run --hermetic`` for its pytest process: the run asks to be judged hermetic.
REQUEST_ENV = "LAB_HERMETIC"
# The lock's digest, handed by the runner (``sha256`` hex of the lock file it installed).
LOCK_ENV = "LAB_HERMETIC_LOCK"
# The commit the runner exported and its tree id (``lab.evidence.tree``'s names).
COMMIT_ENV = "LAB_HERMETIC_COMMIT"
TREE_ENV = "LAB_HERMETIC_TREE"

# Every variable a hermetic run passes on from the caller's environment, and nothing else.
# PATH finds git and the PostgreSQL binaries; the LAB_/BOOK_ names are the lab's own
# inputs (the signing key, where the run can be seen, which PostgreSQL binaries).
ALLOWLIST: tuple[str, ...] = (
    "PATH",
    "LANG",
    "LC_ALL",
    "TZ",
    "TERM",
    "LAB_EVIDENCE_KEY",
    "BOOK_RUN_URL",
    "LAB_PG_BINARIES",
)
# The PostgreSQL template cache, always off: a publishable run's cluster is made by its
# own initdb, never copied from a template someone else's run left behind.
PG_CACHE_ENV = "LAB_PG_CACHE"
PG_CACHE_OFF = "off"
# Set by the runner itself, never taken from the caller: -I-style isolation that every
# child interpreter inherits through its environment (-s: PYTHONNOUSERSITE, -P:
# PYTHONSAFEPATH), bytecode in a fresh directory, a fresh HOME and TMPDIR.
ISOLATION: tuple[str, ...] = (
    "PYTHONNOUSERSITE",
    "PYTHONSAFEPATH",
    "PYTHONPYCACHEPREFIX",
    "PYTHONHASHSEED",
    "HOME",
    "TMPDIR",
    REQUEST_ENV,
    LOCK_ENV,
    PG_CACHE_ENV,
    COMMIT_ENV,
    TREE_ENV,
)
# Names pytest-xdist and execnet set in their workers, and the run's own DSN hand-off; the
# run's marker (``lab.leftovers``), set by the runner or the plugin; PWD, which the sandbox
# (bwrap --chdir) sets to the exported tree.
_RUNTIME_ADDED = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID",
                  "PYTEST_CURRENT_TEST", "PYTEST_VERSION", "LAB_RUN_MARKER", "PWD")


def allowed_names() -> tuple[str, ...]:
    """Every environment variable a hermetic pytest process may see, sorted."""
    return tuple(sorted({*ALLOWLIST, *ISOLATION, *_RUNTIME_ADDED}))


def environment(
    caller: Mapping[str, str], *, pycache: str, home: str, tmp: str, lock_sha256: str,
    commit: str, tree: str,
) -> dict[str, str]:
    """The whole environment of a hermetic run: the allowlisted part of ``caller`` plus
    the isolation settings; nothing else of ``caller`` reaches the run."""
    env = {name: caller[name] for name in ALLOWLIST if name in caller}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(
        PYTHONNOUSERSITE="1",
        PYTHONSAFEPATH="1",
        PYTHONPYCACHEPREFIX=pycache,
        PYTHONHASHSEED="0",
        HOME=home,
        TMPDIR=tmp,
    )
    env[REQUEST_ENV] = "1"
    env[LOCK_ENV] = lock_sha256
    env[PG_CACHE_ENV] = PG_CACHE_OFF
    env[COMMIT_ENV] = commit
    env[TREE_ENV] = tree
    return env


def observe(
    environ: Mapping[str, str],
    *,
    no_user_site: bool,
    safe_path: bool,
    pycache_prefix: str | None,
    ignored: Sequence[str] | None,
    lock: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The report's ``run`` section: what this process sees of its own isolation."""
    requested = environ.get(REQUEST_ENV) == "1"
    return {
        "kind": HERMETIC if requested else LOCAL,
        "allowlist": list(allowed_names()),
        "environment": sorted(environ),
        "no_user_site": no_user_site,
        "safe_path": safe_path,
        "fresh_bytecode": bool(pycache_prefix),
        # Ignored or untracked files of the checkout when the run started (None: unknown).
        "ignored": None if ignored is None else sorted(ignored)[:20],
        "lock": dict(lock) if lock is not None else None,
        # The commit the runner exported and its tree id, as handed to this process: the
        # report's own tree (computed from the files) must be this one.
        "source": {"commit": environ.get(COMMIT_ENV), "tree": environ.get(TREE_ENV)},
    }


def source_failures(report: Mapping[str, Any]) -> list[str]:
    """Why a hermetic report is not what its run section promises: its ``tree``
    (computed from the files after the run) and ``commit`` must be those the runner
    exported, and its PostgreSQL a cluster the run made with its own ``initdb``."""
    run = report.get("run")
    source = run.get("source") if isinstance(run, Mapping) else None
    if not isinstance(source, Mapping):
        return []  # ``failures`` names it
    found: list[str] = []
    if report.get("tree") != source.get("tree"):
        found.append(f"not hermetic: the sources make tree {str(report.get('tree'))[:12]}, "
                     f"not the exported commit's {str(source.get('tree'))[:12]}")
    if report.get("commit") != source.get("commit"):
        found.append("not hermetic: the report names another commit than the one exported")
    database = report.get("postgresql")
    details = database.get("details") if isinstance(database, Mapping) else None
    method = details.get("method") if isinstance(details, Mapping) else None
    if method != "initdb":
        found.append(f"not hermetic: the run's PostgreSQL was not made by its own initdb "
                     f"(method {method!r}): a cached template is never publishable")
    return found


def failures(run: Any) -> list[str]:
    """Why a recorded ``run`` section is not hermetic; empty when it is."""
    if not isinstance(run, Mapping):
        return ["the report does not record how the run was isolated (a local run)"]
    if run.get("kind") != HERMETIC:
        return ["a local run (not lab run --hermetic): never publishable"]
    found: list[str] = []
    allowed = set(allowed_names())
    names = run.get("environment")
    if not isinstance(names, list):
        found.append("the run's environment is not recorded")
    else:
        extra = sorted(str(n) for n in names if n not in allowed)
        if extra:
            found.append(f"environment variables outside the allowlist: {', '.join(extra[:5])}")
    if run.get("allowlist") != list(allowed_names()):
        found.append("the recorded allowlist is not the lab's")
    if run.get("no_user_site") is not True:
        found.append("the user site directory was enabled")
    if run.get("safe_path") is not True:
        found.append("the interpreter put the script or working directory on sys.path")
    if run.get("fresh_bytecode") is not True:
        found.append("bytecode was not kept in a fresh directory")
    ignored = run.get("ignored")
    if ignored is None or (isinstance(ignored, list) and ignored):
        shown = ", ".join(str(i) for i in ignored[:3]) if isinstance(ignored, list) else "unknown"
        found.append(f"the sources were not exactly the commit's tree ({shown})")
    source = run.get("source")
    if not isinstance(source, Mapping) or not all(
            isinstance(source.get(k), str) and source.get(k) for k in ("commit", "tree")):
        found.append("the sources were not exported from a commit's git objects")
    lock = run.get("lock")
    if not isinstance(lock, Mapping) or not isinstance(lock.get("sha256"), str):
        found.append("no lock digest is recorded")
    elif lock.get("installed") != lock.get("sha256"):
        found.append(f"the environment was not installed from the checkout's {lock.get('path')}")
    return [f"not hermetic: {f}" for f in found]
