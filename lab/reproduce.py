"""``lab reproduce EVIDENCE_DIR``: re-run a signed result's commit and compare it fact by fact.

1. Verify the evidence (signature, trust, statement, gate: only a PASS verifies); refuse
   it unverified, unpinned, dirty or without a commit, naming why.
2. Check that its commit is here, on a branch, and that the lock digest it records (if
   any) is the commit's ``uv.lock``; refuse naming the cause otherwise (exit 3 for what
   this machine lacks).
3. Re-run the commit ``--runs K`` times through ``rerun_hermetic`` (``lab run --hermetic
   --commit SHA --evidence DIR``), the one place that knows how a faithful re-run is made.
4. Verify each re-run's evidence and compare it with the original
   (``lab.evidence.reproduction``): a table, same or differs per experiment, the differing
   facts with both values, the measurements side by side; with K > 1, how often each
   fact held.
5. Sign the reproduction (``lab.evidence.reproduction_evidence``), naming the original's
   envelope digest as its input, into ``--out`` (written whole at the end, or not at all).

Exit 0 only when every fact held in every re-run and every experiment passed in the
original and in every re-run; 1 otherwise; 2 for bad input; 3 when the environment
cannot re-run the commit.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from lab import errors, files
from lab.evidence import (
    compiler,
    dsse,
    reproduction,
    reproduction_evidence,
    summary,
    trust,
    verification,
)
from lab.evidence import tree as source_tree
from lab.options import option

DEFAULT_OUT = "reproduction"
LOCK_FILE = "uv.lock"
# A re-run of the whole suite: (commit, evidence directory to write) -> None. Only a
# verified PASS is reproduced, and a narrowed run is never one, so there is no selection.
Rerun = Callable[[str, Path, str | None], None]
_MAX_MEASUREMENTS = 4
_WIDTH = 40


def rerun_hermetic(commit: str, evidence: Path, workers: str | None = None) -> None:
    """Run ``commit`` hermetically into ``evidence`` with ``lab run --hermetic`` (issue 27),
    on ``workers`` pytest-xdist workers as the original run did (None: none).

    The hermetic run exports the commit from git's objects and installs its locked
    environment; this function only asks for it. A ``lab`` without ``--hermetic`` writes
    no evidence and says so: that is an environment that cannot reproduce (exit 3).
    """
    command = [sys.executable, "-m", "lab.cli", "run", "--hermetic", "--commit", commit,
               "--evidence", str(evidence), *(["-n", workers] if workers else [])]
    completed = subprocess.run(command, check=False)
    if not (evidence / compiler.ENVELOPE_FILE).is_file():
        raise errors.ProvisioningError(
            f"`lab run --hermetic --commit {commit[:12]}` exited {completed.returncode} "
            "without writing evidence: this lab cannot re-run a commit hermetically"
        )


def recorded_workers(report: Mapping[str, Any]) -> str | None:
    """The ``-n``/``--numprocesses`` value of the original run's pytest command, if any:
    a reproduction schedules its experiments as the original did."""
    command = report.get("command")
    if not isinstance(command, list):
        return None
    value: str | None = None
    for index, word in enumerate(command):
        if not isinstance(word, str):
            continue
        if word in ("-n", "--numprocesses") and index + 1 < len(command):
            following = command[index + 1]
            value = following if isinstance(following, str) else None
        elif word.startswith("--numprocesses="):
            value = word.partition("=")[2]
        elif word.startswith("-n") and word[2:].isdigit():
            value = word[2:]
    if value is None or not (value.isdigit() and 1 <= int(value) <= 64):
        return None
    return value


def recorded_lock(report: Mapping[str, Any]) -> str | None:
    """The lock digest a report records: ``hermetic.lock_sha256`` or ``environment.lock_sha256``.

    The hermetic and lock issues put it there; older evidence records none.
    """
    for section in ("hermetic", "environment"):
        value = report.get(section)
        digest = value.get("lock_sha256") if isinstance(value, Mapping) else None
        if isinstance(digest, str):
            return digest
    return None


def _git(root: Path, *args: str) -> bytes | None:
    """The fixed git of ``lab.evidence.tree`` (never the caller's); None when it refuses."""
    try:
        return source_tree.git(root, args, "git")
    except errors.UsageError:
        return None


def on_a_branch(root: Path, commit: str) -> list[str]:
    """The branches (local and remote-tracking) of the repository at ``root`` whose history
    holds ``commit``: a commit on none is no commit anyone published, and is not re-run."""
    listed = _git(root, "for-each-ref", "--contains", commit, "--format=%(refname)",
                  "refs/heads", "refs/remotes")
    return sorted(line for line in (listed or b"").decode("utf-8", "replace").splitlines()
                  if line)


def check_environment(report: Mapping[str, Any], root: Path) -> str | None:
    """Refuse (``ProvisioningError``) when the commit or its recorded lock is not available,
    and (``Refused``) when the commit is on no branch of the repository.

    Returns the lock digest that will be used, or None when the evidence records none.
    """
    commit = str(report.get("commit"))
    if commit.startswith("-") or _git(root, "cat-file", "-e", f"{commit}^{{commit}}") is None:
        raise errors.ProvisioningError(
            f"commit {commit[:12]} of the evidence is not in the repository at {root}: "
            "fetch it first"
        )
    if not on_a_branch(root, commit):
        raise errors.Refused(
            f"commit {commit[:12]} of the evidence is on no branch of the repository at "
            f"{root}: only a commit reachable from a branch is re-run"
        )
    wanted = recorded_lock(report)
    if wanted is None:
        return None
    shown = _git(root, "show", f"{commit}:{LOCK_FILE}")
    if shown is None:
        raise errors.ProvisioningError(
            f"the evidence's lock sha256 {wanted[:12]} cannot be satisfied here: commit "
            f"{commit[:12]} has no {LOCK_FILE}"
        )
    have = reproduction_evidence.sha256(shown)
    if have != wanted:
        raise errors.ProvisioningError(
            f"the evidence's lock sha256 {wanted[:12]} cannot be satisfied here: commit "
            f"{commit[:12]}'s {LOCK_FILE} is {have[:12]}"
        )
    return wanted


def _verified_original(
    path: Path, public_key: Any, trusted: Sequence[trust.TrustedKey], root: Path
) -> tuple[dict[str, Any], bytes]:
    verdict = verification.verify(path, public_key=public_key, trusted=trusted, root=root)
    if verdict.unreadable is not None:
        raise errors.InputError(verification.printable(verdict.unreadable))
    if not verdict.ok or verdict.report is None:
        first = verdict.problems[0] if verdict.problems else "no report"
        raise errors.Refused(verification.printable(f"{path}: not verified: {first}"))
    if verdict.pinned_by is None:
        raise errors.Refused(
            f"{path}: UNPINNED: only evidence a pinned key vouches for is re-run (pin its "
            f"signer with --public-key or a key committed under {trust.TRUSTED_DIR}/)")
    report: dict[str, Any] = dict(verdict.report)
    if report.get("dirty") is not False or not report.get("commit"):
        raise errors.Refused(
            f"{path}: the run was not of a clean commit: there is nothing to re-run"
        )
    envelope = files.read_bytes(verdict.envelope, files.ENVELOPE_LIMIT, "envelope")
    return report, envelope


def _target(out: Path, evidence: Path) -> None:
    """Refuse an ``--out`` that would overwrite the evidence or an unrelated directory."""
    if out.resolve() == evidence.resolve() or evidence.resolve().is_relative_to(out.resolve()):
        raise errors.UsageError(f"--out {out} would overwrite the evidence it reproduces")
    if out.exists() and (not out.is_dir() or (
            any(out.iterdir()) and not reproduction_evidence.is_reproduction(out))):
        raise errors.UsageError(
            f"refusing to replace {out}: it is not empty and holds no "
            f"{reproduction_evidence.ENVELOPE_FILE}"
        )


def reproduce(
    evidence: Path,
    *,
    runs: int = 1,
    out: Path,
    rerun: Rerun = rerun_hermetic,
    root: Path | None = None,
    public_key: Any = None,
    console: Console | None = None,
) -> int:
    """Verify, re-run ``runs`` times, compare, sign; the exit code (0 identical, else 1)."""
    if runs < 1:
        raise errors.UsageError(f"--runs must be at least 1, not {runs}")
    tree = root or Path.cwd()
    show = console or summary.console_for_output()
    _target(out, evidence)
    trusted = trust.trusted_keys(tree)  # the default branch's keys and revocations
    original, envelope = _verified_original(evidence, public_key, trusted, tree)
    lock = check_environment(original, tree)
    commit = str(original["commit"])
    signer = dsse.load_signer()
    started = time.monotonic()
    wall_s = 0.0
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.resolve().parent))
    try:
        reports, entries = [], []
        for number in range(1, runs + 1):
            relative = f"{reproduction_evidence.RUNS_DIR}/run-{number}"
            began = time.monotonic()
            show.print(f"[dim]re-run {number} of {runs}: commit {commit[:12]}[/dim]")
            rerun(commit, staging / relative, recorded_workers(original))
            report, run_envelope = _verified_rerun(staging / relative, signer, commit, tree)
            reports.append(report)
            entries.append({"evidence": relative, "envelope_sha256":
                            reproduction_evidence.sha256(run_envelope),
                            "status": report["status"], "commit": report["commit"],
                            "wall_s": round(time.monotonic() - began, 3)})
        comparison = reproduction.compare(original, reports)
        record = {
            "schema_version": reproduction_evidence.SCHEMA_VERSION,
            "reproduced_at_utc": datetime.datetime.now(datetime.UTC).isoformat(
                timespec="seconds").replace("+00:00", "Z"),
            "inputs": [{"name": f"original {compiler.ENVELOPE_FILE}",
                        "digest": {"sha256": reproduction_evidence.sha256(envelope)}}],
            "original": {"envelope_sha256": reproduction_evidence.sha256(envelope),
                         "commit": commit, "status": original["status"],
                         "timestamp_utc": original.get("timestamp_utc"),
                         "lock_sha256": lock},
            "rerun": getattr(rerun, "__name__", type(rerun).__name__),
            "runs": entries,
            "comparison": reproduction.to_json(comparison),
        }
        record["wall_s"] = wall_s = round(time.monotonic() - started, 3)
        reproduction_evidence.write(staging, record, signer)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    show.print(table(comparison))
    show.print(Text(closing_line(comparison, wall_s, out)))
    return 0 if comparison.identical else 1


