"""A hermetic run's dependencies, judged by the lock's wheel hashes, never by ``RECORD``.

A venv's ``RECORD`` files sit in the same writable directory as the files they vouch
for: a file planted there with a line added to some ``RECORD`` passes any check that
reads ``RECORD``. So the authority here is the wheel files themselves: each must hash
to one of the sha256 the lock (``uv export --locked``'s requirements) gives its
distribution, and then its own ``RECORD``, read from inside the verified archive,
says which files it installs with which digests.

``venv_problems`` walks the whole venv: every file must be one a verified wheel
installs, with the wheel's digest, or one the installer writes for it (the
``.dist-info`` bookkeeping, a console script the wheel declares) or ``python -m venv``
writes for itself. Anything else, or a wheel's file that is missing or changed, is a
problem naming the file.
"""

from __future__ import annotations

import base64
import configparser
import csv
import hashlib
import io
import os
import re
import sys
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from lab import errors, files

WHEEL_LIMIT = 512 * files.MIB
_RECORD_LIMIT = 16 * files.MIB
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==")
# What an installer writes into a distribution's .dist-info besides the wheel's files.
_INSTALLER_FILES = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json",
                              "uv_cache.json", "uv_build.json"})
# What ``python -m venv --without-pip`` writes outside site-packages, and the empty lock
# file uv keeps at the venv's top while it installs.
_VENV_FILES = frozenset({"pyvenv.cfg", ".lock"})
_VENV_SCRIPTS = re.compile(r"^(python(3(\.\d+)?)?|activate(\.\w+)?|Activate\.ps1)$")


