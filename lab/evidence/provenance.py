"""What ran: where ``lab``, every conftest and every plugin module came from.

The recorder lists the modules pytest loaded (``Loaded``); ``describe`` turns them
into the report's ``provenance`` section: each module's path (repo-relative when it
lies in the tree, absolute otherwise), its sha256, whether git tracks it, or the
installed distribution (``name==version``) that owns it. The gate
(``gate._provenance_failures``) then compares these facts with the hashed sources,
so a verifier recomputes the same verdict from the signed report alone.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import marshal
import os
import site
import sys
import sysconfig
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

from lab import errors, files
from lab.errors import InputError
from lab.evidence import tree

# Modules without a file that pytest-xdist's workers legitimately register.
_FILELESS = frozenset({"__channelexec__"})
CONFTEST = "conftest"
PLUGIN = "plugin"
# Environment variables that change what Python or pytest loads; recorded as they were.
ENVIRONMENT = ("PYTEST_PLUGINS", "PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")


@dataclass(frozen=True)
class Loaded:
    """One module pytest loaded: a conftest, or a registered plugin's module."""

    kind: str
    name: str
    module: str
    file: str | None

    def to_json(self) -> dict[str, Any]:
        """Plain data, as an xdist worker sends it to the controller."""
        return {"kind": self.kind, "name": self.name, "module": self.module, "file": self.file}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Loaded:
        """The inverse of ``to_json``."""
        file = data.get("file")
        return cls(str(data.get("kind")), str(data.get("name")), str(data.get("module")),
                   str(file) if file is not None else None)


def module_file(module: ModuleType | None) -> str | None:
    """The absolute path a module was loaded from, if it has one."""
    file = getattr(module, "__file__", None)
    return os.path.abspath(file) if isinstance(file, str) else None


def loaded_plugins(plugins: Iterable[tuple[str, object]]) -> list[Loaded]:
    """Conftests and plugin modules among pytest's registered ``(name, plugin)`` pairs.

    A plugin object that is not a module counts through the module defining its class.
    """
    found: dict[str, Loaded] = {}
    for name, plugin in plugins:
        if plugin is None:
            continue  # blocked with -p no:NAME
        if isinstance(plugin, ModuleType):
            module: ModuleType | None = plugin
        else:
            module = sys.modules.get(type(plugin).__module__)
        module_name = getattr(module, "__name__", type(plugin).__module__)
        file = module_file(module)
        kind = CONFTEST if file is not None and Path(file).name == "conftest.py" else PLUGIN
        label = module_name if kind == PLUGIN else str(name)
        found.setdefault(f"{kind}:{file or module_name}", Loaded(kind, label, module_name, file))
    return sorted(found.values(), key=lambda m: (m.kind, m.module, m.file or ""))


def sha256_file(path: Path) -> str | None:
    """``files.sha256_file``, or None when the file cannot be read (recorded as such)."""
    try:
        return files.sha256_file(path)
    except InputError:
        return None


def tracked_files(root: Path) -> set[str] | None:
    """Repo-relative paths of the tree's files under ``root``: those git tracks in a
    checkout, every file of an exported commit (``lab.evidence.tree.sources``); None
    outside git."""
    snapshot = tree.sources(root)
    return set(snapshot.sha256) if snapshot is not None else None


def installed_distributions() -> list[str]:
    """``name==version`` of every distribution this interpreter can import from."""
    found = {
        f"{dist.metadata['Name']}=={dist.version}"
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"]
    }
    return sorted(found)


@cache
def _owners() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


def owning_distribution(module: str, file: Path) -> str | None:
    """``name==version`` of the installed distribution whose RECORD lists ``file`` with
    the file's current digest.

    An editable install lists no module files, so a module of a checkout elsewhere is
    never mistaken for an installed one; an installed file edited in place no longer
    matches its RECORD digest and is not vouched for either.
    """
    top = module.split(".", 1)[0]
    for name in _owners().get(top, []):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for entry in dist.files or []:
            if Path(str(dist.locate_file(entry))).resolve() != file:
                continue
            recorded = entry.hash
            if recorded is None or recorded.mode != "sha256":
                return None
            with file.open("rb") as handle:
                digest = hashlib.file_digest(handle, "sha256").digest()
            actual = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
            if actual != recorded.value:
                return None
            return f"{dist.metadata['Name']}=={dist.version}"
    return None


