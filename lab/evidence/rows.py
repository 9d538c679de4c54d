"""The report's rows, rebuilt from the signed test log: the verifier trusts no row it is given.

``tests.jsonl`` is pytest's own record of the run (every phase report, every failed
collection), signed beside the report. ``check`` reads it line by line (each line a
JSON object of a known type; each test record with a node id), folds it the way the
producer does (``testlog.test_rows``, ``experiment_rows``, ``observation_rows``,
``skip_rows``, ``collection_error_rows``) and requires every section of the report
built from it to be exactly the rebuilt one: a row the log does not hold, a row
missing, renamed or listed twice, an experiment row that leaves out one of its results
or counts one twice, a changed outcome: each is named, and the gate is then
recomputed from rows that are the log's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lab import files
from lab.errors import InputError
from lab.evidence import compiler, testlog

# The record types the recorder writes into tests.jsonl, and nothing else.
SESSION_START, SESSION_FINISH = "SessionStart", "SessionFinish"
TEST_REPORT, COLLECT_REPORT = "TestReport", "CollectReport"
_SHOWN = 5


def records(data: bytes, problems: list[str]) -> list[Mapping[str, Any]] | None:
    """The test and collection records of a signed ``tests.jsonl``, each checked for its
    shape; None (with the problems named) when the log cannot be read as one."""
    name = compiler.TESTS_FILE
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        problems.append(f"{name}: not UTF-8")
        return None
    found: list[Mapping[str, Any]] = []
    kinds: list[str] = []
    for number, line in enumerate(lines, 1):
        try:
            record = files.parse_json(line.encode(), f"{name} line {number}")
        except InputError as exc:
            problems.append(str(exc))
            return None
        if not isinstance(record, Mapping):
            problems.append(f"{name} line {number}: not a JSON object")
            return None
        kind = record.get("$report_type")
        kinds.append(str(kind))
        if kind in (SESSION_START, SESSION_FINISH):
            continue
        if kind not in (TEST_REPORT, COLLECT_REPORT):
            problems.append(f"{name} line {number}: unknown record type {kind!r}")
            return None
        nodeid = record.get("nodeid")
        if not isinstance(nodeid, str) or (kind == TEST_REPORT and not nodeid):
            problems.append(f"{name} line {number}: a {kind} without a node id")
            return None
        # xdist's report for a crashed worker's running test has a phase of its own; it
        # folds to failed, so it is kept: only a test record with no phase at all is named.
        if kind == TEST_REPORT and not isinstance(record.get("when"), str):
            problems.append(f"{name} line {number}: a test record without a phase")
            return None
        found.append(record)
    if kinds and (kinds.count(SESSION_START) > 1 or kinds.count(SESSION_FINISH) > 1
                  or (SESSION_START in kinds and kinds[0] != SESSION_START)
                  or (SESSION_FINISH in kinds and kinds[-1] != SESSION_FINISH)):
        problems.append(f"{name}: its session records are not one start first and one "
                        "finish last")
    return found


def _expected(predicate: Mapping[str, Any]) -> list[testlog.Expected]:
    return [testlog.Expected(str(e["chapter"]), str(e["name"]), int(e["results"]),
                              e["database"])
            for e in predicate["expected"]]


def _duplicates(nodeids: Sequence[str]) -> list[str]:
    seen: set[str] = set()
    twice: list[str] = []
    for nodeid in nodeids:
        if nodeid in seen and nodeid not in twice:
            twice.append(nodeid)
        seen.add(nodeid)
    return twice


def _compare_tests(rebuilt: Sequence[Mapping[str, Any]], given: Sequence[Any],
                   problems: list[str]) -> None:
    """Name how the report's ``tests`` differ from the rebuilt rows."""
    log = compiler.TESTS_FILE
    nodeids = [str(t.get("nodeid")) if isinstance(t, Mapping) else repr(t) for t in given]
    for nodeid in _duplicates(nodeids)[:_SHOWN]:
        problems.append(f"tests: {nodeid} has more than one row")
    recorded = {n: t for n, t in zip(nodeids, given, strict=True)}
    for row in rebuilt:
        kept = recorded.pop(row["nodeid"], None)
        if kept is None:
            problems.append(f"tests: {row['nodeid']} is in {log} but not among the report's "
                            "rows")
        elif kept.get("outcome") != row["outcome"]:
            problems.append(f"tests: {row['nodeid']} is {kept.get('outcome')!r} in the report "
                            f"but {row['outcome']} in the signed {log}")
        elif dict(kept) != row:
            problems.append(f"tests: the row of {row['nodeid']} is not what {log} folds to")
    for nodeid in sorted(recorded)[:_SHOWN]:
        problems.append(f"tests: {nodeid} has a row but no record in {log}")
    if not problems and list(given) != list(rebuilt):
        problems.append(f"tests: the rows are not in the order {log} folds them to")


def check(data: bytes, predicate: Any, problems: list[str]) -> None:
    """Every row section of the report must be exactly what the signed ``tests.jsonl``
    (``data``) folds to; each difference is appended to ``problems``."""
    if not isinstance(predicate, Mapping) or not isinstance(predicate.get("tests"), list):
        return  # the schema check names it
    found = records(data, problems)
    if found is None:
        return
    prefix = predicate.get("experiments_dir")
    try:
        tests = testlog.test_rows(found, prefix if isinstance(prefix, str) else "")
        sections: dict[str, Any] = {
            "experiments": testlog.experiment_rows(_expected(predicate), tests),
            "observations": testlog.observation_rows(tests),
            "skips": testlog.skip_rows(tests),
            "collection_errors": testlog.collection_error_rows(found),
        }
    except (TypeError, ValueError, AttributeError, KeyError):
        problems.append(f"{compiler.TESTS_FILE}: its records cannot be folded into rows")
        return
    mine: list[str] = []
    _compare_tests(tests, predicate["tests"], mine)
    for name, rebuilt in sections.items():
        if predicate.get(name) != rebuilt:
            mine.append(f"{name}: the report's rows are not what the signed "
                        f"{compiler.TESTS_FILE} folds to")
    problems += mine