def _verified_rerun(
    directory: Path, signer: dsse.Signer, commit: str, root: Path
) -> tuple[dict[str, Any], bytes]:
    """The re-run's report and envelope, verified as this reproduction's own work.

    The re-run signs with the key this reproduction signs with (``LAB_EVIDENCE_KEY``,
    inherited), so that key pins it; an ephemeral signer is a fresh key in every
    process, and the re-run is then checked for integrity only.
    """
    pinned = signer.key.public_key() if signer.source != "ephemeral" else None
    verdict = verification.verify(directory, public_key=pinned, root=root)
    if not verdict.ok or verdict.report is None:
        first = verdict.problems[0] if verdict.problems else "no report"
        raise errors.CheckFailed(verification.printable(f"re-run evidence: {first}"))
    if verdict.report["commit"] != commit:
        raise errors.CheckFailed(
            f"the re-run ran commit {verdict.report['commit']}, not the evidence's {commit}"
        )
    data = files.read_bytes(verdict.envelope, files.ENVELOPE_LIMIT, "re-run envelope")
    return dict(verdict.report), data


def _short(value: Any) -> str:
    return summary.shorten(value, _WIDTH)


def _where(nodeid: str) -> str:
    """The parameter part of a node id (``[...]``), to tell results of one experiment apart."""
    start = nodeid.find("[")
    return nodeid[start:] + " " if start >= 0 else ""