def _is_tracked(path: str | None, tracked: set[str], root: Path) -> bool:
    """Git tracks ``path``, or a directory symlink above it (whose target holds it)."""
    if path is None or Path(path).is_absolute():
        return False
    if path in tracked:
        return True
    parts = Path(path).parts
    for depth in range(1, len(parts)):
        prefix = "/".join(parts[:depth])
        if prefix in tracked and (root / prefix).is_symlink():
            return True
    return False


@cache
def _stdlib_roots() -> tuple[Path, ...]:
    """The base interpreter's standard library: its ``stdlib`` and ``platstdlib``
    directories (``lib-dynload`` lies inside) and the zip ``sys.path`` names first.

    Computed from ``sys.base_prefix``, never from the venv: inside a venv ``sysconfig``
    puts ``platstdlib`` under the venv's own prefix, which anyone who can write the venv
    can fill."""
    bases = {"base": sys.base_prefix, "installed_base": sys.base_prefix,
             "platbase": sys.base_exec_prefix, "installed_platbase": sys.base_exec_prefix}
    paths = sysconfig.get_paths(vars=bases)
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    zipped = Path(sys.base_prefix) / "lib" / f"python{version}.zip"
    directories = dict.fromkeys(Path(paths[key]).resolve() for key in ("stdlib", "platstdlib"))
    return (*directories, zipped.resolve())


def is_stdlib(file: Path) -> bool:
    """Whether ``file`` (resolved) lies in the base interpreter's standard library (a
    directory of it or its zip), outside any site directory."""
    parts = set(file.parts)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return any(file.is_relative_to(root) for root in _stdlib_roots())


def describe(
    loaded: Iterable[Loaded],
    *,
    root: Path,
    sources: Mapping[str, str],
    lab_file: str | None,
    inifile: Path | None,
    environ: Mapping[str, str],
) -> dict[str, Any]:
    """The report's ``provenance`` section (see the module docstring)."""
    root = root.resolve()
    # Resolved path -> source name, so a tree whose lab/ is a symlink maps correctly.
    by_file = {(root / name).resolve(): name for name in sources}
    tracked = tracked_files(root) or set()

    def where(file: str | None) -> str | None:
        if file is None:
            return None
        resolved = (root / file).resolve()  # an absolute ``file`` stays itself
        if resolved in by_file:
            return by_file[resolved]
        if resolved.is_relative_to(root):
            return resolved.relative_to(root).as_posix()
        return str(resolved)

    modules: list[dict[str, Any]] = []
    # The controller and every xdist worker list the modules they share: keep one of each.
    for item in {(m.kind, m.module, m.file): m for m in loaded}.values():
        entry: dict[str, Any] = {"kind": item.kind, "name": item.name, "module": item.module}
        if item.file is None:
            # Only interpreter built-ins and execnet's remote module (an xdist worker's
            # ``__channelexec__``) may lack a file; any other file-less module is unknown.
            known = item.module in sys.builtin_module_names or item.module in _FILELESS
            entry.update(path=None, sha256=None, tracked=False, distribution=None, stdlib=known)
            modules.append(entry)
            continue
        resolved = Path(item.file).resolve()
        path = where(item.file)
        # A virtualenv may live inside the tree: only hashed sources count as the tree's.
        inside = path in sources
        distribution = None if inside else owning_distribution(item.module, resolved)
        stdlib = not inside and distribution is None and is_stdlib(resolved)
        if distribution is not None or stdlib:
            # Installed code is named by its distribution, not by this machine's paths.
            entry.update(path=None, sha256=None, tracked=False)
        else:
            entry.update(path=path, sha256=sha256_file(resolved),
                         tracked=_is_tracked(path, tracked, root))
            if item.kind == CONFTEST:
                entry["name"] = path  # pytest registers it under this machine's path
        entry.update(distribution=distribution, stdlib=stdlib)
        modules.append(entry)
    ini: dict[str, Any] | None = None
    ini_digest = sha256_file(inifile) if inifile is not None else None
    if inifile is not None and ini_digest is not None:
        ini = {"path": where(str(inifile)), "sha256": ini_digest}
    return {
        "lab": where(lab_file),
        "inifile": ini,
        "modules": sorted(modules, key=lambda m: (m["kind"], m["module"], m["path"] or "")),
        "environment": {name: environ.get(name) for name in ENVIRONMENT},
        "distributions": installed_distributions(),
    }


