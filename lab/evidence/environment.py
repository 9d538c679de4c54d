"""The running environment against the lock: is what is installed exactly ``uv.lock``?

``uv.lock`` pins every distribution the lab installs by exact version and sha256, and
``scripts/ensure-venv`` installs exactly it (``uv sync --locked``, hashes verified). A
run can still execute other code: a package installed by hand, another version, or a
file of an installed distribution edited after the install. ``check`` tells them apart:

- every distribution installed on the interpreter's search path (``sys.path``: each
  ``*.dist-info`` / ``*.egg-info`` directory, the first of a name winning as it does
  for imports) must be in the lock with that exact version; the lock's own project
  (``source = { editable = ... }`` or ``virtual``), installed editable from the tree
  that the evidence hashes file by file, is exempt;
- every file a distribution's ``RECORD`` lists with a hash must still have it.
  ``RECORD`` lists bytecode (``__pycache__``) without a hash: those entries are
  skipped, as is ``RECORD`` itself.

The result names the lock by its sha256 and lists the first differences by name
(``"numpy 2.1.0: numpy/core/foo.py differs from RECORD"``, ``"extra distribution x 1.2
not in the lock"``, ``"y 1.0 locked as 1.1"``). A distribution in the lock but not
installed is no difference: the lock covers every extra, an environment holds some.

    python -m lab.evidence.environment [--lock uv.lock] [--path DIR ...]

prints the JSON and exits 0 when the environment matches, 1 when it differs, 2 for a
lock that cannot be read (one line on stderr).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import stat
import sys
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

from lab import errors
from lab.files import MIB, read_bytes

LOCK_LIMIT = 16 * MIB  # the lab's uv.lock is about 0.5 MiB
RECORD_LIMIT = 16 * MIB  # the largest RECORD of a dev venv is well under 1 MiB
METADATA_LIMIT = 4 * MIB
MAX_DIFFERENCES = 10  # the first ones are listed, then how many more there were
HASH_CHUNK = MIB


@dataclass(frozen=True)
class Environment:
    """What ``check`` found: the lock's digest and how the installed set differs from it."""

    lock_sha256: str
    matches: bool
    # The first MAX_DIFFERENCES differences, then "... and N more differences".
    differences: tuple[str, ...]
    checked_distributions: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with the same four facts."""
        return {
            "lock_sha256": self.lock_sha256,
            "matches": self.matches,
            "differences": list(self.differences),
            "checked_distributions": self.checked_distributions,
        }


@dataclass(frozen=True)
class Lock:
    """The parts of ``uv.lock`` the check needs."""

    sha256: str
    # Normalized name -> every version the lock pins for it (a universal lock may pin
    # two versions of one name, each for its own Python versions).
    versions: dict[str, frozenset[str]]
    # Normalized names of the lock's own projects (editable or virtual sources).
    exempt: frozenset[str]


def normalize(name: str) -> str:
    """A distribution name as the package index compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> Lock:
    """Parse ``uv.lock`` (bounded read, TOML); ``errors.InputError`` when it is not one."""
    data = read_bytes(path, LOCK_LIMIT, "lock file")
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise errors.InputError(f"lock file {path}: not TOML: {exc}") from None
    packages = document.get("package")
    if not isinstance(packages, list) or not packages:
        raise errors.InputError(f"lock file {path}: no [[package]] entries")
    versions: dict[str, set[str]] = {}
    exempt: set[str] = set()
    for index, package in enumerate(packages):
        if not isinstance(package, dict) or not isinstance(package.get("name"), str):
            raise errors.InputError(f"lock file {path}: package {index + 1} has no name")
        name = normalize(package["name"])
        source = package.get("source")
        if isinstance(source, dict) and ("editable" in source or "virtual" in source):
            exempt.add(name)
            continue
        version = package.get("version")
        if not isinstance(version, str):
            raise errors.InputError(f"lock file {path}: package {package['name']} has no version")
        versions.setdefault(name, set()).add(version)
    return Lock(
        sha256=hashlib.sha256(data).hexdigest(),
        versions={name: frozenset(found) for name, found in versions.items()},
        exempt=frozenset(exempt),
    )


@dataclass(frozen=True)
class Installed:
    """One installed distribution: its metadata directory, name and version."""

    directory: Path
    name: str
    version: str


