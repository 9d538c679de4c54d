"""The lab command: admit, run, verify, publish.

Subcommands are thin: each parses its arguments, turns them into the command's typed
options (``options_from``, the one place a parsed namespace becomes options) and calls
one module's entry point with them, so every behaviour lives (and is tested) in its
module. This module declares every command and option (with help; ``lab.parsing`` shows
each default and suggests the command meant), and ``lab.fault_arguments`` the flags
``lab chaos`` and ``lab soak`` share; no other module of ``lab/`` builds the ``lab``
command line, apart from the child processes run with ``python -m`` that parse their
own argv.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lab import errors, fault_arguments, parsing, protocol, verify
from lab.parsing import options_from as options_from  # re-exported: the tests use cli's
from lab.pg import providers

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


def _lab_postgres_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lab-postgres", default=providers.AUTO, choices=providers.MODES,
                        help=providers.MODE_HELP)


def _add_worker(commands: Commands[parsing.Parser]) -> None:
    worker = commands.add_parser("worker", help="run one work item as an OS process")
    worker.add_argument("--schema", required=True, help="the experiment's isolated schema")
    worker.add_argument("--tool", required=True, help="loopback tool endpoint")
    worker.add_argument("--name", default="worker-process", help="owner name for claims")
    worker.add_argument("--pause", choices=protocol.PROCESS_STAGES, default=None,
                        help="wait for a stdin newline at this boundary")
    worker.add_argument("--crash-at", choices=protocol.PROCESS_STAGES, default=None,
                        help="SIGKILL itself the moment it reaches this boundary")
    worker.add_argument("--armed-by-stdin", action="store_true",
                        help="--crash-at and --pause act once a stdin line armed them")
    worker.add_argument("--start-gate", action="store_true", help="wait for a stdin newline")
    worker.add_argument("--reconcile", default=None, help="reconcile this unknown workflow first")
    worker.add_argument("--lease", type=float, default=3.0, help="lease seconds")
    worker.add_argument("--loop", action="store_true",
                        help="keep running items until idle for --idle-exit")
    worker.add_argument("--idle-exit", type=float, default=2.0, help="seconds idle before exit")
    worker.add_argument("--max-items", type=int, default=0, help="stop after N items (0: none)")
    worker.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat seconds")
    worker.add_argument("--backoff", type=float, default=0.1, help="429 backoff seconds")
    worker.add_argument("--tool-timeout", type=float, default=protocol.TOOL_TIMEOUT_S,
                        help="seconds to wait for the tool's reply before its outcome is "
                             "unknown")
    worker.add_argument(
        "--fused", action="store_true",
        help="with --loop: complete each item in the next claim's transaction, and commit "
             "an idempotent claim with its start barrier (boundary after_claim_barrier)",
    )
    worker.add_argument(
        "--quiet", action="store_true",
        help=f"print no {protocol.STAGE} or {protocol.ITEM} lines (a production worker: "
             "--crash-at and --pause still act at their boundary)",
    )
    worker.add_argument(
        "--batch", type=int, default=1,
        help="with --fused: claim up to N items per transaction and send their requests "
             "together (boundary after_batch); a crash leaves all N to recovery",
    )
    worker.add_argument(
        "--concurrency", type=int, default=1,
        help="with --loop: keep N items in flight, one per thread, each with its own claim, "
             "barrier and completion transactions (owner NAME.K); a crash leaves all N to "
             "recovery, a refused transaction one",
    )
    worker.set_defaults(handler=_worker)


def _add_run(commands: Commands[parsing.Parser]) -> None:
    run = commands.add_parser("run", help="run the experiments and sign the evidence")
    run.add_argument("--chapter", action="append", default=[], help="only this chapter")
    run.add_argument("-n", "--numprocesses", default=None, metavar="N",
                     help="pytest-xdist workers (none: one process, no xdist)")
    run.add_argument("--evidence", default="evidence", help="evidence directory")
    run.add_argument("--hermetic", action="store_true",
                     help="run the committed revision in a fresh clone on the locked "
                          "environment, isolated (the only publishable kind of run)")
    run.add_argument("--beside-load", type=int, default=0, metavar="N",
                     help="run beside N busy-loop processes (signed as --lab-beside-load)")
    run.add_argument("--commit", default=None, metavar="REV",
                     help="with --hermetic: the revision to run (default HEAD)")
    run.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest arguments")
    run.set_defaults(handler=_run)


def _add_reproduce(commands: Commands[parsing.Parser]) -> None:
    again = commands.add_parser(
        "reproduce", help="re-run signed evidence's commit hermetically, compare its facts")
    again.add_argument("evidence", help="the evidence directory to reproduce")
    again.add_argument("--runs", type=int, default=1, help="re-run K times; count each fact")
    again.add_argument("--out", default="reproduction", help="the reproduction's evidence")
    again.add_argument("--public-key", default=None,
                       help="PEM of the expected signer of the evidence (the only key accepted)")
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
    compare.add_argument("first", help="the first run's evidence directory")
    compare.add_argument("second", help="the second run's evidence directory")
    compare.add_argument("--public-key", default=None,
                         help="PEM of the expected signer of both (the only key accepted; "
                              "default: each run's own key)")
    ev.set_defaults(handler=_evidence)
    compare.set_defaults(handler=_compare)


def _add_manifest(commands: Commands[parsing.Parser]) -> None:
    man = commands.add_parser("manifest", help="keep experiments/manifest.json in step")
    man_commands = man.add_subparsers(dest="manifest_command", required=True)
    from lab.evidence import manifest

    for sub, text in (("sync", "rewrite it from collection (exact counts), show the diff"),
                      ("check", "exit 1 naming each difference from collection")):
        parsing.add_options(man_commands.add_parser(sub, help=text), manifest.ManifestOptions)
    man.set_defaults(handler=_manifest)


def _add_model(commands: Commands[parsing.Parser]) -> None:
    mdl = commands.add_parser("model", help="model-generation traces")
    mdl_commands = mdl.add_subparsers(dest="model_command", required=True)
    mrun = mdl_commands.add_parser("run", help="generate proposals, admit them, sign the traces")
    mrun.add_argument("--model", default=None,
                      help="GGUF file (default: LAB_MODEL_PATH, else the fetched SmolLM2)")
    mrun.add_argument("--expect-sha256", default=None, metavar="SHA",
                      help="refuse a model file whose sha256 differs")
    mrun.add_argument("--cases", default=None, help="case set file (default: the lab's own)")
    mrun.add_argument("--case", action="append", default=[], help="only this case id")
    mrun.add_argument("--evidence", default="evidence/model", help="model evidence directory")
    mrun.add_argument("--threads", type=int, default=None, help="CPU threads (default 2)")
    mrun.set_defaults(handler=_model_run)
    mcheck = mdl_commands.add_parser("check", help="re-check a model experiment report")
    mcheck.add_argument("report", help="the model-experiment.json to re-check")
    mcheck.set_defaults(handler=_model_check)


def _add_publish(commands: Commands[parsing.Parser]) -> None:
    pub = commands.add_parser("publish", help="run, verify and build the publication, or refuse")
    pub.add_argument("--out", required=True, help="directory for evidence/ and book/")
    pub.add_argument("--model", default=None, help="GGUF model for the case set")
    pub.add_argument("--expect-sha256", default=None, help="the model's pinned sha256")
    pub.add_argument("--public-key", default=None, help="PEM the evidence must verify under")
    pub.add_argument("--threads", type=int, default=None, help="model CPU threads (default 2)")
    pub.add_argument("-n", "--numprocesses", default=None, metavar="N",
                     help="pytest-xdist workers (none: one process)")
    pub.set_defaults(handler=_publish)


def _add_chaos(commands: Commands[parsing.Parser]) -> None:
    chaos = commands.add_parser("chaos", help="random crashes and faults, then an invariant check")
    chaos.add_argument("--workflows", type=int, default=500, help="workflows in the round")
    chaos.add_argument("--workers", type=int, default=4, help="worker processes at a time")
    chaos.add_argument("--duration", type=float, default=60.0, help="seconds of faults at most")
    chaos.add_argument("--kill-every", type=float, default=200.0, help="mean ms between SIGKILLs")
    fault_arguments.in_flight_arguments(chaos)
    chaos.add_argument("--drop-replies", type=float, default=0.1, help="share of replies lost")
    chaos.add_argument("--reject-429", type=float, default=0.1, help="share of 429 answers")
    chaos.add_argument("--terminate-backends", type=float, default=2000.0,
                       help="mean ms between pg_terminate_backend of a worker (0: never)")
    chaos.add_argument("--non-idempotent-share", type=float, default=0.2,
                       help="share of workflows on the non-idempotent tool")
    chaos.add_argument("--non-idempotent-fenced", action="store_true",
                       help="the non-idempotent tool offers the fenced lookup: its unknowns "
                            "whose lookup is absent are requeued with proof, not reviewed")
    chaos.add_argument("--seed", type=int, default=42, help="seed of the fault schedule")
    chaos.add_argument("--restart-postgres-every", type=float, default=0.0, metavar="MS",
                       help="SIGKILL and restart PostgreSQL about every MS (0: never; "
                            "implies --durable; embedded provider)")
    chaos.add_argument("--min-restarts", type=int, default=2, metavar="N",
                       help="with restarts, the fault phase lasts until N happened (within "
                            "--duration), even when all work settled sooner")
    chaos.add_argument("--partition-every", type=float, default=0.0, metavar="MS",
                       help="cut one link (blackhole or reset) about every MS (0: never); "
                            "the fault phase lasts until one partition healed")
    chaos.add_argument("--partition-for", type=float, default=1000.0, metavar="MS",
                       help="how long a partition lasts")
    chaos.add_argument("--latency", type=float, default=0.0, metavar="MS",
                       help="delay on every proxied link")
    chaos.add_argument("--durable", action="store_true",
                       help="run PostgreSQL with fsync=on and synchronous_commit=on")
    fault_arguments.release_argument(chaos, 0.0, "0, all at once")
    fault_arguments.database_fault_arguments(chaos)
    fault_arguments.host_arguments(chaos)
    chaos.add_argument("--output", default="evidence/chaos.json", help="the report (JSON)")
    _lab_postgres_argument(chaos)
    chaos.set_defaults(handler=_chaos)


def _add_soak(commands: Commands[parsing.Parser]) -> None:
    soak = commands.add_parser("soak", help="a long run mixing every fault, memory sampled")
    soak.add_argument("--workflows", type=int, default=100_000, help="workflows in all")
    soak.add_argument("--round", type=int, default=2_000, metavar="N",
                      help="workflows per chaos round (each checked, then dropped)")
    soak.add_argument("--workers", type=int, default=4, help="worker processes at a time")
    fault_arguments.in_flight_arguments(soak)
    soak.add_argument("--kill-every", type=float, default=1000.0, metavar="MS",
                      help="mean ms between SIGKILLs of a worker")
    soak.add_argument("--drop-replies", type=float, default=0.05, help="share of replies lost")
    soak.add_argument("--reject-429", type=float, default=0.05, help="share of 429 answers")
    soak.add_argument("--terminate-backends", type=float, default=3000.0, metavar="MS",
                      help="mean ms between pg_terminate_backend of a worker (0: never)")
    soak.add_argument("--non-idempotent-share", type=float, default=0.2,
                      help="share of workflows on the non-idempotent tool")
    soak.add_argument("--seed", type=int, default=42, help="seed of the fault schedules")
    soak.add_argument("--restart-postgres-every", type=float, default=30_000.0, metavar="MS",
                      help="SIGKILL and restart PostgreSQL about every MS (0: never)")
    soak.add_argument("--partition-every", type=float, default=15_000.0, metavar="MS",
                      help="cut one link (blackhole or reset) about every MS (0: never)")
    soak.add_argument("--partition-for", type=float, default=800.0, metavar="MS",
                      help="how long a partition lasts")
    fault_arguments.database_fault_arguments(soak)
    fault_arguments.host_arguments(soak)
    soak.add_argument("--fault-phase", type=float, default=60.0, metavar="S",
                      help="seconds of faults per round at most; the drain settles the rest")
    fault_arguments.release_argument(soak, None,
                                     "three quarters of --fault-phase; 0: all at once")
    soak.set_defaults(disk_full_every=30_000.0, disk_full_mb=256, clock_step_every=20_000.0,
                      clock_step_max=10)
    soak.add_argument("--sample-every", type=float, default=2.0, metavar="S",
                      help="seconds between memory and connection samples")
    soak.add_argument("--output", default="evidence/soak.json", help="the report (JSON)")
    soak.add_argument("--figure", default="evidence/soak.svg", help="the memory figure (SVG)")
    _lab_postgres_argument(soak)
    soak.set_defaults(handler=_soak)


def _add_crashpoints(commands: Commands[parsing.Parser]) -> None:
    crash = commands.add_parser(
        "crashpoints", help="every named boundary, fault and tool kind, then the invariants"
    )
    crash.add_argument("--jobs", type=int, default=2, help="cells run in parallel")
    crash.add_argument("--seed", type=int, default=17, help="seed of the cells' workloads")
    crash.add_argument("--only", action="append", default=[],
                       help="only cells whose id (boundary/fault/kind) starts with this")
    crash.add_argument("--output", default="evidence/crashpoints.json",
                       help="the matrix (JSON)")
    _lab_postgres_argument(crash)
    crash.set_defaults(handler=_crashpoints)


def _add_bench(commands: Commands[parsing.Parser]) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print figures (never timed tests)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    throughput = bench_commands.add_parser(
        "throughput", help="workflows/s through worker processes"
    )
    throughput.add_argument("--workflows", type=int, default=1000,
                            help="workflows in each configuration's first short round, which "
                                 "sizes its measured rounds to last --min-seconds")
    throughput.add_argument("--min-seconds", type=float, default=10.0,
                            help="the shortest measured round, seconds (release to last "
                                 "completion)")
    throughput.add_argument("--workers", type=int, default=2, help="worker processes")
    throughput.add_argument("--batch", type=int, default=1,
                            help="workflows per shared transaction per lab worker (its --batch)")
    throughput.add_argument("--concurrency", type=int, default=1,
                            help="workflows in flight per lab worker, each with its own "
                                 "transactions (its --concurrency)")
    throughput.add_argument("--peer", dest="peers", choices=["dbos", "temporal"],
                            action="append", default=[],
                            help="also measure this peer in the same rounds (repeatable with "
                                 "--sweep: every peer named races in one sitting)")
    throughput.add_argument("--repeat", type=int, default=1, help="rounds per configuration")
    throughput.add_argument("--sweep", action="store_true",
                            help="each system over its own configurations, best against best")
    throughput.add_argument("--lab-processes", default="2,4", help="sweep: lab worker processes")
    throughput.add_argument("--lab-batch", default="1,32", help="sweep: lab worker --batch values")
    throughput.add_argument("--lab-concurrency", default="1",
                            help="sweep: lab worker --concurrency values")
    throughput.add_argument("--dbos-processes", default="2,4", help="sweep: DBOS processes")
    throughput.add_argument("--dbos-concurrency", default="1,8,16",
                            help="sweep: DBOS worker_concurrency values")
    throughput.add_argument("--dbos-poll", default="0.005,0.05",
                            help="sweep: DBOS queue polling intervals, seconds")
    throughput.add_argument("--temporal-processes", default="2",
                            help="sweep: Temporal worker processes")
    throughput.add_argument("--temporal-activities", default="1,8",
                            help="sweep: Temporal workers' max_concurrent_activities values")
    throughput.add_argument("--temporal-workflow-tasks", default="1,4",
                            help="sweep: Temporal workers' max_concurrent_workflow_tasks values")
    throughput.add_argument("--noise", default="0",
                            help="busy processes beside every system's rounds; the sweep takes "
                                 "a comma-separated list, each level a sitting of its own")
    throughput.add_argument("--replicated", default="", metavar="MODES",
                            help="the lab on a replicated PostgreSQL: comma-separated modes "
                                 "among none,sync,async (none: a primary alone; sync, async: "
                                 "a primary and a streaming standby on another lab host), "
                                 "each its own durable server on lab hosts, the modes "
                                 "alternating round by round, with each mode's throughput "
                                 "over none's; needs root; not with --peer, --sweep or "
                                 "--lab-postgres (default: the bench's one server, not on "
                                 "lab hosts)")
    claim = bench_commands.add_parser("claim", help="claim latency as finished history grows")
    claim.add_argument("--history", type=int, action="append", default=[], metavar="N",
                       help="finished workflows before measuring (repeatable; "
                            "none: the bench's own series)")
    bench_commands.add_parser("suite", help="experiment suite wall time, serial and parallel")
    bench_commands.add_parser("startup", help="provisioning and worker spawn-to-ready times")
    for sub_parser in (throughput, claim):
        _lab_postgres_argument(sub_parser)
    bench.add_argument("--output-dir", default="evidence/bench",
                       help="where the figures' JSON goes")
    bench.set_defaults(handler=_bench)


def _add_review(commands: Commands[parsing.Parser]) -> None:
    review = commands.add_parser("review", help="list and decide work in manual review")
    review.add_argument("--schema", required=True, help="the schema holding the workflows")
    review.add_argument("--tenant", default="tenant-a",
                        help="the reviewer's tenant: every read and decision is limited to it")
    review.add_argument("--reviewer", default="reviewer", help="who decides (recorded)")
    review_commands = review.add_subparsers(dest="review_command", required=True)
    review_commands.add_parser("list", help="workflows waiting for a person")
    show_review = review_commands.add_parser("show", help="one workflow with its proof")
    show_review.add_argument("workflow", help="the workflow's id")
    requeue = review_commands.add_parser("requeue", help="send back to the queue")
    requeue.add_argument("workflow", help="the workflow's id")
    requeue.add_argument("--force", action="store_true",
                         help="requeue although a start barrier exists (needs --reason)")
    requeue.add_argument("--reason", default="", help="why (recorded; required with --force)")
    resolve = review_commands.add_parser("resolve", help="close it by hand")
    resolve.add_argument("workflow", help="the workflow's id")
    resolve.add_argument("--as", dest="outcome", choices=["failed", "succeeded"], required=True,
                         help="what the person found happened")
    resolve.add_argument("--reason", required=True, help="why (recorded)")
    review.set_defaults(handler=_review)


def _add_book(commands: Commands[parsing.Parser]) -> None:
    book = commands.add_parser("book", help="publication artifacts from verified evidence")
    book_commands = book.add_subparsers(dest="book_command", required=True)
    build = book_commands.add_parser(
        "build", help="the book's site and pages from book/ and signed evidence")
    build.add_argument("--evidence", default="evidence", help="the verified evidence to draw from")
    build.add_argument("--out", default="book/_site",
                       help="output folder (default book/_site; book/ holds the sources)")
    build.add_argument("--public-key", default=None,
                       help="PEM of the expected signer (the only key accepted)")
    build.add_argument("--png", action="store_true",
                       help="also write a PNG beside each SVG figure (the book extra)")
    book.set_defaults(handler=_book)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``lab`` command: one small builder per command group."""
    parser = parsing.Parser(prog="lab", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
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