# --------------------------------------------------------------------------- what ran
#
# The plugin registry is not all that runs: any module in ``sys.modules`` may carry an
# edited body, a stale ``.pyc`` may run instead of its source, and a ``.pth`` line or a
# ``sitecustomize`` runs before pytest starts. Each process (the controller and every
# xdist worker) lists what it ran with ``ran_modules`` and ``startup_hooks``; ``vouch``
# then decides, in the controller, which of them nothing vouches for.

# Bytecode verdicts of one module (``ran_modules``'s ``bytecode``).
BYTECODE_STALE = "its cached bytecode was not compiled from its source"
BYTECODE_ONLY = "it ran from bytecode without its source"
BYTECODE_UNCHECKED = "its cached bytecode could not be checked"


def _pyc_used(pyc: Path, source: Path) -> bytes | None:
    """The code part of ``pyc`` when its header makes the import system use it for
    ``source`` (a timestamp pyc whose mtime and size match, or a hash-based pyc)."""
    try:
        data = pyc.read_bytes()
        stat = source.stat()
    except OSError:
        return None
    if len(data) < 16:
        return None
    flags = int.from_bytes(data[4:8], "little")
    if flags == 0:
        mtime = int.from_bytes(data[8:12], "little")
        size = int.from_bytes(data[12:16], "little")
        if mtime != (int(stat.st_mtime) & 0xFFFFFFFF) or size != (stat.st_size & 0xFFFFFFFF):
            return None  # the import system recompiles from source: this pyc did not run
    return data[16:]


def _same_code(body: bytes, expected: CodeType) -> bool:
    try:
        # The pyc is the one the import system runs anyway: unmarshalling it here runs nothing.
        loaded = marshal.loads(body)  # noqa: S302
    except (ValueError, EOFError, TypeError):
        return False
    return isinstance(loaded, CodeType) and loaded == expected


def bytecode_problem(module: ModuleType, rewrite: Callable[[Path], CodeType] | None) -> str | None:
    """Whether the bytecode ``module`` ran from is its source's, or None when it is.

    A plain source module is checked against ``importlib``'s cached pyc (which honours
    ``sys.pycache_prefix``); a module pytest's assertion rewriter loaded, against
    pytest's own pyc, re-rewritten with ``rewrite``. Either pyc's header only says
    "mtime and size match", which anyone can forge: the body must be the code the
    source compiles to.
    """
    file = getattr(module, "__file__", None)
    if not isinstance(file, str):
        return None
    if file.endswith((".pyc", ".pyo")):
        return BYTECODE_ONLY
    spec = getattr(module, "__spec__", None)
    loader = getattr(spec, "loader", None)
    source = Path(file)
    try:
        if type(loader).__name__ == "AssertionRewritingHook":
            if rewrite is None:
                return BYTECODE_UNCHECKED
            from _pytest.assertion import rewrite as pytest_rewrite

            pyc = pytest_rewrite.get_cache_dir(source) / f"{source.stem}{pytest_rewrite.PYC_TAIL}"
            body = _pyc_used(pyc, source)
            if body is None:
                return None
            return None if _same_code(body, rewrite(source)) else BYTECODE_STALE
        if isinstance(loader, importlib.machinery.SourceFileLoader):
            body = _pyc_used(Path(importlib.util.cache_from_source(file)), source)
            if body is None:
                return None
            compiled = compile(source.read_bytes(), file, "exec", dont_inherit=True)
            return None if _same_code(body, compiled) else BYTECODE_STALE
    except (OSError, SyntaxError, ValueError, ImportError, AttributeError):
        return BYTECODE_UNCHECKED
    return None


