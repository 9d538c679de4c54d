"""The lab's pytest plugin: PostgreSQL for the run, a schema per test, fixtures, observations.

Loaded through the ``pytest11`` entry point. One PostgreSQL server serves the
whole run: the controller (or the only process) provisions it at configure
time and hands the DSN to pytest-xdist workers through ``workerinput``. Each
test that needs the database gets its own schema, dropped afterwards. The
evidence (collection, report, signature, gate) lives in ``lab.recorder``.

Introspection (``--help``, ``--version``, ``--fixtures``, ``--fixtures-per-test``,
``--markers``, ``--collect-only``, ``--setup-plan``) starts no PostgreSQL, writes no
evidence and prints no gate. Every pytest process loads this module, so it imports
the database, HTTP and harness modules only inside the fixtures that use them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from lab import errors, names, protocol, recorder
from lab.runtime import egress

if TYPE_CHECKING:
    from lab import harness as lab_harness
    from lab.runtime import store

log = logging.getLogger("lab.plugin")

_RUNNING_KEY = pytest.StashKey[Any]()
_DSN_KEY = pytest.StashKey[str | None]()
_DATABASE_KEY = pytest.StashKey[dict[str, Any] | None]()
_PROBLEM_KEY = pytest.StashKey[str | None]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lab", "durable-agent lab")
    group.addoption(
        "--lab-postgres",
        choices=["auto", "dsn", "container", "embedded", "none"],
        default=None,
        help="how to provide PostgreSQL for the run (default: ini lab_postgres or auto)",
    )
    group.addoption("--lab-dsn", default=None, help="DSN of an existing loopback server")
    group.addoption(
        "--lab-allow-remote-dsn",
        action="store_true",
        help="accept a non-loopback DSN (a CI service database); off by default",
    )
    group.addoption(
        "--lab-keep-schemas",
        action="store_true",
        help="keep a failed test's schema for inspection instead of dropping it",
    )
    parser.addini("lab_postgres", "default for --lab-postgres", default="auto")
    recorder.addoption(parser)


# pytest's option destinations of the runs that only describe the suite.
_INTROSPECTION = {
    "help": "--help",
    "version": "--version",
    "showfixtures": "--fixtures",
    "show_fixtures_per_test": "--fixtures-per-test",
    "markers": "--markers",
    "collectonly": "--collect-only",
    "setupplan": "--setup-plan",
}


def introspection(config: pytest.Config) -> str | None:
    """The introspection option of this run (``--fixtures``, ...), or None for a real run."""
    for dest, flag in _INTROSPECTION.items():
        if getattr(config.option, dest, False):
            return flag
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "experiment: a chapter experiment of the book (added automatically)"
    )
    looking = introspection(config)
    if looking is not None and not hasattr(config, "workerinput"):
        # Describing the suite is not a run: no server, no evidence, no gate.
        config.stash[_DSN_KEY] = None
        config.stash[_DATABASE_KEY] = None
        config.stash[_PROBLEM_KEY] = f"{looking} starts no PostgreSQL"
        return
    egress.install()
    dsn: str | None = None
    database: dict[str, Any] | None = None
    problem: str | None = None
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        dsn = workerinput.get("lab_dsn")
        database = json.loads(workerinput.get("lab_database", "null"))
        problem = workerinput.get("lab_problem")
    else:
        mode = config.getoption("--lab-postgres") or config.getini("lab_postgres")
        if mode == "none":
            problem = "PostgreSQL disabled with --lab-postgres=none"
        else:
            from lab.pg import cluster

            try:
                running = cluster.start(
                    mode=mode,
                    dsn=config.getoption("--lab-dsn"),
                    allow_remote=config.getoption("--lab-allow-remote-dsn"),
                )
            except errors.LabError as exc:
                problem = str(exc)
            else:
                config.stash[_RUNNING_KEY] = running
                dsn = running.provisioned.dsn
                database = running.provisioned.describe()
                log.info("PostgreSQL for this run: %s", database)
    config.stash[_DSN_KEY] = dsn
    config.stash[_DATABASE_KEY] = database
    config.stash[_PROBLEM_KEY] = problem
    recorder.register(config, database)


def pytest_unconfigure(config: pytest.Config) -> None:
    running = config.stash.get(_RUNNING_KEY, None)
    if running is not None:
        running.stop()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Hand the run's PostgreSQL to each xdist worker (never a second server)."""
    config = node.config
    node.workerinput["lab_dsn"] = config.stash.get(_DSN_KEY, None)
    node.workerinput["lab_database"] = json.dumps(config.stash.get(_DATABASE_KEY, None))
    node.workerinput["lab_problem"] = config.stash.get(_PROBLEM_KEY, None)


