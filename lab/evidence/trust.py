"""Whom a verifier trusts: the keys at the tip of the default branch, minus revoked ones.

A key vouches for evidence only when git tracks it under ``keys/trusted/`` at the **tip
of the repository's default branch** (never at the commit the evidence names: a commit
on no branch could otherwise add the key that vouches for it), or when
``LAB_TRUSTED_KEYS`` (or ``--public-key``) names it. A key tracked under
``keys/revoked/`` at that same tip vouches for nothing, whatever the evidence's age and
whoever names it: ``verification.check_signer`` refuses evidence it signed, naming the
revoked key's file. Both directories are read from git's object store, never from the
working tree. ``runtime.pub.pem`` beside the evidence is never a pin.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import errors, files
from lab.errors import EvidenceError, InputError
from lab.evidence import dsse, tree

TRUSTED_DIR = "keys/trusted"
REVOKED_DIR = "keys/revoked"
TRUSTED_PATTERN = "*.pub.pem"
TRUSTED_ENV = "LAB_TRUSTED_KEYS"
# The default branch, in this order: the remote's default as the last fetch recorded it,
# then the conventional names, then the branch checked out now. No network is asked.
# A checkout that has only the remote's branches (a detached CI checkout) finds them last.
DEFAULT_BRANCH_REFS = ("refs/remotes/origin/HEAD", "refs/heads/main", "refs/heads/master",
                       "refs/remotes/origin/main", "refs/remotes/origin/master")


@dataclass(frozen=True)
class TrustedKey:
    """A public key the verifier knows, and where that knowledge came from.

    ``revoked`` marks a key from ``keys/revoked/``: it is carried with the trusted keys
    so that every verifier refuses it, and never vouches for anything.
    """

    key: ed25519.Ed25519PublicKey
    origin: str
    revoked: bool = False

    @property
    def fingerprint(self) -> str:
        """The key's id (hex sha256 of the raw public key), as evidence names its signer."""
        return dsse.keyid(self.key)


@dataclass(frozen=True)
class Tip:
    """The tip of the default branch: the ref it was found by and its commit."""

    ref: str
    commit: str

    @property
    def label(self) -> str:
        """``<commit[:12]> (tip of <branch>)``: how a key's origin names where it was read."""
        return f"{self.commit[:12]} (tip of {self.ref.removeprefix('refs/heads/')})"


def default_branch(root: Path) -> Tip | None:
    """The tip of the default branch of the repository at ``root``, without the network.

    ``refs/remotes/origin/HEAD`` when it exists (the remote's default branch as a clone
    or ``git remote set-head`` recorded it), else ``refs/heads/main``, else
    ``refs/heads/master``, else ``origin/main`` or ``origin/master``, else the branch
    ``HEAD`` names (a detached ``HEAD`` is no branch). None when ``root`` is in no git
    repository: there is nothing tracked to trust or revoke. ``InputError`` (one line)
    when it is a repository but none of these resolves to a commit.
    """
    if not root.is_dir() or _git(root, ["rev-parse", "--git-dir"]) is None:
        return None
    candidates = list(DEFAULT_BRANCH_REFS)
    current = _git(root, ["symbolic-ref", "-q", "HEAD"])
    if current is not None and current.strip():
        candidates.append(current.decode("utf-8", "replace").strip())
    for ref in candidates:
        found = _git(root, ["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"])
        if found is not None and found.strip():
            name = ref
            if ref == DEFAULT_BRANCH_REFS[0]:
                target = _git(root, ["symbolic-ref", "-q", ref])
                name = (target or ref.encode()).decode("utf-8", "replace").strip()
            return Tip(name, found.decode().strip())
    raise InputError(
        f"{root}: no default branch to read {TRUSTED_DIR}/ and {REVOKED_DIR}/ from "
        "(neither origin/HEAD, main, master, origin/main, origin/master nor a checked-out "
        "branch resolves to a commit)")


