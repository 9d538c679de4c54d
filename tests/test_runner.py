"""``lab run`` and the summary shared with ``lab evidence show``."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from lab import cli, errors, runner
from lab.evidence import compiler, summary


def _args(*argv: str) -> runner.RunOptions:
    return cli.options_from(runner.RunOptions, cli.build_parser().parse_args(["run", *argv]))


def test_command_runs_pytest_on_the_experiments_with_evidence() -> None:
    """The subprocess is this interpreter's pytest, writing evidence where asked."""
    command = runner.pytest_command(_args("-n", "2", "--evidence", "out", "--", "-x", "-q"))
    assert command == [
        sys.executable, "-m", "pytest", "experiments", "-p", "no:cacheprovider",
        "-p", "no:hypothesispytest", "--lab-evidence", "out", "-n", "2", "-x", "-q",
    ]  # fmt: skip
    narrowed = runner.pytest_command(_args("--chapter", "ch01_admission", "--chapter", "ch05"))
    assert narrowed[3:5] == ["experiments/ch01_admission", "experiments/ch05"]
    assert "-n" not in narrowed


def _console() -> tuple[Console, io.StringIO]:
    sink = io.StringIO()
    return Console(file=sink, width=200, color_system=None), sink


def _tree(root: Path) -> None:
    (root / "experiments" / "ch01_x").mkdir(parents=True)
    (root / "experiments" / "manifest.json").write_text(
        json.dumps({"experiments": [{"chapter": "ch01_x", "name": "test_a", "database": False}]})
    )
    (root / "experiments" / "ch01_x" / "test_a.py").write_text(
        'def test_a(observe):\n    """A."""\n    observe({"seen": int("42")}, facts=("seen",))\n'
    )
    (root / "pytest.ini").write_text("[pytest]\n")


@pytest.fixture
def in_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp_path`` holding a one-experiment tree (``_tree``), as the working directory."""
    _tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_run_streams_pytest_then_summarises_the_signed_report(in_tree: Path) -> None:
    """A run without PostgreSQL completes, shows every experiment and fails the gate."""
    console, sink = _console()
    args = _args("--", "--lab-postgres=none", "-p", "no:hypothesispytest", "-p", "no:anyio")
    code = runner.run_main(args, console)
    out = sink.getvalue()
    assert code != 0
    assert re.search(r"ch01_x\s+│\s+1 of 1", out), out
    assert "Gate: FAIL" in out
    assert "no real PostgreSQL database was provisioned for the run" in out
    assert "PostgreSQL: none reached" in out
    assert "EPHEMERAL key" in out
    assert f"Evidence: evidence/{compiler.ENVELOPE_FILE}" in out
    assert (in_tree / "evidence" / compiler.REPORT_FILE).is_file()

    assert cli.main(["evidence", "show", "evidence"]) == 1


def test_chapter_run_warns_it_is_partial_and_unknown_chapters_stop(in_tree: Path) -> None:
    """--chapter narrows the run, and the runner says so before it starts."""
    console, sink = _console()
    with pytest.raises(errors.UsageError, match="no such experiments directory: ch99_none"):
        runner.run_main(_args("--chapter", "ch99_none"), console)
    console, sink = _console()
    args = _args("--chapter", "ch01_x", "--", "--lab-postgres=none", "-p", "no:hypothesispytest")
    assert runner.run_main(args, console) != 0
    assert "PARTIAL by design" in sink.getvalue()
    assert "narrowed: path experiments/ch01_x" in sink.getvalue()


def test_a_run_that_writes_no_evidence_leaves_none_from_an_earlier_run(in_tree: Path) -> None:
    """Stale evidence cannot outlive a run that failed on a usage error."""
    stale = in_tree / "evidence"
    stale.mkdir()
    for name in compiler.RUN_FILES:
        (stale / name).write_text("from an earlier run\n")
    console, _ = _console()
    with pytest.raises(errors.UsageError, match="without writing"):
        runner.run_main(_args("--", "--no-such-option"), console)
    assert sorted(p.name for p in stale.iterdir()) == []


def test_summary_of_a_passing_report() -> None:
    """The summary names the verdict, the database, the signer and where the evidence is."""
    report = {
        "status": "PASS",
        "gate": {"failures": [], "narrowed": []},
        "experiments": [
            {
                "chapter": "ch05_crashes",
                "name": "test_sigkill",
                "outcome": "passed",
                "results": 2,
                "expected_results": 2,
                "duration": 3.5,
                "tests": ["n1", "n2"],
            }
        ],
        "tests": [{"nodeid": "n1", "observations": [{"effects": 1, "state": "succeeded"}]}],
        "postgresql": {"provider": "embedded", "server_version": "15.8"},
        "signing": {"keyid": "ab" * 32, "key_source": "key_file"},
        "commit": "c0ffee",
        "dirty": False,
    }
    console, sink = _console()
    summary.print_summary(report, Path("evidence"), console)
    out = sink.getvalue()
    assert re.search(r"ch05_crashes\s+│\s+1 of 1\s+│\s+3\.5", out), out
    assert "test_sigkill" not in out  # a full run lists what did not pass, not every row
    assert out.rstrip().splitlines()[-1] == "Gate: PASS"
    assert "PostgreSQL: embedded, 15.8" in out
    assert f"Signer: ed25519 key {'ab' * 32} (key_file)" in out
    assert "Commit: c0ffee\n" in out


def test_a_full_runs_summary_puts_counts_and_failures_first_and_the_verdict_last() -> None:
    """Counts per chapter, then every experiment that did not pass with its observation,
    then provenance, and the gate with its reasons as the last lines."""
    experiments = [{"chapter": "ch01_a", "name": f"test_{i}", "outcome": "passed",
                    "duration": 1.0, "tests": []} for i in range(3)]
    experiments += [{"chapter": "ch02_b", "name": "test_broken", "outcome": "failed",
                     "duration": 2.0, "tests": ["n9"]},
                    {"chapter": "ch02_b", "name": "test_gone", "outcome": "missing"}]
    report = {"status": "FAIL", "gate": {"failures": ["ch02_b/test_broken failed"],
                                         "narrowed": []},
              "experiments": experiments,
              "tests": [{"nodeid": "n9", "observations": [{"effects": 2}]}],
              "signing": {}, "commit": "c0ffee"}
    console, sink = _console()
    summary.print_summary(report, Path("evidence"), console)
    lines = sink.getvalue().rstrip().splitlines()
    text = "\n".join(lines)
    assert re.search(r"ch01_a\s+│\s+3 of 3", text) and re.search(r"ch02_b\s+│\s+0 of 2", text)
    assert "test_0" not in text
    broken = next(i for i, line in enumerate(lines) if "test_broken" in line)
    gone = next(i for i, line in enumerate(lines) if "test_gone" in line)
    assert '{"effects": 2}' in lines[broken]
    commit = lines.index("Commit: c0ffee")
    assert max(broken, gone) < commit < lines.index("Gate: FAIL")
    assert lines[-2:] == ["Gate: FAIL", "  failed: ch02_b/test_broken failed"]


def test_shorten_cuts_long_observations() -> None:
    """Observations are compact JSON, cut with an ellipsis."""
    assert summary.shorten({"b": 1, "a": 2}) == '{"a": 2, "b": 1}'
    assert summary.shorten("x" * 100, 10) == "x" * 9 + "…"


def test_the_database_a_run_asks_for_is_read_from_its_pytest_arguments() -> None:
    """``--lab-postgres``/``--lab-dsn`` in either spelling, the last one winning."""
    assert runner.requested_database([]) == ("auto", None, False)
    assert runner.requested_database(
        ["--lab-postgres", "dsn", "--lab-dsn=host=127.0.0.1", "-q"]) == ("dsn", "host=127.0.0.1",
                                                                        False)
    assert runner.requested_database(
        ["--lab-postgres=dsn", "--lab-postgres=embedded", "--lab-allow-remote-dsn"]
    ) == ("embedded", None, True)


def _refusing_port() -> tuple[socket.socket, int]:
    """A loopback port bound but not listening: a connection to it is refused."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    return held, held.getsockname()[1]


