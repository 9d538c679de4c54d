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
import math
import os
import platform
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab import errors
from lab.errors import EvidenceError
from lab.evidence import dsse, environment, gate, manifest, provenance, tree

SCHEMA_VERSION = 1
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://durable-agent-lab.dev/runtime-evidence/v1"

TESTS_FILE = "tests.jsonl"
REPORT_FILE = "runtime.json"
# Test properties the gate reads: a test that reached the run's database, and one that
# asked for it (lab.pytest_plugin and lab.recorder write them).
REACHED_DATABASE = "lab_database"
# Per test: how many times a database server was SIGKILLed and restarted during it.
DATABASE_RESTARTS = "lab_database_restarts"
NEEDS_DATABASE = "lab_needs_database"
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
_SECRET_NAME = re.compile(r"(dsn|pass|pwd|token|secret|credential|auth|apikey|api_key|key)", re.I)
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")
_KEYWORD_SECRET = re.compile(r"\b(password|passwd|pwd|token|secret|sslpassword)\s*=\s*\S+", re.I)
REDACTED = "<redacted>"

# What an experiment's event history and timeline may carry into the report.
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_RANDOM_ID = re.compile(r"\b(?P<prefix>[a-z][a-z0-9]*)_[0-9a-f]{32}\b")
_KIND = re.compile(r"[a-z][a-z0-9_]{0,39}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,39}")
_DETAIL_TOKEN = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_]{0,39})=(?P<value>[A-Za-z0-9_.:-]{0,80})")
_MAX_TEXT = 160

# Outcomes of one test, folded from its setup, call and teardown reports.
PASSED, FAILED, ERROR = gate.PASSED, gate.FAILED, gate.ERROR
SKIPPED, XFAILED, XPASSED, NOT_RUN = gate.SKIPPED, gate.XFAILED, gate.XPASSED, gate.NOT_RUN
RERUN = gate.RERUN


@dataclass(frozen=True)
class Expected:
    """One experiment the manifest requires a complete run to contain."""

    chapter: str
    name: str
    results: int = 1
    # None: the experiment needs the database when it requested the database fixture.
    database: bool | None = None


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


def experiment_of(nodeid: str, prefix: str) -> tuple[str, str] | None:
    """``(chapter, test function)`` of a node id under ``prefix``, else None.

    ``experiments/ch05_crashes/test_x.py::test_y[a]`` gives ``("ch05_crashes", "test_y")``.
    """
    path, sep, rest = nodeid.partition("::")
    if not sep or not path.startswith(prefix):
        return None
    parts = path[len(prefix) :].split("/")
    if len(parts) < 2:
        return None
    function = rest.split("::")[-1].split("[", 1)[0]
    return parts[0], function


def _props(record: Mapping[str, Any]) -> list[tuple[str, Any]]:
    props: list[tuple[str, Any]] = []
    for item in record.get("user_properties") or []:
        if isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str):
            props.append((item[0], item[1]))
    return props


def _message(record: Mapping[str, Any]) -> str | None:
    """A one-line reason from a report's longrepr, without file paths."""
    longrepr = record.get("longrepr")
    text: str | None = None
    if isinstance(longrepr, list | tuple) and len(longrepr) == 3:
        text = str(longrepr[2])  # a skip: (path, lineno, reason)
    elif isinstance(longrepr, dict):
        crash = longrepr.get("reprcrash")
        if isinstance(crash, dict):
            text = str(crash.get("message", ""))
    elif isinstance(longrepr, str):
        text = longrepr
    if not text:
        return None
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300] or None


def _fold(records: Sequence[Mapping[str, Any]]) -> str:
    """One test's outcome from its phase reports, as pytest's summary counts it.

    Exactly one report per phase, each passed, failed or skipped: a second report of a
    phase or any other outcome (pytest-rerunfailures' ``rerun``, a flaky retry) means
    an attempt ran and was replaced, and a failed attempt of a safety experiment is a
    counterexample to its claim, whatever a later attempt did: ``RERUN``.
    """
    phases = [record.get("when") for record in records]
    if len(phases) != len(set(phases)) or any(
        record.get("outcome") not in ("passed", "failed", "skipped") for record in records
    ):
        return RERUN
    outcome = PASSED
    called = False
    for record in records:
        when, result = record.get("when"), record.get("outcome")
        called = called or when == "call"
        xfail = "wasxfail" in record
        if when not in ("setup", "call", "teardown"):
            return FAILED  # xdist's report for a crashed worker's running test
        if result == "failed":
            if when == "call":
                return FAILED
            return ERROR
        if result == "skipped":
            outcome = XFAILED if xfail else SKIPPED
        elif result == "passed" and when == "call" and xfail:
            outcome = XPASSED
    if not records:
        return FAILED
    if outcome == PASSED and not called:
        return NOT_RUN
    return outcome


def _tests(facts: RunFacts) -> list[dict[str, Any]]:
    return test_rows(facts.records, facts.experiments_prefix)


