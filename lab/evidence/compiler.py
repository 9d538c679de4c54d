"""Evidence: compile a run's results into a report, sign it, verify it offline.

A run leaves three files behind (plus the signer's public key)::

    tests.jsonl          one record per pytest result, in pytest's report-log shape
    runtime.json         the report: status, versions, outcomes, observations, each
                         experiment's sanitised event history and process timeline, sources
    runtime.intoto.json  a DSSE envelope around an in-toto Statement whose subjects
                         are every source file and runtime.json, signed with Ed25519
    runtime.pub.pem      the public key that signed it

Everything here is pure of pytest: the recorder hands plain report-log dicts in.
The report is deterministic: two runs of one commit differ only in times,
durations, trace ids and the signature.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab import errors
from lab.errors import EvidenceError
from lab.evidence import dsse, environment, gate, manifest, provenance, redaction, testlog, tree

# The manifest's entries are the compiler's input: callers name them ``compiler.Expected``.
from lab.evidence.testlog import Expected as Expected

SCHEMA_VERSION = 1
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://durable-agent-lab.dev/runtime-evidence/v1"

TESTS_FILE = "tests.jsonl"
REPORT_FILE = "runtime.json"
# Test properties the gate reads: a test that reached the run's database, and one that
# asked for it (lab.pytest_plugin and lab.recorder write them).
REACHED_DATABASE = testlog.REACHED_DATABASE
# Per test: how many times a database server was SIGKILLed and restarted during it.
DATABASE_RESTARTS = "lab_database_restarts"
NEEDS_DATABASE = testlog.NEEDS_DATABASE
# Per test: the Temporal dev server it used, as ``temporal_server.DevServer.describe`` says.
TEMPORAL_SERVER = "lab_temporal_server"
ENVELOPE_FILE = "runtime.intoto.json"
PUBLIC_KEY_FILE = "runtime.pub.pem"
# Everything one run writes: removed before a run so none of it can outlive a failed one.
RUN_FILES = (TESTS_FILE, REPORT_FILE, ENVELOPE_FILE, PUBLIC_KEY_FILE)

# What the evidence covers is every file of the tree that ran (``lab.evidence.tree``): the
# files git tracks in a checkout, every file of a hermetic run's exported commit; the
# report names them all at once by their tree id.

# The limits every run has, whatever it did; ``limits`` adds those derived from the run.
LIMITS = (
    "One side-effecting step per workflow: this is not a general workflow engine and "
    "makes no exactly-once claim.",
    "The workflow store and the tool's ledger share one PostgreSQL server but commit in "
    "separate transactions.",
    "SIGKILL experiments wait for the real database lease to expire; the other "
    "lease-boundary experiments expire leases through SQL and say so.",
    "Loopback-only development credentials and an authoritative lab lookup: no claim "
    "about multi-cluster availability or a real provider's authentication.",
    "An ephemeral signing key proves the evidence was not altered after signing, not who "
    "produced it; publications are signed with a key given in LAB_EVIDENCE_KEY.",
    "Experiments run on one machine against PostgreSQL servers on loopback; they measure "
    "correctness under faults, not throughput or availability.",
    "Trace ids are random and times (durations, event and timeline times) are measured, "
    "so both differ between runs of one commit; random identifiers inside event details "
    "are replaced by per-experiment aliases.",
)

# Option names whose value is a secret, and the shapes of secrets inside a value.


def load_manifest(path: Path) -> list[Expected]:
    """The experiments ``manifest.json`` declares (read, checked: ``lab.evidence.manifest``)."""
    try:
        entries = manifest.load(path).entries
    except errors.InputError as exc:
        raise EvidenceError(str(exc)) from exc
    return [Expected(e.chapter, e.name, e.results, e.database) for e in entries]


# --------------------------------------------------------------------------- collection


@dataclass
class RunFacts:
    """What the pytest side observed about a run, in plain data.

    ``records`` are report-log dicts (``$report_type`` TestReport or CollectReport)
    in the order they arrived; ``collected`` the node ids that were to run.
    """

    records: list[dict[str, Any]]
    collected: list[str]
    experiments_prefix: str
    expected: list[Expected]
    database: Mapping[str, Any] | None
    command: list[str]
    narrowed: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    exitstatus: int | None = None
    # The manifest the expected set was read from (the gate requires the committed one).
    manifest: Path | None = None
    # The effective arguments: command line, PYTEST_ADDOPTS, ini addopts, ini file.
    arguments: Mapping[str, Any] | None = None
    # What pytest loaded (conftests, plugin modules) and where ``lab`` was imported from;
    # ``loaded`` None means not observed, and the report then has no provenance.
    loaded: list[provenance.Loaded] | None = None
    lab_file: str | None = None
    inifile: Path | None = None
    # ``(commit, dirty)`` when the caller already knows them; else read from git.
    git: tuple[str | None, bool | None] | None = None
    # Every module that ran in any process (``provenance.ran_modules``) and the start-up
    # hooks found (``provenance.startup_hooks``); None: not observed.
    ran: list[dict[str, Any]] | None = None
    hooks: list[dict[str, Any]] | None = None
    # How the run was isolated (``hermetic.observe``); None: not observed (a local run).
    run: dict[str, Any] | None = None


def _tests(facts: RunFacts) -> list[dict[str, Any]]:
    return testlog.test_rows(facts.records, facts.experiments_prefix)



def compile_report(
    facts: RunFacts,
    *,
    root: Path,
    signing: Mapping[str, Any],
    now: datetime.datetime | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The run's report (``runtime.json``) with the gate's verdict (``gate.decide``)."""
    env = os.environ if environ is None else environ
    tests = _tests(facts)
    rows = testlog.experiment_rows(facts.expected, tests)
    reported = {t["nodeid"] for t in tests}
    skips = testlog.skip_rows(tests)
    snapshot = tree.sources(root, env)
    commit, dirty = facts.git if facts.git is not None else _git(root, snapshot, env)
    sources = dict(snapshot.sha256) if snapshot is not None else {}
    when = (now or datetime.datetime.now(datetime.UTC)).astimezone(datetime.UTC)
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "gate": {"narrowed": sorted(facts.narrowed)},
        "problems": list(facts.problems),
        "unreported": sorted(set(facts.collected) - reported),
        "timestamp_utc": when.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "commit": commit,
        "dirty": dirty,
        "run_url": run_url(env),
        "command": redaction.redact_command(facts.command, env),
        "selection": _selection(facts, root, env),
        "provenance": _provenance(facts, root, sources, env),
        "run": facts.run,
        "exitstatus": facts.exitstatus,
        "versions": versions(),
        "postgresql": redaction.scrub(facts.database),
        "temporal": _temporal(facts),
        "signing": dict(signing),
        "experiments_dir": facts.experiments_prefix,
        "expected": [
            {"chapter": e.chapter, "name": e.name, "results": e.results, "database": e.database}
            for e in facts.expected
        ],
        "skips": skips,
        "collection_errors": testlog.collection_error_rows(facts.records),
        "experiments": rows,
        "tests": tests,
        "observations": testlog.observation_rows(tests),
        "sources": sources,
        "tree": snapshot.tree if snapshot is not None else None,
        "limits": limits(facts.database, tests, restarts=_restarts(facts),
                         temporal=_temporal(facts)),
        "environment": installed_environment(root),
    }
    verdict = gate.decide(report)
    report["status"] = verdict.status
    report["gate"] = {"failures": verdict.failures, "narrowed": verdict.narrowed}
    report["missing"] = verdict.missing
    report["seed_floor"] = verdict.seed_floor
    report["publishable"] = verdict.publishable
    return report


