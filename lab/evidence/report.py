"""The signed report (``runtime.json``), typed, and its check against the shipped schema.

``report.schema.json`` (package data) is the contract between the producer
(``evidence.compile_report``) and every reader (``verification``, ``summary``,
``book``). A reader calls ``validate`` before it reads a field: what comes back is
a ``Report`` whose declared fields have the declared types, so no reader meets a
string where it expects an object, or a test without a ``nodeid``.
The TypedDicts below mirror the schema's required fields; ``tests/evidence/test_evidence.py``
checks that the two do not drift apart.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any, Literal, NotRequired, TypedDict, cast

import jsonschema

from lab.errors import EvidenceError

SCHEMA_FILE = "report.schema.json"
_MAX_ERRORS = 3


class GateSection(TypedDict):
    """``gate``: why the verdict is what it is."""

    failures: list[str]
    narrowed: list[str]


class Database(TypedDict, total=False):
    """``postgresql``: the server the run reached, as its provider described it."""

    provider: str | None
    server_version: str | None
    details: dict[str, Any] | None


class Signing(TypedDict):
    """``signing``: the key that signed; ``key_source`` is the producer's word only."""

    algorithm: Literal["ed25519"]
    key_source: str
    keyid: str
    public_key: str


class ExpectedEntry(TypedDict):
    """One experiment the manifest declared when the run compiled its report."""

    chapter: str
    name: str
    results: int
    database: bool | None


class Skip(TypedDict, total=False):
    """A skipped or xfailed experiment result (``nodeid`` and ``outcome`` always present)."""

    nodeid: str
    outcome: str
    reason: str | None


class CollectionError(TypedDict, total=False):
    """A module that failed to collect (``nodeid`` always present)."""

    nodeid: str
    message: str | None


class Event(TypedDict):
    """One sanitised workflow event of an experiment's history."""

    t: float | None
    workflow: str
    kind: str
    fence: int | None
    detail: str


class Mark(TypedDict):
    """One mark of an experiment's process timeline."""

    t: float | None
    actor: str
    what: str


class _TestRequired(TypedDict):
    nodeid: str
    chapter: str | None
    experiment: str | None
    outcome: str
    duration: float
    claim: str | None
    database: bool
    needs_database: bool
    observations: list[Any]
    events: list[Event]
    timeline: list[Mark]
    trace_ids: list[str]


class Test(_TestRequired, total=False):
    """One pytest result, folded from its phases."""

    message: str | None
    # Per observation, each key's kind: "fact", "measurement" or "unclassified".
    observation_kinds: list[dict[str, str]]


class Experiment(TypedDict):
    """One experiment's row: declared ones in manifest order, then undeclared ones."""

    chapter: str
    name: str
    declared: bool
    expected_results: int | None
    results: int
    outcome: str
    duration: float
    claim: str | None
    needs_database: bool | None
    tests: list[str]


class Observation(TypedDict):
    """One observation an experiment recorded, with the result that recorded it."""

    nodeid: str
    observation: Any
    kinds: NotRequired[dict[str, str]]


class Report(TypedDict):
    """``runtime.json``, as the schema guarantees it after ``validate``."""

    schema_version: int
    status: Literal["PASS", "FAIL", "PARTIAL"]
    gate: GateSection
    missing: list[str]
    problems: list[str]
    unreported: list[str]
    timestamp_utc: str
    commit: str | None
    dirty: bool | None
    run_url: str | None
    command: list[str]
    exitstatus: int | None
    versions: dict[str, str | None]
    postgresql: Database | None
    signing: Signing
    experiments_dir: str
    expected: list[ExpectedEntry]
    skips: list[Skip]
    collection_errors: list[CollectionError]
    experiments: list[Experiment]
    tests: list[Test]
    observations: list[Observation]
    sources: dict[str, str]
    limits: list[str]


@functools.cache
def schema() -> dict[str, Any]:
    """The report's JSON Schema, as shipped with the package."""
    text = resources.files("lab.evidence").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema())
    cls.check_schema(schema())
    validator: jsonschema.protocols.Validator = cls(schema())
    return validator


def problems(data: Any) -> list[str]:
    """Every way ``data`` breaks the schema, each naming the field (empty when valid)."""
    found: list[str] = []
    errors = sorted(_validator().iter_errors(data), key=lambda e: list(e.absolute_path))
    for error in errors:
        where = "/".join(str(part) for part in error.absolute_path) or "(top level)"
        message = error.message if len(error.message) <= 200 else error.message[:199] + "…"
        found.append(f"{where}: {message}")
    return found


def validate(data: object, where: str = "report") -> Report:
    """``data`` as a ``Report`` when it matches the schema, else ``EvidenceError``.

    The message names ``where`` and the first few offending fields.
    """
    found = problems(data)
    if found:
        more = f" (and {len(found) - _MAX_ERRORS} more)" if len(found) > _MAX_ERRORS else ""
        raise EvidenceError(f"{where}: not a valid report: {'; '.join(found[:_MAX_ERRORS])}{more}")
    return cast(Report, data)
