"""The pytest side of the evidence: annotate results, collect them, apply the gate.

Two parts, registered by the lab plugin's ``pytest_configure`` through
``register``:

* the annotator runs wherever tests run (a plain process or each xdist worker)
  and puts the test's claim, chapter and experiment name into the report's
  ``user_properties``, which xdist carries to the controller with the report;
* the collector runs only where no ``workerinput`` exists (a plain process or the
  xdist controller): it keeps every report and, at session end, compiles, signs
  and writes the evidence and turns a gate verdict other than PASS into a
  non-zero exit status.

Nothing relies on ``workeroutput``: a crashed worker loses it, while xdist still
turns the crashed worker's running test into a failed report.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from lab import dsse, errors, evidence, gate

ANNOTATOR = "lab-recorder-annotator"
COLLECTOR = "lab-recorder-collector"
DEFAULT_DIRECTORY = "evidence"
# Requesting this fixture (directly or through another) means the test needs PostgreSQL.
DATABASE_FIXTURE = "lab_dsn"

_annotated = pytest.StashKey[bool]()


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
        help="the experiment manifest (default <rootdir>/experiments/manifest.json)",
    )


def register(config: pytest.Config, database: Mapping[str, Any] | None) -> None:
    """Register the recorder for this process; ``database`` describes the PostgreSQL used.

    Called from the plugin's ``pytest_configure`` in every process; the collector
    and the gate are registered only outside xdist workers.
    """
    manager = config.pluginmanager
    experiments = manifest_path(config).parent
    if not manager.has_plugin(ANNOTATOR):
        manager.register(Annotator(experiments), ANNOTATOR)
    if not hasattr(config, "workerinput") and not manager.has_plugin(COLLECTOR):
        manager.register(Collector(config, database), COLLECTOR)


def manifest_path(config: pytest.Config) -> Path:
    """The manifest: ``--lab-manifest`` (relative to the invocation dir) or the default."""
    given = config.getoption("lab_manifest", None)
    if given:
        return (config.invocation_params.dir / str(given)).resolve()
    return config.rootpath / "experiments" / "manifest.json"


def claim_of(obj: object) -> str | None:
    """The first paragraph of a test function's docstring, on one line."""
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(paragraph.split())


class Annotator:
    """Adds the claim, chapter, experiment name and database need to each test's reports."""

    def __init__(self, experiments: Path) -> None:
        self.experiments = experiments

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
            props.append((evidence.NEEDS_DATABASE, True))
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
        self.prefix = _prefix(config.rootpath, self.manifest.parent)
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

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """In a single process, the items that will run."""
        self.collected.update(item.nodeid for item in session.items)

    def pytest_deselected(self, items: Sequence[pytest.Item]) -> None:
        """Deselection narrows the run (seen only where collection happens)."""
        self.deselected.extend(item.nodeid for item in items)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """A module that cannot be collected is a failure, not a silent absence."""
        if report.failed:
            self.records.append(self._serialize(report))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Every phase report, including xdist's failed report for a crashed worker."""
        self.records.append(self._serialize(report))

    def _serialize(self, report: pytest.TestReport | pytest.CollectReport) -> dict[str, Any]:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        # xdist attaches its worker controller to each report; keep only the worker's id.
        node = data.pop("node", None)
        worker = getattr(getattr(node, "gateway", None), "id", None)
        if worker is not None:
            data["worker_id"] = str(worker)
        # A JSON round trip makes the record plain data, exactly as tests.jsonl holds it.
        plain: dict[str, Any] = json.loads(json.dumps(data, default=str))
        return plain

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
        if getattr(option, "keyword", ""):
            reasons.append(f"-k {option.keyword}")
        if getattr(option, "markexpr", ""):
            reasons.append(f"-m {option.markexpr}")
        if getattr(option, "deselect", None):
            reasons.append("--deselect " + " ".join(option.deselect))
        if getattr(option, "lf", False):
            reasons.append("--lf")
        experiments = self.manifest.parent.resolve()
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
        problems: list[str] = []
        try:
            expected = evidence.load_manifest(self.manifest)
        except errors.EvidenceError as exc:
            expected = []
            problems.append(str(exc))
        try:
            signer = dsse.load_signer()
        except errors.EvidenceError as exc:
            problems.append(str(exc))
            signer = dsse.load_signer({})
        status = int(session.exitstatus)
        facts = evidence.RunFacts(
            records=self.records,
            collected=sorted(self.collected),
            experiments_prefix=self.prefix,
            expected=expected,
            database=self.database,
            command=["pytest", *self.config.invocation_params.args],
            narrowed=self.narrowed(),
            problems=problems,
            exitstatus=status,
        )
        given = self.config.getoption("lab_evidence", None) or DEFAULT_DIRECTORY
        self.directory = self.config.invocation_params.dir / str(given)
        boundaries = (
            {"$report_type": "SessionStart", "pytest_version": pytest.__version__},
            {"$report_type": "SessionFinish", "exitstatus": status},
        )
        self.report = evidence.write(
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
