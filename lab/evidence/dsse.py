"""DSSE envelopes signed with Ed25519: the signing and checking primitives.

The envelope is the DSSE v1 format (``payloadType``, base64 ``payload``,
``signatures``), signed over the pre-authentication encoding
``DSSEv1 SP len(type) SP type SP len(body) SP body``. Nothing here knows what the
payload says; ``evidence`` builds the in-toto statement and ``verification``
decides what a verified statement proves.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import files
from lab.errors import EvidenceError, InputError

PAYLOAD_TYPE = "application/vnd.in-toto+json"
KEY_ENV = "LAB_EVIDENCE_KEY"


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding of a payload."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(body), body)


def b64decode(text: str) -> bytes:
    """Decode standard or URL-safe base64, padded or not; reject anything else."""
    if not isinstance(text, str):
        raise ValueError("base64 field is not a string")
    data = text.strip().replace("-", "+").replace("_", "/")
    data += "=" * (-len(data) % 4)
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"invalid base64: {exc}") from exc


def raw_public_key(key: ed25519.Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of an Ed25519 public key."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keyid(key: ed25519.Ed25519PublicKey) -> str:
    """Key id: hex sha256 of the raw public key."""
    return hashlib.sha256(raw_public_key(key)).hexdigest()


def public_pem(key: ed25519.Ed25519PublicKey) -> str:
    """SubjectPublicKeyInfo PEM of a public key."""
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")


def load_public_key(pem: bytes) -> ed25519.Ed25519PublicKey:
    """An Ed25519 public key from PEM; anything else is an ``EvidenceError``."""
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise EvidenceError(f"not a PEM public key: {exc}") from exc
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise EvidenceError("the public key is not Ed25519")
    return key


def load_public_key_file(path: Path, what: str = "public key") -> ed25519.Ed25519PublicKey:
    """An Ed25519 public key from a PEM file; ``InputError`` naming the path otherwise.

    Bounded, regular files only (``files.read_bytes``): a FIFO or a huge file is refused,
    not read."""
    data = files.read_bytes(path, files.PUBLIC_KEY_LIMIT, what)
    try:
        return load_public_key(data)
    except EvidenceError as exc:
        raise InputError(f"{what} {path}: {exc}") from None


@dataclass(frozen=True)
class Signer:
    """An Ed25519 key and where it came from (``key_file`` or ``ephemeral``)."""

    key: ed25519.Ed25519PrivateKey = field(repr=False)
    source: str

    @property
    def keyid(self) -> str:
        """Hex sha256 of the raw public key."""
        return keyid(self.key.public_key())

    def describe(self) -> dict[str, str]:
        """The ``signing`` section of a report."""
        return {
            "algorithm": "ed25519",
            "key_source": self.source,
            "keyid": self.keyid,
            "public_key": public_pem(self.key.public_key()),
        }


def load_signer(environ: Mapping[str, str] | None = None) -> Signer:
    """The publication key named by ``LAB_EVIDENCE_KEY``, else a fresh ephemeral key."""
    env = os.environ if environ is None else environ
    path = env.get(KEY_ENV)
    if not path:
        return Signer(ed25519.Ed25519PrivateKey.generate(), "ephemeral")
    try:
        pem = files.read_bytes(Path(path), files.PUBLIC_KEY_LIMIT, KEY_ENV)
        key = serialization.load_pem_private_key(pem, password=None)
    except InputError as exc:
        raise EvidenceError(f"{KEY_ENV} does not name a readable PEM private key: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise EvidenceError(f"{KEY_ENV} does not name a readable PEM private key: {exc}") from exc
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise EvidenceError(f"{KEY_ENV} is not an Ed25519 private key")
    return Signer(key, "key_file")


def sign_envelope(
    payload: bytes, signer: Signer, payload_type: str = PAYLOAD_TYPE
) -> dict[str, Any]:
    """A DSSE envelope with one Ed25519 signature over ``PAE(type, payload)``."""
    signature = signer.key.sign(pae(payload_type, payload))
    return {
        "payloadType": payload_type,
        "payload": base64.b64encode(payload).decode("ascii"),
        "signatures": [{"keyid": signer.keyid, "sig": base64.b64encode(signature).decode("ascii")}],
    }


def check_signature(
    envelope: Mapping[str, Any], payload: bytes, key: ed25519.Ed25519PublicKey
) -> None:
    """Return if one of the envelope's signatures is ``key``'s over ``payload``.

    Standard and URL-safe base64 are both accepted. Raises ``EvidenceError`` naming
    the cause: no signature, undecodable fields, a different signer, or a signature
    that does not cover this payload and payload type.
    """
    signatures = envelope.get("signatures")
    if not isinstance(signatures, list) or not signatures:
        raise EvidenceError("signature: the envelope carries no signatures")
    payload_type = envelope.get("payloadType")
    if not isinstance(payload_type, str):
        raise EvidenceError("payload type: missing")
    message = pae(payload_type, payload)
    for item in signatures:
        try:
            key.verify(b64decode(item.get("sig")), message)
        except (InvalidSignature, ValueError, AttributeError):
            continue
        return
    # keyid is an unauthenticated hint: it only sharpens the message.
    ids = sorted({str(i["keyid"]) for i in signatures if isinstance(i, dict) and i.get("keyid")})
    if ids and keyid(key) not in ids:
        raise EvidenceError(
            f"signature: signed by key {', '.join(ids)}, not by the expected key {keyid(key)}"
        )
    raise EvidenceError(
        "signature: does not verify over the payload (altered payload or signature)"
    )
