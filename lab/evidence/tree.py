"""The sources of a run as git objects: export a commit's tree, and name any tree by its id.

A publishable run must not let the caller's git decide what it runs: a global or
system configuration (filters, attributes, URL rewrites), ``GIT_*`` variables and
whatever ``git`` is first on ``PATH`` all change what a clone or checkout writes.
So the one ``git`` this module runs is ``GIT`` (a fixed absolute path) with a fixed
environment (``git_environment``: no system or global configuration, an empty
``HOME``, nothing inherited), and it only reads objects: the commit, its recursive
listing and each blob's raw bytes. Nothing git writes is trusted either: the commit
object must hash to the commit id asked for, every blob to its id, and the tree the
files make (``tree_id``, computed here from the bytes and modes) to the commit's tree.

The tree id is then the name of every tracked file at once: the evidence records it,
and ``lab evidence verify --check-sources`` recomputes it from the files of the
checkout it is given, so no pattern list decides which files count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath

from lab import errors, files

# Set by ``lab run --hermetic`` for its pytest process: the commit it exported and that
# commit's tree id. A process that sees them reads its sources from the files on disk.
from lab.evidence.hermetic import COMMIT_ENV, TREE_ENV

# The one git: a fixed path, never ``PATH``'s first ``git``.
GIT = "/usr/bin/git"
_TIMEOUT = 300
# Any one source file: larger is refused (the lock, the largest, is well under 1 MiB).
BLOB_LIMIT = files.SOURCE_LIMIT
REGULAR, EXECUTABLE, SYMLINK, DIRECTORY = "100644", "100755", "120000", "40000"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One file of a tree: its git mode, object id and repo-relative posix path."""

    mode: str
    oid: str
    path: str


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The files under a root as git would name them: each file's entry and sha256,
    and the id of the tree they make."""

    tree: str
    entries: tuple[Entry, ...]
    sha256: Mapping[str, str]


def git_environment(home: str) -> dict[str, str]:
    """The whole environment of every ``git`` this module runs: no system or global
    configuration, ``home`` (an empty directory) as ``HOME``, no replace refs, C locale;
    nothing of the caller's (no ``GIT_DIR``, ``GIT_CONFIG_*``, ``PATH``)."""
    return {
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_NO_REPLACE_OBJECTS": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "HOME": home,
        "PATH": "/usr/bin:/bin",
        "LC_ALL": "C",
    }