def test_rows(records: Sequence[Mapping[str, Any]], prefix: str) -> list[dict[str, Any]]:
    """The report's ``tests`` rows, folded from pytest's records (``tests.jsonl``'s lines);
    the verifier rebuilds them this way instead of trusting the report's rows."""
    by_node: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        if record.get("$report_type", "TestReport") == "TestReport":
            by_node.setdefault(str(record.get("nodeid")), []).append(record)
    tests: list[dict[str, Any]] = []
    for nodeid in sorted(by_node):
        phases = by_node[nodeid]
        # Each phase's report copies the item's user_properties as they stand, so
        # the longest list is the whole record and the others are its prefixes.
        props = max((_props(r) for r in phases), key=len, default=[])
        first = {key: value for key, value in reversed(props)}
        observations = [v for k, v in props if k == "lab_observation"]
        # One kinds table per observation, recorded with it (lab.evidence.observations).
        kinds = [v for k, v in props if k == "lab_observation_kinds"]
        events, timeline, trace_ids = _history(first)
        outcome = _fold(phases)
        where = experiment_of(nodeid, prefix)
        test: dict[str, Any] = {
            "nodeid": nodeid,
            "chapter": where[0] if where else None,
            "experiment": where[1] if where else None,
            "outcome": outcome,
            "duration": round(sum(float(r.get("duration") or 0.0) for r in phases), 6),
            "claim": first.get("lab_claim"),
            "database": any(k == REACHED_DATABASE and v is True for k, v in props),
            "needs_database": any(k == NEEDS_DATABASE and v is True for k, v in props),
            "observations": observations,
            "observation_kinds": kinds,
            "events": events,
            "timeline": timeline,
            "trace_ids": trace_ids,
        }
        if outcome != PASSED:
            reasons = [m for m in (_message(r) for r in phases) if m]
            test["message"] = reasons[0] if reasons else None
        tests.append(test)
    return tests


class _Aliases:
    """Stable names for random identifiers, in order of first appearance in one test.

    ``st1_<32 hex>`` becomes ``st1-1``: the report stays deterministic and still
    shows which events share an identifier.
    """

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self.counts: dict[str, int] = {}

    def __call__(self, text: str) -> str:
        def alias(match: re.Match[str]) -> str:
            raw, prefix = match.group(0), match.group("prefix")
            if raw not in self.names:
                self.counts[prefix] = self.counts.get(prefix, 0) + 1
                self.names[raw] = f"{prefix}-{self.counts[prefix]}"
            return self.names[raw]

        return _RANDOM_ID.sub(alias, text)


