"""Secrets stay out of reprs: the one rule for what holds a secret, the one way to hide it.

A repr reaches places nobody means to publish: pytest's assertion explanations
(``where 1 = _Run(dsn='... password=...').seed``), tracebacks, log lines and, through
them, the signed ``tests.jsonl`` of a failed run. So every dataclass field that holds a
secret is declared ``field(repr=False)`` (the form mypy's dataclass plugin understands),
and ``tests/test_redact.py`` walks every dataclass of the lab and fails on a field the
rule calls secret-bearing that still shows in its repr.

The rule (``secret_bearing``), on a field's name and its annotation:

1. a word of the name (split at ``_``) is one of ``SECRET_WORDS``: a DSN or conninfo
   (may carry a password), a password, a token, a secret, a credential;
2. or the annotation names key material (``KEY_MATERIAL``: a private key, the result-key
   catalog) or bytes under a name that says key.

Names that merely contain "key" are not secrets by themselves: an ``effect_key`` is a
digest printed in evidence, a ``public_key`` or ``keyid`` is public, an observation's
``key`` is a name. A class that is not a dataclass and holds a secret keeps object's
default repr (``<... object at 0x...>``), which shows no attribute.

A repr is not the only way out: pytest prints a failing frame's arguments (a ``dsn``
string among them). So the secrets this process handles (the run's database password,
each tool's bearer token) are also ``remember``-ed, and the lab's plugin ``scrub``-s
every test report (its traceback and captured output) before the terminal or
``tests.jsonl`` sees it. That registry is this module's only state; everything else is
pure.
"""

from __future__ import annotations

import re

SECRET_WORDS = frozenset({
    "dsn", "dsns", "conninfo", "password", "passwd", "pwd", "token", "tokens", "secret",
    "secrets", "credential", "credentials",
})
# Annotation fragments of objects that are key material whatever the field is called.
KEY_MATERIAL = ("PrivateKey", "KeyCatalog")
_WORD = re.compile(r"[a-z0-9]+")
# What replaces a remembered secret in scrubbed text.
REDACTED = "<redacted>"
# Shorter values are not remembered: replacing them would mangle ordinary text.
MIN_SECRET = 8
_remembered: set[str] = set()


def secret_bearing(name: str, annotation: object) -> bool:
    """Whether a field called ``name`` with ``annotation`` (a type or its text) holds a
    secret by the module's rule."""
    words = set(_WORD.findall(name.lower()))
    if words & SECRET_WORDS:
        return True
    text = annotation if isinstance(annotation, str) else repr(annotation)
    if any(fragment in text for fragment in KEY_MATERIAL):
        return True
    return "key" in name.lower() and "bytes" in text


def remember(*values: str | None) -> None:
    """Note secrets this process holds (a password, a token), so ``scrub`` hides them.

    Values shorter than ``MIN_SECRET`` are ignored (a process holds a handful of
    secrets: one per database and per tool it starts).
    """
    for value in values:
        if value and len(value) >= MIN_SECRET:
            _remembered.add(value)


def remembered() -> frozenset[str]:
    """The secrets ``remember`` has noted in this process."""
    return frozenset(_remembered)


def scrub(text: str, secrets: frozenset[str] | None = None) -> str:
    """``text`` with every remembered secret (or each of ``secrets``) replaced by
    ``REDACTED``, longest first (so a secret inside another is not half-replaced)."""
    for value in sorted(_remembered if secrets is None else secrets, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text
