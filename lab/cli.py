"""The lab command: admit, run, verify, publish.

Subcommands are thin: each parses its arguments, turns them into the command's typed
options (``options_from``, the one place a parsed namespace becomes options) and calls
one module's entry point with them, so every behaviour lives (and is tested) in its
module. This module declares every command, with its help; each command's flags are
declared once, by the fields of its options dataclass in the module that owns the
command (``lab.options.option``), and ``lab.parsing.add_options`` builds them from it,
importing that module only when the command is used (``lab.parsing`` also shows each
default and suggests the command meant). Apart from the child processes run with
``python -m`` that parse their own argv, nothing else builds a command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lab import errors, parsing, verify
from lab.parsing import options_from as options_from  # re-exported: the tests use cli's

Commands = argparse._SubParsersAction  # the type of ``add_subparsers()``'s result


def _plancheck(args: argparse.Namespace) -> int:
    """``lab plancheck``: admit one proposal from stdin (no options); never execute."""
    # Imported here: jsonschema would add to every worker process's start-up.
    from lab.runtime import proposal

    raw = sys.stdin.buffer.read(proposal.MAX_PROPOSAL_BYTES + 1)
    try:
        plan = proposal.admit(raw)
    except errors.Rejected as exc:
        print(str(exc), file=sys.stderr)
        return 1
    json.dump(
        {
            "admitted": True,
            "fingerprint": plan.fingerprint(),
            "plan": plan.to_json(),
            "next_required_stage": "persist_then_wait_for_approval",
        },
        sys.stdout,
        sort_keys=True,
    )
    sys.stdout.write("\n")
    return 0


def _worker(args: argparse.Namespace) -> int:
    from lab.runtime import processes
    return processes.worker_main(options_from(processes.WorkerOptions, args))


def _run(args: argparse.Namespace) -> int:
    from lab import runner

    return runner.run_main(options_from(runner.RunOptions, args))


def _evidence(args: argparse.Namespace) -> int:
    return verify.verify_main(options_from(verify.EvidenceOptions, args))


def _compare(args: argparse.Namespace) -> int:
    from lab import reproduce

    return reproduce.compare_main(options_from(reproduce.CompareOptions, args))


def _manifest(args: argparse.Namespace) -> int:
    from lab.evidence import manifest

    return manifest.cli_main(options_from(manifest.ManifestOptions, args))


def _model_run(args: argparse.Namespace) -> int:
    from lab.model import command as model_command

    return model_command.run_main(options_from(model_command.RunOptions, args))


def _model_check(args: argparse.Namespace) -> int:
    from lab.model import command as model_command

    return model_command.check_main(options_from(model_command.CheckOptions, args))


def _publish(args: argparse.Namespace) -> int:
    from lab import publish

    return publish.cli_main(options_from(publish.PublishOptions, args))


def _chaos(args: argparse.Namespace) -> int:
    from lab.faults import chaos_command

    return chaos_command.cli_main(options_from(chaos_command.ChaosOptions, args))


def _soak(args: argparse.Namespace) -> int:
    from lab.faults import soak

    return soak.cli_main(options_from(soak.SoakOptions, args))


def _bench(args: argparse.Namespace) -> int:
    from lab.bench import command as bench_command

    kinds: dict[str, type[bench_command.BenchOptions]] = {
        "throughput": bench_command.ThroughputOptions, "claim": bench_command.ClaimOptions,
        "suite": bench_command.SuiteOptions, "startup": bench_command.StartupOptions,
    }
    return bench_command.cli_main(options_from(kinds[args.bench_command], args))


def _book(args: argparse.Namespace) -> int:
    from lab.book import builder
    from lab.model import signed  # handed down: the book never imports lab.model

    return builder.cli_main(options_from(builder.BuildOptions, args), model_verifier=signed.verify)


def _crashpoints(args: argparse.Namespace) -> int:
    from lab.faults import crashpoints

    return crashpoints.cli_main(options_from(crashpoints.CrashpointsOptions, args))


def _review(args: argparse.Namespace) -> int:
    from lab import review

    kinds: dict[str, type[review.ReviewOptions]] = {
        "list": review.ReviewOptions, "show": review.ShowOptions,
        "requeue": review.RequeueOptions, "resolve": review.ResolveOptions,
    }
    return review.cli_main(options_from(kinds[args.review_command], args))


def _reproduce(args: argparse.Namespace) -> int:
    from lab import reproduce

    return reproduce.cli_main(options_from(reproduce.ReproduceOptions, args))


def _add_worker(commands: Commands[parsing.Parser]) -> None:
    worker = commands.add_parser("worker", help="run one work item as an OS process")
    parsing.add_options(worker, "lab.runtime.processes:WorkerOptions")
    worker.set_defaults(handler=_worker)


def _add_run(commands: Commands[parsing.Parser]) -> None:
    run = commands.add_parser("run", help="run the experiments and sign the evidence")
    parsing.add_options(run, "lab.runner:RunOptions")
    run.set_defaults(handler=_run)


def _add_reproduce(commands: Commands[parsing.Parser]) -> None:
    again = commands.add_parser(
        "reproduce", help="re-run signed evidence's commit hermetically, compare its facts")
    parsing.add_options(again, "lab.reproduce:ReproduceOptions")
    again.set_defaults(handler=_reproduce)


def _add_evidence(commands: Commands[parsing.Parser]) -> None:
    ev = commands.add_parser("evidence", help="verify, show or compare signed evidence")
    ev_commands = ev.add_subparsers(dest="evidence_command", required=True)
    verify_parser = ev_commands.add_parser("verify", help="verify the signed evidence offline")
    show = ev_commands.add_parser("show", help="verify, then print the summary of the report")
    for ev_command in (verify_parser, show):
        parsing.add_options(ev_command, verify.EvidenceOptions)
    compare = ev_commands.add_parser(
        "compare", help="verify two runs and compare their facts; exit 1 naming any that differ")
    parsing.add_options(compare, "lab.reproduce:CompareOptions")
    ev.set_defaults(handler=_evidence)
    compare.set_defaults(handler=_compare)


def _add_manifest(commands: Commands[parsing.Parser]) -> None:
    man = commands.add_parser("manifest", help="keep experiments/manifest.json in step")
    man_commands = man.add_subparsers(dest="manifest_command", required=True)
    for sub, text in (("sync", "rewrite it from collection (exact counts), show the diff"),
                      ("check", "exit 1 naming each difference from collection")):
        parsing.add_options(man_commands.add_parser(sub, help=text),
                            "lab.evidence.manifest:ManifestOptions")
    man.set_defaults(handler=_manifest)


def _add_model(commands: Commands[parsing.Parser]) -> None:
    mdl = commands.add_parser("model", help="model-generation traces")
    mdl_commands = mdl.add_subparsers(dest="model_command", required=True)
    mrun = mdl_commands.add_parser("run", help="generate proposals, admit them, sign the traces")
    parsing.add_options(mrun, "lab.model.command:RunOptions")
    mrun.set_defaults(handler=_model_run)
    mcheck = mdl_commands.add_parser("check", help="re-check a model experiment report")
    parsing.add_options(mcheck, "lab.model.command:CheckOptions")
    mcheck.set_defaults(handler=_model_check)


def _add_publish(commands: Commands[parsing.Parser]) -> None:
    pub = commands.add_parser("publish", help="run, verify and build the publication, or refuse")
    parsing.add_options(pub, "lab.publish:PublishOptions")
    pub.set_defaults(handler=_publish)


def _add_chaos(commands: Commands[parsing.Parser]) -> None:
    chaos = commands.add_parser("chaos", help="random crashes and faults, then an invariant check")
    parsing.add_options(chaos, "lab.faults.chaos_command:ChaosOptions")
    chaos.set_defaults(handler=_chaos)


def _add_soak(commands: Commands[parsing.Parser]) -> None:
    soak = commands.add_parser("soak", help="a long run mixing every fault, memory sampled")
    parsing.add_options(soak, "lab.faults.soak:SoakOptions")
    soak.set_defaults(handler=_soak)


def _add_crashpoints(commands: Commands[parsing.Parser]) -> None:
    crash = commands.add_parser(
        "crashpoints", help="every named boundary, fault and tool kind, then the invariants"
    )
    parsing.add_options(crash, "lab.faults.crashpoints:CrashpointsOptions")
    crash.set_defaults(handler=_crashpoints)


def _add_bench(commands: Commands[parsing.Parser]) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print figures (never timed tests)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    throughput = bench_commands.add_parser(
        "throughput", help="workflows/s through worker processes"
    )
    parsing.add_options(throughput, "lab.bench.command:ThroughputOptions", inherited=False)
    claim = bench_commands.add_parser("claim", help="claim latency as finished history grows")
    parsing.add_options(claim, "lab.bench.command:ClaimOptions", inherited=False)
    # suite and startup have no flags of their own: only ``lab bench``'s.
    bench_commands.add_parser("suite", help="experiment suite wall time, serial and parallel")
    bench_commands.add_parser("startup", help="provisioning and worker spawn-to-ready times")
    parsing.add_options(bench, "lab.bench.command:OutputOptions")
    bench.set_defaults(handler=_bench)


def _add_review(commands: Commands[parsing.Parser]) -> None:
    review = commands.add_parser("review", help="list and decide work in manual review")
    parsing.add_options(review, "lab.review:ReviewOptions")
    review_commands = review.add_subparsers(dest="review_command", required=True)
    # list has no flags of its own: only ``lab review``'s.
    review_commands.add_parser("list", help="workflows waiting for a person")
    for sub, kind, text in (("show", "ShowOptions", "one workflow with its proof"),
                            ("requeue", "RequeueOptions", "send back to the queue"),
                            ("resolve", "ResolveOptions", "close it by hand")):
        parsing.add_options(review_commands.add_parser(sub, help=text), f"lab.review:{kind}",
                            inherited=False)
    review.set_defaults(handler=_review)


def _add_book(commands: Commands[parsing.Parser]) -> None:
    book = commands.add_parser("book", help="publication artifacts from verified evidence")
    book_commands = book.add_subparsers(dest="book_command", required=True)
    build = book_commands.add_parser(
        "build", help="the book's site and pages from book/ and signed evidence")
    parsing.add_options(build, "lab.book.builder:BuildOptions")
    book.set_defaults(handler=_book)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``lab`` command: one small builder per command group."""
    parser = parsing.Parser(prog="lab", description=__doc__.splitlines()[0])
    parsing.add_version(parser, f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("plancheck", help="admit one proposal from stdin; never execute")
    check.set_defaults(handler=_plancheck)
    # In this order: ``lab --help`` lists the commands as they are added.
    for add in (_add_worker, _add_run, _add_reproduce, _add_evidence, _add_manifest, _add_model,
                _add_publish, _add_chaos, _add_soak, _add_crashpoints, _add_bench, _add_review,
                _add_book):
        add(commands)
    return parser


def _version() -> str:
    """The installed distribution's version, with the lab's import path (which tree ran)."""
    from importlib import metadata

    try:
        version = metadata.version("durable-agent-lab")
    except metadata.PackageNotFoundError:
        version = "(not installed)"
    return f"{version} ({Path(__file__).resolve().parent})"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lab`` console script.

    The one place where a failure becomes a message and an exit code: every
    subcommand raises ``errors.LabError`` subclasses and ``errors.exit_code``
    picks the code from the table in ``lab.errors``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    # A pool's retries are logged as warnings; the one-line error below says what failed.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    name = " ".join(
        str(part) for part in (args.command, *_subcommand(args)) if part
    )
    try:
        code: int = args.handler(args)
    except errors.LabError as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, errors.Refused):
            message = f"refused: {message}"
        print(f"lab {name}: {message}", file=sys.stderr)
        return errors.exit_code(exc)
    except KeyboardInterrupt:
        print(f"lab {name}: interrupted", file=sys.stderr)
        return errors.EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``| head``): say nothing more, and keep Python's
        # own flush at exit from raising again on the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return errors.EXIT_VERDICT
    return code


def _subcommand(args: argparse.Namespace) -> list[str]:
    return [
        getattr(args, attribute)
        for attribute in ("evidence_command", "manifest_command", "model_command", "bench_command",
                          "review_command", "book_command")
        if getattr(args, attribute, None)
    ]


if __name__ == "__main__":
    sys.exit(main())
