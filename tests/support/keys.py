"""Signing keys for the lab's own tests, and forged evidence.

A fixture plugin (``tests/conftest.py`` loads it through ``pytest_plugins``):
``make_key`` is the one fixture for signing keys in tests, a fresh Ed25519 pair
written as the PEM files the lab reads. ``KeyFiles`` (what it returns) and
``resign`` (forge evidence the way an attacker with a fresh key would) are
imported by the tests that use them: ``from tests.support.keys import KeyFiles``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from lab.evidence import compiler, dsse


@dataclass(frozen=True)
class KeyFiles:
    """A fresh Ed25519 key pair and the PEM files a test hands to the lab."""

    private: ed25519.Ed25519PrivateKey
    private_pem: Path  # PKCS8, unencrypted: what LAB_EVIDENCE_KEY names
    public_pem: Path  # SubjectPublicKeyInfo: what --public-key and keys/trusted/ hold

    @property
    def public(self) -> ed25519.Ed25519PublicKey:
        """The public half."""
        return self.private.public_key()


@pytest.fixture
def make_key(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], KeyFiles]:
    """A factory of test keys: ``make_key("ci")`` writes ``ci.pem`` and ``ci.pub.pem``."""
    directory = tmp_path_factory.mktemp("keys")

    def make(name: str = "key") -> KeyFiles:
        private = ed25519.Ed25519PrivateKey.generate()
        private_pem = directory / f"{name}.pem"
        private_pem.write_bytes(
            private.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        public_pem = directory / f"{name}.pub.pem"
        public_pem.write_bytes(
            private.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        return KeyFiles(private, private_pem, public_pem)

    return make


def resign(
    directory: Path,
    change: Callable[[dict[str, Any]], None],
    *,
    key_source: str = "ephemeral",
    signer: dsse.Signer | None = None,
    record: Callable[[dict[str, Any]], None] | None = None,
) -> dsse.Signer:
    """Forge evidence as an attacker would: apply ``change`` to the signed report in
    ``directory`` (and ``record`` to each line of tests.jsonl, so the rows and the
    records the verifier folds agree) and re-sign both with a fresh key, or ``signer``."""
    forged_by = signer or dsse.Signer(ed25519.Ed25519PrivateKey.generate(), key_source)
    data: dict[str, Any] = json.loads((directory / compiler.REPORT_FILE).read_text())
    data["signing"] = forged_by.describe()
    change(data)
    report_bytes = compiler.dumps_report(data)
    tests_bytes = (directory / compiler.TESTS_FILE).read_bytes()
    if record is not None:
        lines = [json.loads(line) for line in tests_bytes.decode().splitlines()]
        for line in lines:
            record(line)
        tests_bytes = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines).encode()
        (directory / compiler.TESTS_FILE).write_bytes(tests_bytes)
    payload = json.dumps(
        compiler.statement(report_bytes, data, tests_bytes), sort_keys=True, separators=(",", ":")
    ).encode()
    (directory / compiler.REPORT_FILE).write_bytes(report_bytes)
    envelope = dsse.sign_envelope(payload, forged_by)
    (directory / compiler.ENVELOPE_FILE).write_text(json.dumps(envelope))
    (directory / compiler.PUBLIC_KEY_FILE).write_text(data["signing"]["public_key"])
    return forged_by
