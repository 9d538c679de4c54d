"""The CI gate, proven on tiny experiment trees run by an inner pytest.

Most inner runs replace the lab plugin (``-p no:lab``) with a stand-in conftest
that registers the real recorder with a described database (or none) and a
``lab_dsn`` fixture that marks the test as having reached it, so each rule is
shown in a fraction of a second. Two runs go through pytest-xdist, one through
the real plugin without PostgreSQL, and one through the real plugin against the
outer run's PostgreSQL.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from psycopg import conninfo

import lab
from lab import files, rawoutcome, recorder
from lab.evidence import compiler, dsse, gate, testlog, verification
from lab.evidence.seed import SEED_EXPERIMENTS
from tests.support import labtree
from tests.support.keys import KeyFiles

pytest_plugins = ["pytester"]

STAND_IN = """
import pytest
from lab import recorder

DATABASE = {"provider": "dsn", "server_version": "15.0 (stand-in)", "details": {}}


def pytest_addoption(parser):
    recorder.addoption(parser)
    parser.addoption("--stand-in-database", choices=["yes", "no"], default="yes")


def pytest_configure(config):
    reached = config.getoption("--stand-in-database") == "yes"
    recorder.register(config, DATABASE if reached else None)


@pytest.fixture
def lab_dsn(request):
    request.node.user_properties.append(("lab_database", True))
    return "postgresql://stand-in"


@pytest.fixture
def observe(request):
    def record(value, **declared):
        request.node.user_properties.extend(recorder.observation_properties(value, **declared))
    return record
"""

MANIFEST = {
    "experiments": [
        {"chapter": "ch01_x", "name": "test_pure", "results": 1},
        {"chapter": "ch01_x", "name": "test_db", "results": 1},
        {"chapter": "ch02_y", "name": "test_windows", "results": 2},
    ]
}

# The line of CH01's test_db that the edits below replace.
OBSERVED = '    observe({"state": "succeeded"}, facts=("state",))'

CH01 = '''
import pytest


def test_pure(observe):
    """A pure claim
    over two lines.

    Details that are not the claim."""
    observe({"pure": True, "count": 3}, facts=("pure", "count"))


def test_db(lab_dsn, observe):
    """The database claim."""
    observe({"state": "succeeded"}, facts=("state",))
'''

CH02 = '''
import pytest


@pytest.mark.parametrize("window", ["after_claim", "after_tool"])
def test_windows(lab_dsn, window):
    """Both windows hold."""
'''

INI = "[pytest]\nxfail_strict = false\n"


@pytest.fixture
def tree(pytester: pytest.Pytester) -> pytest.Pytester:
    """A complete experiment tree with the stand-in plugin."""
    pytester.makeini(INI)
    pytester.makeconftest(STAND_IN)
    experiments = pytester.path / "experiments"
    (experiments / "ch01_x").mkdir(parents=True)
    (experiments / "ch02_y").mkdir()
    (experiments / "ch01_x" / "test_a.py").write_text(CH01)
    (experiments / "ch02_y" / "test_b.py").write_text(CH02)
    labtree.publishable(pytester.path, MANIFEST["experiments"])
    return pytester


def _own(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The tree's own tests, without the seed floor's stand-ins."""
    return [t for t in report["tests"] if labtree.SEED_FILE not in t["nodeid"]]


# Plugins the inner runs do not need; hypothesis's alone costs seconds per run.
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:anyio")


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # A separate process: an in-process run would count this session's own modules
    # (tests/*.py outside the tree) among those the inner run ran.
    return pytester.runpytest_subprocess("-p", "no:lab", *QUIET, *args)


def _report(pytester: pytest.Pytester, directory: str = "evidence") -> dict[str, Any]:
    report: dict[str, Any] = json.loads(
        (pytester.path / directory / compiler.REPORT_FILE).read_text()
    )
    return report


