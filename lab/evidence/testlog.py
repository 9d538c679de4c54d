"""The test log folded into the report's rows: tests, experiments, observations, skips.

pytest's report-log records (``tests.jsonl``'s lines) are folded here the same way by
the producer (``compiler.compile_report``) and by the verifier (``rows.check``), which
rebuilds every row from the signed log instead of trusting the report's. Event histories
are sanitised on the way: ids aliased, texts cut, details kept only in a safe shape.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lab.evidence import gate, redaction

# Test properties the gate reads: a test that reached the run's database, and one that
# asked for it (lab.pytest_plugin and lab.recorder write them, via ``compiler``).
REACHED_DATABASE = "lab_database"
NEEDS_DATABASE = "lab_needs_database"

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


def properties(record: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """A record's ``user_properties`` as (name, value) pairs, malformed ones left out."""
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
        # Each phase's report copies the item's user_properties as they stand (plus that
        # phase's own raw outcome, lab.rawoutcome), so the longest list is the whole record.
        props = max((properties(r) for r in phases), key=len, default=[])
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
            "what": aliases(redaction.redact_text(str(item.get("what", ""))))[:_MAX_TEXT],
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
    return text if shape.fullmatch(text) else redaction.REDACTED


def _detail(value: Any, aliases: _Aliases) -> str:
    """``key=value`` tokens with identifier values; anything else is redacted."""
    tokens: list[str] = []
    for token in aliases(redaction.redact_text(str(value or ""))).split():
        match = _DETAIL_TOKEN.fullmatch(token)
        if match is None:
            tokens.append(redaction.REDACTED)
        elif redaction.is_secret_name(match.group("key")):
            tokens.append(f"{match.group('key')}={redaction.REDACTED}")
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
