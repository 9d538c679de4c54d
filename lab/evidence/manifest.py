"""The experiment manifest: what a complete run must contain, kept in step with the code.

``experiments/manifest.json`` declares every experiment (chapter, test function)
and how many pytest results it produces (one, or one per parameter). The gate
compares a run against it, exactly. Two commands keep it honest:

* ``lab manifest sync`` collects the experiments (pytest ``--collect-only`` in a
  child process: no database, no evidence), rewrites the manifest with exact
  result counts, keeps each existing entry's ``seed`` and ``database`` fields, and
  prints the diff for review in git;
* ``lab manifest check`` collects the same way and exits 1 naming each difference
  (undeclared, declared but absent, miscounted).

``gate.count_problem`` is the one exact-count rule, shared by ``check`` and the gate.

Each experiment has a wall-clock budget (``budget_s``): the manifest's default, or the
entry's own. The plugin enforces it (``lab.budget``): on expiry the experiment fails
naming what it waited for, and its fixtures kill its processes and stop its server.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lab import errors, files
from lab.evidence import gate
from lab.options import option
from lab.pg import providers

if TYPE_CHECKING:  # pytest stays out of the processes that only read a manifest
    import pytest

MANIFEST_FILE = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20
# The child's collection output is read back from this file (named by the parent).
_OUT_ENV = "LAB_MANIFEST_COLLECT_OUT"
_EXPERIMENTS_ENV = "LAB_MANIFEST_EXPERIMENTS"
DEFAULT_ABOUT = (
    "The experiments a run must contain to be evidence. Deleting or renaming one makes the "
    "gate fail. results: how many pytest results the experiment produces (exactly); seed: "
    "one of the 26 experiments of the seed lab. budget_s: the wall-clock seconds an "
    "experiment's setup and body may take (the default above, or its own); past it the "
    "experiment fails naming what it waited for. Written by `lab manifest sync`."
)

Key = tuple[str, str]
# An experiment's wall-clock budget when the manifest names none (setup and body, seconds).
DEFAULT_BUDGET_S = 300.0


@dataclass(frozen=True)
class Entry:
    """One declared experiment: a test function of a chapter and its exact result count."""

    chapter: str
    name: str
    results: int = 1
    seed: bool = False
    # None: the experiment needs the database when it requests the database fixture.
    database: bool | None = None
    # None: the manifest's default budget.
    budget_s: float | None = None

    @property
    def key(self) -> Key:
        """``(chapter, name)``, the experiment's identity."""
        return (self.chapter, self.name)

    @property
    def label(self) -> str:
        """``chapter/name``, as every message names it."""
        return f"{self.chapter}/{self.name}"


@dataclass(frozen=True)
class Manifest:
    """The manifest file's content: its explanation and its entries, in order."""

    about: str
    entries: tuple[Entry, ...]
    budget_s: float = DEFAULT_BUDGET_S

    def budget(self, key: Key) -> float:
        """The wall-clock budget of the experiment ``key``: its own, else the default."""
        for entry in self.entries:
            if entry.key == key and entry.budget_s is not None:
                return entry.budget_s
        return self.budget_s


def parse(text: str, source: str = MANIFEST_FILE) -> Manifest:
    """Parse manifest JSON; raise ``InputError`` naming ``source`` unless it has the shape."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise errors.InputError(f"{source}: not JSON: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("experiments"), list):
        raise errors.InputError(f"{source}: must be an object with an 'experiments' list")
    unknown = set(raw) - {"about", "experiments", "budget_s"}
    if unknown:
        raise errors.InputError(f"{source}: unknown keys {sorted(unknown)}")
    about = raw.get("about", DEFAULT_ABOUT)
    if not isinstance(about, str):
        raise errors.InputError(f"{source}: 'about' must be a string")
    budget_s = _budget(raw.get("budget_s", DEFAULT_BUDGET_S), source, "the default budget_s")
    entries: list[Entry] = []
    seen: set[Key] = set()
    for item in raw["experiments"]:
        entry = _entry(item, source)
        if entry.key in seen:
            raise errors.InputError(f"{source}: {entry.label} is declared twice")
        seen.add(entry.key)
        entries.append(entry)
    return Manifest(about, tuple(entries), budget_s)


def _budget(value: Any, source: str, what: str) -> float:
    """A budget in seconds: a positive number of at most a day."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 86400:
        raise errors.InputError(f"{source}: {what} must be seconds in (0, 86400]")
    return float(value)