def table(comparison: reproduction.Comparison) -> Table:
    """Same or differs per experiment, differing facts with both values, measurements."""
    runs = comparison.runs
    grid = Table(title=f"Reproduction: {runs} re-run(s)", show_lines=False)
    for column in ("Experiment", "Outcome", "Facts", "Differing facts", "Measurements"):
        grid.add_column(column, overflow="fold")
    for e in comparison.experiments:
        outcomes = " ".join(e.outcomes)
        facts = f"same ({len(e.facts)})" if e.same else f"DIFFERS ({len(e.differing)})"
        differing = []
        for fact in e.differing:
            held = f" (held {fact.held} of {runs}: unreliable)" if runs > 1 else ""
            if fact.misdeclared:
                held += (f" (the original calls it a {fact.original_kind}; the commit "
                         f"declares a {fact.kind})")
            values = " | ".join(_short(v) for v in fact.values)
            differing.append(
                f"{_where(fact.nodeid)}{fact.key}: {_short(fact.original)} -> {values}{held}")
        measured = [
            f"{_where(m.nodeid)}{m.key}: {_short(m.original)} | "
            + " | ".join(_short(v) for v in m.values)
            for m in e.measurements[:_MAX_MEASUREMENTS]
        ]
        if len(e.measurements) > _MAX_MEASUREMENTS:
            measured.append(f"... {len(e.measurements) - _MAX_MEASUREMENTS} more")
        grid.add_row(Text(e.label), Text(f"{e.original_outcome} -> {outcomes}"), Text(facts),
                     Text("\n".join(differing)), Text("\n".join(measured)))
    return grid


