"""``lab run``: run the experiments in a pytest subprocess and summarise the compiler.

pytest does the work (and the lab plugin writes and signs the evidence); this
module only builds the command, streams pytest's output and then renders the
signed report, with the same function ``lab evidence show`` uses.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from lab import errors, files
from lab.evidence import compiler, gate, summary

EXPERIMENTS = "experiments"
pytest_usage_error = 4  # pytest.ExitCode.USAGE_ERROR, without importing pytest here


def pytest_command(args: argparse.Namespace) -> list[str]:
    """The pytest invocation of ``lab run`` for its parsed arguments."""
    chapters: Sequence[str] = args.chapter or []
    targets = [f"{EXPERIMENTS}/{chapter}" for chapter in chapters] or [EXPERIMENTS]
    # Experiments use no hypothesis; its plugin costs ~1.6 s of imports per process.
    command = [sys.executable, "-m", "pytest", *targets, "-p", "no:cacheprovider",
               "-p", "no:hypothesispytest"]
    command += ["--lab-evidence", str(args.evidence)]
    if args.numprocesses:
        command += ["-n", str(args.numprocesses)]
    extra = list(args.pytest_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    return command + extra


def run_main(args: argparse.Namespace, console: Console | None = None) -> int:
    """Run the experiments, print the summary; exit 0 only when the gate says PASS."""
    out = console or summary.console_for_output()
    chapters: Sequence[str] = args.chapter or []
    missing = [c for c in chapters if not (Path(EXPERIMENTS) / c).is_dir()]
    if not Path(EXPERIMENTS).is_dir() or missing:
        named = ", ".join(missing) or EXPERIMENTS
        raise errors.UsageError(f"no such experiments directory: {named}")
    if chapters:
        out.print(
            f"[yellow]Only {', '.join(chapters)}: a narrowed run is PARTIAL by design and "
            "never passes the gate.[/yellow]"
        )
    command = pytest_command(args)
    out.print(f"[dim]$ {' '.join(command)}[/dim]")
    directory = Path(args.evidence)
    # Evidence of an earlier run must not survive a run that writes none (a usage
    # error, a crash): whatever is in the directory afterwards is this run's.
    for name in compiler.RUN_FILES:
        (directory / name).unlink(missing_ok=True)
    # pytest's own progress streams straight to the terminal.
    completed = subprocess.run(command, check=False)
    report_path = directory / compiler.REPORT_FILE
    if not report_path.is_file():
        message = f"pytest exited {completed.returncode} without writing {report_path}"
        if completed.returncode == pytest_usage_error:
            raise errors.UsageError(message)
        raise errors.CheckFailed(message)
    report = files.read_json(report_path, files.REPORT_LIMIT, "report")
    summary.print_summary(report, Path(args.evidence), out)
    if report.get("status") != gate.PASS:
        return completed.returncode or 1
    return completed.returncode