def normalise(name: str) -> str:
    """A distribution name as the wheel spec compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_hashes(requirements: str) -> dict[str, set[str]]:
    """``{distribution: {sha256, ...}}`` of a hashed requirements file (``uv export``)."""
    found: dict[str, set[str]] = {}
    joined = requirements.replace("\\\n", " ")
    for line in joined.splitlines():
        line = line.strip()
        match = _NAME.match(line)
        if match:
            found.setdefault(normalise(match.group(1)), set()).update(_HASH.findall(line))
    return found


def sha256_of(path: Path) -> str:
    """The hex sha256 of a wheel file (bounded, regular files only)."""
    return hashlib.sha256(files.read_bytes(path, WHEEL_LIMIT, "wheel")).hexdigest()


def verified(wheels: Iterable[Path], locked: Mapping[str, set[str]]) -> list[Path]:
    """``wheels``, each checked to hash to a sha256 the lock gives its distribution, and
    one per locked distribution at most; ``EnvironmentFailure`` naming the first that
    does not."""
    seen: dict[str, Path] = {}
    for wheel in sorted(wheels):
        name = normalise(wheel.name.split("-", 1)[0])
        allowed = locked.get(name)
        if not allowed:
            raise errors.EnvironmentFailure(f"wheel {wheel.name}: {name} is not in the lock")
        if sha256_of(wheel) not in allowed:
            raise errors.EnvironmentFailure(
                f"wheel {wheel.name}: its sha256 is none the lock gives {name}")
        if name in seen:
            raise errors.EnvironmentFailure(f"wheel {wheel.name}: a second wheel of {name}")
        seen[name] = wheel
    return list(seen.values())


@dataclass
class Installs:
    """What verified wheels install: site-packages paths with their digests (None: the
    installer rewrites it), dist-info directories, console script names, and the files
    installed outside site-packages (``.data/headers``, ``.data/data``) by venv path."""

    site: dict[str, str | None] = field(default_factory=dict)
    venv: dict[str, str | None] = field(default_factory=dict)
    dist_infos: set[str] = field(default_factory=set)
    scripts: dict[str, str | None] = field(default_factory=dict)


def _record(archive: zipfile.ZipFile, wheel: Path) -> tuple[str, list[list[str]]]:
    names = [n for n in archive.namelist()
             if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(names) != 1:
        raise errors.EnvironmentFailure(f"wheel {wheel.name}: not one .dist-info/RECORD")
    info = archive.getinfo(names[0])
    if info.file_size > _RECORD_LIMIT:
        raise errors.EnvironmentFailure(f"wheel {wheel.name}: its RECORD is too large")
    text = archive.read(info).decode("utf-8")
    return names[0].split("/")[0], list(csv.reader(io.StringIO(text)))


def _entry_scripts(archive: zipfile.ZipFile, dist_info: str) -> list[str]:
    name = f"{dist_info}/entry_points.txt"
    if name not in archive.namelist():
        return []
    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(archive.read(name).decode("utf-8"))
    return [script for section in ("console_scripts", "gui_scripts") if parser.has_section(section)
            for script in parser.options(section)]


def installs(wheels: Sequence[Path]) -> Installs:
    """Every file the (already verified) ``wheels`` install, from their own RECORDs."""
    found = Installs()
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            dist_info, rows = _record(archive, wheel)
            found.dist_infos.add(dist_info)
            for script in _entry_scripts(archive, dist_info):
                found.scripts[script] = None
            for row in rows:
                if not row or not row[0]:
                    continue
                path, digest = PurePosixPath(row[0]), (row[1] if len(row) > 1 else "")
                if path.is_absolute() or ".." in path.parts:
                    raise errors.EnvironmentFailure(f"wheel {wheel.name}: {row[0]} leaves "
                                                    "the venv")
                sha = _hex(digest)
                parts = path.parts
                if parts[0].endswith(".data") and len(parts) > 2:
                    if parts[1] in ("purelib", "platlib"):
                        found.site[PurePosixPath(*parts[2:]).as_posix()] = sha
                    elif parts[1] == "scripts":
                        found.scripts[parts[-1]] = None  # its shebang is rewritten
                    elif parts[1] == "headers":
                        # Where pip and uv put a wheel's headers: include/site/pythonX.Y/<dist>/.
                        found.venv[PurePosixPath(
                            "include", "site", f"python{sys.version_info[0]}.{sys.version_info[1]}",
                            dist_info.split("-")[0], *parts[2:]).as_posix()] = sha
                    elif parts[1] == "data":
                        found.venv[PurePosixPath(*parts[2:]).as_posix()] = sha
                    continue
                found.site[path.as_posix()] = sha
    return found


def _hex(digest: str) -> str | None:
    """A RECORD digest (``sha256=<urlsafe b64>``) as hex; None for none (RECORD itself)."""
    algorithm, _, value = digest.partition("=")
    if algorithm != "sha256" or not value:
        return None
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()


def _walk(root: Path) -> list[str]:
    names: list[str] = []
    for directory, subdirs, filenames in os.walk(root):
        base = Path(directory).relative_to(root)
        names += [(base / name).as_posix() for name in filenames]
        names += [(base / name).as_posix() for name in subdirs
                  if (Path(directory) / name).is_symlink()]
    return sorted(names)


def venv_problems(venv: Path, site: Path, wheels: Sequence[Path],
                  stamp: str | None = None) -> list[str]:
    """How the venv at ``venv`` (site-packages ``site``) differs from what the verified
    ``wheels`` install: a file no wheel installs, a wheel's file missing or changed.
    ``stamp``: a file name the caller keeps at the venv's top (its own record)."""
    expected = installs(wheels)
    problems: list[str] = []
    site_rel = site.relative_to(venv).as_posix()
    seen: set[str] = set()
    seen_outside: set[str] = set()
    for name in _walk(venv):
        path = venv / name
        if name.startswith(site_rel + "/"):
            inner = name[len(site_rel) + 1:]
            seen.add(inner)
            if inner in expected.site:
                want = expected.site[inner]
                if want is not None and not path.is_symlink() and (
                        hashlib.sha256(files.read_bytes(path, WHEEL_LIMIT, "venv file"))
                        .hexdigest() != want):
                    problems.append(f"{inner}: differs from its wheel")
                continue
            top = inner.split("/")
            if len(top) == 2 and top[0] in expected.dist_infos and top[1] in _INSTALLER_FILES:
                continue
            problems.append(f"{inner}: installed by no locked wheel")
            continue
        parts = name.split("/")
        if name in _VENV_FILES or name == stamp or name in ("lib64", "bin/python"):
            continue
        if name in expected.venv:
            seen_outside.add(name)
            want = expected.venv[name]
            read = files.read_bytes(path, WHEEL_LIMIT, "venv file")
            if want is not None and hashlib.sha256(read).hexdigest() != want:
                problems.append(f"{name}: differs from its wheel")
            continue
        if len(parts) == 2 and parts[0] == "bin" and (
                _VENV_SCRIPTS.match(parts[1]) or parts[1] in expected.scripts):
            continue
        problems.append(f"{name}: installed by no locked wheel")
    for inner, want in sorted(expected.site.items()):
        if inner not in seen and not inner.endswith(".dist-info/RECORD") and want is not None:
            problems.append(f"{inner}: a locked wheel's file is missing")
    for name, want in sorted(expected.venv.items()):
        if name not in seen_outside and want is not None:
            problems.append(f"{name}: a locked wheel's file is missing")
    return problems
