"""The crash-point matrix as data: its file format, its verdict, and its signed digest.

Pure: no database, no processes. The format lives with the evidence, its reader:
``lab crashpoints`` (``lab.faults.crashpoints``), its producer, writes the matrix,
and ``lab book build`` renders it from the evidence bundle (``lab.evidence.bundle``)
with ``lab.book.crashpoints.book_section``. The file is signed with the run when an experiment of
the run observed its sha256 (``SIGNED_KEY``): the signed report then binds the
file's exact bytes, and the chapter says so; any other matrix is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema

from lab import errors, files, protocol

FORMAT = "lab-crashpoints/1"
OUTPUT_FILE = "crashpoints.json"
MAX_MATRIX_BYTES = 4 * 1024 * 1024
# The observation key an experiment records the matrix file's sha256 under.
SIGNED_KEY = "crashpoints_sha256"

AUTOMATIC = "automatic"  # settled without a person
PERSON = "person"  # waits for a person, with the recorded reason
VIOLATION = "violation"  # the invariant checker found a violation
NOT_REACHED = "not_reached"  # the run never got to the boundary: the cell proves nothing
NOT_APPLICABLE = "not_applicable"
STATUSES = (AUTOMATIC, PERSON, VIOLATION, NOT_REACHED, NOT_APPLICABLE)

# The tool kinds whose columns differ only by the fenced lookup (issue 40): a cell waiting
# for a person under the first and settled automatically under the second "moved".
NON_IDEMPOTENT = "non_idempotent"  # no fenced lookup: a person decides its unknowns
NON_IDEMPOTENT_FENCED = "non_idempotent_fenced"  # its "absent" is a proof
# The event a reconciliation commits; its detail carries the lookup's proof.
RECONCILED_EVENT = "reconciled"


def outcome(cell: Mapping[str, Any]) -> str:
    """A cell's outcome in a few words: final state, effects, who settles it."""
    status = cell.get("status")
    if status == NOT_APPLICABLE:
        return "n/a"
    if status == VIOLATION:
        kinds = sorted({str(v.get("kind")) for v in cell.get("violations", [])})
        return f"VIOLATION {', '.join(kinds)}"
    if status == NOT_REACHED:
        return "boundary not reached"
    workflows = int(cell.get("workflows") or 1)
    who = f"person: {cell.get('why')}" if status == PERSON else "automatic"
    if workflows > 1 and status == PERSON:
        who += f" ({cell.get('waiting_for_person')} of {workflows})"
    effects = int(cell.get("effects") or 0)
    text = f"{cell.get('final_state')}, {effects} effect{'' if effects == 1 else 's'}, {who}"
    return f"{workflows} workflows: {text}" if workflows > 1 else text


def canonical_json(matrix: Mapping[str, Any]) -> bytes:
    """The matrix as the bytes written to the evidence directory (sorted, indented)."""
    return (json.dumps(matrix, indent=2, sort_keys=True) + "\n").encode("utf-8")


def digest(data: bytes) -> str:
    """sha256 of the matrix file's bytes, as an experiment observes it for the signature."""
    return hashlib.sha256(data).hexdigest()


def load(data: bytes) -> dict[str, Any]:
    """Parse a matrix file, refusing anything that is not one (size- and shape-checked)."""
    if len(data) > MAX_MATRIX_BYTES:
        raise errors.InputError(f"crash-point matrix larger than {MAX_MATRIX_BYTES} bytes")
    # Depth-bounded (no RecursionError), then every field the book reads schema-checked.
    matrix = files.parse_json(data, "crash-point matrix")
    if not isinstance(matrix, dict) or matrix.get("format") != FORMAT:
        raise errors.InputError(f"not a {FORMAT} matrix")
    for name in ("cells", "boundaries", "faults", "kinds"):
        if not isinstance(matrix.get(name), list):
            raise errors.InputError(f"crash-point matrix without a {name} list")
    for cell in matrix["cells"]:
        if not isinstance(cell, dict) or not all(
            isinstance(cell.get(k), str) for k in ("boundary", "fault", "kind", "status")
        ):
            raise errors.InputError("crash-point matrix with a malformed cell")
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(MATRIX_SCHEMA).iter_errors(matrix)
    )
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top)"
        raise errors.InputError(f"crash-point matrix: {where}: {error.message[:200]}")
    return matrix