def test_an_unreachable_dsn_stops_the_run_before_pytest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One line, exit 3, no test collected and no evidence written (a real process)."""
    _tree(tmp_path)
    held, port = _refusing_port()
    with held:
        env = {**os.environ, "BOOK_LAB_DSN": f"postgresql://x:s3cret@127.0.0.1:{port}/db"}
        env.pop("PYTEST_ADDOPTS", None)
        done = subprocess.run([sys.executable, "-m", "lab.cli", "run"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == errors.EXIT_ENVIRONMENT, done.stderr
    assert done.stderr.splitlines() == [
        f"lab run: PostgreSQL at 127.0.0.1:{port} cannot be reached: Connection refused "
        "(the DSN of BOOK_LAB_DSN or --lab-dsn)"]
    assert done.stdout == "" and "s3cret" not in done.stderr
    assert not (tmp_path / "evidence").exists()


def test_a_dsn_is_probed_only_when_the_run_would_use_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another provider asked for: the DSN in the environment is not the run's, no probe."""
    held, port = _refusing_port()
    with held:
        environ = {"BOOK_LAB_DSN": f"postgresql://x@127.0.0.1:{port}/db"}
        runner.check_database(["--lab-postgres", "none"], environ)
        runner.check_database(["--lab-postgres=embedded"], environ)
        with pytest.raises(errors.ProvisioningError, match="cannot be reached"):
            runner.check_database([], environ)
        with pytest.raises(errors.ProvisioningError, match="cannot be reached"):
            runner.check_database([], {"PYTEST_ADDOPTS": f"--lab-dsn 'host=127.0.0.1 port={port}'"})


def test_a_run_with_no_way_to_a_server_stops_before_pytest(tmp_path: Path) -> None:
    """No DSN, no Docker daemon, no server binaries (a directory without them is named):
    the run stops in one paragraph naming each fix, before any test."""
    empty = tmp_path / "bin"
    empty.mkdir()
    environ = {"LAB_PG_BINARIES": str(empty), "DOCKER_HOST": f"unix://{tmp_path}/none.sock"}
    with pytest.raises(errors.ProvisioningError, match="No PostgreSQL server could be provided"):
        runner.check_database([], environ)
    with pytest.raises(errors.ProvisioningError, match="needs PostgreSQL server binaries"):
        runner.check_database(["--lab-postgres", "embedded"], environ)
    runner.check_database(["--lab-postgres=none"], environ)