def _edit(pytester: pytest.Pytester, old: str, new: str) -> None:
    path = pytester.path / "experiments" / "ch01_x" / "test_a.py"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_complete_passing_run_is_pass_and_verifies(tree: pytest.Pytester) -> None:
    """Every declared experiment ran and passed against a database: PASS, exit 0."""
    result = _run(tree, "experiments")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*gate: PASS; evidence in *signed by * (ephemeral)*"])
    report = _report(tree)
    assert report["status"] == gate.PASS
    assert report["gate"] == {"failures": [], "narrowed": []}
    assert [t["outcome"] for t in report["tests"]] == ["passed"] * (4 + len(SEED_EXPERIMENTS))
    assert report["seed_floor"] == {"required": 26, "passed": 26}
    pure = _own(report)[1]
    assert pure["nodeid"] == "experiments/ch01_x/test_a.py::test_pure"
    assert pure["claim"] == "A pure claim over two lines."
    assert pure["observations"] == [{"count": 3, "pure": True}]
    assert pure["observation_kinds"] == [{"count": "fact", "pure": "fact"}]
    assert report["postgresql"]["server_version"] == "15.0 (stand-in)"
    rows = {r["name"]: r for r in report["experiments"]}
    assert rows["test_windows"]["results"] == 2
    assert verification.verify(tree.path / "evidence", check_sources=True, root=tree.path).ok

    lines = [json.loads(x) for x in (tree.path / "evidence" / compiler.TESTS_FILE).open()]
    assert lines[0]["$report_type"] == "SessionStart"
    assert lines[-1] == {"$report_type": "SessionFinish", "exitstatus": 0}
    call = next(x for x in lines if x.get("when") == "call" and x["nodeid"].endswith("test_db"))
    assert {"nodeid", "outcome", "when", "duration", "user_properties"} <= set(call)
    assert ["lab_chapter", "ch01_x"] in call["user_properties"]
    assert ["lab_experiment", "test_db"] in call["user_properties"]
    assert ["lab_database", True] in call["user_properties"]


@pytest.mark.parametrize(
    ("old", "new", "finding"),
    [
        pytest.param(
            '    observe({"state": "succeeded"}, facts=("state",))',
            '    pytest.skip("no reason")',
            "experiments/ch01_x/test_a.py::test_db skipped",
            id="skipped",
        ),
        pytest.param(
            '    observe({"state": "succeeded"}, facts=("state",))',
            "    assert False, 'broken'",
            "experiments/ch01_x/test_a.py::test_db failed",
            id="failed",
        ),
        pytest.param(
            '    observe({"state": "succeeded"}, facts=("state",))',
            '    pytest.xfail("known")',
            "experiments/ch01_x/test_a.py::test_db xfailed",
            id="xfail",
        ),
        pytest.param(
            "def test_db(lab_dsn, observe):",
            "def helper_db(lab_dsn, observe):",
            "ch01_x/test_db did not run",
            id="missing",
        ),
        pytest.param(
            "def test_db(lab_dsn, observe):",
            "@pytest.fixture\ndef broken():\n    raise RuntimeError\n\n\n"
            "def test_db(lab_dsn, observe, broken):",
            "experiments/ch01_x/test_a.py::test_db error",
            id="error",
        ),
        pytest.param(
            '    observe({"state": "succeeded"}, facts=("state",))',
            '    observe({"state": "succeeded", "ratio": 0.5}, facts=("state",))',
            "experiments/ch01_x/test_a.py::test_db failed",
            id="undeclared",
        ),
        pytest.param(
            '    observe({"state": "succeeded"}, facts=("state",))',
            '    observe({"state": "succeeded"}, facts=("state",), measurements=("state",))',
            "experiments/ch01_x/test_a.py::test_db: observation key 'state' is neither a fact "
            "nor a measurement (declare it: observe(..., facts=(...)) or measurements=(...))",
            id="declared-both",
        ),
    ],
)
def test_each_broken_experiment_fails_the_gate(
    tree: pytest.Pytester, old: str, new: str, finding: str
) -> None:
    """A skipped, failed, xfailed, missing or erroring experiment fails the run."""
    _edit(tree, old, new)
    result = _run(tree, "experiments")
    assert result.ret != 0
    report = _report(tree)
    assert report["status"] == gate.FAIL
    assert finding in report["gate"]["failures"], report["gate"]["failures"]
    result.stdout.fnmatch_lines(["*gate: FAIL*", f"*failed: {finding}*"])


def test_fewer_results_than_declared_fail(tree: pytest.Pytester) -> None:
    """A parametrised experiment that lost a case is caught by its declared count."""
    path = tree.path / "experiments" / "ch02_y" / "test_b.py"
    path.write_text(path.read_text().replace('["after_claim", "after_tool"]', '["after_claim"]'))
    result = _run(tree, "experiments")
    assert result.ret != 0
    assert "ch02_y/test_windows produced 1 of 2 results" in _report(tree)["gate"]["failures"]


