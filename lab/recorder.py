"""The pytest side of the evidence: annotate results, collect them, apply the gate.

Three parts, registered by the lab plugin's ``pytest_configure`` through
``register``:

* the annotator runs wherever tests run (a plain process or each xdist worker)
  and puts the test's claim, chapter and experiment name into the report's
  ``user_properties``, which xdist carries to the controller with the report;
* ``lab.rawoutcome`` notes each phase's raw outcome where it is first seen and
  carries it in the phase's report;
* the collector runs only where no ``workerinput`` exists (a plain process or the
  xdist controller): it keeps every report and, at session end, compiles, signs
  and writes the evidence and turns a gate verdict other than PASS into a
  non-zero exit status.

Results never rely on ``workeroutput``: a crashed worker loses it, while xdist
still turns the crashed worker's running test into a failed report. Only the list of
modules a worker loaded (its conftests and plugins) travels that way, and a worker
that sends none is recorded as a problem, so a crash cannot hide what ran.

Heavy modules (signing, report compilation) are imported inside the hooks that use
them: a pytest process that never writes evidence never pays for them.
"""

from __future__ import annotations

import inspect
import json
import os
import shlex
import sys
import sysconfig
from collections.abc import Generator, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lab import errors, rawoutcome
from lab.evidence import gate, hermetic, observations, provenance

ANNOTATOR = "lab-recorder-annotator"
COLLECTOR = "lab-recorder-collector"
DEFAULT_DIRECTORY = "evidence"
# Requesting this fixture (directly or through another) means the test needs PostgreSQL.
DATABASE_FIXTURE = "lab_dsn"
# The test property that says a test asked for the database (compiler.NEEDS_DATABASE).
NEEDS_DATABASE = "lab_needs_database"
# Where an xdist worker puts the modules it loaded, for the controller's provenance.
LOADED_KEY = "lab_loaded"
# Where an xdist worker puts every module it ran and the start-up hooks it saw.
RAN_KEY = "lab_ran"

# The test properties one ``observe`` call leaves: the values, then each key's kind.
OBSERVATION = "lab_observation"
OBSERVATION_KINDS = "lab_observation_kinds"

_annotated = pytest.StashKey[bool]()

# Hooks through which a plugin can change what a test's outcome looks like: run or skip
# its body, build, rewrite or report its phase reports. Only pytest, its installed
# plugins (each file vouched for by its distribution's RECORD) and the lab may implement
# them; a conftest or another module of the tree that does fails the gate (issue 42).
REPORT_HOOKS = (
    "pytest_runtest_protocol", "pytest_runtest_setup", "pytest_runtest_call",
    "pytest_runtest_teardown", "pytest_pyfunc_call", "pytest_runtest_makereport",
    "pytest_runtest_logreport", "pytest_report_teststatus", "pytest_report_to_serializable",
    "pytest_report_from_serializable", "pytest_make_collect_report", "pytest_collectreport",
)


def observation_properties(
    value: Mapping[str, Any],
    *,
    facts: Sequence[str] = (),
    measurements: Sequence[str] = (),
) -> list[tuple[str, Any]]:
    """The two test properties of one observation: its JSON values and their kinds.

    Classified here, when recorded (``lab.evidence.observations``); always appended
    together, so the report pairs the n-th observation with the n-th kinds.
    """
    loaded = json.loads(json.dumps(dict(value), sort_keys=True))
    kinds = observations.classify(loaded, facts=facts, measurements=measurements)
    return [(OBSERVATION, loaded), (OBSERVATION_KINDS, kinds)]


def addoption(parser: pytest.Parser) -> None:
    """Options of the evidence recorder; called from the plugin's ``pytest_addoption``."""
    group = parser.getgroup("lab-evidence", "signed evidence of experiment runs")
    group.addoption(
        "--lab-evidence",
        metavar="DIR",
        default=None,
        help="write signed evidence to DIR (default 'evidence' when experiments run); "
        "giving it always writes evidence and applies the gate",
    )
    group.addoption(
        "--lab-no-evidence",
        action="store_true",
        default=False,
        help="write no evidence and apply no gate",
    )
    group.addoption(
        "--lab-manifest",
        metavar="PATH",
        default=None,
        help="read the expected set from PATH instead of <rootdir>/experiments/manifest.json; "
        "such a run is never publishable (the gate fails, saying so)",
    )


