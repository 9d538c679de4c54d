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
from pathlib import Path
from typing import Any

import pytest
from psycopg import conninfo

from lab import dsse, evidence, gate, verification

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
    def record(value):
        request.node.user_properties.append(("lab_observation", value))
    return record
"""

MANIFEST = {
    "experiments": [
        {"chapter": "ch01_x", "name": "test_pure", "results": 1},
        {"chapter": "ch01_x", "name": "test_db", "results": 1},
        {"chapter": "ch02_y", "name": "test_windows", "results": 2},
    ]
}

CH01 = '''
import pytest


def test_pure(observe):
    """A pure claim
    over two lines.

    Details that are not the claim."""
    observe({"pure": True, "count": 3})


def test_db(lab_dsn, observe):
    """The database claim."""
    observe({"state": "succeeded"})
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
    (experiments / "manifest.json").write_text(json.dumps(MANIFEST))
    (experiments / "ch01_x" / "test_a.py").write_text(CH01)
    (experiments / "ch02_y" / "test_b.py").write_text(CH02)
    return pytester


# Plugins the inner runs do not need; hypothesis's alone costs seconds per run.
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:anyio")


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:lab", *QUIET, *args)


def _report(pytester: pytest.Pytester, directory: str = "evidence") -> dict[str, Any]:
    report: dict[str, Any] = json.loads(
        (pytester.path / directory / evidence.REPORT_FILE).read_text()
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
    assert [t["outcome"] for t in report["tests"]] == ["passed"] * 4
    pure = report["tests"][1]
    assert pure["nodeid"] == "experiments/ch01_x/test_a.py::test_pure"
    assert pure["claim"] == "A pure claim over two lines."
    assert pure["observations"] == [{"count": 3, "pure": True}]
    assert report["postgresql"]["server_version"] == "15.0 (stand-in)"
    rows = {r["name"]: r for r in report["experiments"]}
    assert rows["test_windows"]["results"] == 2
    assert verification.verify(tree.path / "evidence", check_sources=True, root=tree.path).ok

    lines = [json.loads(x) for x in (tree.path / "evidence" / evidence.TESTS_FILE).open()]
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
            '    observe({"state": "succeeded"})',
            '    pytest.skip("no reason")',
            "experiments/ch01_x/test_a.py::test_db skipped",
            id="skipped",
        ),
        pytest.param(
            '    observe({"state": "succeeded"})',
            "    assert False, 'broken'",
            "experiments/ch01_x/test_a.py::test_db failed",
            id="failed",
        ),
        pytest.param(
            '    observe({"state": "succeeded"})',
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
    assert report["missing"] == ["ch01_x/test_db", "ch01_x/test_pure", "ch02_y/test_windows"]


def test_xdist_run_collects_from_workers_and_passes(tree: pytest.Pytester) -> None:
    """Under xdist the controller learns the collection and the observations from workers."""
    result = tree.runpytest_subprocess("-p", "no:lab", *QUIET, "-n", "2", "experiments")
    assert result.ret == 0, result.stdout.str()
    report = _report(tree)
    assert report["status"] == gate.PASS, report["gate"]
    observed = {o["nodeid"].rsplit("::", 1)[1]: o["observation"] for o in report["observations"]}
    assert observed == {"test_db": {"state": "succeeded"}, "test_pure": {"count": 3, "pure": True}}
    assert report["tests"][0]["claim"] == "The database claim."


def test_crashed_xdist_worker_is_a_failed_experiment(tree: pytest.Pytester) -> None:
    """A worker killed mid-test leaves a failed experiment, never a silent gap."""
    _edit(tree, '    observe({"state": "succeeded"})', "    import os\n    os._exit(3)")
    result = tree.runpytest_subprocess("-p", "no:lab", *QUIET, "-n", "2", "experiments")
    assert result.ret != 0
    report = _report(tree)
    assert report["status"] == gate.FAIL
    crashed = next(t for t in report["tests"] if t["nodeid"].endswith("::test_db"))
    assert crashed["outcome"] == "failed"
    assert "crashed" in crashed["message"]
    assert "experiments/ch01_x/test_a.py::test_db failed" in report["gate"]["failures"]


# --------------------------------------------------------------------------- the real plugin


def _real_tree(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini(INI)
    experiments = pytester.path / "experiments"
    (experiments / "ch01_x").mkdir(parents=True)
    manifest = {
        "experiments": [
            {"chapter": "ch01_x", "name": "test_pure", "results": 1, "database": False},
            {"chapter": "ch01_x", "name": "test_db", "results": 1},
        ]
    }
    (experiments / "manifest.json").write_text(json.dumps(manifest))
    (experiments / "ch01_x" / "test_a.py").write_text(
        '''
def test_pure(observe):
    """Pure."""
    observe({"pure": True})


def test_db(lab_schema, observe):
    """Reaches the run's PostgreSQL through the plugin's schema fixture."""
    observe({"schema": "made"})
'''
    )
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
    text = (tree.path / "evidence" / evidence.REPORT_FILE).read_text()
    password = _password(lab_dsn)
    assert password is None or password not in text
    assert verification.verify(tree.path / "evidence").ok


def _password(dsn: str) -> str | None:
    return conninfo.conninfo_to_dict(dsn).get("password") or os.environ.get("PGPASSWORD")


def test_signing_key_from_environment_is_used(
    tree: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LAB_EVIDENCE_KEY signs the run; a broken key fails the gate rather than hiding."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate()
    path = tmp_path / "key.pem"
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    monkeypatch.setenv(dsse.KEY_ENV, str(path))
    assert _run(tree, "experiments").ret == 0
    report = _report(tree)
    assert report["signing"]["key_source"] == "key_file"
    assert verification.verify(tree.path / "evidence", public_key=key.public_key()).ok

    monkeypatch.setenv(dsse.KEY_ENV, str(tmp_path / "absent.pem"))
    assert _run(tree, "experiments").ret != 0
    report = _report(tree)
    assert report["signing"]["key_source"] == "ephemeral"
    assert any(f.startswith(dsse.KEY_ENV) for f in report["gate"]["failures"])