def test_collection_error_fails_the_gate(tree: pytest.Pytester) -> None:
    """A module that cannot be imported is a failure, not an absence."""
    (tree.path / "experiments" / "ch02_y" / "test_b.py").write_text("import missing_for_gate\n")
    result = _run(tree, "experiments")
    assert result.ret != 0
    failures = _report(tree)["gate"]["failures"]
    assert any(f.startswith("collection error in experiments/ch02_y/test_b.py") for f in failures)


def test_no_database_fails_the_gate(tree: pytest.Pytester) -> None:
    """All experiments pass, but the run reached no database: FAIL."""
    result = _run(tree, "experiments", "--stand-in-database=no")
    assert result.ret != 0
    report = _report(tree)
    assert report["status"] == gate.FAIL
    assert report["postgresql"] is None
    assert "no real PostgreSQL database was provisioned for the run" in report["gate"]["failures"]


def test_experiment_that_never_reached_the_database_fails(tree: pytest.Pytester) -> None:
    """A test that asked for the database must have reached it."""
    tree.makeconftest(
        STAND_IN.replace('    request.node.user_properties.append(("lab_database", True))\n', "")
    )
    result = _run(tree, "experiments")
    assert result.ret != 0
    failures = _report(tree)["gate"]["failures"]
    assert "experiments/ch01_x/test_a.py::test_db did not reach a real database" in failures
    assert not any("test_pure" in f for f in failures)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        pytest.param(["experiments", "-k", "pure or db"], "-k pure or db", id="-k"),
        pytest.param(["experiments/ch01_x"], "path experiments/ch01_x", id="chapter"),
        pytest.param(
            ["experiments/ch01_x/test_a.py::test_pure", "experiments/ch01_x/test_a.py::test_db"],
            "node id experiments/ch01_x/test_a.py::test_pure",
            id="node-ids",
        ),
        pytest.param(
            ["experiments", "--deselect", "experiments/ch02_y/test_b.py"],
            "--deselect experiments/ch02_y/test_b.py",
            id="deselect",
        ),
        pytest.param(["experiments", "-m", "not slow"], "-m not slow", id="-m"),
        pytest.param(
            ["experiments", "--ignore", "experiments/ch02_y"],
            "--ignore experiments/ch02_y",
            id="--ignore",
        ),
        pytest.param(
            ["experiments", "--ignore-glob", "*/ch02_y/*"], "--ignore-glob */ch02_y/*",
            id="--ignore-glob",
        ),
    ],
)
def test_narrowed_run_is_partial(tree: pytest.Pytester, args: list[str], reason: str) -> None:
    """Everything selected passed, but the selection was narrowed: PARTIAL, non-zero exit."""
    result = _run(tree, *args)
    assert result.ret != 0
    report = _report(tree)
    assert report["status"] == gate.PARTIAL, report["gate"]
    assert reason in report["gate"]["narrowed"]
    result.stdout.fnmatch_lines(["*gate: PARTIAL*"])


def test_setup_only_run_is_not_a_pass(tree: pytest.Pytester) -> None:
    """--setup-only runs fixtures but no test body: nothing passed."""
    result = _run(tree, "experiments", "--setup-only")
    assert result.ret != 0
    report = _report(tree)
    assert report["status"] == gate.FAIL
    assert "experiments/ch01_x/test_a.py::test_db not run" in report["gate"]["failures"]


def test_collect_only_writes_no_evidence(tree: pytest.Pytester) -> None:
    """Listing the experiments is not a run: no evidence and pytest's own exit status."""
    result = _run(tree, "experiments", "--collect-only")
    assert result.ret == 0
    assert not (tree.path / "evidence").exists()


def test_unit_tests_alone_write_no_evidence(tree: pytest.Pytester) -> None:
    """A run of tests/ only is not an experiment run: no evidence, no gate."""
    tree.mkdir("tests")
    (tree.path / "tests" / "test_unit.py").write_text("def test_unit():\n    pass\n")
    result = _run(tree, "tests")
    assert result.ret == 0
    assert not (tree.path / "evidence").exists()
    result = _run(tree, "experiments", "--lab-no-evidence", "-k", "pure")
    assert result.ret == 0
    assert not (tree.path / "evidence").exists()