def register(config: pytest.Config, database: Mapping[str, Any] | None) -> None:
    """Register the recorder for this process; ``database`` describes the PostgreSQL used.

    Called from the plugin's ``pytest_configure`` in every process; the collector
    and the gate are registered only outside xdist workers.
    """
    manager = config.pluginmanager
    experiments = experiments_path(config)
    rawoutcome.register(config)
    if not manager.has_plugin(ANNOTATOR):
        manager.register(Annotator(config, experiments), ANNOTATOR)
    if not hasattr(config, "workerinput") and not manager.has_plugin(COLLECTOR):
        manager.register(Collector(config, database), COLLECTOR)


def experiments_path(config: pytest.Config) -> Path:
    """The experiments directory: always ``<rootdir>/experiments``."""
    return config.rootpath / "experiments"


def manifest_path(config: pytest.Config) -> Path:
    """The manifest read: ``--lab-manifest`` (relative to the invocation dir) or the
    committed ``<rootdir>/experiments/manifest.json``. The report records which, and
    the gate accepts only the committed one."""
    given = config.getoption("lab_manifest", None)
    if given:
        return (config.invocation_params.dir / str(given)).resolve()
    return experiments_path(config) / "manifest.json"


def loaded_modules(config: pytest.Config) -> list[provenance.Loaded]:
    """The conftests and plugin modules registered in this process."""
    return provenance.loaded_plugins(config.pluginmanager.list_name_plugin())


def effective_arguments(config: pytest.Config) -> dict[str, Any]:
    """What pytest parsed: the command line, ``PYTEST_ADDOPTS`` and ini ``addopts``."""
    raw = os.environ.get("PYTEST_ADDOPTS", "")
    try:
        environment = shlex.split(raw)
    except ValueError:
        environment = [raw]
    ini = config.getini("addopts")
    return {
        "command_line": [str(a) for a in config.invocation_params.args],
        "environment": environment,
        "ini": [str(a) for a in ini] if isinstance(ini, list) else [],
    }


def _rewriter(config: pytest.Config) -> Any:
    """What pytest's assertion rewriter makes of a file, to check its cached pyc with."""
    from _pytest.assertion import rewrite

    def rewritten(path: Path) -> Any:
        return rewrite._rewrite_test(path, config)[1]

    return rewritten


def report_hook_owners(config: pytest.Config) -> list[dict[str, str]]:
    """Each implementation of a ``REPORT_HOOKS`` hook by a module of the tree other than
    the lab's own (a conftest, a ``pytest_plugins`` module): hook, plugin and file."""
    root = config.rootpath.resolve()
    installed = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"],
                                             sysconfig.get_paths()["platlib"])}
    found: list[dict[str, str]] = []
    for name in REPORT_HOOKS:
        caller = getattr(config.hook, name, None)
        for impl in caller.get_hookimpls() if caller is not None else ():
            module = impl.plugin if isinstance(impl.plugin, ModuleType) else \
                sys.modules.get(type(impl.plugin).__module__)
            file = getattr(module, "__file__", None)
            if not isinstance(file, str):
                continue
            path = Path(file).resolve()
            if (not path.is_relative_to(root) or path.is_relative_to(root / "lab")
                    or any(path.is_relative_to(site) for site in installed)):
                continue
            found.append({"hook": name, "plugin": impl.plugin_name,
                          "file": path.relative_to(root).as_posix()})
    return found


def ran_here(config: pytest.Config) -> dict[str, Any]:
    """Every module this process ran, the start-up hooks of its interpreter and the
    tree's modules that implement a hook which can change a test's outcome."""
    return {
        "modules": provenance.ran_modules(_rewriter(config)),
        "hooks": provenance.startup_hooks(),
        "report_hooks": report_hook_owners(config),
    }