def _history(
    props: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """The test's event history, process timeline and trace ids, sanitised for the report.

    Only the known fields of each entry survive, identifiers must look like
    identifiers, an event detail is ``key=value`` tokens (any other token is
    redacted), free text is scrubbed like the rest of the report, and random
    identifiers are aliased.
    """
    aliases = _Aliases()
    events: list[dict[str, Any]] = []
    for item in _entries(props.get("lab_events")):
        fence = item.get("fence")
        events.append(
            {
                "t": _seconds(item.get("t")),
                "workflow": _identifier(item.get("workflow"), _NAME, aliases),
                "kind": _identifier(item.get("kind"), _KIND, aliases),
                "fence": fence if isinstance(fence, int) and not isinstance(fence, bool) else None,
                "detail": _detail(item.get("detail"), aliases),
            }
        )
    timeline = [
        {
            "t": _seconds(item.get("t")),
            "actor": _identifier(item.get("actor"), _NAME, aliases),
            "what": aliases(_redact_text(str(item.get("what", ""))))[:_MAX_TEXT],
        }
        for item in _entries(props.get("lab_timeline"))
    ]
    raw_ids = props.get("lab_trace_ids")
    trace_ids = [
        str(value)
        for value in (raw_ids if isinstance(raw_ids, list) else [])
        if isinstance(value, str) and _TRACE_ID.fullmatch(value)
    ]
    return events, timeline, trace_ids


def _entries(value: Any) -> list[Mapping[str, Any]]:
    return [item for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return round(number, 3) if math.isfinite(number) else None


def _identifier(value: Any, shape: re.Pattern[str], aliases: _Aliases) -> str:
    text = aliases(str(value)) if value is not None else ""
    return text if shape.fullmatch(text) else REDACTED


def _detail(value: Any, aliases: _Aliases) -> str:
    """``key=value`` tokens with identifier values; anything else is redacted."""
    tokens: list[str] = []
    for token in aliases(_redact_text(str(value or ""))).split():
        match = _DETAIL_TOKEN.fullmatch(token)
        if match is None:
            tokens.append(REDACTED)
        elif _is_secret_name(match.group("key")):
            tokens.append(f"{match.group('key')}={REDACTED}")
        else:
            tokens.append(token)
    return " ".join(tokens)


def collection_error_rows(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The report's ``collection_errors``: every failed collection record, by node id."""
    failed = [
        {"nodeid": str(r.get("nodeid")), "message": _message(r)}
        for r in records
        if r.get("$report_type") == "CollectReport" and r.get("outcome") == "failed"
    ]
    return sorted(failed, key=lambda item: item["nodeid"])


def experiment_rows(
    expected: Sequence[Expected], tests: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Per-experiment rows: declared ones first, in manifest order, then undeclared ones;
    the verifier rebuilds them this way from the rows it rebuilt."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for test in tests:
        if test["experiment"] is not None:
            groups.setdefault((test["chapter"], test["experiment"]), []).append(test)
    rows: list[dict[str, Any]] = []
    declared = {(e.chapter, e.name): e for e in expected}
    keys = [(e.chapter, e.name) for e in expected]
    keys += sorted(set(groups) - set(declared))
    for key in keys:
        ran = groups.get(key, [])
        spec = declared.get(key)
        rows.append({
            "chapter": key[0],
            "name": key[1],
            "declared": spec is not None,
            "expected_results": spec.results if spec else None,
            "results": len(ran),
            "outcome": gate.fold_outcomes([t["outcome"] for t in ran]),
            "duration": round(sum(t["duration"] for t in ran), 6),
            "claim": next((t["claim"] for t in ran if t["claim"]), None),
            "needs_database": spec.database if spec else None,
            "tests": [t["nodeid"] for t in ran],
        })
    return rows


def skip_rows(tests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Skips anywhere: a skipped unit test in an evidence run fails the gate as well."""
    return [
        {"nodeid": t["nodeid"], "outcome": t["outcome"], "reason": t.get("message")}
        for t in tests
        if t["outcome"] in (SKIPPED, XFAILED)
    ]


def observation_rows(tests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The report's ``observations``: each observation of each row with its kinds."""
    return [
        {"nodeid": t["nodeid"], "observation": o,
         "kinds": kinds[i] if i < len(kinds := t["observation_kinds"]) else {}}
        for t in tests for i, o in enumerate(t["observations"])
    ]


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
    rows = experiment_rows(facts.expected, tests)
    reported = {t["nodeid"] for t in tests}
    skips = skip_rows(tests)
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
        "command": redact_command(facts.command, env),
        "selection": _selection(facts, root, env),
        "provenance": _provenance(facts, root, sources, env),
        "run": facts.run,
        "exitstatus": facts.exitstatus,
        "versions": versions(),
        "postgresql": _scrub(facts.database),
        "temporal": _temporal(facts),
        "signing": dict(signing),
        "experiments_dir": facts.experiments_prefix,
        "expected": [
            {"chapter": e.chapter, "name": e.name, "results": e.results, "database": e.database}
            for e in facts.expected
        ],
        "skips": skips,
        "collection_errors": collection_error_rows(facts.records),
        "experiments": rows,
        "tests": tests,
        "observations": observation_rows(tests),
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
        for key, value in _props(record):
            if key == DATABASE_RESTARTS and isinstance(value, int) and value > 0:
                nodeid = str(record.get("nodeid"))
                found[nodeid] = max(found.get(nodeid, 0), value)
    return found


def _temporal(facts: RunFacts) -> list[dict[str, Any]]:
    """Every Temporal dev server the run's experiments used, once each, as they recorded it."""
    found: dict[str, dict[str, Any]] = {}
    for record in facts.records:
        for key, value in _props(record):
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
    passed = {t["nodeid"] for t in tests if t.get("outcome") == PASSED}
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
                arguments[name] = redact_command([str(v) for v in value], env)
            else:
                arguments[name] = _redact_text(str(value)) if value is not None else None
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
            environment[name] = " ".join(redact_command(value.split(), env))
    if facts.ran is not None:
        described["ran"] = provenance.vouch(
            facts.ran, facts.hooks or [], root=root, sources=sources
        )
    return described


def _is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def _scrub(value: Any) -> Any:
    """Drop secret-named keys and DSN userinfo from provider details."""
    if isinstance(value, Mapping):
        return {str(k): _scrub(v) for k, v in sorted(value.items()) if not _is_secret_name(str(k))}
    if isinstance(value, list | tuple):
        return [_scrub(v) for v in value]
    if isinstance(value, str):
        return _redact_text(value)
    return value


def _redact_text(text: str) -> str:
    text = _URL_USERINFO.sub(lambda m: m.group("scheme") + REDACTED + "@", text)
    return _KEYWORD_SECRET.sub(lambda m: m.group(1) + "=" + REDACTED, text)


def redact_command(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The command line with DSNs, passwords and tokens replaced by ``<redacted>``.

    A value is secret when it follows (or is joined by ``=`` to) an option whose name
    says so, carries URL userinfo or ``password=``, or equals a secret environment value.
    """
    env = os.environ if environ is None else environ
    secrets = sorted(
        (v for k, v in env.items() if _is_secret_name(k) and len(v) >= 6),
        key=len,
        reverse=True,
    )
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if arg.startswith("--") and "=" in arg:
            name, value = arg.split("=", 1)
            if _is_secret_name(name):
                out.append(f"{name}={REDACTED}")
                continue
            arg = f"{name}={_redact_text(value)}"
        elif arg.startswith("--") and len(arg) > 2 and _is_secret_name(arg):
            out.append(arg)
            hide_next = True
            continue
        arg = _redact_text(arg)
        for secret in secrets:
            arg = arg.replace(secret, REDACTED)
        out.append(arg)
    return out


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