def test_explicit_evidence_dir_applies_the_gate_to_any_run(tree: pytest.Pytester) -> None:
    """--lab-evidence writes evidence even when no experiment ran, and it fails."""
    tree.mkdir("tests")
    (tree.path / "tests" / "test_unit.py").write_text("def test_unit():\n    pass\n")
    result = _run(tree, "tests", "--lab-evidence", "out")
    assert result.ret != 0
    report = _report(tree, "out")
    assert report["status"] == gate.FAIL
    own = [m for m in report["missing"] if m.startswith(("ch01_x/", "ch02_y/"))]
    assert own == ["ch01_x/test_db", "ch01_x/test_pure", "ch02_y/test_windows"]
    assert len(report["missing"]) == 3 + len(SEED_EXPERIMENTS)


def test_xdist_run_collects_from_workers_and_passes(tree: pytest.Pytester) -> None:
    """Under xdist the controller learns the collection and the observations from workers."""
    result = tree.runpytest_subprocess("-p", "no:lab", *QUIET, "-n", "2", "experiments")
    assert result.ret == 0, result.stdout.str()
    report = _report(tree)
    assert report["status"] == gate.PASS, report["gate"]
    observed = {o["nodeid"].rsplit("::", 1)[1]: o["observation"] for o in report["observations"]}
    assert observed == {"test_db": {"state": "succeeded"}, "test_pure": {"count": 3, "pure": True}}
    assert _own(report)[0]["claim"] == "The database claim."


def test_crashed_xdist_worker_is_a_failed_experiment(tree: pytest.Pytester) -> None:
    """A worker killed mid-test leaves a failed experiment, never a silent gap."""
    _edit(tree, OBSERVED, "    import os\n    os._exit(3)")
    result = tree.runpytest_subprocess("-p", "no:lab", *QUIET, "-n", "2", "experiments")
    assert result.ret != 0
    report = _report(tree)
    assert report["status"] == gate.FAIL
    crashed = next(t for t in report["tests"] if t["nodeid"].endswith("::test_db"))
    assert crashed["outcome"] == "failed"
    assert "crashed" in crashed["message"]
    assert "experiments/ch01_x/test_a.py::test_db failed" in report["gate"]["failures"]


def test_a_crash_that_loses_xdist_s_report_is_still_a_failed_test(
    pytestconfig: pytest.Config,
) -> None:
    """A crash that also breaks xdist's channel sends no report: the test is failed, not absent."""
    crashed = "experiments/ch01_x/test_a.py::test_db"
    passed = "experiments/ch01_x/test_a.py::test_pure"
    ran = pytest.TestReport(passed, ("experiments/ch01_x/test_a.py", 1, "test_pure"), {},
                            "passed", None, "call")
    records = [recorder.serialize(pytestconfig, ran)]
    lost = recorder.never_reported(pytestconfig, {crashed, passed}, records)
    assert [r["nodeid"] for r in lost] == [crashed]
    rows = {t["nodeid"]: t for t in testlog.test_rows([*records, *lost], "experiments/")}
    assert rows[crashed]["outcome"] == "failed"
    assert "crashed" in rows[crashed]["message"]
    assert rows[passed]["outcome"] == "passed"
    assert rawoutcome.problems(lost) == []  # xdist's own form, which no phase check applies to


# --------------------------------------------------------------------------- the real plugin


