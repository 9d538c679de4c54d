"""``lab run``: run the experiments in a pytest subprocess and summarise the evidence.

pytest does the work (and the lab plugin writes and signs the evidence); this
module only builds the command, streams pytest's output and then renders the
signed report, with the same function ``lab evidence show`` uses.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from lab import evidence, gate, summary

EXPERIMENTS = "experiments"


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
        out.print(f"[red]no such experiments directory: {missing or EXPERIMENTS}[/red]")
        return 2
    if chapters:
        out.print(
            f"[yellow]Only {', '.join(chapters)}: a narrowed run is PARTIAL by design and "
            "never passes the gate.[/yellow]"
        )
    command = pytest_command(args)
    out.print(f"[dim]$ {' '.join(command)}[/dim]")
    started = time.time()
    # pytest's own progress streams straight to the terminal.
    completed = subprocess.run(command, check=False)
    report_path = Path(args.evidence) / evidence.REPORT_FILE
    if not report_path.is_file() or report_path.stat().st_mtime < started:
        out.print(f"[red]pytest exited {completed.returncode} without writing {report_path}[/red]")
        return completed.returncode or 1
    report = json.loads(report_path.read_text(encoding="utf-8"))
    summary.print_summary(report, Path(args.evidence), out)
    if report.get("status") != gate.PASS:
        return completed.returncode or 1
    return completed.returncode
