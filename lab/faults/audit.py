"""The independent audit: runs ``audit.sql`` against a kept schema, nothing else.

A second witness beside ``lab.faults.invariants``: the rules are written again as
plain SQL, and this runner imports only psycopg and the floor (``lab.errors``,
``lab.files``), never the runtime or the checker (``tests/faults/test_audit.py`` holds it
to that). ``compare`` says whether the two agree on the effect keys they flag.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from lab import errors, files

AUDIT_SQL = Path(__file__).with_name("audit.sql")
AUDIT_SQL_LIMIT = 64 * files.KIB
# The checker's kinds that state the same rules as the audit's (by effect key).
SHARED_KINDS = ("duplicate_effect", "succeeded_without_effect", "effect_without_owner",
                "lost_workflow", "write_after_absent", "false_outcome")


@dataclass(frozen=True)
class Finding:
    """One row an audit query returned: a rule that does not hold."""

    rule: str
    workflow_id: str
    effect_key: str
    detail: str


def queries(path: Path = AUDIT_SQL) -> list[tuple[str, str]]:
    """(rule, query) pairs of the audit file, in order; each block starts ``-- name: rule``."""
    text = files.read_bytes(path, AUDIT_SQL_LIMIT, "audit SQL").decode("utf-8")
    blocks = re.split(r"^-- name: ([a-z_]+)\s*$", text, flags=re.MULTILINE)
    found = [(blocks[i], blocks[i + 1].strip().rstrip(";")) for i in range(1, len(blocks), 2)]
    if not found:
        raise errors.InputError(f"audit SQL {path}: no '-- name:' blocks")
    return found


def run(dsn: str, schema: str, expected_workflows: int | None = None) -> list[Finding]:
    """Every finding of every rule in ``schema``; with ``expected_workflows``, a count
    that differs is a ``lost_workflow`` finding too. psycopg errors become
    ``errors.StoreError`` here."""
    findings: list[Finding] = []
    try:
        with psycopg.connect(dsn, connect_timeout=10) as conn:
            conn.read_only = True
            with conn.transaction():
                conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(
                    sql.Identifier(schema)))
                for rule, query in queries():
                    for row in conn.execute(query).fetchall():
                        findings.append(Finding(rule, str(row[0]), str(row[1]), str(row[2])))
                if expected_workflows is not None:
                    counted = conn.execute("SELECT count(*) FROM workflows").fetchone()
                    total = int(counted[0]) if counted else 0
                    if total != expected_workflows:
                        findings.append(Finding("lost_workflow", "", "",
                                                f"{total} workflows, {expected_workflows} created"))
    except psycopg.Error as exc:
        raise errors.StoreError(
            f"the audit could not read schema {schema}: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        ) from None
    return findings


def compare(findings: Iterable[Finding],
            checker: Iterable[tuple[str, str]]) -> dict[str, object]:
    """Whether the audit and the checker agree: the same effect keys flagged (the
    checker's by its ``SHARED_KINDS``; ``checker`` gives (kind, effect_key) pairs).
    Returns the comparison for the report."""
    audit_list = list(findings)
    audit_keys = {f.effect_key for f in audit_list}
    checker_list = [(kind, key) for kind, key in checker]
    checker_keys = {key for kind, key in checker_list if kind in SHARED_KINDS}
    return {
        "audit_findings": len(audit_list),
        "audit_by_rule": dict(sorted(Counter(f.rule for f in audit_list).items())),
        "only_audit": sorted(audit_keys - checker_keys)[:20],
        "only_checker": sorted(checker_keys - audit_keys)[:20],
        "checker_violations": len(checker_list),
        "agree": audit_keys == checker_keys,
    }