def trusted_keys(root: Path, environ: Mapping[str, str] | None = None) -> list[TrustedKey]:
    """The keys a verifier knows: trusted ones first, then the revoked ones (``revoked``).

    Trusted: every ``keys/trusted/*.pub.pem`` git tracks at the tip of the default
    branch (``default_branch``) of the repository at ``root``, read from git's object
    store (an untracked or locally edited file is not a publication key: anyone can
    drop one there), and each file or directory (its ``*.pub.pem``) named in
    ``LAB_TRUSTED_KEYS``, separated by ``os.pathsep``. Revoked: every
    ``keys/revoked/*.pub.pem`` at that tip; pass the whole list to the verifier even
    with ``--public-key``, so a revoked key is refused however it is named. A listed
    file that is not an Ed25519 PEM key is an error.
    """
    env = os.environ if environ is None else environ
    tip = default_branch(root)
    tracked = [] if tip is None else [
        TrustedKey(_tracked_key(root, tip.commit, name), f"{name} at {tip.label}",
                   revoked=name.startswith(f"{REVOKED_DIR}/"))
        for directory in (TRUSTED_DIR, REVOKED_DIR)
        for name in _tracked_key_names(root, tip.commit, directory)]
    paths: list[tuple[Path, str]] = []
    for entry in (env.get(TRUSTED_ENV) or "").split(os.pathsep):
        if not entry:
            continue
        where = Path(entry)
        if where.is_dir():
            paths += [(p, f"{TRUSTED_ENV} {p}") for p in sorted(where.glob(TRUSTED_PATTERN))]
        else:
            paths.append((where, f"{TRUSTED_ENV} {where}"))
    explicit = [TrustedKey(dsse.load_public_key_file(path, "trusted key"), origin)
                for path, origin in paths]
    return ([k for k in tracked if not k.revoked] + explicit
            + [k for k in tracked if k.revoked])


def revoked(known: Sequence[TrustedKey], key: ed25519.Ed25519PublicKey) -> TrustedKey | None:
    """The revocation among ``known`` that names ``key``, or None."""
    raw = dsse.raw_public_key(key)
    return next((k for k in known if k.revoked and dsse.raw_public_key(k.key) == raw), None)


def _git(root: Path, args: Sequence[str]) -> bytes | None:
    """``git args`` in ``root`` by the lab's fixed git with no caller configuration
    (``tree.git``): which keys are trusted, and which revoked, is never the answer of a
    ``git`` first on ``PATH`` or of a global configuration. None when git refuses."""
    try:
        return tree.git(root, args, "read the trusted keys")
    except (errors.EnvironmentFailure, errors.UsageError):
        return None


def _tracked_key_names(root: Path, commit: str, directory: str) -> list[str]:
    """``<directory>/*.pub.pem`` as git tracks them at ``commit`` (none outside git)."""
    if not root.is_dir() or commit.startswith("-"):
        return []
    listed = _git(root, ["ls-tree", "-r", "-z", "--name-only", commit, "--", f"{directory}/"])
    names = (listed or b"").decode("utf-8", "replace").split("\0")
    return sorted(n for n in names
                  if n.startswith(f"{directory}/") and PurePosixPath(n).match(TRUSTED_PATTERN))


def _tracked_key(root: Path, commit: str, name: str) -> ed25519.Ed25519PublicKey:
    size = _git(root, ["cat-file", "-s", f"{commit}:{name}"])
    if size is None or int(size.strip() or b"0") > files.PUBLIC_KEY_LIMIT:
        raise InputError(f"key {name} at {commit[:12]}: unreadable or larger than "
                         f"{files.PUBLIC_KEY_LIMIT} bytes")
    data = _git(root, ["cat-file", "blob", f"{commit}:{name}"]) or b""
    try:
        return dsse.load_public_key(data)
    except EvidenceError as exc:
        raise InputError(f"key {name} at {commit[:12]}: {exc}") from None
