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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from lab import evidence

EXPERIMENTS = "experiments"
_STYLE = {
    evidence.PASS: "bold green",
    evidence.PARTIAL: "bold yellow",
    evidence.FAIL: "bold red",
    evidence.PASSED: "green",
    "missing": "red",
}


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
    out = console or _console()
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
    print_summary(report, Path(args.evidence), out)
    if report.get("status") != evidence.PASS:
        return completed.returncode or 1
    return completed.returncode


def _console() -> Console:
    # Experiment names are long: off a terminal (CI logs) use a wide page, not 80 columns.
    probe = Console()
    return probe if probe.is_terminal else Console(width=200)


def shorten(value: Any, width: int = 60) -> str:
    """Compact JSON of an observation, cut to ``width`` characters."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= width else text[: width - 1] + "…"


def _observation(report: Mapping[str, Any], row: Mapping[str, Any]) -> str:
    by_node = {t["nodeid"]: t for t in report.get("tests", [])}
    for nodeid in row.get("tests", []):
        test = by_node.get(nodeid, {})
        if test.get("observations"):
            return shorten(test["observations"][0])
        if test.get("message"):
            return shorten(test["message"])
    return ""


def print_summary(
    report: Mapping[str, Any], directory: Path, console: Console | None = None
) -> None:
    """Render a report: one row per experiment, the verdict, PostgreSQL, signer, location."""
    out = console or _console()
    table = Table(title="Experiments", show_lines=False)
    # Result and time must stay legible; the observation gives way on narrow screens.
    table.add_column("chapter", overflow="fold")
    table.add_column("experiment", overflow="fold")
    table.add_column("result", no_wrap=True)
    table.add_column("seconds", justify="right", no_wrap=True)
    table.add_column("key observation", overflow="fold", max_width=60)
    for row in report.get("experiments", []):
        outcome = str(row.get("outcome"))
        expected = row.get("expected_results")
        count = f" {row.get('results')}/{expected}" if expected and expected != 1 else ""
        table.add_row(
            str(row.get("chapter")),
            str(row.get("name")),
            Text(outcome + count, style=_STYLE.get(outcome, "red")),
            f"{float(row.get('duration') or 0.0):.2f}",
            _observation(report, row),
        )
    out.print(table)

    status = str(report.get("status"))
    gate = report.get("gate", {})
    out.print(Text(f"Gate: {status}", style=_STYLE.get(status, "bold red")))
    for reason in gate.get("narrowed", []):
        out.print(f"  narrowed: {reason}")
    for failure in gate.get("failures", []):
        out.print(Text(f"  failed: {failure}", style="red"))

    database = report.get("postgresql")
    if database:
        out.print(
            f"PostgreSQL: {database.get('provider', '?')}, {database.get('server_version', '?')}"
        )
        details = database.get("details") or {}
        # Provenance: the binaries path, the image digest or the DSN's host, as recorded.
        for name in ("binaries", "method", "image", "image_digest", "host", "port"):
            if details.get(name):
                out.print(Text(f"  {name}: {details[name]}"))
    else:
        out.print(Text("PostgreSQL: none reached", style="red"))

    signing = report.get("signing", {})
    source = signing.get("key_source", "?")
    label = "EPHEMERAL key: integrity only, not identity" if source == "ephemeral" else source
    out.print(f"Signer: ed25519 key {signing.get('keyid', '?')} ({label})")
    commit = report.get("commit") or "unknown commit"
    dirty = " (dirty tree)" if report.get("dirty") else ""
    out.print(f"Commit: {commit}{dirty}")
    out.print(
        f"Evidence: {directory / evidence.ENVELOPE_FILE} "
        f"(check with: lab evidence verify {directory})"
    )