LOCK_FILE = "uv.lock"


def installed_environment(root: Path) -> dict[str, Any] | None:
    """The running environment against the checkout's ``uv.lock``: the lock's digest and
    whether every installed distribution and every file its RECORD hashes match it
    (``lab.evidence.environment``); None for a checkout without a lock."""
    lock = root / LOCK_FILE
    if not lock.is_file():
        return None
    try:
        return environment.check(lock).to_json()
    except errors.InputError as exc:
        return {"lock_sha256": None, "matches": False, "differences": [str(exc)],
                "checked_distributions": 0}


def _restarts(facts: RunFacts) -> dict[str, int]:
    """Database crash-restarts per test node id, as the plugin recorded them."""
    found: dict[str, int] = {}
    for record in facts.records:
        for key, value in testlog.properties(record):
            if key == DATABASE_RESTARTS and isinstance(value, int) and value > 0:
                nodeid = str(record.get("nodeid"))
                found[nodeid] = max(found.get(nodeid, 0), value)
    return found


def _temporal(facts: RunFacts) -> list[dict[str, Any]]:
    """Every Temporal dev server the run's experiments used, once each, as they recorded it."""
    found: dict[str, dict[str, Any]] = {}
    for record in facts.records:
        for key, value in testlog.properties(record):
            if key == TEMPORAL_SERVER and isinstance(value, dict):
                found.setdefault(json.dumps(value, sort_keys=True), dict(value))
    return [found[key] for key in sorted(found)]


