"""``lab publish``: every refusal names what it refuses, before or after running anything.

The refusals that need no run are driven through the command itself. The
orchestration is driven with the experiment and model steps replaced by
functions that say what a real step would (a non-PASS exit, or evidence a
real step wrote and someone altered), because a full publication run takes
the whole experiment suite; CI's own steps run the real entry points.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lab import cli, publish, runner
from lab.errors import Refused
from lab.evidence import compiler, dsse
from lab.model import command as model_command
from tests.support import canned_model, labtree
from tests.support.keys import KeyFiles

REPO = Path(__file__).resolve().parents[1]


def _git_tree(path: Path) -> Path:
    path.mkdir()
    for argv in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", "-C", str(path), *argv], check=True)
    (path / "a.py").write_text("x = 1\n")
    subprocess.run(["git", "-C", str(path), "add", "a.py"], check=True)
    subprocess.run(
        ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a"],
        check=True,
    )
    return path


def _args(out: Path, **changes: Any) -> publish.PublishOptions:
    return publish.PublishOptions(out=str(out), **changes)


def _lab(*argv: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lab.cli", *argv],
        cwd=cwd, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_unsigned_is_refused_before_anything_runs(tmp_path: Path) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != dsse.KEY_ENV}
    done = _lab("publish", "--out", str(tmp_path / "pub"), cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        "lab publish: refused: unsigned: set LAB_EVIDENCE_KEY to the publication key's "
        "private PEM\n"
    )
    assert not (tmp_path / "pub").exists()


def test_unpinned_model_and_key_are_refused(
    tmp_path: Path, make_key: Callable[[str], KeyFiles]
) -> None:
    tree = _git_tree(tmp_path / "tree")
    mine = make_key("k")
    env = {dsse.KEY_ENV: str(mine.private_pem)}
    with pytest.raises(Refused, match=r"unpinned: --model m\.gguf needs --expect-sha256"):
        publish.prepare(_args(tmp_path / "o", model="m.gguf"), tree, env)
    other = make_key("other").public_pem
    with pytest.raises(Refused, match="unpinned: LAB_EVIDENCE_KEY signs as"):
        publish.prepare(_args(tmp_path / "o", public_key=str(other)), tree, env)
    plan = publish.prepare(_args(tmp_path / "o", public_key=str(mine.public_pem)), tree, env)
    assert dsse.keyid(plan.pinned) == dsse.load_signer(env).keyid


def test_a_dirty_tree_is_refused_naming_the_file(
    tmp_path: Path, make_key: Callable[[str], KeyFiles]
) -> None:
    tree = _git_tree(tmp_path / "tree")
    env = {dsse.KEY_ENV: str(make_key("k").private_pem)}
    (tree / "a.py").write_text("x = 2\n")
    with pytest.raises(Refused, match=r"dirty before the run: a\.py changed"):
        publish.prepare(_args(tmp_path / "o"), tree, env)
    (tree / "a.py").write_text("x = 1\n")
    (tree / "new.py").write_text("")
    with pytest.raises(Refused, match=r"dirty before the run: new\.py changed"):
        publish.prepare(_args(tmp_path / "o"), tree, env)
    with pytest.raises(Refused, match="is not a git working tree"):
        publish.prepare(_args(tmp_path / "o"), tmp_path / "nowhere", env)


def test_the_callers_git_and_its_global_excludes_do_not_decide_dirtiness(
    tmp_path: Path, make_key: Callable[[str], KeyFiles], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``git`` first on ``PATH`` that says every tree is clean, and a global excludes
    file hiding an untracked ``conftest.py`` (which pytest would load): the tree is
    still dirty, because the lab asks its own git with no caller configuration."""
    tree = _git_tree(tmp_path / "tree")
    env = {dsse.KEY_ENV: str(make_key("k").private_pem)}
    (tree / "conftest.py").write_text("import os\n")
    home, liar = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    liar.mkdir()
    (home / "ignore").write_text("conftest.py\n")
    (home / ".gitconfig").write_text(f"[core]\n\texcludesFile = {home / 'ignore'}\n")
    (liar / "git").write_text("#!/bin/sh\nexit 0\n")
    (liar / "git").chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PATH", f"{liar}:/usr/bin:/bin")
    with pytest.raises(Refused, match=r"dirty before the run: conftest\.py changed"):
        publish.prepare(_args(tmp_path / "o"), tree, env)


