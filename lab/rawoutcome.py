"""Each phase's raw outcome, noted where it is first seen and checked against its report.

A phase's report (setup, call, teardown) is built after the phase ran, and anything
between the test body and the report can rewrite it: a hook (``recorder.REPORT_HOOKS``
names those, and the gate refuses a tree's own) or code that patches pytest's internals
at import time, which implements no hook at all. So the lab notes the outcome where it
is first seen: ``RawOutcomes`` wraps ``pytest_runtest_setup``, ``_call`` and
``_teardown`` with ``trylast`` wrappers, which pluggy calls innermost (closest to the
body), and notes whether the phase raised a skip, raised anything else or returned.
Its innermost ``pytest_runtest_makereport`` wrapper puts that into the phase's report
as the property ``lab_raw_outcome``, so it travels with the report through xdist to
the controller and into the signed ``tests.jsonl``.

The collector compares each phase report's outcome to it (``problems``): a report whose
outcome is not the raw one (a forged pass, and an xfail too, which pytest's skipping
plugin turns from failed into skipped) or that carries no raw outcome fails the gate.
"""

from __future__ import annotations

import contextlib
import unittest
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

import pytest

from lab.evidence import testlog

PLUGIN = "lab-raw-outcomes"
# The test property each phase report carries: that phase's raw outcome.
RAW_OUTCOME = "lab_raw_outcome"
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
PHASES = ("setup", "call", "teardown")

_noted = pytest.StashKey[dict[str, str]]()


@contextlib.contextmanager
def noting(item: pytest.Item, phase: str) -> Iterator[None]:
    """Note the raw outcome of ``phase`` of ``item``: what the block inside did.

    A skip (``pytest.skip``, a skip mark, ``unittest.SkipTest``: what pytest's report
    builder counts as one) is skipped; any other exception, ``pytest.fail`` and
    ``pytest.xfail`` among them, is failed; a return is passed. The exception is always
    re-raised: noting changes nothing of what pytest sees.
    """
    outcome = FAILED
    try:
        yield
        outcome = PASSED
    except (pytest.skip.Exception, unittest.SkipTest):
        outcome = SKIPPED
        raise
    finally:
        item.stash.setdefault(_noted, {})[phase] = outcome


class RawOutcomes:
    """The innermost wrappers: note each phase's raw outcome, put it into its report."""

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        """Note the setup phase's raw outcome."""
        with noting(item, "setup"):
            return (yield)

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        """Note the call phase's raw outcome."""
        with noting(item, "call"):
            return (yield)

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        """Note the teardown phase's raw outcome."""
        with noting(item, "teardown"):
            return (yield)

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """Carry the phase's raw outcome in its report (only in the report: pytest copies
        ``item.user_properties`` into each report, so the item keeps none of them)."""
        report = yield
        # Taken, not read: a phase run again (a rerun plugin) is noted again or has none.
        raw = item.stash.get(_noted, {}).pop(call.when, None)
        if raw is not None:
            report.user_properties.append((RAW_OUTCOME, raw))
        return report


def register(config: pytest.Config) -> None:
    """Register the wrappers in this process (each xdist worker runs its own tests).

    Registered at configure time, after pytest's plugins and the lab's module: among
    ``trylast`` wrappers the last registered is the innermost.
    """
    if not config.pluginmanager.has_plugin(PLUGIN):
        config.pluginmanager.register(RawOutcomes(), PLUGIN)


def problems(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per test phase report whose outcome is not its raw outcome, or that has
    no single raw outcome: node id, phase, raw and reported outcome.

    xdist's report for a crashed worker's running test is no phase (its ``when`` is
    ``???``): it is built by the controller, folds to failed and fails the gate anyway.
    """
    found: list[str] = []
    for record in records:
        when = record.get("when")
        if record.get("$report_type", "TestReport") != "TestReport" or when not in PHASES:
            continue
        nodeid, reported = record.get("nodeid"), record.get("outcome")
        raw = [value for key, value in testlog.properties(record) if key == RAW_OUTCOME]
        if not raw:
            found.append(f"{nodeid} {when}: no raw outcome was recorded, reported "
                         f"{reported}: the lab did not see the phase it reports")
        elif len(raw) > 1:
            found.append(f"{nodeid} {when}: {len(raw)} raw outcomes recorded "
                         f"({', '.join(map(str, raw))}), reported {reported}: something "
                         f"else wrote {RAW_OUTCOME}")
        elif raw[0] != reported:
            found.append(f"{nodeid} {when}: raw outcome {raw[0]}, reported {reported}: "
                         "something changed the report after the phase ran")
    return found