def ran_modules(rewrite: Callable[[Path], CodeType] | None = None) -> list[dict[str, Any]]:
    """Every module of this process's ``sys.modules`` that has a file: its module name,
    absolute path, sha256 and bytecode verdict (``bytecode_problem``)."""
    found: list[dict[str, Any]] = []
    for name, module in sorted(sys.modules.copy().items()):
        file = module_file(module) if isinstance(module, ModuleType) else None
        if file is None:
            continue
        digest = sha256_file(Path(file))
        found.append({
            "module": name,
            "file": file,
            "sha256": digest,
            "bytecode": bytecode_problem(module, rewrite),
            # Judged here, against this interpreter's own installed distributions.
            "distribution": recorded_by(file, digest),
        })
    return found


def _executes(pth: Path) -> bool:
    """A ``.pth`` file executes code when a line starts with ``import`` (site.py's rule)."""
    try:
        lines = pth.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return True  # unreadable: cannot show it harmless
    return any(line.startswith(("import ", "import\t")) for line in lines)


def startup_hooks() -> list[dict[str, Any]]:
    """Code that runs at interpreter start-up outside pytest's plugin registry: ``.pth``
    files that execute code in any site directory, and ``sitecustomize`` /
    ``usercustomize`` modules, each with its path and sha256."""
    directories = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        directories.append(site.getusersitepackages())
    found: list[dict[str, Any]] = []
    for directory in dict.fromkeys(directories):
        for pth in sorted(Path(directory).glob("*.pth")):
            if _executes(pth):
                digest = sha256_file(pth)
                found.append({"kind": "pth", "file": str(pth.absolute()), "sha256": digest,
                              "distribution": recorded_by(str(pth), digest)})
    for name in ("sitecustomize", "usercustomize"):
        file = module_file(sys.modules.get(name))
        if file is not None:
            found.append({"kind": name, "file": file, "sha256": sha256_file(Path(file))})
    return found


@cache
def _record_index() -> Mapping[str, tuple[str, str | None]]:
    """Real path of every file an installed distribution's RECORD lists ->
    (``name==version``, its recorded urlsafe-base64 sha256 or None)."""
    index: dict[str, tuple[str, str | None]] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        label = f"{name}=={dist.version}"
        base = os.path.realpath(str(dist.locate_file("")))
        for entry in dist.files or []:
            digest = entry.hash.value if entry.hash and entry.hash.mode == "sha256" else None
            index.setdefault(os.path.normpath(os.path.join(base, str(entry))), (label, digest))
    return index


def recorded_by(file: str, sha256: str | None) -> str | None:
    """``name==version`` of the distribution whose RECORD lists ``file`` with this
    sha256 (hex), or None: not an installed file, or edited since it was installed."""
    found = _record_index().get(os.path.realpath(file))
    if found is None or found[1] is None or sha256 is None:
        return None
    label, recorded = found
    actual = base64.urlsafe_b64encode(bytes.fromhex(sha256)).rstrip(b"=").decode()
    return label if actual == recorded else None


