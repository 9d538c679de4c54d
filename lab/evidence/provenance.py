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
import importlib.metadata
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from lab import files
from lab.errors import InputError

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
    """Repo-relative paths git tracks under ``root`` (None outside a git checkout)."""
    try:
        done = subprocess.run(
            ["git", "ls-files", "-z"], cwd=root, capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return {p for p in done.stdout.decode("utf-8", "replace").split("\0") if p}


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


def _is_stdlib(file: Path) -> bool:
    parts = set(file.parts)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    for key in ("stdlib", "platstdlib"):
        base = Path(sysconfig.get_paths()[key]).resolve()
        if file.is_relative_to(base):
            return True
    return False


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
        stdlib = not inside and distribution is None and _is_stdlib(resolved)
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
