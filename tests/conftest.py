"""The lab's own tests: their fixture plugins and hypothesis profiles.

The tests are laid out like ``lab/``: ``tests/runtime/`` tests ``lab.runtime``,
``tests/evidence/`` ``lab.evidence`` and so on; tests of the top-level modules (and of
the repository's layout as a whole) sit in ``tests/`` itself. What they share lives
in ``tests/support/``: plain modules imported as ``tests.support.<name>``, and the
fixture plugins below.

Hypothesis: ``ci`` (the default) is bounded and derandomized, so a run is
reproducible and the whole fuzz suite stays well under a minute on two cores.
``long`` is for a deliberate soak:
``HYPOTHESIS_PROFILE=long pytest tests/runtime/test_admission_fuzz.py``. Neither keeps
an example database, so nothing is written into the tree.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Fixture plugins: ``make_key`` (a fresh Ed25519 key pair as the PEM files the lab reads).
pytest_plugins = ["tests.support.keys"]

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long", parent=settings.get_profile("ci"), max_examples=10_000, derandomize=False
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# --------------------------------------------------------------------------- markers

TESTS = Path(__file__).resolve().parent

# Fixtures that provision or reach a PostgreSQL server (lab.pytest_plugin's lab_dsn, on
# which lab_schema, lab_store and lab build; the repository conftest's servers of a
# module's own). item.fixturenames is the closure, so a fixture built on them counts.
POSTGRES_FIXTURES = frozenset({"lab_dsn", "killable_postgres", "faulty_server",
                               "beyond_one_host"})
# Tests that drive Chromium: a whole file, or one test ("dir/test_x.py::name").
BROWSER = frozenset({
    "book/test_book_browser.py",
    "book/test_book_layout.py::test_the_layout_checks_pass_a_good_page_and_fail_a_bad_one",
})
MODEL_DIRECTORIES = frozenset({"model"})
# Measured at 20 s or more (pytest -n 2 --durations on two busy cores, load 5 to 7, see
# docs/development.md): a whole file ("dir/test_x.py", most of its tests run a lab of
# their own) or one test function with all its parameters ("dir/test_x.py::name").
SLOW = frozenset({
    "evidence/test_gate.py",  # inner lab runs through pytester: 23 tests over 20 s
    "test_authoring.py",  # a chapter written from the guide, run and gated for real
    "test_nothing_left.py",  # chapter 11 runs interrupted and killed mid-chaos
    "test_reproduction.py",  # genuine runs and their reproductions
    "test_leaks.py",  # a real failing `lab run`
    "pg/test_container_provider.py::"
    "test_a_parallel_run_shares_one_container_and_records_it_in_the_evidence",
    "evidence/test_manifest.py::test_sync_then_check_on_a_new_chapter_without_a_database",
    "evidence/test_publication.py::test_a_venv_is_judged_by_the_locks_wheels_not_by_its_record",
    "test_runner.py::test_chapter_run_warns_it_is_partial_and_unknown_chapters_stop",
    "runtime/test_store_stateful.py::test_store_state_machine_keeps_every_invariant",
    "faults/test_traffic.py::test_a_soak_strikes_every_fault_while_work_is_in_flight",
    # A chaos round on four lab hosts: failovers and every fault between hosts (~60 s).
    "faults/test_chaos_hosts.py::"
    "test_a_small_round_on_four_hosts_fails_over_strikes_every_kind_and_loses_nothing",
})
# Module fixtures whose setup alone takes the time, by directory: tests/book's ``tree``
# runs a small experiment tree for real three times (50 to 60 s, once per module).
SLOW_FIXTURES = {"book": frozenset({"tree"})}


def _marks(relative: str, name: str, fixturenames: list[str]) -> list[str]:
    """The markers of the test ``name`` in ``relative`` (a path under tests/)."""
    directory = relative.split("/", 1)[0]
    marks = []
    if POSTGRES_FIXTURES.intersection(fixturenames):
        marks.append("postgres")
    if relative in BROWSER or f"{relative}::{name}" in BROWSER:
        marks.append("browser")
    if directory in MODEL_DIRECTORIES:
        marks.append("model")
    if (relative in SLOW or f"{relative}::{name}" in SLOW
            or SLOW_FIXTURES.get(directory, frozenset()).intersection(fixturenames)):
        marks.append("slow")
    return marks


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the lab's own tests (pytest calls this with every item, experiments' too)."""
    for item in items:
        try:
            relative = item.path.resolve().relative_to(TESTS).as_posix()
        except ValueError:
            continue
        name = getattr(item, "originalname", item.name)
        for mark in _marks(relative, name, getattr(item, "fixturenames", [])):
            item.add_marker(mark)
