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

import argparse
import base64
import binascii
import datetime
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import errors

SCHEMA_VERSION = 1
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://durable-agent-lab.dev/runtime-evidence/v1"

TESTS_FILE = "tests.jsonl"
REPORT_FILE = "runtime.json"
# Test properties the gate reads: a test that reached the run's database, and one that
# asked for it (lab.pytest_plugin and lab.recorder write them).
REACHED_DATABASE = "lab_database"
NEEDS_DATABASE = "lab_needs_database"
ENVELOPE_FILE = "runtime.intoto.json"
PUBLIC_KEY_FILE = "runtime.pub.pem"
KEY_ENV = "LAB_EVIDENCE_KEY"

PASS = "PASS"  # noqa: S105 - a verdict, not a password
FAIL = "FAIL"
PARTIAL = "PARTIAL"

# What the evidence covers: the code that ran and the declaration of what had to run.
SOURCE_PATTERNS = (
    "lab/**/*.py",
    "lab/schema.sql",
    "experiments/**/*.py",
    "experiments/manifest.json",
    "pyproject.toml",
)

LIMITS = (
    "One side-effecting step per workflow: this is not a general workflow engine and "
    "makes no exactly-once claim.",
    "The workflow store and the tool's ledger share one PostgreSQL server but commit in "
    "separate transactions.",
    "SIGKILL experiments wait for the real database lease to expire; the other "
    "lease-boundary experiments expire leases through SQL and say so.",
    "Loopback-only development credentials and an authoritative lab lookup: no claim "
    "about multi-cluster availability or a real provider's authentication.",
    "An embedded PostgreSQL cluster runs with fsync off: experiments kill workers, never "
    "the database server, so the server's own durability is not tested.",
    "An ephemeral signing key proves the evidence was not altered after signing, not who "
    "produced it; publications are signed with a key given in LAB_EVIDENCE_KEY.",
    "Experiments run on one machine against one PostgreSQL server; they measure "
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
PASSED = "passed"
FAILED = "failed"
ERROR = "error"
SKIPPED = "skipped"
XFAILED = "xfailed"
XPASSED = "xpassed"
NOT_RUN = "not run"  # setup and teardown passed but the body never ran (--setup-only)


class EvidenceError(errors.LabError):
    """Evidence could not be compiled, signed or read."""


@dataclass(frozen=True)
class Expected:
    """One experiment the manifest requires a complete run to contain."""

    chapter: str
    name: str
    results: int = 1
    # None: the experiment needs the database when it requested the database fixture.
    database: bool | None = None


def load_manifest(path: Path) -> list[Expected]:
    """Read ``manifest.json``; reject anything but the declared shape."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EvidenceError(f"cannot read experiment manifest {path}: {exc}") from exc
    items = raw.get("experiments") if isinstance(raw, dict) else None
    if not isinstance(items, list):
        raise EvidenceError(f"{path}: 'experiments' must be a list")
    expected: list[Expected] = []
    seen: set[tuple[str, str]] = set()
    for item in items:
        if not isinstance(item, dict):
            raise EvidenceError(f"{path}: every experiment must be an object")
        chapter, name = item.get("chapter"), item.get("name")
        results, database = item.get("results", 1), item.get("database")
        if not (isinstance(chapter, str) and isinstance(name, str) and name.startswith("test")):
            raise EvidenceError(f"{path}: bad chapter/name in {item!r}")
        if isinstance(results, bool) or not isinstance(results, int) or results < 1:
            raise EvidenceError(f"{path}: results must be a positive integer in {item!r}")
        if database is not None and not isinstance(database, bool):
            raise EvidenceError(f"{path}: database must be true or false in {item!r}")
        if (chapter, name) in seen:
            raise EvidenceError(f"{path}: {chapter}/{name} is declared twice")
        seen.add((chapter, name))
        expected.append(Expected(chapter, name, results, database))
    return expected


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
    """One test's outcome from its phase reports, as pytest's summary counts it."""
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
    by_node: dict[str, list[dict[str, Any]]] = {}
    for record in facts.records:
        if record.get("$report_type", "TestReport") == "TestReport":
            by_node.setdefault(str(record.get("nodeid")), []).append(record)
    tests: list[dict[str, Any]] = []
    for nodeid in sorted(by_node):
        records = by_node[nodeid]
        # Each phase's report copies the item's user_properties as they stand, so
        # the longest list is the whole record and the others are its prefixes.
        props = max((_props(r) for r in records), key=len, default=[])
        first = {key: value for key, value in reversed(props)}
        observations = [v for k, v in props if k == "lab_observation"]
        events, timeline, trace_ids = _history(first)
        outcome = _fold(records)
        where = experiment_of(nodeid, facts.experiments_prefix)
        test: dict[str, Any] = {
            "nodeid": nodeid,
            "chapter": where[0] if where else None,
            "experiment": where[1] if where else None,
            "outcome": outcome,
            "duration": round(sum(float(r.get("duration") or 0.0) for r in records), 6),
            "claim": first.get("lab_claim"),
            "database": any(k == REACHED_DATABASE and v is True for k, v in props),
            "needs_database": any(k == NEEDS_DATABASE and v is True for k, v in props),
            "observations": observations,
            "events": events,
            "timeline": timeline,
            "trace_ids": trace_ids,
        }
        if outcome != PASSED:
            reasons = [m for m in (_message(r) for r in records) if m]
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


def _collection_errors(facts: RunFacts) -> list[dict[str, Any]]:
    failed = [
        {"nodeid": str(r.get("nodeid")), "message": _message(r)}
        for r in facts.records
        if r.get("$report_type") == "CollectReport" and r.get("outcome") == "failed"
    ]
    return sorted(failed, key=lambda item: item["nodeid"])


def _experiments(
    facts: RunFacts, tests: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Per-experiment rows (declared first, in manifest order), the gate's findings,
    and the experiments that produced fewer results than declared."""
    findings: list[str] = []
    shortfalls: list[str] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for test in tests:
        if test["experiment"] is not None:
            groups.setdefault((test["chapter"], test["experiment"]), []).append(test)
    rows: list[dict[str, Any]] = []
    declared = {(e.chapter, e.name): e for e in facts.expected}
    keys = [(e.chapter, e.name) for e in facts.expected]
    keys += sorted(set(groups) - set(declared))
    for key in keys:
        ran = groups.get(key, [])
        spec = declared.get(key)
        label = f"{key[0]}/{key[1]}"
        outcomes = sorted({t["outcome"] for t in ran})
        if not ran:
            outcome = "missing"
        elif outcomes == [PASSED]:
            outcome = PASSED
        else:
            outcome = next(
                o for o in (FAILED, ERROR, NOT_RUN, XPASSED, XFAILED, SKIPPED) if o in outcomes
            )
        row: dict[str, Any] = {
            "chapter": key[0],
            "name": key[1],
            "declared": spec is not None,
            "expected_results": spec.results if spec else None,
            "results": len(ran),
            "outcome": outcome,
            "duration": round(sum(t["duration"] for t in ran), 6),
            "claim": next((t["claim"] for t in ran if t["claim"]), None),
            "needs_database": spec.database if spec else None,
            "tests": [t["nodeid"] for t in ran],
        }
        rows.append(row)
        if spec is None:
            findings.append(f"{label} ran but is not declared in the manifest")
        elif ran and len(ran) < spec.results:
            shortfalls.append(f"{label} produced {len(ran)} of {spec.results} results")
        for test in ran:
            if test["outcome"] != PASSED:
                findings.append(f"{test['nodeid']} {test['outcome']}")
            elif _needs_database(spec, test) and not test["database"]:
                findings.append(f"{test['nodeid']} did not reach a real database")
    return rows, findings, shortfalls


def _needs_database(spec: Expected | None, test: Mapping[str, Any]) -> bool:
    """The manifest's word when it gives one, else whether the test asked for the database."""
    if spec is not None and spec.database is not None:
        return spec.database
    return bool(test["needs_database"])


def compile_report(
    facts: RunFacts,
    *,
    root: Path,
    signing: Mapping[str, Any],
    now: datetime.datetime | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The run's report (``runtime.json``) and its gate verdict.

    PASS only when every declared experiment produced all its results, all passed
    against a real database, nothing was skipped, and the selection was not narrowed.
    """
    env = os.environ if environ is None else environ
    tests = _tests(facts)
    rows, findings, shortfalls = _experiments(facts, tests)
    missing = sorted(f"{r['chapter']}/{r['name']}" for r in rows if r["outcome"] == "missing")
    reported = {t["nodeid"] for t in tests}
    unreported = sorted(set(facts.collected) - reported)
    skips = [
        {"nodeid": t["nodeid"], "outcome": t["outcome"], "reason": t.get("message")}
        for t in tests
        if t["experiment"] is not None and t["outcome"] in (SKIPPED, XFAILED)
    ]
    collection_errors = _collection_errors(facts)
    failures = list(facts.problems)
    failures += [f"collection error in {c['nodeid']}: {c['message']}" for c in collection_errors]
    failures += [f"{nodeid} was collected but never reported" for nodeid in unreported]
    failures += findings
    failures += [
        f"{t['nodeid']} {t['outcome']}"
        for t in tests
        if t["experiment"] is None and t["outcome"] in (FAILED, ERROR, NOT_RUN)
    ]
    if facts.database is None:
        failures.append("no real PostgreSQL database was provisioned for the run")
    if not facts.narrowed:
        # A narrowed selection explains absent results; it is reported as PARTIAL.
        failures += [f"{name} did not run" for name in missing]
        failures += shortfalls
    if failures:
        status = FAIL
    elif facts.narrowed:
        status = PARTIAL
    else:
        status = PASS
    commit, dirty = _git(root)
    when = (now or datetime.datetime.now(datetime.UTC)).astimezone(datetime.UTC)
    sources = source_digests(root)
    return {
        "schema_version": SCHEMA_VERSION,
        "status": status,
        "gate": {
            "failures": failures,
            "narrowed": sorted(facts.narrowed),
        },
        "timestamp_utc": when.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "commit": commit,
        "dirty": dirty,
        "run_url": run_url(env),
        "command": redact_command(facts.command, env),
        "exitstatus": facts.exitstatus,
        "versions": versions(),
        "postgresql": _scrub(facts.database),
        "signing": dict(signing),
        "experiments_dir": facts.experiments_prefix,
        "expected": [
            {"chapter": e.chapter, "name": e.name, "results": e.results, "database": e.database}
            for e in facts.expected
        ],
        "missing": missing,
        "skips": skips,
        "collection_errors": collection_errors,
        "experiments": rows,
        "tests": tests,
        "observations": [
            {"nodeid": t["nodeid"], "observation": o} for t in tests for o in t["observations"]
        ],
        "sources": sources,
        "limits": list(LIMITS),
    }


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


def _git(root: Path) -> tuple[str | None, bool | None]:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None, None
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None, None
    dirty = None if status.returncode != 0 else bool(status.stdout.strip())
    return head.stdout.strip(), dirty


def source_files(root: Path) -> list[str]:
    """Repo-relative posix paths of the files the evidence covers, sorted."""
    found: set[str] = set()
    for pattern in SOURCE_PATTERNS:
        for path in root.glob(pattern):
            if path.is_file() and "__pycache__" not in path.parts:
                found.add(path.relative_to(root).as_posix())
    return sorted(found)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def source_digests(root: Path) -> dict[str, str]:
    """``{path: sha256}`` of every source file under ``root``."""
    return {name: sha256_file(root / name) for name in source_files(root)}


# --------------------------------------------------------------------------- signing


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding of a payload."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(body), body)


def b64decode(text: str) -> bytes:
    """Decode standard or URL-safe base64, padded or not; reject anything else."""
    if not isinstance(text, str):
        raise ValueError("base64 field is not a string")
    data = text.strip().replace("-", "+").replace("_", "/")
    data += "=" * (-len(data) % 4)
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"invalid base64: {exc}") from exc


def raw_public_key(key: ed25519.Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of an Ed25519 public key."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keyid(key: ed25519.Ed25519PublicKey) -> str:
    """Key id: hex sha256 of the raw public key."""
    return hashlib.sha256(raw_public_key(key)).hexdigest()


def public_pem(key: ed25519.Ed25519PublicKey) -> str:
    """SubjectPublicKeyInfo PEM of a public key."""
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")


def load_public_key(pem: bytes) -> ed25519.Ed25519PublicKey:
    """An Ed25519 public key from PEM; anything else is an ``EvidenceError``."""
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise EvidenceError(f"not a PEM public key: {exc}") from exc
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise EvidenceError("the public key is not Ed25519")
    return key


@dataclass(frozen=True)
class Signer:
    """An Ed25519 key and where it came from (``key_file`` or ``ephemeral``)."""

    key: ed25519.Ed25519PrivateKey
    source: str

    @property
    def keyid(self) -> str:
        """Hex sha256 of the raw public key."""
        return keyid(self.key.public_key())

    def describe(self) -> dict[str, str]:
        """The ``signing`` section of a report."""
        return {
            "algorithm": "ed25519",
            "key_source": self.source,
            "keyid": self.keyid,
            "public_key": public_pem(self.key.public_key()),
        }


def load_signer(environ: Mapping[str, str] | None = None) -> Signer:
    """The publication key named by ``LAB_EVIDENCE_KEY``, else a fresh ephemeral key."""
    env = os.environ if environ is None else environ
    path = env.get(KEY_ENV)
    if not path:
        return Signer(ed25519.Ed25519PrivateKey.generate(), "ephemeral")
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise EvidenceError(f"{KEY_ENV} does not name a readable PEM private key: {exc}") from exc
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise EvidenceError(f"{KEY_ENV} is not an Ed25519 private key")
    return Signer(key, "key_file")


def statement(report_bytes: bytes, report: Mapping[str, Any]) -> dict[str, Any]:
    """The in-toto Statement: subjects are the sources and ``runtime.json``."""
    subjects = [
        {"name": name, "digest": {"sha256": digest}}
        for name, digest in sorted(report["sources"].items())
    ]
    subjects.append(
        {"name": REPORT_FILE, "digest": {"sha256": hashlib.sha256(report_bytes).hexdigest()}}
    )
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": PREDICATE_TYPE,
        "predicate": dict(report),
    }


def sign_envelope(
    payload: bytes, signer: Signer, payload_type: str = PAYLOAD_TYPE
) -> dict[str, Any]:
    """A DSSE envelope with one Ed25519 signature over ``PAE(type, payload)``."""
    signature = signer.key.sign(pae(payload_type, payload))
    return {
        "payloadType": payload_type,
        "payload": base64.b64encode(payload).decode("ascii"),
        "signatures": [{"keyid": signer.keyid, "sig": base64.b64encode(signature).decode("ascii")}],
    }


def dumps_report(report: Mapping[str, Any]) -> bytes:
    """The canonical bytes of ``runtime.json``."""
    return (json.dumps(report, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


def write(
    directory: Path,
    facts: RunFacts,
    *,
    root: Path,
    signer: Signer,
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
    (directory / TESTS_FILE).write_text(
        "".join(json.dumps(line, sort_keys=True, default=str) + "\n" for line in lines),
        encoding="utf-8",
    )
    report_bytes = dumps_report(report)
    (directory / REPORT_FILE).write_bytes(report_bytes)
    payload = json.dumps(
        statement(report_bytes, report), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()
    envelope = sign_envelope(payload, signer)
    (directory / ENVELOPE_FILE).write_text(json.dumps(envelope, indent=2) + "\n", encoding="utf-8")
    (directory / PUBLIC_KEY_FILE).write_text(signing["public_key"], encoding="ascii")
    return report


# --------------------------------------------------------------------------- verification


@dataclass
class Verdict:
    """The outcome of verifying evidence: ok only when ``problems`` is empty."""

    envelope: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    report: dict[str, Any] | None = None
    signer_keyid: str | None = None

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.problems


def locate(path: Path) -> tuple[Path, Path]:
    """``(envelope, runtime.json)`` for an evidence directory or an envelope file."""
    if path.is_dir():
        return path / ENVELOPE_FILE, path / REPORT_FILE
    return path, path.parent / REPORT_FILE


def verify(
    path: Path,
    *,
    public_key: ed25519.Ed25519PublicKey | None = None,
    check_sources: bool = False,
    root: Path | None = None,
) -> Verdict:
    """Check an evidence envelope offline and name every failure.

    Checks the payload type, the Ed25519 signature (against ``public_key`` when
    pinned, else the key the evidence carries), the statement and its subjects,
    ``runtime.json`` on disk, the gate fields, and with ``check_sources`` the
    subjects against the files under ``root`` (default: the working directory).
    """
    envelope_path, report_path = locate(path)
    verdict = Verdict(envelope_path)
    problems = verdict.problems
    try:
        envelope = json.loads(envelope_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        problems.append(f"envelope: cannot read {envelope_path}: {exc}")
        return verdict
    if not isinstance(envelope, dict):
        problems.append("envelope: not a JSON object")
        return verdict
    payload_type = envelope.get("payloadType")
    if payload_type != PAYLOAD_TYPE:
        problems.append(f"payload type: {payload_type!r} is not {PAYLOAD_TYPE!r}")
    try:
        payload = b64decode(envelope.get("payload"))  # type: ignore[arg-type]
    except ValueError as exc:
        problems.append(f"payload: {exc}")
        return verdict
    parsed: Any = None
    try:
        parsed = json.loads(payload)
    except ValueError as exc:
        problems.append(f"payload: not JSON ({exc})")
    predicate = parsed.get("predicate") if isinstance(parsed, dict) else None
    signing = predicate.get("signing") if isinstance(predicate, dict) else None

    key = public_key
    if key is None:
        embedded = signing.get("public_key") if isinstance(signing, dict) else None
        if not isinstance(embedded, str):
            problems.append("signature: no public key pinned and none in the evidence")
            return verdict
        try:
            key = load_public_key(embedded.encode())
        except EvidenceError as exc:
            problems.append(f"signature: {exc}")
            return verdict
        verdict.notes.append(
            "verified with the public key the evidence carries: this proves integrity, "
            "not identity; pin the signer with --public-key"
        )
    verdict.signer_keyid = keyid(key)
    try:
        _check_signature(envelope, payload, key)
    except EvidenceError as exc:
        problems.append(str(exc))
    if isinstance(signing, dict) and signing.get("key_source") == "ephemeral":
        verdict.notes.append(
            "signed with an EPHEMERAL key: not a publication signature "
            f"(set {KEY_ENV} to sign with a known key)"
        )
    if not isinstance(parsed, dict):
        return verdict
    sources = _check_statement(parsed, report_path, problems)
    if isinstance(predicate, dict):
        verdict.report = predicate
        _check_gate(predicate, problems)
    if check_sources:
        _check_sources(sources, root or Path.cwd(), problems)
    return verdict


def _check_signature(
    envelope: Mapping[str, Any], payload: bytes, key: ed25519.Ed25519PublicKey
) -> None:
    """Return if one of the envelope's signatures is ``key``'s over ``payload``.

    Standard and URL-safe base64 are both accepted. Raises ``EvidenceError`` naming
    the cause: no signature, undecodable fields, a different signer, or a signature
    that does not cover this payload and payload type.
    """
    signatures = envelope.get("signatures")
    if not isinstance(signatures, list) or not signatures:
        raise EvidenceError("signature: the envelope carries no signatures")
    payload_type = envelope.get("payloadType")
    if not isinstance(payload_type, str):
        raise EvidenceError("payload type: missing")
    message = pae(payload_type, payload)
    for item in signatures:
        try:
            key.verify(b64decode(item.get("sig")), message)
        except (InvalidSignature, ValueError, AttributeError):
            continue
        return
    # keyid is an unauthenticated hint: it only sharpens the message.
    ids = sorted({str(i["keyid"]) for i in signatures if isinstance(i, dict) and i.get("keyid")})
    if ids and keyid(key) not in ids:
        raise EvidenceError(
            f"signature: signed by key {', '.join(ids)}, not by the expected key {keyid(key)}"
        )
    raise EvidenceError(
        "signature: does not verify over the payload (altered payload or signature)"
    )


def _check_statement(
    statement_: Mapping[str, Any], report_path: Path, problems: list[str]
) -> dict[str, str]:
    """Check the statement against ``runtime.json``; return the source subjects it signs."""
    if statement_.get("_type") != STATEMENT_TYPE:
        problems.append(f"statement: _type {statement_.get('_type')!r} is not {STATEMENT_TYPE!r}")
    if statement_.get("predicateType") != PREDICATE_TYPE:
        problems.append(f"statement: predicateType {statement_.get('predicateType')!r} unknown")
    subjects = _subjects(statement_, problems)
    predicate = statement_.get("predicate")
    if REPORT_FILE not in subjects:
        problems.append(f"subjects: {REPORT_FILE} is not a subject")
    elif not report_path.is_file():
        problems.append(f"{REPORT_FILE}: missing next to the envelope ({report_path})")
    else:
        data = report_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != subjects[REPORT_FILE]:
            problems.append(f"{REPORT_FILE}: its sha256 does not match the signed subject")
        else:
            try:
                if json.loads(data) != predicate:
                    problems.append(f"{REPORT_FILE}: differs from the signed predicate")
            except ValueError:
                problems.append(f"{REPORT_FILE}: not JSON")
    sources = predicate.get("sources") if isinstance(predicate, dict) else None
    declared = {k: v for k, v in subjects.items() if k != REPORT_FILE}
    if sources != declared:
        problems.append("subjects: the source subjects differ from the report's sources")
    return declared


def _subjects(statement_: Mapping[str, Any], problems: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    items = statement_.get("subject")
    if not isinstance(items, list) or not items:
        problems.append("statement: no subjects")
        return found
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        digest = item.get("digest") if isinstance(item, dict) else None
        sha = digest.get("sha256") if isinstance(digest, dict) else None
        if not isinstance(name, str) or not isinstance(sha, str) or name in found:
            problems.append(f"statement: malformed or duplicate subject {item!r}")
            continue
        found[name] = sha
    return found


def _check_gate(report: Mapping[str, Any], problems: list[str]) -> None:
    if report.get("schema_version") != SCHEMA_VERSION:
        problems.append(f"report: schema_version {report.get('schema_version')!r} unsupported")
    if report.get("status") != PASS:
        problems.append(f"gate: status is {report.get('status')}, not PASS")
    if report.get("missing"):
        problems.append(f"gate: missing experiments: {', '.join(report['missing'])}")
    if report.get("skips"):
        names = ", ".join(s.get("nodeid", "?") for s in report["skips"])
        problems.append(f"gate: skipped or xfailed: {names}")
    if not report.get("postgresql"):
        problems.append("gate: no real PostgreSQL database was reached")


def _check_sources(sources: Mapping[str, str], root: Path, problems: list[str]) -> None:
    for name, digest in sorted(sources.items()):
        path = root / name
        if not path.is_file():
            problems.append(f"source {name}: missing from {root}")
        elif sha256_file(path) != digest:
            problems.append(f"source {name}: differs from the signed digest")
    for name in source_files(root):
        if name not in sources:
            problems.append(f"source {name}: present in {root} but not covered by the evidence")


# --------------------------------------------------------------------------- command


def cli_main(args: argparse.Namespace) -> int:
    """``lab evidence verify|show``: exit 0 only when the evidence verifies."""
    path = Path(args.path)
    if args.evidence_command == "show":
        from lab import runner

        _, report_path = locate(path)
        try:
            report = json.loads(report_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            print(f"cannot read {report_path}: {exc}")
            return 2
        runner.print_summary(report, report_path.parent)
        return 0 if report.get("status") == PASS else 1
    pinned: ed25519.Ed25519PublicKey | None = None
    if args.public_key:
        try:
            pinned = load_public_key(Path(args.public_key).read_bytes())
        except (OSError, EvidenceError) as exc:
            print(f"FAIL cannot use --public-key {args.public_key}: {exc}")
            return 2
    verdict = verify(path, public_key=pinned, check_sources=bool(args.check_sources))
    print(format_verdict(verdict))
    return 0 if verdict.ok else 1


def format_verdict(verdict: Verdict) -> str:
    """A short human verdict: one line, then each failure and note."""
    report = verdict.report or {}
    head = "OK" if verdict.ok else "FAIL"
    lines = [
        f"{head} {verdict.envelope}: status {report.get('status', '?')}, "
        f"commit {report.get('commit') or '?'}, signer {verdict.signer_keyid or '?'}"
    ]
    lines += [f"  failed: {p}" for p in verdict.problems]
    lines += [f"  note: {n}" for n in verdict.notes]
    return "\n".join(lines)