def test_a_run_that_is_not_pass_is_refused(
    tmp_path: Path, make_key: Callable[[str], KeyFiles]
) -> None:
    tree = _git_tree(tmp_path / "tree")
    env = {dsse.KEY_ENV: str(make_key("k").private_pem)}
    plan = publish.prepare(_args(tmp_path / "o"), tree, env)
    seen: list[runner.RunOptions] = []

    def failing(options: runner.RunOptions) -> int:
        seen.append(options)
        return 1

    with pytest.raises(Refused, match="not PASS: the experiments exited 1"):
        publish.publish(plan, run_experiments=failing)
    assert seen[0] == runner.RunOptions(evidence=str(plan.evidence), hermetic=True)
    assert not plan.book.exists()


def test_model_evidence_under_another_key_is_refused(
    tmp_path: Path, make_key: Callable[[str], KeyFiles]
) -> None:
    """The model step's evidence must verify under the pinned key before any book is built:
    the bundle's private copy is checked (against the model file too), and a model that
    was run makes its part required."""
    env = {dsse.KEY_ENV: str(make_key("k").private_pem)}
    tree = labtree.one_experiment_tree(tmp_path)
    model_file = tmp_path / "m.gguf"
    model_file.write_bytes(b"GGUF canned")
    plan = publish.Plan(
        out=tmp_path / "o", root=tree, pinned=dsse.load_signer(env).key.public_key(), trusted=(),
        model=model_file, expect_sha256="0" * 64, threads=1, numprocesses=None,
    )  # fmt: skip
    stale = plan.model_evidence / "traces" / "stale.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")

    def model_step(options: model_command.RunOptions) -> int:
        assert not stale.exists(), "an earlier publication's model evidence was kept"
        # Real signed model evidence, but under an ephemeral key, not the pinned one.
        canned_model.write_evidence(Path(options.evidence), tmp_path / "scratch", ["account-a"])
        return 0

    def experiments_step(options: runner.RunOptions) -> int:
        # Genuine runtime evidence under the pinned key: the refusal is the model's own.
        compiler.write(Path(options.evidence),
                       compiler.RunFacts(**labtree.one_experiment_facts()),
                       root=tree, signer=dsse.load_signer(env))
        return 0

    with pytest.raises(
        Refused,
        match=r"evidence/model: signature: signed by key [0-9a-f]{64}, "
        "not by the expected key",
    ):
        publish.publish(plan, run_experiments=experiments_step, run_model=model_step)
    assert not plan.book.exists()

    def other_model_step(options: model_command.RunOptions) -> int:
        # Signed by the pinned key, but of another model file than the one published.
        canned_model.write_evidence(Path(options.evidence), tmp_path / "other", ["account-a"],
                                    signer=dsse.load_signer(env))
        return 0

    model_file.write_bytes(b"GGUF another")
    with pytest.raises(Refused, match=r"evidence/model: model .*m\.gguf: its sha256 is not "
                                      "the signed model digest"):
        publish.publish(plan, run_experiments=experiments_step, run_model=other_model_step)
    assert not plan.book.exists()

    with pytest.raises(Refused, match=r"evidence/model: no model/ beside the evidence"):
        publish.publish(plan, run_experiments=experiments_step, run_model=lambda args: 0)
    assert not plan.book.exists()


def test_publish_is_a_lab_subcommand() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["publish", "--out", "x", "--model", "m", "--expect-sha256", "s"])
    assert args.handler is not None
    assert cli.options_from(publish.PublishOptions, args) == publish.PublishOptions(
        out="x", model="m", expect_sha256="s"
    )
    assert REPO.joinpath("lab", "publish.py").is_file()
