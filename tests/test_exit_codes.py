"""Every ``lab`` subcommand exits with the documented code (``lab.errors``'s table).

Table-driven: for each subcommand a usage error (an unknown option, exit 2) and a
bad input (exit 2 for unusable input, 1 where the command's job is to judge the
input), each a single line on stderr without a traceback, run as a real process
in an empty directory with no database and no evidence key.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import errors

USAGE = errors.EXIT_USAGE
VERDICT = errors.EXIT_VERDICT

COMMANDS: list[tuple[str, list[str], str, int]] = [
    # (id, argv, stdin, expected exit code)
    ("plancheck-usage", ["plancheck", "--bogus"], "", USAGE),
    ("plancheck-rejects", ["plancheck"], "{not json", VERDICT),
    ("worker-usage", ["worker", "--bogus"], "", USAGE),
    ("worker-no-dsn", ["worker", "--schema", "s", "--tool", "http://127.0.0.1:9"], "", USAGE),
    ("run-usage", ["run", "--bogus"], "", USAGE),
    ("run-no-chapter", ["run", "--chapter", "ch99_none"], "", USAGE),
    ("run-commit-alone", ["run", "--commit", "HEAD"], "", USAGE),
    ("run-hermetic-outside-git", ["run", "--hermetic"], "", USAGE),
    ("evidence-usage", ["evidence", "verify", "--bogus"], "", USAGE),
    ("evidence-verify-missing", ["evidence", "verify", "absent"], "", USAGE),
    ("evidence-show-missing", ["evidence", "show", "absent"], "", USAGE),
    ("evidence-verify-device", ["evidence", "verify", "/dev/zero"], "", USAGE),
    ("manifest-usage", ["manifest", "check", "--bogus"], "", USAGE),
    ("manifest-no-experiments", ["manifest", "check"], "", USAGE),
    ("model-usage", ["model", "run", "--bogus"], "", USAGE),
    ("model-run-missing", ["model", "run", "--model", "absent.gguf"], "", USAGE),
    ("model-check-missing", ["model", "check", "absent.json"], "", USAGE),
    ("publish-usage", ["publish", "--bogus"], "", USAGE),
    ("chaos-usage", ["chaos", "--bogus"], "", USAGE),
    ("chaos-bad-setting", ["chaos", "--workflows", "0"], "", USAGE),
    ("chaos-bad-disk-full", ["chaos", "--disk-full-every", "10"], "", USAGE),
    ("chaos-bad-clock-step", ["chaos", "--clock-step-max", "0"], "", USAGE),
    ("chaos-bad-batch", ["chaos", "--batch", "0"], "", USAGE),
    ("soak-usage", ["soak", "--bogus"], "", USAGE),
    ("soak-bad-round", ["soak", "--round", "0"], "", USAGE),
    ("soak-bad-fault-setting", ["soak", "--disk-full-fs", "nfs"], "", USAGE),
    ("crashpoints-usage", ["crashpoints", "--bogus"], "", USAGE),
    ("crashpoints-bad-jobs", ["crashpoints", "--jobs", "0"], "", USAGE),
    ("bench-usage", ["bench", "bogus"], "", USAGE),
    ("bench-bad-batch", ["bench", "throughput", "--batch", "65"], "", USAGE),
    ("bench-bad-sweep-batch", ["bench", "throughput", "--sweep", "--peer", "dbos",
                               "--lab-batch", "1,0"], "", USAGE),
    ("review-usage", ["review", "--bogus"], "", USAGE),
    ("review-no-dsn", ["review", "--schema", "s", "list"], "", USAGE),
    ("reproduce-usage", ["reproduce", "--bogus"], "", USAGE),
    ("reproduce-missing", ["reproduce", "absent"], "", USAGE),
    ("reproduce-bad-runs", ["reproduce", ".", "--runs", "0"], "", USAGE),
    ("reproduce-unverified", ["reproduce", "."], "", USAGE),
    ("book-usage", ["book", "build", "--bogus"], "", USAGE),
    ("book-missing-evidence", ["book", "build", "--evidence", "absent", "--out", "b"], "", USAGE),
]


@pytest.mark.parametrize(("argv", "stdin", "code"),
                         [pytest.param(a, s, c, id=i) for i, a, s, c in COMMANDS])
def test_exit_code_follows_the_table(
    tmp_path: Path, argv: list[str], stdin: str, code: int
) -> None:
    """The documented exit code, one line on stderr, no traceback, nothing written."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("BOOK_LAB_DSN", "LAB_TOOL_TOKEN", "LAB_EVIDENCE_KEY")}
    done = subprocess.run(
        [sys.executable, "-m", "lab.cli", *argv], cwd=tmp_path, input=stdin, env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip(), "a failure says why"
    if not done.stderr.startswith("usage:"):
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_every_subcommand_is_in_the_table() -> None:
    """A new subcommand without a row here fails: the table is enforced, not hoped for."""
    from lab import cli

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    tabled = {argv[0] for _, argv, _, _ in COMMANDS}
    assert sorted(set(commands.choices) - tabled) == []  # type: ignore[arg-type]


def test_exit_code_table() -> None:
    """The mapping itself: one function decides, from the exception's class."""
    assert errors.exit_code(errors.InputError("x")) == 2
    assert errors.exit_code(errors.UsageError("x")) == 2
    assert errors.exit_code(errors.Refused("x")) == 1
    assert errors.exit_code(errors.CheckFailed("x")) == 1
    assert errors.exit_code(errors.Conflict("x")) == 1
    assert errors.exit_code(errors.StoreError("x")) == 3
    assert errors.exit_code(errors.ProvisioningError("x")) == 3
    assert errors.exit_code(errors.ToolUnavailable("x")) == 3
    assert errors.exit_code(errors.MissingExtra("x")) == 3
    assert errors.exit_code(errors.EnvironmentFailure("x")) == 3
    assert errors.exit_code(KeyboardInterrupt()) == 130