def installed(paths: Sequence[str | Path] | None = None) -> Iterator[Installed]:
    """Each distribution on ``paths`` (default ``sys.path``), the first of each name only.

    A metadata directory whose METADATA (or PKG-INFO) has no name or version is yielded
    with an empty one, so the caller reports it rather than skipping it.
    """
    seen: set[str] = set()
    for entry in sys.path if paths is None else paths:
        base = Path(entry or os.curdir)
        try:
            children = sorted(os.listdir(base))
        except OSError:  # a zip file, a missing directory: nothing installed there
            continue
        for child in children:
            if not child.endswith((".dist-info", ".egg-info")):
                continue
            directory = base / child
            if not directory.is_dir():
                continue
            name, version = _name_and_version(directory)
            key = normalize(name) if name else str(directory)
            if key in seen:
                continue
            seen.add(key)
            yield Installed(directory, name, version)


def _name_and_version(directory: Path) -> tuple[str, str]:
    for file_name in ("METADATA", "PKG-INFO"):
        path = directory / file_name
        if path.is_file():
            try:
                text = read_bytes(path, METADATA_LIMIT, "metadata").decode("utf-8", "replace")
            except errors.InputError:
                return "", ""
            headers = HeaderParser().parsestr(text, headersonly=True)
            return str(headers.get("Name", "")).strip(), str(headers.get("Version", "")).strip()
    return "", ""


def record_differences(dist: Installed) -> Iterator[str]:
    """The files of ``dist`` whose content no longer has the hash its RECORD lists."""
    label = f"{dist.name} {dist.version}"
    record = dist.directory / "RECORD"
    if not record.is_file():
        yield f"{label}: no RECORD to check its files against"
        return
    try:
        text = read_bytes(record, RECORD_LIMIT, "RECORD").decode("utf-8")
    except (errors.InputError, UnicodeDecodeError) as exc:
        yield f"{label}: RECORD unreadable: {exc}"
        return
    root = dist.directory.parent
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 2 or not row[1]:
            continue  # RECORD itself and bytecode are listed without a hash
        relative, expected = row[0], row[1]
        if "__pycache__" in Path(relative).parts or relative.endswith(".pyc"):
            continue
        algorithm, _, value = expected.partition("=")
        if algorithm not in hashlib.algorithms_guaranteed or not value:
            yield f"{label}: {relative} has an unusable hash in RECORD"
            continue
        actual = _file_hash(Path(os.path.normpath(root / relative)), algorithm)
        if actual is None:
            yield f"{label}: {relative} is missing (listed in RECORD)"
        elif actual != value:
            yield f"{label}: {relative} differs from RECORD"


def _file_hash(path: Path, algorithm: str) -> str | None:
    """The RECORD form (urlsafe base64, no padding) of the file's digest; None if absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        digest = hashlib.new(algorithm)
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii")


def check(
    lock_path: Path,
    paths: Sequence[str | Path] | None = None,
    *,
    max_differences: int = MAX_DIFFERENCES,
) -> Environment:
    """Compare the environment on ``paths`` (default ``sys.path``) with ``lock_path``.

    Raises ``errors.InputError`` (one line, naming the file) for a lock that cannot be
    read; every difference of the environment itself is reported, not raised.
    """
    lock = read_lock(lock_path)
    found: list[str] = []
    checked = 0
    for dist in installed(paths):
        checked += 1
        if not dist.name or not dist.version:
            found.append(f"{dist.directory}: metadata without a name or version")
            continue
        key = normalize(dist.name)
        if key in lock.exempt:
            continue
        locked = lock.versions.get(key)
        if locked is None:
            found.append(f"extra distribution {dist.name} {dist.version} not in the lock")
            continue
        if dist.version not in locked:
            found.append(f"{dist.name} {dist.version} locked as {' or '.join(sorted(locked))}")
            continue
        found.extend(record_differences(dist))
    listed = tuple(found[:max_differences])
    if len(found) > max_differences:
        listed += (f"... and {len(found) - max_differences} more differences",)
    return Environment(
        lock_sha256=lock.sha256,
        matches=not found,
        differences=listed,
        checked_distributions=checked,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.evidence.environment``: JSON; exit 0 matches, 1 differs, 2 bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m lab.evidence.environment",
        description="Compare the installed distributions with uv.lock.",
    )
    parser.add_argument("--lock", type=Path, default=Path("uv.lock"), help="the lock file")
    parser.add_argument(
        "--path", action="append", default=None,
        help="a directory of installed distributions (repeatable; default: sys.path)",
    )
    args = parser.parse_args(argv)
    try:
        result = check(args.lock, args.path)
    except errors.LabError as exc:
        print(f"lab.evidence.environment: {exc}", file=sys.stderr)
        return errors.exit_code(exc)
    print(json.dumps(result.to_json(), indent=2))
    return 0 if result.matches else 1


if __name__ == "__main__":
    sys.exit(main())
