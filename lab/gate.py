"""The gate: the verdict of a run, decided from the report's own rows.

``decide`` is pure and reads only what the signed report records (test outcomes,
experiment rows, collection errors, unreported tests, problems the plugin found,
the narrowing of the selection and the database reached), so the producer that
writes the verdict and the verifier that checks it compute it the same way: a
report whose ``status`` or ``gate.failures`` disagree with its rows is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PASS = "PASS"  # noqa: S105 - a verdict, not a password
FAIL = "FAIL"
PARTIAL = "PARTIAL"

# Outcomes of one test, folded from its setup, call and teardown reports.
PASSED = "passed"
FAILED = "failed"
ERROR = "error"
SKIPPED = "skipped"
XFAILED = "xfailed"
XPASSED = "xpassed"
NOT_RUN = "not run"  # setup and teardown passed but the body never ran (--setup-only)
MISSING = "missing"

# The worst outcome wins when one experiment has several results.
_SEVERITY = (FAILED, ERROR, NOT_RUN, XPASSED, XFAILED, SKIPPED)


@dataclass(frozen=True)
class Gate:
    """A verdict and every reason for it."""

    status: str
    failures: list[str]
    narrowed: list[str]
    missing: list[str]


def fold_outcomes(outcomes: Sequence[str]) -> str:
    """One experiment's outcome from its results' outcomes."""
    distinct = set(outcomes)
    if not distinct:
        return MISSING
    if distinct == {PASSED}:
        return PASSED
    return next((o for o in _SEVERITY if o in distinct), FAILED)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _mappings(value: Any) -> list[Mapping[str, Any]]:
    return [item for item in _list(value) if isinstance(item, Mapping)]


def decide(report: Mapping[str, Any]) -> Gate:
    """The gate's verdict from a report's recorded facts.

    PASS only when every declared experiment produced exactly its declared results,
    all passed against a real database, nothing was skipped, nothing failed outside
    the experiments either, no problem was recorded, and the selection was not narrowed.
    """
    gate = report.get("gate")
    narrowed = sorted(str(n) for n in _list(gate.get("narrowed") if isinstance(gate, Mapping)
                                            else None))
    failures = [str(p) for p in _list(report.get("problems"))]
    failures += [
        f"collection error in {c.get('nodeid')}: {c.get('message')}"
        for c in _mappings(report.get("collection_errors"))
    ]
    failures += [f"{nodeid} was collected but never reported"
                 for nodeid in _list(report.get("unreported"))]
    tests = {str(t.get("nodeid")): t for t in _mappings(report.get("tests"))}
    missing: list[str] = []
    shortfalls: list[str] = []
    for row in _mappings(report.get("experiments")):
        label = f"{row.get('chapter')}/{row.get('name')}"
        ran = [tests.get(str(nodeid), {}) for nodeid in _list(row.get("tests"))]
        expected = row.get("expected_results")
        if not row.get("declared"):
            failures.append(f"{label} ran but is not declared in the manifest")
        elif not ran:
            missing.append(label)
        elif isinstance(expected, int) and len(ran) < expected:
            shortfalls.append(f"{label} produced {len(ran)} of {expected} results")
        for test in ran:
            nodeid = test.get("nodeid", "?")
            if test.get("outcome") != PASSED:
                failures.append(f"{nodeid} {test.get('outcome')}")
            elif _needs_database(row, test) and test.get("database") is not True:
                failures.append(f"{nodeid} did not reach a real database")
    failures += [
        f"{t.get('nodeid')} {t.get('outcome')}"
        for t in tests.values()
        if t.get("experiment") is None and t.get("outcome") in (FAILED, ERROR, NOT_RUN)
    ]
    if not report.get("postgresql"):
        failures.append("no real PostgreSQL database was provisioned for the run")
    if not narrowed:
        # A narrowed selection explains absent results; it is reported as PARTIAL.
        failures += [f"{name} did not run" for name in missing]
        failures += shortfalls
    if failures:
        status = FAIL
    elif narrowed:
        status = PARTIAL
    else:
        status = PASS
    return Gate(status, failures, narrowed, sorted(missing))


def _needs_database(row: Mapping[str, Any], test: Mapping[str, Any]) -> bool:
    """The manifest's word when it gives one, else whether the test asked for the database."""
    declared = row.get("needs_database")
    if isinstance(declared, bool):
        return declared
    return test.get("needs_database") is True