def _entry(item: Any, source: str) -> Entry:
    if not isinstance(item, dict):
        raise errors.InputError(f"{source}: every experiment must be an object")
    unknown = set(item) - {"chapter", "name", "results", "seed", "database", "budget_s"}
    if unknown:
        raise errors.InputError(f"{source}: unknown keys {sorted(unknown)} in {item!r}")
    chapter, name = item.get("chapter"), item.get("name")
    results, seed, database = item.get("results", 1), item.get("seed", False), item.get("database")
    if not (isinstance(chapter, str) and chapter and "/" not in chapter):
        raise errors.InputError(f"{source}: bad chapter in {item!r}")
    if not (isinstance(name, str) and name.startswith("test")):
        raise errors.InputError(f"{source}: bad name in {item!r}")
    if isinstance(results, bool) or not isinstance(results, int) or results < 1:
        raise errors.InputError(f"{source}: results must be a positive integer in {item!r}")
    if not isinstance(seed, bool):
        raise errors.InputError(f"{source}: seed must be true or false in {item!r}")
    if database is not None and not isinstance(database, bool):
        raise errors.InputError(f"{source}: database must be true or false in {item!r}")
    budget_s = None if item.get("budget_s") is None else _budget(
        item["budget_s"], source, f"budget_s of {chapter}/{name}")
    return Entry(chapter, name, results, seed, database, budget_s)


def load(path: Path) -> Manifest:
    """Read and parse the manifest at ``path``: a regular file of at most
    ``MAX_MANIFEST_BYTES`` (a FIFO cannot hang the read, a device cannot flood it)."""
    data = files.read_bytes(path, MAX_MANIFEST_BYTES, "experiment manifest")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.InputError(f"{path}: not UTF-8") from exc
    return parse(text, str(path))


def render(manifest: Manifest) -> str:
    """The manifest as its file holds it: one line per experiment, for readable diffs."""
    lines = ["{", f"  \"about\": {json.dumps(manifest.about)},",
             f"  \"budget_s\": {json.dumps(_seconds(manifest.budget_s))},", '  "experiments": [']
    for index, entry in enumerate(manifest.entries):
        fields: dict[str, Any] = {
            "chapter": entry.chapter,
            "name": entry.name,
            "results": entry.results,
            "seed": entry.seed,
        }
        if entry.database is not None:
            fields["database"] = entry.database
        if entry.budget_s is not None:
            fields["budget_s"] = _seconds(entry.budget_s)
        comma = "," if index < len(manifest.entries) - 1 else ""
        lines.append(f"    {json.dumps(fields)}{comma}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def _seconds(value: float) -> int | float:
    """Whole seconds as an integer in the file (``300``, not ``300.0``)."""
    return int(value) if value == int(value) else value


# --------------------------------------------------------------------------- comparing


def differences(declared: Sequence[Entry], found: Mapping[Key, int]) -> list[str]:
    """Every difference between the manifest and the experiments found, one message each."""
    problems: list[str] = []
    declared_keys = {entry.key for entry in declared}
    for entry in declared:
        if entry.key not in found:
            problems.append(f"{entry.label} is declared in the manifest but was not collected")
            continue
        problem = gate.count_problem(entry.label, entry.results, found[entry.key])
        if problem:
            problems.append(problem)
    for key, count in found.items():
        if key not in declared_keys:
            problems.append(
                f"{key[0]}/{key[1]} is not declared in the manifest ({count} collected)"
            )
    return problems


def synced(manifest: Manifest, found: Mapping[Key, int]) -> Manifest:
    """The manifest rewritten for ``found`` (in collection order), keeping known flags."""
    old = {entry.key: entry for entry in manifest.entries}
    entries = []
    for key, count in found.items():
        previous = old.get(key)
        if previous is not None:
            entries.append(dataclasses.replace(previous, results=count))
        else:
            entries.append(Entry(key[0], key[1], count))
    return Manifest(manifest.about, tuple(entries), manifest.budget_s)


def diff(before: str, after: str, path: Path) -> str:
    """A unified diff of the manifest text, empty when nothing changed."""
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=f"a/{path}",
            tofile=f"b/{path}",
        )
    )