def limits(
    database: Mapping[str, Any] | None,
    tests: list[dict[str, Any]],
    *,
    restarts: Mapping[str, int],
    temporal: Sequence[Mapping[str, Any]] = (),
) -> list[str]:
    """The limits the evidence states: the fixed ones, and those derived from what the run
    did (the run's server and its durability, whether any experiment killed a server).

    Derived, never a constant, so the signed text cannot drift from the code that ran.
    """
    stated = list(LIMITS)
    details = (database or {}).get("details") or {}
    provider = (database or {}).get("provider")
    durability = details.get("durability") if isinstance(details, Mapping) else None
    if provider is None:
        stated.append("No PostgreSQL server was provisioned for this run.")
    elif durability:
        stated.append(f"The run's PostgreSQL ({provider}) ran with {durability}.")
    else:
        stated.append(f"The run's PostgreSQL ({provider}) is the given server; its "
                      "durability settings are whatever that server has.")
    killed = {nodeid: n for nodeid, n in restarts.items() if n > 0}
    passed = {t["nodeid"] for t in tests if t.get("outcome") == gate.PASSED}
    if killed:
        count = len(killed)
        stated.append(
            f"{sum(killed.values())} SIGKILLs and restarts of a PostgreSQL postmaster in "
            f"{count} experiment{'s' if count != 1 else ''} "
            f"({len(set(killed) & passed)} passed), each on a "
            "durable server of the experiment's own (fsync and synchronous commits on): "
            "recovery from the WAL is tested; the OS page cache survives a postmaster "
            "SIGKILL, so the disk's honesty about fsync is not."
        )
    else:
        stated.append("No experiment of this run killed a database server: the server's "
                      "own crash recovery is not tested by this evidence.")
    for server in temporal:
        stated.append(
            f"Temporal ran as its dev server (Temporal Server {server.get('server_version')}, "
            f"{server.get('distribution')}), which keeps its state in one SQLite file, not "
            "PostgreSQL: the Temporal chapter compares what happens in each window, not "
            "storage engines or production deployments."
        )
    return stated


