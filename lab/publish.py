"""``lab publish``: regenerate the publication in one command, or refuse and say why.

Runs the experiments hermetically (``lab run --hermetic``: the committed HEAD's files
exported from git's objects, on the lock's verified wheels), the model case set when a
model is given (``lab model run``), verifies both under the pinned key, and builds the book
from them (``lab book build``), all into ``--out``::

    DIR/evidence/          the runtime evidence, signed
    DIR/evidence/model/    the model evidence, signed (with --model)
    DIR/book/              the book

It refuses, naming what, anything that is not PASS, unsigned (no
``LAB_EVIDENCE_KEY``), unpinned (a model without ``--expect-sha256``, a key
other than ``--public-key``) or dirty (a working tree with changes, before or
after the run). Only the order and the refusals live here; every step is
another module's entry point.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import errors
from lab.book import builder
from lab.errors import Refused
from lab.evidence import bundle, caller, dsse, tree, trust
from lab.model import signed
from lab.options import option

if TYPE_CHECKING:
    # The steps' modules are imported when a step runs (see ``_run_experiments``).
    from lab import runner
    from lab.model import command as model_command

RunStep = Callable[["runner.RunOptions"], int]
ModelStep = Callable[["model_command.RunOptions"], int]


@dataclass(frozen=True)
class PublishOptions:
    """What ``lab publish`` is asked to do: its flags, declared here."""

    out: str = option(help="directory for evidence/ and book/")
    model: str | None = option(None, help="GGUF model for the case set")
    expect_sha256: str | None = option(None, help="the model's pinned sha256")
    public_key: str | None = option(None, help="PEM the evidence must verify under")
    threads: int | None = option(None, help="model CPU threads (default 2)")
    numprocesses: str | None = option(
        None, flags=("-n", "--numprocesses"), metavar="N",
        help="pytest-xdist workers (none: one process)")


@dataclass(frozen=True)
class Plan:
    """What one publication run will do, decided before anything runs."""

    out: Path
    root: Path
    pinned: ed25519.Ed25519PublicKey
    # The default branch's keys and revocations (``trust.trusted_keys``), read before the
    # run: a revoked publication key publishes nothing.
    trusted: tuple[trust.TrustedKey, ...]
    model: Path | None
    expect_sha256: str | None
    threads: int | None
    numprocesses: str | None

    @property
    def evidence(self) -> Path:
        """The runtime evidence directory."""
        return self.out / "evidence"

    @property
    def model_evidence(self) -> Path:
        """The model evidence directory."""
        return self.evidence / "model"

    @property
    def book(self) -> Path:
        """The book's directory."""
        return self.out / "book"


def dirty_files(root: Path) -> list[str]:
    """Changed or untracked files of the git working tree at ``root`` (ignored files aside).

    Asked of the lab's fixed git with no system or global configuration
    (``tree.git``), as the evidence asks: the caller's ``git`` on ``PATH``, or a global
    excludes file, must not decide whether a tree is clean enough to publish."""
    not_a_tree = Refused(f"dirty: {root} is not a git working tree, so its sources cannot "
                         "be pinned")
    if not root.is_dir():
        raise not_a_tree
    try:
        out = tree.git(root, ["status", "--porcelain", "--untracked-files=all"],
                       f"cannot ask git about {root}")
    except errors.EnvironmentFailure as exc:
        raise Refused(f"dirty: {exc}") from exc
    except errors.UsageError as exc:
        raise not_a_tree from exc
    return [line[3:] for line in out.decode("utf-8", "replace").splitlines() if line.strip()]


def _refuse_dirty(root: Path, when: str) -> None:
    changed = dirty_files(root)
    if changed:
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        raise Refused(f"dirty {when}: {changed[0]}{more} changed in {root}; commit first")