# --------------------------------------------------------------------------- collecting


def collect(experiments: Path, timeout: float = 300.0) -> dict[Key, int]:
    """Collect the experiments under ``experiments`` in a child pytest and count results.

    The child runs ``pytest --collect-only`` with PostgreSQL disabled and no evidence,
    and this module as a plugin that writes each item's chapter and function name to a
    file. A collection error raises ``InputError`` with pytest's message.
    """
    experiments = experiments.resolve()
    if not experiments.is_dir():
        raise errors.UsageError(f"no such experiments directory: {experiments}")
    with tempfile.TemporaryDirectory(prefix="lab-manifest-") as scratch:
        out = Path(scratch) / "collected.json"
        command = [
            sys.executable, "-m", "pytest", str(experiments), "--collect-only", "-q",
            "--rootdir", str(experiments.parent), "-p", "no:cacheprovider",
            "-p", "lab.evidence.manifest", "--lab-postgres", providers.NONE, "--lab-no-evidence",
        ]  # fmt: skip
        env = {**os.environ, _OUT_ENV: str(out), _EXPERIMENTS_ENV: str(experiments)}
        try:
            completed = subprocess.run(
                command, cwd=experiments.parent, env=env, capture_output=True, text=True,
                timeout=timeout, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise errors.UsageError(f"collecting {experiments} took over {timeout}s") from exc
        if completed.returncode != 0 or not out.is_file():
            tail = " | ".join(
                line for line in (completed.stdout + completed.stderr).splitlines()[-8:] if line
            )
            raise errors.InputError(
                f"collecting {experiments} failed (pytest exit {completed.returncode}): {tail}"
            )
        pairs = json.loads(out.read_text(encoding="utf-8"))
    found: dict[Key, int] = {}
    for chapter, name in pairs:
        found[(chapter, name)] = found.get((chapter, name), 0) + 1
    return found


def pytest_collection_finish(session: pytest.Session) -> None:
    """In the child of ``collect``: write ``[chapter, function]`` of every item."""
    out, experiments = os.environ.get(_OUT_ENV), os.environ.get(_EXPERIMENTS_ENV)
    if not out or not experiments:
        return
    root = Path(experiments)
    pairs: list[list[str]] = []
    for item in session.items:
        try:
            parts = item.path.resolve().relative_to(root).parts
        except ValueError:
            continue
        # The same identity the recorder gives a result: chapter directory, function name.
        if len(parts) >= 2:
            pairs.append([parts[0], getattr(item, "originalname", item.name)])
    Path(out).write_text(json.dumps(pairs), encoding="utf-8")


# --------------------------------------------------------------------------- the command


@dataclass(frozen=True)
class ManifestOptions:
    """What ``lab manifest sync|check`` is asked to do: the subcommand and its flags."""

    manifest_command: str
    experiments: str = option("experiments", help="the directory of chapter experiments")
    manifest: str | None = option(
        None, help="the manifest file (default EXPERIMENTS/manifest.json)")


def _paths(options: ManifestOptions) -> tuple[Path, Path]:
    experiments = Path(options.experiments)
    manifest_path = Path(options.manifest) if options.manifest else experiments / MANIFEST_FILE
    return experiments, manifest_path


def cli_main(options: ManifestOptions) -> int:
    """``lab manifest sync|check``: 0 when in step (or synced), 1 naming each difference."""
    experiments, path = _paths(options)
    found = collect(experiments)
    if options.manifest_command == "check":
        current = load(path)
        problems = differences(current.entries, found)
        for problem in problems:
            print(f"manifest: {problem}")
        if problems:
            print(f"{len(problems)} difference(s); run `lab manifest sync` and review the diff")
            return 1
        print(f"manifest: {len(current.entries)} experiments, in step with {experiments}")
        return 0
    before = path.read_text(encoding="utf-8") if path.exists() else ""
    current = load(path) if before else Manifest(DEFAULT_ABOUT, ())
    after = render(synced(current, found))
    changes = diff(before, after, path)
    if not changes:
        print(f"manifest: unchanged, {len(found)} experiments")
        return 0
    # Written whole or not at all: a half-written manifest would fail every run.
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(after, encoding="utf-8")
    staged.replace(path)
    sys.stdout.write(changes)
    print(f"manifest: wrote {path} ({len(found)} experiments); review the diff above")
    return 0