def _relative(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` in posix form, or absolute when outside it."""
    resolved = path.resolve()
    try:
        return resolved.relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(resolved)


def _selection(facts: RunFacts, root: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """Which manifest gave the expected set, and the effective arguments, redacted."""
    recorded = None
    if facts.manifest is not None:
        # A relative path is relative to the root of the sources.
        path = facts.manifest if facts.manifest.is_absolute() else root / facts.manifest
        digest = provenance.sha256_file(path)
        # An unreadable manifest is recorded as none (load_manifest names the problem).
        if digest is not None:
            recorded = {"path": _relative(path, root), "sha256": digest}
    arguments: dict[str, Any] | None = None
    if facts.arguments is not None:
        arguments = {}
        for name, value in sorted(facts.arguments.items()):
            if isinstance(value, list | tuple):
                arguments[name] = redaction.redact_command([str(v) for v in value], env)
            else:
                arguments[name] = redaction.redact_text(str(value)) if value is not None else None
    return {"manifest": recorded, "arguments": arguments}


def _provenance(
    facts: RunFacts, root: Path, sources: Mapping[str, str], env: Mapping[str, str]
) -> dict[str, Any] | None:
    if facts.loaded is None:
        return None
    described = provenance.describe(
        facts.loaded,
        root=root,
        sources=sources,
        lab_file=facts.lab_file,
        inifile=facts.inifile,
        environ=env,
    )
    environment = described["environment"]
    for name, value in environment.items():
        if value is not None:
            # PYTEST_ADDOPTS may carry a DSN; redact it like the command line.
            environment[name] = " ".join(redaction.redact_command(value.split(), env))
    if facts.ran is not None:
        described["ran"] = provenance.vouch(
            facts.ran, facts.hooks or [], root=root, sources=sources
        )
    return described


def run_url(environ: Mapping[str, str]) -> str | None:
    """Where this run can be seen: ``BOOK_RUN_URL`` or a GitHub Actions run."""
    if environ.get("BOOK_RUN_URL"):
        return environ["BOOK_RUN_URL"]
    parts = [environ.get(k) for k in ("GITHUB_SERVER_URL", "GITHUB_REPOSITORY", "GITHUB_RUN_ID")]
    if all(parts):
        return f"{parts[0]}/{parts[1]}/actions/runs/{parts[2]}"
    return None


def versions() -> dict[str, str | None]:
    """Versions of the interpreter and the libraries the experiments depend on."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("durable-agent-lab", "pytest", "pytest-xdist", "psycopg", "httpx", "cryptography"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def _git(
    root: Path, snapshot: tree.Snapshot | None, environ: Mapping[str, str]
) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the run: an exported commit is dirty when its files on disk
    no longer make its tree; a checkout, when git reports any change (the fixed git of
    ``lab.evidence.tree``, never the caller's)."""
    exported = tree.exported_commit(environ)
    if exported is not None and not (root / ".git").exists():
        return exported[0], snapshot is None or snapshot.tree != exported[1]
    try:
        head = tree.git(root, ["rev-parse", "HEAD"], "the run's commit").decode().strip()
        status = tree.git(root, ["status", "--porcelain"], "the run's tree state")
    except (errors.UsageError, errors.EnvironmentFailure):
        return None, None
    return head, bool(status.strip())


def source_files(root: Path) -> list[str]:
    """Repo-relative posix paths of the files the evidence covers, sorted: every file of
    the tree (``lab.evidence.tree.sources``); none outside git."""
    snapshot = tree.sources(root)
    return sorted(snapshot.sha256) if snapshot is not None else []


def source_digests(root: Path) -> dict[str, str]:
    """``{path: sha256}`` of every source file under ``root``."""
    snapshot = tree.sources(root)
    return dict(snapshot.sha256) if snapshot is not None else {}


# --------------------------------------------------------------------------- signing


def statement(
    report_bytes: bytes, report: Mapping[str, Any], tests_bytes: bytes | None = None
) -> dict[str, Any]:
    """The in-toto Statement: subjects are the sources, ``runtime.json`` and ``tests.jsonl``.

    ``tests.jsonl`` (pytest's own records of the run) is signed too, so a reader
    can rely on the raw results as much as on the compiled report.
    """
    subjects = [
        {"name": name, "digest": {"sha256": digest}}
        for name, digest in sorted(report["sources"].items())
    ]
    subjects.append(
        {"name": REPORT_FILE, "digest": {"sha256": hashlib.sha256(report_bytes).hexdigest()}}
    )
    if tests_bytes is not None:
        subjects.append(
            {"name": TESTS_FILE, "digest": {"sha256": hashlib.sha256(tests_bytes).hexdigest()}}
        )
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": PREDICATE_TYPE,
        "predicate": dict(report),
    }


def dumps_report(report: Mapping[str, Any]) -> bytes:
    """The canonical bytes of ``runtime.json``."""
    return (json.dumps(report, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


def write(
    directory: Path,
    facts: RunFacts,
    *,
    root: Path,
    signer: dsse.Signer,
    session_records: tuple[dict[str, Any], dict[str, Any]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Compile, sign and write the evidence of one run into ``directory``; return the report."""
    signing = signer.describe()
    report = compile_report(facts, root=root, signing=signing, environ=environ)
    directory.mkdir(parents=True, exist_ok=True)
    lines = list(facts.records)
    if session_records is not None:
        lines = [session_records[0], *lines, session_records[1]]
    tests_bytes = "".join(
        json.dumps(line, sort_keys=True, default=str) + "\n" for line in lines
    ).encode("utf-8")
    report_bytes = dumps_report(report)
    payload = json.dumps(
        statement(report_bytes, report, tests_bytes),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()
    envelope = dsse.sign_envelope(payload, signer)
    (directory / TESTS_FILE).write_bytes(tests_bytes)
    (directory / REPORT_FILE).write_bytes(report_bytes)
    (directory / ENVELOPE_FILE).write_text(json.dumps(envelope, indent=2) + "\n", encoding="utf-8")
    (directory / PUBLIC_KEY_FILE).write_text(signing["public_key"], encoding="ascii")
    return report