def observe_run(config: pytest.Config) -> dict[str, Any]:
    """The report's ``run`` section, observed at configure time, before any test ran:
    the environment's names, the interpreter's isolation, the checkout's stray files
    (looked for only when the run asks to be hermetic) and the lock's digest."""
    requested = os.environ.get(hermetic.REQUEST_ENV) == "1"
    root = config.rootpath
    return hermetic.observe(
        os.environ,
        no_user_site=bool(sys.flags.no_user_site),
        safe_path=bool(sys.flags.safe_path),
        pycache_prefix=sys.pycache_prefix,
        ignored=provenance.stray_files(root) if requested else None,
        lock=provenance.lock_digest(root, os.environ.get(hermetic.LOCK_ENV)),
    )


def claim_of(obj: object) -> str | None:
    """The first paragraph of a test function's docstring, on one line."""
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(paragraph.split())


class Annotator:
    """Adds the claim, chapter, experiment name and database need to each test's reports."""

    def __init__(self, config: pytest.Config, experiments: Path) -> None:
        self.config = config
        self.experiments = experiments

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """An xdist worker tells the controller which conftests and plugins it loaded
        (the controller collects nothing, so it never imports most conftests)."""
        output = getattr(self.config, "workeroutput", None)
        if output is not None:
            output[LOADED_KEY] = json.dumps([m.to_json() for m in loaded_modules(self.config)])
            output[RAN_KEY] = json.dumps(ran_here(self.config))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        # Added before the setup report is built, so every phase's report carries them
        # (pytest copies item.user_properties into each report).
        if not item.stash.get(_annotated, False):
            item.stash[_annotated] = True
            item.user_properties.extend(self._properties(item))
        report = yield
        return report

    def _properties(self, item: pytest.Item) -> list[tuple[str, object]]:
        props: list[tuple[str, object]] = []
        claim = claim_of(getattr(item, "obj", None))
        if claim:
            props.append(("lab_claim", claim))
        if DATABASE_FIXTURE in getattr(item, "fixturenames", ()):
            # The gate then requires the test to have reached the database too.
            props.append((NEEDS_DATABASE, True))
        try:
            parts = item.path.resolve().relative_to(self.experiments.resolve()).parts
        except ValueError:
            return props
        if len(parts) >= 2:
            props.append(("lab_chapter", parts[0]))
            props.append(("lab_experiment", getattr(item, "originalname", item.name)))
        return props


