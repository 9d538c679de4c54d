"""Secrets kept out of the evidence: secret-named keys, DSN userinfo, ``password=``.

The compiler scrubs provider details and the command line with these, and the test log's
event histories (``testlog``) pass every text through ``redact_text``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

_SECRET_NAME = re.compile(r"(dsn|pass|pwd|token|secret|credential|auth|apikey|api_key|key)", re.I)
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")
_KEYWORD_SECRET = re.compile(r"\b(password|passwd|pwd|token|secret|sslpassword)\s*=\s*\S+", re.I)
REDACTED = "<redacted>"


def is_secret_name(name: str) -> bool:
    """Whether a key, option or variable name says its value is a secret."""
    return bool(_SECRET_NAME.search(name))


def scrub(value: Any) -> Any:
    """Drop secret-named keys and DSN userinfo from provider details."""
    if isinstance(value, Mapping):
        return {str(k): scrub(v) for k, v in sorted(value.items()) if not is_secret_name(str(k))}
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact_text(text: str) -> str:
    """``text`` with URL userinfo and ``password=``-style values replaced."""
    text = _URL_USERINFO.sub(lambda m: m.group("scheme") + REDACTED + "@", text)
    return _KEYWORD_SECRET.sub(lambda m: m.group(1) + "=" + REDACTED, text)


def redact_command(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The command line with DSNs, passwords and tokens replaced by ``<redacted>``.

    A value is secret when it follows (or is joined by ``=`` to) an option whose name
    says so, carries URL userinfo or ``password=``, or equals a secret environment value.
    """
    env = os.environ if environ is None else environ
    secrets = sorted(
        (v for k, v in env.items() if is_secret_name(k) and len(v) >= 6),
        key=len,
        reverse=True,
    )
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if arg.startswith("--") and "=" in arg:
            name, value = arg.split("=", 1)
            if is_secret_name(name):
                out.append(f"{name}={REDACTED}")
                continue
            arg = f"{name}={redact_text(value)}"
        elif arg.startswith("--") and len(arg) > 2 and is_secret_name(arg):
            out.append(arg)
            hide_next = True
            continue
        arg = redact_text(arg)
        for secret in secrets:
            arg = arg.replace(secret, REDACTED)
        out.append(arg)
    return out