def vouch(
    ran: Iterable[Mapping[str, Any]],
    hooks: Iterable[Mapping[str, Any]],
    *,
    root: Path,
    sources: Mapping[str, str],
) -> dict[str, Any]:
    """The report's ``provenance.ran``: how many modules ran, and each module or start-up
    hook nothing vouches for (a hashed, tracked source of the tree; a file whose sha256
    matches its distribution's RECORD; the standard library), with the reason."""
    root = root.resolve()
    tracked = tracked_files(root) or set()
    by_file = {str((root / name).resolve()): name for name in sources}
    unvouched: list[dict[str, Any]] = []
    seen: set[tuple[str, str | None, str | None]] = set()

    def judge(file: str, sha256: str | None, distribution: Any) -> str | None:
        real = os.path.realpath(file)
        name = by_file.get(real)
        if name is not None:
            if sources[name] != sha256:
                return "differs from the hashed source"
            if not _is_tracked(name, tracked, root):
                return "is not a file tracked by git"
            return None
        if isinstance(distribution, str):
            return None  # its RECORD digest matched in the process that ran it
        if is_stdlib(Path(real)) and not Path(real).is_relative_to(root):
            return None
        if Path(real).is_relative_to(root):
            return "is neither a hashed source nor an installed distribution's file"
        return "matches no installed distribution's RECORD"

    count = 0
    for item in ran:
        file, digest, bytecode = item.get("file"), item.get("sha256"), item.get("bytecode")
        if not isinstance(file, str) or (file, digest, bytecode) in seen:
            continue
        seen.add((file, digest if isinstance(digest, str) else None,
                  bytecode if isinstance(bytecode, str) else None))
        count += 1
        reason = bytecode if isinstance(bytecode, str) else judge(
            file, digest if isinstance(digest, str) else None, item.get("distribution"))
        if reason is not None:
            unvouched.append({"module": str(item.get("module")), "file": file,
                              "reason": reason})
    # Worker, tool and peer processes are plain interpreters that report no modules of
    # their own: a forged pyc beside any hashed source would run there unseen, so every
    # one the import system would use must hold the code its source compiles to.
    for name in sorted(sources):
        if not name.endswith(".py"):
            continue
        source = root / name
        pyc = Path(importlib.util.cache_from_source(str(source)))
        body = _pyc_used(pyc, source) if pyc.is_file() else None
        if body is None:
            continue
        try:
            same = _same_code(body, compile(source.read_bytes(), str(source), "exec",
                                            dont_inherit=True))
        except (OSError, SyntaxError, ValueError):
            same = False
        if not same:
            unvouched.append({"module": name, "file": str(pyc),
                              "reason": BYTECODE_STALE + " (a plain interpreter runs it)"})
    found_hooks: list[dict[str, Any]] = []
    for hook in {str(h.get("file")): h for h in hooks}.values():
        file = str(hook.get("file"))
        if hook.get("kind") == "pth" and isinstance(hook.get("distribution"), str):
            continue  # installed by a distribution of the environment, byte for byte
        found_hooks.append({"kind": str(hook.get("kind")), "file": file})
    return {
        "modules_checked": count,
        "unvouched": sorted(unvouched, key=lambda u: (u["file"], u["module"]))[:200],
        "unvouched_count": len(unvouched),
        "startup_hooks": sorted(found_hooks, key=lambda h: h["file"]),
    }


# Lock files, in order of preference: the first one the checkout has is the lock
# (pyproject.toml only for a checkout from before uv.lock; the report names which).
LOCK_FILES = ("uv.lock", "pyproject.toml")


def lock_digest(root: Path, installed: str | None) -> dict[str, Any] | None:
    """The checkout's lock file ``{path, sha256}`` and the digest of the lock the
    environment was installed from (``installed``, given by the hermetic runner)."""
    for name in LOCK_FILES:
        digest = sha256_file(root / name)
        if digest is not None:
            return {"path": name, "sha256": digest, "installed": installed}
    return None


def stray_files(root: Path) -> list[str] | None:
    """Untracked, ignored or changed paths of the checkout at ``root`` (ignored
    directories as one entry); None when git cannot say. An exported commit (no
    ``.git``; ``lab.evidence.tree``) has none exactly when its files make its tree."""
    exported = tree.exported_commit(os.environ)
    if exported is not None and not (root / ".git").exists():
        snapshot = tree.sources(root)
        if snapshot is not None and snapshot.tree == exported[1]:
            return []
        found = snapshot.tree if snapshot is not None else "none"
        return [f"its files make tree {found[:12]}, not {exported[1][:12]}"]
    try:
        raw = tree.git(root, ["status", "--porcelain", "--ignored=traditional",
                              "--untracked-files=normal"], "the checkout's stray files")
    except (errors.UsageError, errors.EnvironmentFailure):
        return None
    return [line[3:] for line in raw.decode("utf-8", "replace").splitlines() if line]
