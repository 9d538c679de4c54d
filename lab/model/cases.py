"""The model experiment's case set: authored requests and what each one tries.

A case set is a versioned JSON file (``model_cases.json`` ships with the lab)::

    {"version": 1, "cases": [{"id", "prompt", "account", "amount_minor",
      "currency", "expect", "injects"?, "note"?}, ...]}

``account``, ``amount_minor`` and ``currency`` are what the request asks for,
admissible or not; ``expect`` is ``admit`` when a faithful plan must be
admitted and ``refuse`` when no faithful plan may be (an amount out of range,
an unknown account, another currency). ``injects`` names the authority a
prompt injection tries to smuggle in: field names and values that no admitted
plan may carry, and ``plans``, the most plans one generation may have admitted.
Pure code: the file is read size-limited and checked field by field.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from lab import errors

CASE_SET_VERSION = 1
DEFAULT_FILE = Path(__file__).with_name("model_cases.json")
MAX_FILE_BYTES = 256 * 1024
EXPECTATIONS = ("admit", "refuse")

_CASE_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
_FIELDS = {"id", "prompt", "account", "amount_minor", "currency", "expect"}
_OPTIONAL = {"injects", "note"}
_INJECT_FIELDS = {"keys", "values"}


@dataclass(frozen=True)
class Injection:
    """What a request tries to grant itself: field names and values no plan may carry."""

    keys: tuple[str, ...] = ()
    values: tuple[str | int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The injection as written in the case set."""
        return {"keys": list(self.keys), "values": list(self.values)}


@dataclass(frozen=True)
class Case:
    """One authored request and the plan a faithful model would propose for it."""

    id: str
    account: str
    amount_minor: int
    prompt: str
    currency: str = "CNY"
    expect: str = "admit"
    injects: Injection = field(default_factory=Injection)
    note: str = ""


@dataclass(frozen=True)
class CaseSet:
    """The cases of one file, with the file's version and digest for the report."""

    cases: tuple[Case, ...]
    version: int
    sha256: str
    source: str
    data: bytes

    def describe(self) -> dict[str, Any]:
        """The report's ``case_set`` section."""
        return {
            "version": self.version,
            "sha256": self.sha256,
            "source": self.source,
            "cases": len(self.cases),
        }


def _bad(message: str) -> NoReturn:
    raise errors.InputError(message)


def _injection(value: Any, where: str) -> Injection:
    if value is None:
        return Injection()
    if not isinstance(value, dict) or not set(value) <= _INJECT_FIELDS:
        _bad(f"{where}: injects must be an object with keys and/or values")
    keys = value.get("keys", [])
    values = value.get("values", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        _bad(f"{where}: injects.keys must be a list of field names")
    if not isinstance(values, list) or not all(
        (isinstance(v, str) and v) or type(v) is int for v in values
    ):
        _bad(f"{where}: injects.values must be a list of strings and integers")
    return Injection(tuple(keys), tuple(values))


def _case(item: Any, where: str) -> Case:
    if not isinstance(item, dict) or not _FIELDS <= set(item) <= _FIELDS | _OPTIONAL:
        _bad(f"{where} is not {{{', '.join(sorted(_FIELDS))}[, injects, note]}}")
    if not isinstance(item["id"], str) or not _CASE_ID.fullmatch(item["id"]):
        _bad(f"{where}: id must be 1-64 of [a-z0-9-], starting with a letter or digit")
    if not isinstance(item["prompt"], str) or not item["prompt"].strip():
        _bad(f"{where}: prompt must be a non-empty string")
    if not isinstance(item["account"], str) or not isinstance(item["currency"], str):
        _bad(f"{where}: account and currency must be strings")
    if type(item["amount_minor"]) is not int:
        _bad(f"{where}: amount_minor must be an integer")
    if item["expect"] not in EXPECTATIONS:
        _bad(f"{where}: expect must be one of {', '.join(EXPECTATIONS)}")
    note = item.get("note", "")
    if not isinstance(note, str):
        _bad(f"{where}: note must be a string")
    return Case(
        id=item["id"],
        account=item["account"],
        amount_minor=item["amount_minor"],
        prompt=item["prompt"],
        currency=item["currency"],
        expect=item["expect"],
        injects=_injection(item.get("injects"), where),
        note=note,
    )


def parse(data: bytes, source: str) -> CaseSet:
    """A case set from a file's bytes; ``errors.InputError`` names the first problem."""
    if len(data) > MAX_FILE_BYTES:
        _bad(f"case set {source} is larger than {MAX_FILE_BYTES} bytes")
    try:
        value = json.loads(data)
    except ValueError as exc:
        _bad(f"case set {source} is not JSON: {exc}")
    if not isinstance(value, dict) or set(value) != {"version", "cases"}:
        _bad(f"case set {source} must be an object {{version, cases}}")
    if value["version"] != CASE_SET_VERSION:
        _bad(f"case set {source}: version {value['version']!r} is not {CASE_SET_VERSION}")
    items = value["cases"]
    if not isinstance(items, list) or not items:
        _bad(f"case set {source}: cases must be a non-empty list")
    cases = tuple(_case(item, f"case {index} in {source}") for index, item in enumerate(items))
    if len({c.id for c in cases}) != len(cases):
        _bad(f"case ids in {source} are not unique")
    return CaseSet(
        cases=cases,
        version=CASE_SET_VERSION,
        sha256=hashlib.sha256(data).hexdigest(),
        source=source,
        data=data,
    )


def load(path: Path | None = None) -> CaseSet:
    """The case set in ``path``, or the lab's own when ``path`` is None."""
    path = DEFAULT_FILE if path is None else path
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        _bad(f"cannot read case set {path}: {exc.strerror or exc}")
    source = DEFAULT_FILE.name if path == DEFAULT_FILE else str(path)
    return parse(data, source)


def subset(case_set: CaseSet, ids: list[str]) -> CaseSet:
    """The named cases of ``case_set`` (same version, digest and source), in its order."""
    unknown = sorted(set(ids) - {c.id for c in case_set.cases})
    if unknown:
        _bad(f"no such case in {case_set.source}: {', '.join(unknown)}")
    chosen = tuple(c for c in case_set.cases if c.id in ids)
    return CaseSet(chosen, case_set.version, case_set.sha256, case_set.source, case_set.data)
