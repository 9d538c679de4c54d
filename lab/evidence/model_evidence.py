"""The model evidence's layout, as its readers see it, and what its verifier answers.

``lab model run`` (``lab.model``) produces and signs ``<evidence>/model/``; its verifier
(``lab.model.signed.verify``) recomputes the model report's content, which needs the
model experiment's own admission code, so it stays with the producer. Readers (the
evidence bundle, the book) know the files by these names and take the verifier as a
``ModelVerifier`` handed down by the command that opens the bundle: they never import
``lab.model``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric import ed25519

from lab.evidence import trust

MODEL_DIR = "model"
REPORT_FILE = "model-experiment.json"
TRACES_DIR = "traces"
ENVELOPE_FILE = "model.intoto.json"
PUBLIC_KEY_FILE = "model.pub.pem"
CASES_FILE = "cases.json"
# The generation modes, in the order the report and the book show them.
MODES = ("unconstrained", "constrained")


class ModelVerdict(Protocol):
    """What a model evidence verifier answers."""

    @property
    def ok(self) -> bool: ...
    @property
    def problems(self) -> list[str]: ...
    @property
    def pinned_by(self) -> str | None: ...


class ModelVerifier(Protocol):
    """A verifier of a model evidence directory (``lab.model.signed.verify``)."""

    def __call__(
        self,
        path: Path,
        *,
        public_key: ed25519.Ed25519PublicKey | None = None,
        trusted: Sequence[trust.TrustedKey] = (),
    ) -> ModelVerdict: ...
