"""Bounded reads of regular files: the one way the lab reads a file it did not write.

Evidence, keys, manifests and model reports are inputs an adversary may choose, so
a read must never hang (a FIFO), never exhaust memory (``/dev/zero``, a huge file)
and always name the path it failed on. ``read_bytes`` opens without blocking,
refuses anything but a regular file, and reads at most ``limit`` bytes plus one to
tell a file that is too large; every failure is an ``errors.InputError`` whose
one-line message starts with what the file is and where it is.

``write_tree`` is the other way round: a folder of generated files (the book) written
whole, every path proven inside the folder first, and what the previous write listed in
its manifest removed, so nothing stale and nothing outside is ever touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lab.errors import InputError, Refused

KIB = 1024
MIB = 1024 * KIB

# Limits for the files the lab reads: generous for real runs (a full run's report is
# about 0.4 MiB and its tests.jsonl about 1.6 MiB), small enough to never exhaust memory.
PUBLIC_KEY_LIMIT = 64 * KIB
MANIFEST_LIMIT = 1 * MIB
REPORT_LIMIT = 64 * MIB
ENVELOPE_LIMIT = 96 * MIB  # base64 of a report-sized payload
TESTS_LOG_LIMIT = 256 * MIB
SOURCE_LIMIT = 16 * MIB
MODEL_REPORT_LIMIT = 16 * MIB


def read_bytes(path: Path, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    ``what`` names the file in errors (``"envelope"``, ``"public key"``). Raises
    ``InputError`` for a missing or unreadable file, anything that is not a regular
    file (a directory, FIFO, socket or device), and a file larger than ``limit``.
    """
    try:
        # O_NONBLOCK: opening a FIFO for reading must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{what} {path}: is a directory, not a file") from None
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot open: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{what} {path}: {_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise InputError(f"{what} {path}: {info.st_size} bytes, over the {limit}-byte limit")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(MIB, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:  # the file grew while it was read
            raise InputError(f"{what} {path}: over the {limit}-byte limit")
        return b"".join(chunks)
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """The hex sha256 of the regular file ``path``, streamed (any size, never a FIFO).

    The one digest of a file the lab computes: sources, the manifest, the model, the
    ini file. Raises ``InputError`` naming the path for anything unreadable or not a
    regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InputError(f"file {path}: cannot open: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"file {path}: {_kind(info.st_mode)}, not a regular file")
        digest = hashlib.sha256()
        while chunk := os.read(fd, MIB):
            digest.update(chunk)
        return digest.hexdigest()
    except OSError as exc:
        raise InputError(f"file {path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def read_json(path: Path, limit: int, what: str) -> Any:
    """``read_bytes`` then strict JSON (UTF-8, no NaN or Infinity); errors name the path."""
    return parse_json(read_bytes(path, limit, what), f"{what} {path}")


MAX_DEPTH = 64  # a real report nests about 6 levels; every reader stays far from recursion limits


def parse_json(data: bytes, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """Strict JSON from bytes: UTF-8, no NaN or Infinity, nested at most ``max_depth`` deep.

    The depth bound keeps every later reader (schema check, comparison, rendering)
    clear of Python's recursion limit. Raises ``InputError`` starting with ``where``.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise InputError(f"{where}: not JSON ({exc})") from None
    except RecursionError:
        raise InputError(f"{where}: JSON nested too deeply") from None
    if _depth(value) > max_depth:
        raise InputError(f"{where}: JSON nested deeper than {max_depth} levels")
    return value


def write_tree(
    out: Path, contents: Mapping[str, bytes], *, manifest: str, emptied: Sequence[str] = (),
    what: str = "previous manifest",
) -> None:
    """Write ``contents`` (``{relative path: bytes}``) into ``out``, replacing the last write.

    What the previous write listed in ``out/<manifest>`` (``sha256sum`` lines) is removed
    first, then each directory of ``emptied`` left empty; the new files are written and
    listed in a new manifest. Every target is proven inside ``out`` (``Refused`` naming
    it otherwise) before anything is removed or written; the old manifest is read bounded
    (``what`` names it in errors).
    """
    targets = {name: _inside(out, name) for name in sorted(contents)}
    _inside(out, manifest)
    listing = out / manifest
    if listing.is_file():
        old = read_bytes(listing, MANIFEST_LIMIT, what)
        for line in old.decode("utf-8", "replace").splitlines():
            _, _, name = line.partition("  ")
            target = (out / name).resolve()
            if name and target.is_relative_to(out) and target.is_file():
                target.unlink()
    for directory in (out / name for name in emptied):
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
    for name, data in sorted(contents.items()):
        path = targets[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        _inside(out, name)  # a directory made above cannot lead outside either
        path.write_bytes(data)
    lines = [
        f"{hashlib.sha256(data).hexdigest()}  {name}\n"
        for name, data in sorted(contents.items())
    ]
    listing.write_text("".join(lines), encoding="utf-8")


def _inside(out: Path, name: str) -> Path:
    """``out / name``, proven to stay inside ``out`` once symbolic links are resolved."""
    target = out / name
    resolved = target.resolve()
    if os.path.isabs(name) or ".." in Path(name).parts or not resolved.is_relative_to(out):
        raise Refused(f"{name!r} would be written outside --out {out}")
    return target


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects, counted without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level + 1)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"