def closing_line(comparison: reproduction.Comparison, wall_s: float, out: Path) -> str:
    """The verdict in one line: how many experiments were identical in their facts."""
    total = len(comparison.experiments)
    same = sum(1 for e in comparison.experiments if e.same)
    failed = [e.label for e in comparison.experiments if not e.passed]
    differing = [e.label for e in comparison.experiments if not e.same]
    parts = [f"reproduction {comparison.verdict.upper()}: {same} of {total} experiments "
             f"identical in their facts over {comparison.runs} re-run(s)"]
    if differing:
        parts.append(f"differing: {', '.join(differing)}")
    if failed:
        parts.append(f"not passed everywhere: {', '.join(failed)}")
    parts.append(f"wall time {wall_s:.1f} s; signed evidence in {out}")
    return "; ".join(parts)


@dataclass(frozen=True)
class ReproduceOptions:
    """What ``lab reproduce`` is asked to do: its arguments, declared here."""

    evidence: str = option(help="the evidence directory to reproduce", positional=True)
    runs: int = option(1, help="re-run K times; count each fact")
    out: str = option("reproduction", help="the reproduction's evidence")
    public_key: str | None = option(
        None, help="PEM of the expected signer of the evidence (the only key accepted)")


def cli_main(options: ReproduceOptions) -> int:
    """``lab reproduce``: pin, check the evidence exists, reproduce."""
    pinned = None
    if options.public_key:
        pinned = dsse.load_public_key_file(Path(options.public_key), "--public-key")
    evidence = Path(options.evidence)
    if not evidence.exists():
        raise errors.InputError(f"evidence {evidence}: no such file or directory")
    return reproduce(evidence, runs=options.runs, out=Path(options.out), public_key=pinned)


# --------------------------------------------------------------------------- lab evidence compare


@dataclass(frozen=True)
class CompareOptions:
    """``lab evidence compare A B [--public-key PEM]``: the facts of two verified runs."""

    evidence_command: str
    first: str = option(help="the first run's evidence directory", positional=True)
    second: str = option(help="the second run's evidence directory", positional=True)
    public_key: str | None = option(
        None, help="PEM of the expected signer of both (the only key accepted; default: each "
                   "run's own key)")


def _verified_report(path: Path, public_key: Any, root: Path) -> dict[str, Any]:
    """The report of ``path``, verified like ``lab evidence verify`` (a PASS), or refused."""
    if not path.exists():
        raise errors.InputError(f"evidence {path}: no such file or directory")
    trusted = trust.trusted_keys(root)
    verdict = verification.verify(path, public_key=public_key, trusted=trusted, root=root)
    if verdict.unreadable is not None:
        raise errors.InputError(verification.printable(verdict.unreadable))
    if not verdict.ok or verdict.report is None:
        first = verdict.problems[0] if verdict.problems else "no report"
        raise errors.Refused(verification.printable(f"{path}: not verified: {first}"))
    return dict(verdict.report)


def differences(comparison: reproduction.Comparison) -> list[str]:
    """One line per differing fact (``chapter/name [params] key: A -> B``) and per
    experiment that did not pass in both runs."""
    lines: list[str] = []
    for e in comparison.experiments:
        lines += [f"{e.label} {_where(f.nodeid)}{f.key}: {_short(f.original)} -> "
                  + " | ".join(_short(v) for v in f.values) for f in e.differing]
        if not e.passed:
            lines.append(f"{e.label}: outcome {e.original_outcome} -> {' '.join(e.outcomes)}")
    return lines


def compare_main(options: CompareOptions, console: Console | None = None) -> int:
    """``lab evidence compare A B``: verify both runs, compare their facts as ``lab
    reproduce`` does (``lab.evidence.reproduction``); exit 0 only when every fact of every
    experiment is the same and every experiment passed in both, else 1, naming each
    differing experiment and key."""
    root = Path.cwd()
    pinned = None
    if options.public_key:
        pinned = dsse.load_public_key_file(Path(options.public_key), "--public-key")
    first = _verified_report(Path(options.first), pinned, root)
    second = _verified_report(Path(options.second), pinned, root)
    comparison = reproduction.compare(first, [second])
    show = console or summary.console_for_output()
    differing = differences(comparison)
    if differing:
        show.print(table(comparison))
    total = len(comparison.experiments)
    same = sum(1 for e in comparison.experiments if e.same and e.passed)
    verdict = "IDENTICAL" if comparison.identical else "DIFFER"
    show.print(Text(f"facts {verdict}: {same} of {total} experiments the same in "
                    f"{options.first} and {options.second}"))
    for line in differing:
        show.print(Text(f"differs: {line}"))
    return 0 if comparison.identical else 1
