"""``lab model run|check``: a real GGUF model proposes, strict admission judges.

``lab model run`` loads one GGUF file (``engine``), generates every case of the
case set (``cases``) unconstrained and grammar-constrained, judges every
candidate (``candidates``), writes the report (``generation``) and signs it
with every trace (``signed``). ``lab model check REPORT`` re-checks a
written report's rows. This module is only the commands' glue.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lab import errors
from lab.evidence import dsse
from lab.model import cases, engine, generation, signed
from lab.options import option


@dataclass(frozen=True)
class RunOptions:
    """What ``lab model run`` is asked to do: its flags, declared here."""

    model: str | None = option(
        None, help="GGUF file (default: LAB_MODEL_PATH, else the fetched SmolLM2)")
    expect_sha256: str | None = option(
        None, metavar="SHA", help="refuse a model file whose sha256 differs")
    cases: str | None = option(None, help="case set file (default: the lab's own)")
    case: tuple[str, ...] = option((), help="only this case id")
    evidence: str = option("evidence/model", help="model evidence directory")
    threads: int | None = option(None, help="CPU threads (default 2)")


@dataclass(frozen=True)
class CheckOptions:
    """What ``lab model check`` is asked to do: the report to re-check."""

    report: str = option(help="the model-experiment.json to re-check", positional=True)


def run_main(options: RunOptions) -> int:
    """``lab model run``: 0 with the signed evidence written and no unsafe plan, else 1.

    Every input is checked before the model is loaded and nothing is written
    until every generation is done, so unusable input changes nothing.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    model_path = Path(options.model) if options.model else engine.default_model_path()
    if model_path is None:
        raise errors.UsageError(
            f"no --model given, {engine.MODEL_PATH_ENV} unset and no {engine.TINY_DEFAULT_PATH} "
            "(scripts/fetch-model --tiny fetches it)"
        )
    model = engine.verify_model(model_path, options.expect_sha256)
    case_set = cases.load(Path(options.cases) if options.cases else None)
    if options.case:
        case_set = cases.subset(case_set, list(options.case))
    signed.check_target(Path(options.evidence))
    signer = dsse.load_signer()
    model_engine = engine.Engine(model, options.threads or engine.THREADS)
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    directory = Path(options.evidence)
    with tempfile.TemporaryDirectory(prefix="lab-model-") as scratch:
        traces = Path(scratch) / generation.TRACES_DIR
        with Progress(*columns, console=Console(stderr=True)) as progress:
            report = generation.run(model_engine, case_set, traces, progress)
        signed.write(directory, report, traces, case_set, signer)
    print(directory / generation.REPORT_FILE)
    unsafe = {mode: counts["unsafe"] for mode, counts in report["summary"].items()}
    print(
        f"{len(report['cases'])} generations, unsafe per mode {unsafe}, "
        f"load {report['load_seconds']:.2f} s, total {report['total_seconds']:.1f} s",
        file=sys.stderr,
    )
    return 1 if any(unsafe.values()) else 0


def check_main(options: CheckOptions) -> int:
    """``lab model check REPORT``: 0 when the report's rows hold, 1 naming each problem."""
    path = Path(options.report)
    try:
        with path.open("rb") as handle:
            data = handle.read(signed.MAX_REPORT_BYTES + 1)
        report = json.loads(data)
    except (OSError, ValueError) as exc:
        raise errors.InputError(f"cannot read report {path}: {exc}") from exc
    if len(data) > signed.MAX_REPORT_BYTES or not isinstance(report, dict):
        raise errors.InputError(f"{path} is not a model experiment report")
    problems = generation.check(report)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    print(f"{path}: {len(report['cases'])} generations checked")
    return 0