def prepare(options: PublishOptions, root: Path, environ: dict[str, str]) -> Plan:
    """Check everything that can be checked before running; raise ``Refused`` naming it.

    The plan carries the trust material too, read here once: the pin and the default
    branch's keys and revocations (``trust.trusted_keys``) that every verification uses.
    """
    if not environ.get(dsse.KEY_ENV):
        raise Refused(f"unsigned: set {dsse.KEY_ENV} to the publication key's private PEM")
    signer = dsse.load_signer(environ)
    pinned = signer.key.public_key()
    if options.public_key:
        # Bounded, regular files only: a FIFO or a huge file is refused, not read.
        expected = dsse.load_public_key_file(Path(options.public_key), "--public-key")
        if dsse.raw_public_key(expected) != dsse.raw_public_key(pinned):
            raise Refused(
                f"unpinned: {dsse.KEY_ENV} signs as {signer.keyid}, not as the --public-key "
                f"{dsse.keyid(expected)}"
            )
        pinned = expected
    if options.model and not options.expect_sha256:
        raise Refused(f"unpinned: --model {options.model} needs --expect-sha256")
    if options.expect_sha256 and not options.model:
        raise errors.UsageError("--expect-sha256 needs --model")
    _refuse_dirty(root, "before the run")
    out = Path(options.out).resolve()
    if out == root or root.is_relative_to(out):
        raise errors.UsageError(f"--out {options.out} would hold the working tree itself")
    return Plan(
        out=out,
        root=root,
        pinned=pinned,
        trusted=tuple(trust.trusted_keys(root, environ)),
        model=Path(options.model) if options.model else None,
        expect_sha256=options.expect_sha256,
        threads=options.threads,
        numprocesses=options.numprocesses,
    )


def _run_experiments(options: runner.RunOptions) -> int:
    from lab import runner

    return runner.run_main(options)


def _run_model(options: model_command.RunOptions) -> int:
    from lab.model import command as model_command

    return model_command.run_main(options)


def publish(
    plan: Plan,
    *,
    run_experiments: RunStep = _run_experiments,
    run_model: ModelStep = _run_model,
) -> list[str]:
    """Run, verify and build as ``plan`` says; the book's files, or ``Refused`` naming why.

    The evidence is verified once: the bundle opened here (``lab.evidence.bundle``) is
    what the refusals judge and what the book is written from.
    """
    # Model evidence of an earlier publication must not reach this book.
    if plan.model_evidence.exists():
        shutil.rmtree(plan.model_evidence)
    from lab import runner
    from lab.model import command as model_command

    # Always hermetic: the committed HEAD exported from git's objects, on the locked wheels, so
    # nothing left in this working tree or this interpreter reaches the published run.
    code = run_experiments(
        runner.RunOptions(numprocesses=plan.numprocesses, evidence=str(plan.evidence),
                          hermetic=True)
    )
    if code != 0:
        raise Refused(f"not PASS: the experiments exited {code}; see {plan.evidence}")
    if plan.model is not None:
        code = run_model(
            model_command.RunOptions(
                model=str(plan.model), expect_sha256=plan.expect_sha256,
                evidence=str(plan.model_evidence), threads=plan.threads,
            )
        )
        if code != 0:
            raise Refused(f"not PASS: the model case set exited {code}; see {plan.model_evidence}")
    _refuse_dirty(plan.root, "after the run")
    # Opened and verified once, each part on a private copy that is what the book is
    # written from: the runtime evidence (its sources against this tree), the model
    # evidence (of this very model file: the pin is checked on the copy published), a
    # reproduction and the crash-point matrix.
    opened = bundle.open_bundle(
        plan.evidence, public_key=plan.pinned, trusted=plan.trusted, root=plan.root,
        model_verifier=functools.partial(signed.verify, model_path=plan.model),
    )
    if plan.model is not None:
        # The model was run: its evidence is required, not an optional part.
        model = opened.parts[bundle.MODEL]
        if not model.present:
            raise Refused(model.refused or f"{plan.model_evidence}: {model.absent}")
    if opened.not_hermetic is not None:
        raise Refused(f"{plan.evidence}: {opened.not_hermetic}")
    return builder.from_bundle(opened, plan.book, root=plan.root)


def cli_main(options: PublishOptions) -> int:
    """``lab publish``: 0 with the book written from verified evidence; refusals are raised."""
    root = Path.cwd().resolve()
    plan = prepare(options, root, dict(os.environ))
    # The process that will seal the evidence is this one: once the arguments are known
    # good, and before anything is removed or run, its interpreter must be the lock's
    # (the hermetic run checks it again: remembered, not repeated).
    caller.require()
    written = publish(plan)
    model = f", model evidence in {plan.model_evidence}" if plan.model else ", no model"
    print(
        f"published: experiments PASS in {plan.evidence}{model}, verified under key "
        f"{dsse.keyid(plan.pinned)}; book of {len(written)} files in {plan.book}"
    )
    return 0