class Collector:
    """Controller-side: keeps every report and applies the gate at session end."""

    def __init__(self, config: pytest.Config, database: Mapping[str, Any] | None) -> None:
        self.config = config
        self.database = database
        self.manifest = manifest_path(config)
        self.prefix = _prefix(config.rootpath, experiments_path(config))
        self.worker_loaded: list[provenance.Loaded] = []
        self.worker_ran: list[dict[str, Any]] = []
        self.worker_hooks: list[dict[str, Any]] = []
        self.worker_report_hooks: list[dict[str, Any]] = []
        self.run = observe_run(config)
        self.worker_problems: list[str] = []
        self.records: list[dict[str, Any]] = []
        self.collected: set[str] = set()
        self.deselected: list[str] = []
        self.report: dict[str, Any] | None = None
        self.directory: Path | None = None

    # ------------------------------------------------------------------ collection

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: Sequence[str]) -> None:
        """Under xdist the controller collects nothing: workers tell what they collected."""
        self.collected.update(ids)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        """A worker's loaded modules; a worker that sent none cannot vouch for its code."""
        output = getattr(node, "workeroutput", None) or {}
        text = output.get(LOADED_KEY)
        worker = getattr(getattr(node, "gateway", None), "id", "?")
        try:
            items = json.loads(text) if isinstance(text, str) else None
        except ValueError:
            items = None
        if not isinstance(items, list):
            self.worker_problems.append(
                f"xdist worker {worker} did not report the conftests and plugins it loaded"
            )
            return
        self.worker_loaded += [provenance.Loaded.from_json(i) for i in items if isinstance(i, dict)]
        try:
            ran = json.loads(output.get(RAN_KEY) or "null")
        except ValueError:
            ran = None
        if not isinstance(ran, dict) or not isinstance(ran.get("modules"), list):
            self.worker_problems.append(f"xdist worker {worker} did not report the modules it ran")
            return
        self.worker_ran += [m for m in ran["modules"] if isinstance(m, dict)]
        self.worker_hooks += [h for h in ran.get("hooks") or [] if isinstance(h, dict)]
        self.worker_report_hooks += [h for h in ran.get("report_hooks") or []
                                     if isinstance(h, dict)]

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """In a single process, the items that will run."""
        self.collected.update(item.nodeid for item in session.items)

    def pytest_deselected(self, items: Sequence[pytest.Item]) -> None:
        """Deselection narrows the run (seen only where collection happens)."""
        self.deselected.extend(item.nodeid for item in items)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """A module that cannot be collected is a failure, not a silent absence."""
        if report.failed:
            self.records.append(serialize(self.config, report))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Every phase report, including xdist's failed report for a crashed worker."""
        self.records.append(serialize(self.config, report))

    # ------------------------------------------------------------------ the gate

    def wanted(self) -> bool:
        """Evidence is written for experiment runs or when asked for; never for unit tests only."""
        if self.config.getoption("lab_no_evidence", False) or self.config.option.collectonly:
            return False
        if self.config.getoption("lab_evidence", None):
            return True
        seen = [*self.collected, *self.deselected, *(r["nodeid"] for r in self.records)]
        return any(nodeid.startswith(self.prefix) for nodeid in seen)

    def narrowed(self) -> list[str]:
        """Why the selection is narrower than every experiment, if it is."""
        option = self.config.option
        reasons: list[str] = []
        # Every way of running less, wherever it was given (command line, PYTEST_ADDOPTS
        # or ini addopts all end up in config.option).
        for name in ("ignore", "ignore_glob"):
            for pattern in getattr(option, name, None) or []:
                reasons.append(f"--{name.replace('_', '-')} {pattern}")
        for name, flag in (("lf", "--lf"), ("failedfirst", "--ff"), ("stepwise", "--sw"),
                           ("stepwise_skip", "--sw-skip")):
            if getattr(option, name, False):
                reasons.append(flag)
        if getattr(option, "keyword", ""):
            reasons.append(f"-k {option.keyword}")
        if getattr(option, "markexpr", ""):
            reasons.append(f"-m {option.markexpr}")
        if getattr(option, "deselect", None):
            reasons.append("--deselect " + " ".join(option.deselect))
        experiments = experiments_path(self.config).resolve()
        for arg in self.config.args:
            path_part, sep, _ = arg.partition("::")
            path = (self.config.invocation_params.dir / path_part).resolve()
            inside = path != experiments and path.is_relative_to(experiments)
            if sep and (inside or path == experiments):
                reasons.append(f"node id {arg}")
            elif inside:
                reasons.append(f"path {arg}")
        dropped = sorted(n for n in self.deselected if n.startswith(self.prefix))
        if dropped and not reasons:
            reasons.append(f"{len(dropped)} experiment results deselected")
        return reasons

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """Compile and sign the evidence; a verdict other than PASS fails the run."""
        if not self.wanted():
            return
        from lab.evidence import compiler, dsse

        problems: list[str] = list(self.worker_problems)
        self.records += never_reported(self.config, self.collected, self.records)
        stopped = session.shouldfail or session.shouldstop
        if stopped:
            # -x / --maxfail: the rest of the selection never ran.
            problems.append(f"the run stopped early: {stopped}")
        try:
            expected = compiler.load_manifest(self.manifest)
        except errors.EvidenceError as exc:
            expected = []
            problems.append(str(exc))
        try:
            signer = dsse.load_signer()
        except errors.EvidenceError as exc:
            problems.append(str(exc))
            signer = dsse.load_signer({})
        status = int(session.exitstatus)
        here = ran_here(self.config)
        for owner in {json.dumps(h, sort_keys=True): h for h in
                      [*here["report_hooks"], *self.worker_report_hooks]}.values():
            problems.append(f"{owner.get('file')} implements {owner.get('hook')}, a hook that "
                            "can change a test's outcome: only pytest, its installed plugins "
                            "and the lab may")
        # Each phase report says what the lab saw its phase do, or the report was changed.
        problems += rawoutcome.problems(self.records)
        facts = compiler.RunFacts(
            records=self.records,
            collected=sorted(self.collected),
            experiments_prefix=self.prefix,
            expected=expected,
            database=self.database,
            command=["pytest", *self.config.invocation_params.args],
            narrowed=self.narrowed(),
            problems=problems,
            exitstatus=status,
            manifest=self.manifest,
            arguments=effective_arguments(self.config),
            loaded=[*loaded_modules(self.config), *self.worker_loaded],
            lab_file=provenance.module_file(sys.modules.get("lab")),
            inifile=self.config.inipath,
            ran=[*here["modules"], *self.worker_ran],
            hooks=[*here["hooks"], *self.worker_hooks],
            run=self.run,
        )
        given = self.config.getoption("lab_evidence", None) or DEFAULT_DIRECTORY
        self.directory = self.config.invocation_params.dir / str(given)
        boundaries = (
            {"$report_type": "SessionStart", "pytest_version": pytest.__version__},
            {"$report_type": "SessionFinish", "exitstatus": status},
        )
        self.report = compiler.write(
            self.directory,
            facts,
            root=self.config.rootpath,
            signer=signer,
            session_records=boundaries,
        )
        if self.report["status"] != gate.PASS and status == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """The gate's verdict, after pytest's own summary."""
        report = self.report
        if report is None or self.directory is None:
            return
        signing = report["signing"]
        terminalreporter.section("lab evidence")
        terminalreporter.write_line(
            f"gate: {report['status']}; evidence in {self.directory} signed by "
            f"{signing['keyid'][:16]} ({signing['key_source']})"
        )
        floor = report.get("seed_floor") or {}
        terminalreporter.write_line(
            f"  seed floor: {floor.get('passed')} of {floor.get('required')} seed "
            "experiments declared, run and passed"
        )
        if report.get("dirty"):
            terminalreporter.write_line("  dirty tree: this evidence is never publishable")
        run = report.get("run") or {}
        kind = run.get("kind", hermetic.LOCAL) if isinstance(run, dict) else hermetic.LOCAL
        publishable = "publishable" if report.get("publishable") else "not publishable"
        terminalreporter.write_line(f"  run: {kind} ({publishable})")
        for reason in report["gate"]["narrowed"]:
            terminalreporter.write_line(f"  narrowed: {reason}")
        failures = report["gate"]["failures"]
        for failure in failures[:25]:
            terminalreporter.write_line(f"  failed: {failure}")
        if len(failures) > 25:
            terminalreporter.write_line(f"  ... and {len(failures) - 25} more (see runtime.json)")


