"""Whom a verifier trusts: publication keys pinned in git or named by ``LAB_TRUSTED_KEYS``.

A key vouches for evidence only when git tracks it under ``keys/trusted/`` at the commit
the evidence names, or when ``LAB_TRUSTED_KEYS`` (or ``--public-key``) names it;
``runtime.pub.pem`` beside the evidence is never a pin. ``verification`` decides with
these keys.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import files
from lab.errors import EvidenceError, InputError
from lab.evidence import compiler, dsse

TRUSTED_DIR = "keys/trusted"
TRUSTED_PATTERN = "*.pub.pem"
TRUSTED_ENV = "LAB_TRUSTED_KEYS"


@dataclass(frozen=True)
class TrustedKey:
    """A public key the verifier trusts, and where that trust came from."""

    key: ed25519.Ed25519PublicKey
    origin: str


def load_public_key_file(path: Path, what: str = "public key") -> ed25519.Ed25519PublicKey:
    """An Ed25519 public key from a PEM file; ``InputError`` naming the path otherwise."""
    data = files.read_bytes(path, files.PUBLIC_KEY_LIMIT, what)
    try:
        return dsse.load_public_key(data)
    except EvidenceError as exc:
        raise InputError(f"{what} {path}: {exc}") from None


def trusted_keys(
    root: Path, environ: Mapping[str, str] | None = None, *, commit: str | None = "HEAD"
) -> list[TrustedKey]:
    """The publication keys a verifier trusts without ``--public-key``.

    Every ``keys/trusted/*.pub.pem`` that git tracks at ``commit`` of the repository at
    ``root``, read from git's object store (an untracked or locally edited file in
    ``./keys/trusted/`` is not a publication key: anyone can drop one there), and each
    file or directory (its ``*.pub.pem``) given explicitly in ``LAB_TRUSTED_KEYS``,
    separated by ``os.pathsep``. A listed file that is not an Ed25519 PEM key is an error.
    With ``commit`` None only the explicit keys count (``trusted_keys_for`` passes the
    evidence's own commit).
    """
    env = os.environ if environ is None else environ
    keys = [] if commit is None else [
        TrustedKey(_tracked_key(root, commit, name), f"{name} at {commit[:12]}")
        for name in _tracked_key_names(root, commit)]
    paths: list[tuple[Path, str]] = []
    for entry in (env.get(TRUSTED_ENV) or "").split(os.pathsep):
        if not entry:
            continue
        where = Path(entry)
        if where.is_dir():
            paths += [(p, f"{TRUSTED_ENV} {p}") for p in sorted(where.glob(TRUSTED_PATTERN))]
        else:
            paths.append((where, f"{TRUSTED_ENV} {where}"))
    return keys + [
        TrustedKey(load_public_key_file(path, "trusted key"), origin) for path, origin in paths
    ]


def trusted_keys_for(
    root: Path, evidence: Path, environ: Mapping[str, str] | None = None
) -> list[TrustedKey]:
    """The publication keys trusted for one evidence file: tracked at *its* commit.

    A key is trusted when git tracks it under ``keys/trusted/`` at the commit the
    evidence names (so a key removed since, or added later, neither vouches for nor
    against older evidence), or when ``LAB_TRUSTED_KEYS`` names it. Evidence that names
    no commit, or a commit this repository does not hold, gets the explicit keys only:
    pin it with ``--public-key``.
    """
    commit = evidence_commit(evidence)
    if commit is not None and _git(root, ["cat-file", "-e", f"{commit}^{{commit}}"]) is None:
        commit = None
    return trusted_keys(root, environ, commit=commit)


def evidence_commit(evidence: Path) -> str | None:
    """The full commit id the evidence's signed report names, or None.

    Read before the signature is checked, only to choose which committed keys may
    vouch for it: a forged commit cannot help a forger, whose key must still be one
    that git tracked there.
    """
    try:
        where = evidence / compiler.ENVELOPE_FILE if evidence.is_dir() else evidence
        envelope = files.read_json(where, files.ENVELOPE_LIMIT, "envelope")
        parsed = files.parse_json(dsse.b64decode(envelope.get("payload")), "payload")
    except (InputError, ValueError, AttributeError, TypeError):
        return None
    predicate = parsed.get("predicate") if isinstance(parsed, dict) else None
    commit = predicate.get("commit") if isinstance(predicate, dict) else None
    if isinstance(commit, str) and len(commit) == 40 and all(
            c in "0123456789abcdef" for c in commit):
        return commit
    return None


def _git(root: Path, args: Sequence[str]) -> bytes | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=30,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _tracked_key_names(root: Path, commit: str) -> list[str]:
    """``keys/trusted/*.pub.pem`` as git tracks them at ``commit`` (none outside git)."""
    if not root.is_dir() or commit.startswith("-"):
        return []
    listed = _git(root, ["ls-tree", "-r", "-z", "--name-only", commit, "--", f"{TRUSTED_DIR}/"])
    names = (listed or b"").decode("utf-8", "replace").split("\0")
    return sorted(n for n in names
                  if n.startswith(f"{TRUSTED_DIR}/") and PurePosixPath(n).match(TRUSTED_PATTERN))


def _tracked_key(root: Path, commit: str, name: str) -> ed25519.Ed25519PublicKey:
    size = _git(root, ["cat-file", "-s", f"{commit}:{name}"])
    if size is None or int(size.strip() or b"0") > files.PUBLIC_KEY_LIMIT:
        raise InputError(f"trusted key {name} at {commit}: unreadable or larger than "
                         f"{files.PUBLIC_KEY_LIMIT} bytes")
    data = _git(root, ["cat-file", "blob", f"{commit}:{name}"]) or b""
    try:
        return dsse.load_public_key(data)
    except EvidenceError as exc:
        raise InputError(f"trusted key {name} at {commit}: {exc}") from None
