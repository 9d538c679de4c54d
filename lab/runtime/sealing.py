"""Results at rest: AES-256-GCM under a key id from a key catalog.

The catalog maps key ids to 32-byte keys and names the active one. New
results are sealed with the active key; any key still in the catalog opens
older results, so rotation keeps them readable; an unknown key id or a
tampered ciphertext fails closed. The catalog comes from ``LAB_RESULT_KEYS``
(``kid=base64key,kid2=base64key``, the first is active) or a file named by
``LAB_RESULT_KEYS_FILE``; without either, a development key is generated and
the catalog says so.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lab import errors

KEYS_ENV = "LAB_RESULT_KEYS"
KEYS_FILE_ENV = "LAB_RESULT_KEYS_FILE"
SEALED_FORMAT = "lab-sealed@v1"


@dataclass(frozen=True)
class KeyCatalog:
    """Key ids to AES-256 keys; ``active`` seals, every key opens."""

    keys: Mapping[str, bytes] = field(repr=False)
    active: str
    development: bool = False
    _aad_prefix: bytes = field(default=b"lab/result@v1\0", repr=False)

    def __post_init__(self) -> None:
        if self.active not in self.keys:
            raise errors.IntegrityFailure("active result key is not in the catalog")
        for kid, key in self.keys.items():
            if not kid or len(key) != 32:
                raise errors.IntegrityFailure(f"result key {kid!r} is not a 256-bit key")

    def rotated(self, kid: str, key: bytes) -> KeyCatalog:
        """A catalog with ``kid`` added and made active; older keys stay readable."""
        return KeyCatalog({**self.keys, kid: key}, kid, self.development)

    def seal(self, value: dict[str, Any], context: str) -> dict[str, str]:
        """Encrypt ``value`` bound to ``context`` (for example the workflow id)."""
        nonce = secrets.token_bytes(12)
        plaintext = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
        aad = self._aad_prefix + self.active.encode() + b"\0" + context.encode()
        ciphertext = AESGCM(self.keys[self.active]).encrypt(nonce, plaintext, aad)
        return {
            "format": SEALED_FORMAT,
            "key_id": self.active,
            "nonce": base64.b64encode(nonce).decode(),
            "ciphertext": base64.b64encode(ciphertext).decode(),
        }

    def open(self, sealed: Mapping[str, Any], context: str) -> dict[str, Any]:
        """Decrypt a sealed value; an unknown key id or any tampering fails closed."""
        if sealed.get("format") != SEALED_FORMAT:
            raise errors.IntegrityFailure("stored result is not a sealed result")
        kid = str(sealed.get("key_id", ""))
        if kid not in self.keys:
            raise errors.IntegrityFailure(f"stored result uses unknown key id {kid!r}")
        try:
            nonce = base64.b64decode(str(sealed["nonce"]), validate=True)
            ciphertext = base64.b64decode(str(sealed["ciphertext"]), validate=True)
            aad = self._aad_prefix + kid.encode() + b"\0" + context.encode()
            plaintext = AESGCM(self.keys[kid]).decrypt(nonce, ciphertext, aad)
        except (KeyError, ValueError, InvalidTag) as exc:
            raise errors.IntegrityFailure("stored result failed authentication") from exc
        value: dict[str, Any] = json.loads(plaintext)
        return value

    def to_env(self) -> str:
        """The ``LAB_RESULT_KEYS`` value for this catalog, active key first."""
        ordered = [self.active, *(k for k in self.keys if k != self.active)]
        return ",".join(f"{k}={base64.b64encode(self.keys[k]).decode()}" for k in ordered)


def parse_catalog(text: str) -> KeyCatalog:
    """Parse ``kid=base64key,...``; the first key is active."""
    keys: dict[str, bytes] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        kid, sep, encoded = item.partition("=")
        if not sep:
            raise errors.IntegrityFailure("result key entries must look like kid=base64key")
        try:
            keys[kid.strip()] = base64.b64decode(encoded.strip(), validate=True)
        except ValueError as exc:
            raise errors.IntegrityFailure(f"result key {kid!r} is not base64") from exc
    if not keys:
        raise errors.IntegrityFailure("the result key catalog is empty")
    return KeyCatalog(keys, next(iter(keys)))


def development_catalog() -> KeyCatalog:
    """A fresh random key, clearly marked as a development key."""
    kid = "dev-" + secrets.token_hex(4)
    return KeyCatalog({kid: secrets.token_bytes(32)}, kid, development=True)


def load_catalog(environ: Mapping[str, str] | None = None) -> KeyCatalog:
    """The catalog from the environment or its file, else a development catalog."""
    env = os.environ if environ is None else environ
    if env.get(KEYS_ENV):
        return parse_catalog(env[KEYS_ENV])
    if env.get(KEYS_FILE_ENV):
        return parse_catalog(Path(env[KEYS_FILE_ENV]).read_text(encoding="utf-8").strip())
    return development_catalog()