def _prefix(root: Path, experiments: Path) -> str:
    """Node-id prefix of the experiments directory, e.g. ``experiments/``."""
    try:
        relative = experiments.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return experiments.name + "/"
    return "" if relative == "." else relative + "/"


def serialize(config: pytest.Config, report: pytest.TestReport | pytest.CollectReport
              ) -> dict[str, Any]:
    """A report as plain data, exactly as ``tests.jsonl`` holds it."""
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    # xdist attaches its worker controller to each report; keep only the worker's id.
    node = data.pop("node", None)
    worker = getattr(getattr(node, "gateway", None), "id", None)
    if worker is not None:
        data["worker_id"] = str(worker)
    # A JSON round trip makes the record plain data.
    plain: dict[str, Any] = json.loads(json.dumps(data, default=str))
    return plain


def never_reported(config: pytest.Config, collected: Iterable[str],
                   records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A failed record for each collected test that no record names.

    xdist turns a crashed worker's running test into a failed report, except when the
    crash also breaks the controller's channel to that worker ("cannot send (already
    closed?)"): then no report comes at all. The test still did not pass, so it is
    recorded as failed in xdist's own form (phase ``???``), never as a gap.
    """
    reported = {r.get("nodeid") for r in records
                if r.get("$report_type", "TestReport") == "TestReport"}
    found: list[dict[str, Any]] = []
    for nodeid in sorted(set(collected) - reported):
        path = nodeid.split("::", 1)[0]
        message = (f"{nodeid} never reported: its xdist worker crashed, or the run ended "
                   "before it ran")
        # "???" is no phase: it is the one xdist gives a crashed worker's test.
        report = pytest.TestReport(nodeid, (path, None, path), {}, "failed", message,
                                   "???")  # type: ignore[arg-type]
        found.append(serialize(config, report))
    return found