def git(repo: Path, args: Sequence[str], what: str, stdin: bytes | None = None) -> bytes:
    """``GIT`` run in ``repo`` with ``git_environment`` and no hooks; its stdout.

    ``errors.EnvironmentFailure`` when that git cannot run, ``errors.UsageError`` naming
    ``what`` and git's last line when it refuses.
    """
    if not os.access(GIT, os.X_OK):
        raise errors.EnvironmentFailure(f"{what}: {GIT} is not an executable git")
    with tempfile.TemporaryDirectory(prefix="lab-git-home-") as home:
        try:
            done = subprocess.run(
                [GIT, "-c", "core.hooksPath=/dev/null", *args], cwd=repo, input=stdin,
                capture_output=True, timeout=_TIMEOUT, check=False, env=git_environment(home),
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise errors.EnvironmentFailure(f"{what}: git failed: {exc}") from exc
    if done.returncode != 0:
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise errors.UsageError(f"{what}: {(lines or ['git failed'])[-1]}")
    return done.stdout


def _hasher(oid: str) -> str:
    """The object format of an id: sha1 (40 hex digits) or sha256 (64)."""
    return "sha256" if len(oid) == 64 else "sha1"


def object_id(kind: str, data: bytes, algorithm: str = "sha1") -> str:
    """The git object id of ``data`` stored as a ``kind`` object (blob, tree, commit)."""
    digest = hashlib.new(algorithm)
    digest.update(f"{kind} {len(data)}\0".encode())
    digest.update(data)
    return digest.hexdigest()


def tree_id(entries: Iterable[Entry], algorithm: str = "sha1") -> str:
    """The id of the tree ``entries`` (files with their paths) make, as git computes it:
    one tree object per directory, entries in git's order (a directory sorts as its name
    followed by ``/``)."""
    root: dict[str, object] = {}
    for entry in entries:
        *parents, name = entry.path.split("/")
        node = root
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise errors.InputError(f"tree: {entry.path} is inside a file")
            node = child
        node[name] = entry

    def write(node: Mapping[str, object]) -> bytes:
        rows: list[tuple[bytes, bytes]] = []
        for name, value in node.items():
            if isinstance(value, Entry):
                mode, oid = value.mode, value.oid
                key = name.encode()
            else:
                mode, oid = DIRECTORY, write(value).hex()  # type: ignore[arg-type]
                key = name.encode() + b"/"
            rows.append((key, f"{mode} {name}".encode() + b"\0" + bytes.fromhex(oid)))
        body = b"".join(row for _, row in sorted(rows))
        return bytes.fromhex(object_id("tree", body, algorithm))

    return write(root).hex()


def _safe_path(path: str) -> PurePosixPath:
    pure = PurePosixPath(path)
    if (not path or pure.is_absolute() or any(p in ("", ".", "..", ".git") for p in pure.parts)
            or "\\" in path or "\0" in path):
        raise errors.InputError(f"tree: {path!r} is not a plain path inside the tree")
    return pure


def commit_tree(repo: Path, commit: str) -> str:
    """The tree id of ``commit``, read from the commit object after checking that the
    object hashes to ``commit``."""
    body = git(repo, ["cat-file", "commit", commit], f"commit {commit[:12]}")
    if object_id("commit", body, _hasher(commit)) != commit:
        raise errors.EnvironmentFailure(f"commit {commit[:12]}: its object does not hash "
                                        "to its id")
    first = body.split(b"\n", 1)[0].decode("ascii", "replace")
    if not first.startswith("tree "):
        raise errors.EnvironmentFailure(f"commit {commit[:12]}: no tree in its object")
    return first[5:].strip()


def _listing(repo: Path, tree: str) -> list[Entry]:
    raw = git(repo, ["ls-tree", "-r", "-z", "--full-tree", tree], f"tree {tree[:12]}")
    found: list[Entry] = []
    for record in raw.decode("utf-8", "surrogateescape").split("\0"):
        if not record:
            continue
        meta, _, path = record.partition("\t")
        mode, kind, oid = meta.split(" ")
        if kind != "blob" or mode not in (REGULAR, EXECUTABLE):
            raise errors.UsageError(f"tree {tree[:12]}: {path} is a {kind} of mode {mode}; "
                                    "only regular and executable files are exported")
        _safe_path(path)
        found.append(Entry(mode, oid, path))
    return found


def _blobs(repo: Path, entries: Sequence[Entry]) -> dict[str, bytes]:
    """Every blob of ``entries``, each checked against its id."""
    wanted = sorted({e.oid for e in entries})
    raw = git(repo, ["cat-file", "--batch"], "reading the tree's blobs",
              stdin="".join(f"{oid}\n" for oid in wanted).encode())
    found: dict[str, bytes] = {}
    at = 0
    for oid in wanted:
        end = raw.index(b"\n", at)
        header = raw[at:end].decode("ascii", "replace").split(" ")
        if len(header) != 3 or header[0] != oid or header[1] != "blob":
            raise errors.EnvironmentFailure(f"blob {oid[:12]}: git answered {header!r}")
        size = int(header[2])
        if size > BLOB_LIMIT:
            raise errors.UsageError(f"blob {oid[:12]}: {size} bytes, over the "
                                    f"{BLOB_LIMIT}-byte limit")
        data = raw[end + 1:end + 1 + size]
        if object_id("blob", data, _hasher(oid)) != oid:
            raise errors.EnvironmentFailure(f"blob {oid[:12]}: its bytes do not hash to its id")
        found[oid] = data
        at = end + 1 + size + 1
    return found


def export(repo: Path, commit: str, target: Path) -> str:
    """Write the files of ``commit`` of the repository at ``repo`` into the new directory
    ``target``, from git's objects only; the commit's tree id.

    The commit object must hash to ``commit``, every blob to its id, and the files as
    written must make the commit's tree again (``snapshot``): anything git or the disk
    changed on the way fails with ``EnvironmentFailure``.
    """
    tree = commit_tree(repo, commit)
    entries = _listing(repo, tree)
    if tree_id(entries, _hasher(commit)) != tree:
        raise errors.EnvironmentFailure(f"tree {tree[:12]}: its listing does not make its id")
    blobs = _blobs(repo, entries)
    target.mkdir(parents=False, exist_ok=False)
    for entry in entries:
        path = target / _safe_path(entry.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = 0o755 if entry.mode == EXECUTABLE else 0o644
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(blobs[entry.oid])
        os.chmod(path, mode)
    written = walk(target, _hasher(commit)).tree
    if written != tree:
        raise errors.EnvironmentFailure(f"{target}: the exported files make tree "
                                        f"{written[:12]}, not {tree[:12]}")
    return tree


def _entry(root: Path, name: str, algorithm: str) -> tuple[Entry, str] | None:
    """The entry and sha256 of the file ``name`` under ``root``; None when it is absent."""
    path = root / name
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise errors.InputError(f"source {name}: cannot read: {exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode):
        data = os.readlink(path).encode("utf-8", "surrogateescape")
        mode = SYMLINK
    else:
        data = files.read_bytes(path, BLOB_LIMIT, f"source {name}:")
        mode = EXECUTABLE if info.st_mode & 0o100 else REGULAR
    return (Entry(mode, object_id("blob", data, algorithm), name),
            hashlib.sha256(data).hexdigest())


def _snapshot(root: Path, names: Iterable[str], algorithm: str) -> Snapshot:
    entries: list[Entry] = []
    digests: dict[str, str] = {}
    for name in sorted(set(names)):
        found = _entry(root, name, algorithm)
        if found is not None:
            entries.append(found[0])
            digests[name] = found[1]
    return Snapshot(tree_id(entries, algorithm), tuple(entries), digests)


def walk(root: Path, algorithm: str = "sha1") -> Snapshot:
    """Every file under ``root`` (an exported tree: no ``.git``), as a tree."""
    names: list[str] = []
    for directory, subdirs, filenames in os.walk(root):
        subdirs.sort()
        base = Path(directory).relative_to(root)
        for name in filenames:
            names.append((base / name).as_posix())
        for name in subdirs:
            if (Path(directory) / name).is_symlink():
                names.append((base / name).as_posix())
    return _snapshot(root, names, algorithm)


def tracked(root: Path) -> Snapshot:
    """The files git's index tracks in the checkout at ``root``, as they are on disk
    (a tracked file that is missing is left out, so the tree differs)."""
    raw = git(root, ["ls-files", "-z", "--cached"], f"listing {root}")
    names = [n for n in raw.decode("utf-8", "surrogateescape").split("\0") if n]
    head = git(root, ["rev-parse", "--show-object-format"], f"listing {root}").decode().strip()
    return _snapshot(root, names, "sha256" if head == "sha256" else "sha1")


def exported_commit(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """``(commit, tree)`` a hermetic runner exported for this process, else None."""
    commit, tree = environ.get(COMMIT_ENV), environ.get(TREE_ENV)
    if commit and tree:
        return commit, tree
    return None


def sources(root: Path, environ: Mapping[str, str] | None = None) -> Snapshot | None:
    """The run's sources: every file of an exported tree (when ``environ`` names one and
    ``root`` has no ``.git``), else every file git tracks at ``root``; None outside git."""
    env = os.environ if environ is None else environ
    exported = exported_commit(env)
    if exported is not None and not (root / ".git").exists():
        return walk(root, _hasher(exported[0]))
    try:
        return tracked(root)
    except (errors.UsageError, errors.EnvironmentFailure):
        return None