def _real_tree(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini(INI)
    experiments = pytester.path / "experiments"
    (experiments / "ch01_x").mkdir(parents=True)
    entries = [
        {"chapter": "ch01_x", "name": "test_pure", "results": 1, "database": False},
        {"chapter": "ch01_x", "name": "test_db", "results": 1},
    ]
    (experiments / "ch01_x" / "test_a.py").write_text(
        '''
def test_pure(observe):
    """Pure."""
    observe({"pure": callable(observe)}, facts=("pure",))


def test_db(lab_schema, observe):
    """Reaches the run's PostgreSQL through the plugin's schema fixture."""
    observe({"schema": lab_schema and "made"}, facts=("schema",))
'''
    )
    labtree.publishable(pytester.path, entries)
    return pytester


def test_real_plugin_without_postgresql_fails_the_gate(pytester: pytest.Pytester) -> None:
    """Through the entry point, a run told not to provision PostgreSQL cannot pass."""
    tree = _real_tree(pytester)
    result = tree.runpytest_subprocess(*QUIET, "--lab-postgres=none")
    assert result.ret != 0
    report = _report(tree)
    assert report["status"] == gate.FAIL
    assert "no real PostgreSQL database was provisioned for the run" in report["gate"]["failures"]


def test_real_plugin_against_postgresql_passes(
    pytester: pytest.Pytester, lab_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the entry point, reusing the outer run's PostgreSQL: PASS, and verified."""
    tree = _real_tree(pytester)
    monkeypatch.setenv("BOOK_LAB_DSN", lab_dsn)
    result = tree.runpytest_subprocess(*QUIET, "--lab-postgres=dsn")
    assert result.ret == 0, result.stdout.str()
    report = _report(tree)
    assert report["status"] == gate.PASS, report["gate"]
    assert report["postgresql"]["provider"] == "dsn"
    text = (tree.path / "evidence" / compiler.REPORT_FILE).read_text()
    password = _password(lab_dsn)
    assert password is None or password not in text
    assert verification.verify(tree.path / "evidence").ok


def _password(dsn: str) -> str | None:
    given = conninfo.conninfo_to_dict(dsn).get("password")
    return str(given) if given else os.environ.get("PGPASSWORD")


def test_signing_key_from_environment_is_used(
    tree: pytest.Pytester,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_key: Callable[[str], KeyFiles],
) -> None:
    """LAB_EVIDENCE_KEY signs the run; a broken key fails the gate rather than hiding."""
    key = make_key("key")
    monkeypatch.setenv(dsse.KEY_ENV, str(key.private_pem))
    assert _run(tree, "experiments").ret == 0
    report = _report(tree)
    assert report["signing"]["key_source"] == "key_file"
    assert verification.verify(tree.path / "evidence", public_key=key.public).ok

    monkeypatch.setenv(dsse.KEY_ENV, str(tmp_path / "absent.pem"))
    assert _run(tree, "experiments").ret != 0
    report = _report(tree)
    assert report["signing"]["key_source"] == "ephemeral"
    assert any(f.startswith(dsse.KEY_ENV) for f in report["gate"]["failures"])


def test_more_results_than_declared_fail(tree: pytest.Pytester) -> None:
    """The declared count is exact: a parametrisation that grew is caught too."""
    path = tree.path / "experiments" / "ch02_y" / "test_b.py"
    path.write_text(path.read_text().replace('["after_claim", "after_tool"]', '["a", "b", "c"]'))
    labtree.commit(tree.path)
    result = _run(tree, "experiments")
    assert result.ret != 0
    failures = _report(tree)["gate"]["failures"]
    assert failures == ["ch02_y/test_windows produced 3 results but declares 2"]


def test_stopping_early_fails_the_gate(tree: pytest.Pytester) -> None:
    """-x stops at the first failure: the rest never ran, and the gate says so."""
    _edit(tree, OBSERVED, "    assert False")
    labtree.commit(tree.path)
    result = _run(tree, "experiments", "-x")
    assert result.ret != 0
    failures = _report(tree)["gate"]["failures"]
    assert any(f.startswith("the run stopped early") for f in failures), failures


# --------------------------------------------------------------------------- attacks (issue 14)


def test_trimmed_manifest_and_ignore_through_pytest_addopts_do_not_pass(
    tree: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack 1: a manifest without ch02_y and --ignore of it, both hidden in PYTEST_ADDOPTS.
    The run is not PASS, names the foreign manifest and the narrowing, and records the
    environment's options."""
    manifest = json.loads((tree.path / "experiments" / "manifest.json").read_text())
    manifest["experiments"] = [e for e in manifest["experiments"] if e["chapter"] != "ch02_y"]
    trimmed = tmp_path / "trimmed.json"
    trimmed.write_text(json.dumps(manifest))
    addopts = f"--lab-manifest={trimmed} --ignore=experiments/ch02_y"
    monkeypatch.setenv("PYTEST_ADDOPTS", addopts)
    result = _run(tree, "experiments")
    assert result.ret != 0
    report = _report(tree)
    assert report["status"] == gate.FAIL
    assert (
        f"the expected set came from {trimmed}, not the committed experiments/manifest.json: "
        "a run against another manifest is never publishable"
    ) in report["gate"]["failures"]
    assert "--ignore experiments/ch02_y" in report["gate"]["narrowed"]
    assert report["selection"]["arguments"]["environment"] == addopts.split()
    assert "experiments" in report["selection"]["arguments"]["command_line"]
    assert report["provenance"]["environment"]["PYTEST_ADDOPTS"] == addopts


def test_trimmed_manifest_without_a_seed_experiment_fails_naming_it(
    tree: pytest.Pytester,
) -> None:
    """Issue 23: drop a seed experiment from the tree and the committed manifest alike:
    the seed floor, fixed in code, still fails the run and names it."""
    gone = ("ch03_leases", "test_two_claimers_cannot_own_one_workflow")
    path = tree.path / "experiments" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["experiments"] = [
        e for e in manifest["experiments"] if (e["chapter"], e["name"]) != gone
    ]
    path.write_text(json.dumps(manifest))
    seed_file = tree.path / "experiments" / gone[0] / f"{labtree.SEED_FILE}{gone[0]}.py"
    seed_file.write_text(seed_file.read_text().replace(f"def {gone[1]}(", "def _gone("))
    labtree.commit(tree.path)
    result = _run(tree, "experiments")
    assert result.ret != 0
    report = _report(tree)
    assert report["gate"]["failures"] == [
        f"seed experiment {gone[0]}/{gone[1]} is not declared in the manifest"
    ]
    assert report["seed_floor"] == {"required": 26, "passed": 25}


EVIL_HOOK = """

def pytest_pyfunc_call(pyfuncitem):
    return True  # every test body is skipped and reported as passed
"""


def test_untracked_root_conftest_that_fakes_passes_fails_naming_it(
    tree: pytest.Pytester,
) -> None:
    """Attack 2a: a root conftest.py listed in .git/info/exclude whose pytest_pyfunc_call
    returns True turns a failing experiment into a "pass" on a clean tree; the gate names
    the untracked conftest."""
    labtree.git(tree.path, "rm", "-q", "--cached", "conftest.py")
    with (tree.path / ".git" / "info" / "exclude").open("a") as handle:
        handle.write("conftest.py\n")
    _edit(tree, OBSERVED, "    assert False, 'broken'")
    labtree.commit(tree.path)
    conftest = tree.path / "conftest.py"
    conftest.write_text(conftest.read_text() + EVIL_HOOK)
    assert labtree.git(tree.path, "status", "--porcelain") == ""
    result = _run(tree, "experiments")
    assert result.ret != 0
    report = _report(tree)
    assert report["dirty"] is False
    assert all(t["outcome"] == "passed" for t in report["tests"])  # the forgery worked...
    # ...and the gate still refuses it, naming the conftest.
    failures = report["gate"]["failures"]
    assert "conftest conftest.py was loaded from outside the hashed sources" in failures
    # The module check of what ran names the same file; nothing else fails.
    assert all("conftest.py" in failure for failure in failures), failures
    root_conftest = next(m for m in report["provenance"]["modules"] if m["kind"] == "conftest")
    assert root_conftest["tracked"] is False
    assert root_conftest["sha256"] == files.sha256_file(tree.path / "conftest.py")


def test_a_tracked_conftest_that_changes_outcomes_fails_naming_it(
    tree: pytest.Pytester,
) -> None:
    """Issue 42: a committed, tracked conftest whose pytest_pyfunc_call fakes every pass
    is vouched for as a source, but it implements a hook that can change a test's outcome:
    the gate fails naming the file and the hook."""
    _edit(tree, OBSERVED, "    assert False, 'broken'")
    conftest = tree.path / "conftest.py"
    conftest.write_text(conftest.read_text() + EVIL_HOOK)
    labtree.commit(tree.path)
    result = _run(tree, "experiments")
    assert result.ret != 0
    report = _report(tree)
    assert report["dirty"] is False
    assert all(t["outcome"] == "passed" for t in report["tests"])  # the forgery worked...
    # ...and the gate refuses it, naming the conftest and the hook.
    assert report["status"] == gate.FAIL
    assert any("conftest.py implements pytest_pyfunc_call" in f
               for f in report["gate"]["failures"]), report["gate"]["failures"]


# Prepended to an experiment module: no hook, only pytest's report builder patched at
# import time, so a failed call comes out passed (the gate's hook rule cannot see it).
FORGED_REPORTS = """
import _pytest.reports

_built = _pytest.reports.TestReport.from_item_and_call.__func__


def _forged(cls, item, call):
    report = _built(cls, item, call)
    if report.when == "call" and report.outcome == "failed":
        report.outcome, report.longrepr = "passed", None
    return report


_pytest.reports.TestReport.from_item_and_call = classmethod(_forged)
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_a_report_forged_without_a_hook_fails_naming_its_raw_outcome(
    tree: pytest.Pytester, workers: list[str]
) -> None:
    """Issue 42: an experiment module that implements no hook but patches pytest's report
    builder at import time turns its failed call into a pass in a clean, committed tree;
    the raw outcome the lab noted where the call ended says failed, so the gate refuses
    the run, naming the test, the phase and both outcomes, and nothing else."""
    _edit(tree, OBSERVED, "    assert False, 'broken'")
    path = tree.path / "experiments" / "ch01_x" / "test_a.py"
    path.write_text(FORGED_REPORTS + path.read_text())
    labtree.commit(tree.path)
    result = _run(tree, *workers, "experiments")
    assert result.ret != 0
    report = _report(tree)
    assert report["dirty"] is False
    assert all(t["outcome"] == "passed" for t in report["tests"])  # the forgery worked...
    # ...and the gate refuses it for that reason alone.
    forged = "experiments/ch01_x/test_a.py::test_db"
    problem = (f"{forged} call: raw outcome failed, reported passed: something changed the "
               "report after the phase ran")
    assert report["status"] == gate.FAIL
    assert report["gate"]["failures"] == [problem]
    result.stdout.fnmatch_lines(["*gate: FAIL*", f"*failed: {problem}*"])
    # The signed log carries each phase's raw outcome beside its reported one.
    lines = [json.loads(x) for x in (tree.path / "evidence" / compiler.TESTS_FILE).open()]
    raw = {(x["nodeid"], x["when"]): [v for k, v in x["user_properties"]
                                      if k == "lab_raw_outcome"]
           for x in lines if x["$report_type"] == "TestReport"}
    assert raw[(forged, "call")] == ["failed"]
    assert raw[(forged, "setup")] == raw[(forged, "teardown")] == ["passed"]
    assert all(len(r) == 1 for r in raw.values())


def test_pytest_plugins_module_from_elsewhere_fails_naming_it(
    tree: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack 2b: PYTEST_PLUGINS loads a module from outside the tree that fakes every
    pass; the gate names the plugin and the report records PYTEST_PLUGINS."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "lab_evil_plugin.py").write_text(EVIL_HOOK)
    monkeypatch.syspath_prepend(str(elsewhere))
    monkeypatch.setenv("PYTHONPATH", str(elsewhere))  # the inner run is a subprocess
    monkeypatch.setenv("PYTEST_PLUGINS", "lab_evil_plugin")
    _edit(tree, OBSERVED, "    assert False, 'broken'")
    labtree.commit(tree.path)
    result = _run(tree, "experiments")
    assert result.ret != 0
    report = _report(tree)
    evil = str((elsewhere / "lab_evil_plugin.py").resolve())
    failures = report["gate"]["failures"]
    assert (f"plugin lab_evil_plugin ({evil}) was loaded from outside the hashed sources"
            in failures)
    assert all("lab_evil_plugin" in failure or "PYTHONPATH" in failure
               for failure in failures), failures
    assert report["provenance"]["environment"]["PYTEST_PLUGINS"] == "lab_evil_plugin"


def test_lab_imported_from_another_checkout_fails_naming_it(
    tree: pytest.Pytester, tmp_path: Path
) -> None:
    """Attack 2c: lab is imported from a copy elsewhere (as a virtualenv whose editable
    install points at another checkout does) while this tree's files are hashed."""
    other = tmp_path / "other-checkout"
    shutil.copytree(Path(lab.__file__).resolve().parent, other / "lab",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # The tree has no lab/ of its own, so nothing shadows the copy.
    labtree.git(tree.path, "rm", "-r", "-q", "lab")
    labtree.commit(tree.path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "BOOK_"))}
    env["PYTHONPATH"] = str(other)
    # -P: do not put the working directory first on sys.path (as the pytest script does).
    done = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-p", "no:lab", *QUIET, "experiments"],
        cwd=tree.path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode != 0, done.stdout[-2000:]
    report = _report(tree)
    copy = (other / "lab" / "__init__.py").resolve()
    assert f"lab was imported from {copy}, not from the hashed sources" in (
        report["gate"]["failures"]
    )
    assert report["provenance"]["environment"]["PYTHONPATH"] == str(other)


def test_readme_test_command_with_a_skipped_unit_test_does_not_pass(
    tree: pytest.Pytester,
) -> None:
    """Attack 6: tests and experiments run together (the README's command); one skipped
    unit test fails the gate, naming it."""
    tree.mkdir("tests")
    (tree.path / "tests" / "test_unit.py").write_text(
        "import pytest\n\n\ndef test_unit():\n    pytest.skip('no model')\n"
    )
    labtree.commit(tree.path)
    result = _run(tree, "tests", "experiments")
    assert result.ret != 0
    report = _report(tree)
    assert report["gate"]["failures"] == ["tests/test_unit.py::test_unit skipped"]
    assert report["skips"] == [
        {"nodeid": "tests/test_unit.py::test_unit", "outcome": "skipped",
         "reason": "Skipped: no model"}
    ]


def test_dirty_tree_is_never_publishable(tree: pytest.Pytester) -> None:
    """A dirty tree still produces evidence, marked dirty, and the gate fails naming it."""
    (tree.path / "experiments" / "notes.txt").write_text("uncommitted\n")
    result = _run(tree, "experiments")
    assert result.ret != 0
    report = _report(tree)
    assert report["dirty"] is True
    assert report["gate"]["failures"] == [
        "the working tree has uncommitted changes (or its state is unknown): evidence of a "
        "dirty tree is never publishable"
    ]
    assert not verification.verify(tree.path / "evidence").ok


@pytest.mark.parametrize("flag", ["--lf", "--ff", "--sw"])
def test_cache_driven_selection_is_narrowing(tree: pytest.Pytester, flag: str) -> None:
    """--lf, --ff and --sw let an earlier run's cache choose or order what runs: PARTIAL."""
    result = tree.runpytest_subprocess("-p", "no:lab", "-p", "no:hypothesispytest",
                                       "-p", "no:anyio",
                                       "experiments", flag)
    assert result.ret != 0
    report = _report(tree)
    assert report["status"] == gate.PARTIAL, report["gate"]
    assert flag in report["gate"]["narrowed"]


def test_conftest_loaded_only_by_an_xdist_worker_is_named(tree: pytest.Pytester) -> None:
    """Under xdist the controller imports no chapter conftest; the workers report what
    they loaded, so an untracked one is still named."""
    (tree.path / ".git" / "info" / "exclude").write_text("experiments/ch01_x/conftest.py\n")
    (tree.path / "experiments" / "ch01_x" / "conftest.py").write_text(EVIL_HOOK)
    assert labtree.git(tree.path, "status", "--porcelain") == ""
    result = tree.runpytest_subprocess("-p", "no:lab", *QUIET, "-n", "2", "experiments")
    assert result.ret != 0
    report = _report(tree)
    failures = report["gate"]["failures"]
    assert ("conftest experiments/ch01_x/conftest.py was loaded from outside the hashed "
            "sources") in failures
    assert all("experiments/ch01_x/conftest.py" in failure for failure in failures), failures


def test_ini_addopts_narrowing_is_recorded_and_counts(tree: pytest.Pytester) -> None:
    """An --ignore hidden in the committed ini's addopts narrows the run like any other,
    and the report records the ini's options."""
    tree.makeini(INI + "addopts = --ignore=experiments/ch02_y\n")
    labtree.commit(tree.path)
    result = _run(tree, "experiments")
    assert result.ret != 0
    report = _report(tree)
    assert report["status"] == gate.PARTIAL, report["gate"]
    assert report["gate"]["narrowed"] == ["--ignore experiments/ch02_y"]
    assert report["selection"]["arguments"]["ini"] == ["--ignore=experiments/ch02_y"]
    assert report["provenance"]["inifile"]["path"] == "tox.ini"