_NAMED = {"type": "object", "required": ["name"],
          "properties": {"name": {"type": "string"}, "meaning": {"type": "string"},
                         "why": {"type": "string"}}}
# What the book reads of a matrix, with the types it reads it as.
MATRIX_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "faults": {"type": "array", "items": _NAMED},
        "boundaries": {"type": "array", "items": _NAMED},
        "omitted_faults": {"type": "array", "items": _NAMED},
        "kinds": {"type": "array", "items": {"type": "string"}},
        "coverage": {"type": "object"},
        "summary": {"type": "object"},
        "cells": {"type": "array", "items": {
            "type": "object",
            "properties": {
                "effects": {"type": ["integer", "null"]},
                "workflows": {"type": "integer", "minimum": 1},
                "waiting_for_person": {"type": "integer", "minimum": 0},
                "violations": {"type": "array", "items": {"type": "object"}},
                "events": {"type": "array"},
                "late": {"type": "object", "properties": {
                    "placement": {"type": "string"},
                    "answers": {"type": "array", "items": {"type": "string"}}}},
                "history": {"type": "array", "items": {
                    "type": "object",
                    "properties": {"workflow": {"type": "string"}, "kind": {"type": "string"},
                                   "detail": {"type": "string"}},
                }},
            },
        }},
    },
}


def passed(matrix: Mapping[str, Any]) -> bool:
    """True when no cell broke an invariant or missed its boundary, and coverage is full."""
    summary = matrix["summary"]
    coverage = matrix["coverage"]
    return (summary[VIOLATION] == 0 and summary[NOT_REACHED] == 0
            and matrix["violation_count"] == 0
            and (not matrix.get("complete") or coverage["reached"] == coverage["defined"]))


def moved_to_automatic(matrix: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The (row, fault) cells that wait for a person with a non-idempotent tool without a
    fenced lookup and are settled automatically by one, each with its proof: the detail of
    every fenced "absent" the cell's reconciliations committed (``lookup=absent
    closed_through=F``). A cell that settled automatically without such a proof (in the
    PostgreSQL column a worker may carry on after the restart, or not, by timing) was not
    moved by the fenced lookup and is not listed."""
    cells = {(c["boundary"], c["fault"], c["kind"]): c for c in matrix["cells"]}
    moved = []
    for (row, fault, kind), cell in cells.items():
        fenced = cells.get((row, fault, NON_IDEMPOTENT_FENCED))
        if kind != NON_IDEMPOTENT or fenced is None:
            continue
        if cell["status"] == PERSON and fenced["status"] == AUTOMATIC:
            proofs = sorted({str(e.get("detail")) for e in fenced.get("history", [])
                             if isinstance(e, dict) and e.get("kind") == RECONCILED_EVENT
                             and str(e.get("detail")).startswith(protocol.FENCED_ABSENT)})
            if not proofs:
                continue
            moved.append({"boundary": row, "fault": fault, "before": outcome(cell),
                          "after": outcome(fenced), "proof": proofs})
    return moved


def late_answers(matrix: Mapping[str, Any]) -> dict[str, Counter[str]]:
    """For each tool kind, how its late requests were answered (refused, applied), over
    every cell that held one past the client's timeout."""
    found: dict[str, Counter[str]] = {}
    for cell in matrix["cells"]:
        late = cell.get("late")
        if isinstance(late, dict):
            found.setdefault(str(cell["kind"]), Counter()).update(
                str(a) for a in late.get("answers", []))
    return found


# --------------------------------------------------------------------------- the book


def read(evidence_dir: Path) -> bytes | None:
    """The matrix file beside the evidence, size-limited and checked; None when absent."""
    path = evidence_dir / OUTPUT_FILE
    if not path.is_file():
        return None
    with path.open("rb") as handle:
        data = handle.read(MAX_MATRIX_BYTES + 1)
    load(data)
    return data


def signed_digests(report: Mapping[str, Any]) -> set[str]:
    """Every matrix sha256 an experiment of the signed report observed."""
    found = set()
    for test in report.get("tests", []):
        for observation in test.get("observations", []) if isinstance(test, dict) else []:
            if isinstance(observation, dict) and isinstance(observation.get(SIGNED_KEY), str):
                found.add(observation[SIGNED_KEY])
    return found