def pytest_report_header(config: pytest.Config) -> str | None:
    database = config.stash.get(_DATABASE_KEY, None)
    if database is not None:
        details = database.get("details") or {}
        # Where the server came from, as the evidence records it (never the DSN itself).
        source = details.get("image_digest") or details.get("binaries") or details.get("host")
        return (
            f"lab: PostgreSQL {database.get('server_version')} "
            f"via {database.get('provider')}" + (f" ({source})" if source else "")
        )
    return f"lab: no PostgreSQL ({config.stash.get(_PROBLEM_KEY, None)})"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "experiments" in item.path.parts:
            item.add_marker(pytest.mark.experiment)


@pytest.fixture(scope="session")
def lab_dsn(pytestconfig: pytest.Config) -> str:
    """The DSN of the run's PostgreSQL server (fails the test if there is none)."""
    dsn = pytestconfig.stash.get(_DSN_KEY, None)
    if not dsn:
        problem = pytestconfig.stash.get(_PROBLEM_KEY, None)
        pytest.fail(f"no PostgreSQL for this run: {problem}", pytrace=False)
    return dsn


@pytest.fixture
def lab_schema(request: pytest.FixtureRequest, lab_dsn: str) -> Iterator[str]:
    """A fresh schema holding every table of the lab, dropped after the test."""
    from lab.runtime import store

    schema = names.new_id("t").lower()[:30]
    store.create_schema(lab_dsn, schema)
    reached_database(request.node)
    yield schema
    failed = getattr(request.node, "lab_failed", False)
    if failed and request.config.getoption("--lab-keep-schemas"):
        log.warning("kept schema %s of failed test %s", schema, request.node.nodeid)
        return
    store.drop_schema(lab_dsn, schema)


def reached_database(node: pytest.Item) -> None:
    """Record that ``node`` used the run's real database, as the gate requires of an
    experiment that needs one. ``lab_schema`` does it; a test that works on the database
    without that fixture (the chaos round makes its own schemas) calls it itself."""
    from lab.evidence import compiler

    node.user_properties.append((compiler.REACHED_DATABASE, True))


@pytest.fixture
def lab_store(lab_dsn: str, lab_schema: str) -> Iterator[store.Store]:
    """A ``Store`` on the test's own schema."""
    from lab.runtime import store

    db = store.Store.open(lab_dsn, lab_schema)
    yield db
    db.close()


@pytest.fixture
def lab(
    request: pytest.FixtureRequest, lab_dsn: str, lab_schema: str, lab_store: store.Store
) -> Iterator[lab_harness.Harness]:
    """Everything an experiment drives: tools, workers, OS processes, SQL helpers."""
    from lab import harness as lab_harness

    rig = lab_harness.Harness(lab_dsn, lab_schema, lab_store)
    try:
        yield rig
    finally:
        rig.close()
        try:
            history = rig.event_history()
            traces = rig.trace_ids()
        except errors.LabError:
            history, traces = [], []
        request.node.user_properties.append(("lab_events", history))
        request.node.user_properties.append(("lab_trace_ids", traces))
        request.node.user_properties.append(("lab_timeline", rig.timeline))



@pytest.fixture
def observe(request: pytest.FixtureRequest) -> Any:
    """Record what a test read back: ``observe({"state": "succeeded", "elapsed_s": 0.4})``.

    Each key is a fact or a measurement (``lab.evidence.observations``): by default by its
    name and value, or as declared with ``facts=("key", ...)`` / ``measurements=(...)``.
    """

    def record(
        value: dict[str, Any], *, facts: tuple[str, ...] = (), measurements: tuple[str, ...] = ()
    ) -> None:
        properties = recorder.observation_properties(
            value, facts=facts, measurements=measurements
        )
        print(f"{protocol.OBSERVATION} {json.dumps(properties[0][1], sort_keys=True)}")
        request.node.user_properties.extend(properties)

    return record


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed:
        item.lab_failed = True  # type: ignore[attr-defined]
    return report
