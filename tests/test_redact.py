"""No secret in a repr: every secret-bearing dataclass field of the lab is left out of it.

The rule is ``lab.redact.secret_bearing`` (a DSN, password, token, secret or credential
by the field's name; key material by its annotation). The walk imports every module of
``lab`` and inspects every dataclass it defines; the source is read too, so a dataclass
the walk cannot reach (defined inside a function) fails rather than hides.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lab
from lab import redact
from lab.faults import crashpoints
from lab.runtime import sealing

PACKAGE = Path(lab.__file__).parent
PASSWORD = "hunter2-not-in-any-repr"  # a planted test secret


def _modules() -> list[Any]:
    return [importlib.import_module(info.name)
            for info in pkgutil.walk_packages(lab.__path__, "lab.")]


def _dataclasses(owner: Any, module: str) -> Iterator[type]:
    for value in vars(owner).values():
        if inspect.isclass(value) and value.__module__ == module:
            if dataclasses.is_dataclass(value):
                yield value
            yield from _dataclasses(value, module)


def _every_dataclass() -> dict[str, type]:
    found: dict[str, type] = {}
    for module in _modules():
        for cls in _dataclasses(module, module.__name__):
            found[f"{module.__name__}.{cls.__qualname__}"] = cls
    return found


def _declared_in_source() -> set[str]:
    """``module.Class`` of every class decorated with ``dataclass`` in lab's source."""
    names: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                "dataclass" in ast.unparse(d) for d in node.decorator_list
            ):
                names.add(f"{module}.{node.name}")
    return names


def test_every_secret_bearing_dataclass_field_is_left_out_of_its_repr() -> None:
    found = _every_dataclass()
    reached = {name.rsplit(".", 1)[0] + "." + cls.__name__ for name, cls in found.items()}
    assert _declared_in_source() <= reached, "dataclasses the walk cannot inspect"
    shown: list[str] = []
    secret_fields = 0
    for name, cls in sorted(found.items()):
        for f in dataclasses.fields(cls):
            if redact.secret_bearing(f.name, f.type):
                secret_fields += 1
                if f.repr:
                    shown.append(f"{name}.{f.name}: declare it field(repr=False)")
    assert shown == []
    # The walk is not vacuous: the DSNs, tokens and keys of today's lab are among them.
    assert secret_fields >= 10
    assert "lab.faults.crashpoints._Run" in found


@pytest.mark.parametrize(("name", "annotation", "bearing"), [
    ("dsn", "str", True),
    ("admin_dsn", "str", True),
    ("password", "str | None", True),
    ("token", "str", True),
    ("client_secret", "str", True),
    ("key", "ed25519.Ed25519PrivateKey", True),
    ("keys", "sealing.KeyCatalog", True),
    ("keys", "Mapping[str, bytes]", True),
    ("effect_key", "str", False),  # a digest, printed in evidence
    ("public_key", "str | None", False),
    ("keyid", "str | None", False),
    ("key", "ed25519.Ed25519PublicKey", False),
    ("key", "str", False),  # an observation's key: a name
    ("tokenizer_threads", "int", False),
])
def test_the_rule(name: str, annotation: str, bearing: bool) -> None:
    assert redact.secret_bearing(name, annotation) is bearing


def test_a_crash_point_runs_repr_holds_no_dsn_token_or_key() -> None:
    """The leak issue 41 found: ``_Run(dsn='... password=...')`` in a failed cell's traceback."""
    catalog = sealing.KeyCatalog({"k1": b"\x01" * 32}, "k1")
    run = crashpoints._Run(f"host=127.0.0.1 port=5 password={PASSWORD}", "tok-planted", 17,
                           catalog, False, None)
    text = repr(run) + repr(catalog)
    for planted in (PASSWORD, "tok-planted", repr(b"\x01" * 32)):
        assert planted not in text
    assert "seed=17" in text and "active='k1'" in text  # the rest still shows
