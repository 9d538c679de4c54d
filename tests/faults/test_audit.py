"""The independent SQL audit: it shares no code with the runtime, and it sees what it must."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from lab.faults import audit, invariants

ROOT = Path(__file__).resolve().parents[2]
# What the audit's runner may import: psycopg, the floor's errors and bounded reads, stdlib.
ALLOWED_LAB = {"lab", "lab.errors", "lab.files"}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "lab":
                found |= {f"lab.{alias.name}" for alias in node.names}
    return found


def test_the_audit_shares_no_code_with_the_runtime_or_the_checker() -> None:
    """Every import of lab/faults/audit.py, at any depth of the file, is psycopg, the
    standard library, or the floor's ``errors`` and ``files``: never lab.runtime,
    lab.faults.invariants or any other lab module."""
    imports = _imports(ROOT / "lab" / "faults" / "audit.py")
    lab_imports = {name for name in imports if name == "lab" or name.startswith("lab.")}
    assert lab_imports <= ALLOWED_LAB, sorted(lab_imports - ALLOWED_LAB)
    third_party = {name.split(".")[0] for name in imports} - {"lab", "__future__"}
    import sys

    assert third_party - set(sys.stdlib_module_names) == {"psycopg"}


def test_the_audit_file_names_every_rule() -> None:
    rules = [name for name, _ in audit.queries()]
    assert rules == ["duplicate_effect", "succeeded_without_effect", "effect_without_dispatch",
                     "lost_workflow", "resurrected_after_completion", "write_after_absent",
                     "false_outcome"]


def _succeeded(lab: Any, idempotent: bool) -> Any:
    rig = lab.credit_tool(idempotent=idempotent)
    job = lab.approved(idempotent=idempotent)
    done = rig.worker.run_one()
    assert done is not None and done.state == "succeeded"
    return job


def _both(lab: Any) -> tuple[list[audit.Finding], list[invariants.Violation]]:
    history = invariants.load(lab.dsn, lab.schema, open_result=lab.store.keys.open)
    return audit.run(lab.dsn, lab.schema), invariants.check(history)


def test_a_clean_history_has_no_finding_and_the_checkers_agree(lab: Any) -> None:
    _succeeded(lab, idempotent=True)
    findings, found = _both(lab)
    assert findings == [] and found == []
    assert audit.compare(findings, [(v.kind, v.effect_key) for v in found])["agree"] is True


def test_a_duplicated_effect_and_a_lost_workflow_are_found_by_both(lab: Any) -> None:
    """A second ledger row for a non-idempotent key and a workflow left running without an
    owner's lease: the audit flags both, the checker too, and they agree on the keys."""
    job = _succeeded(lab, idempotent=False)
    lab.store.execute(
        "INSERT INTO tool_effects (effect_key, idempotent, fingerprint, account, amount_minor,"
        " currency, receipt, trace_id, start_id) SELECT effect_key, idempotent, fingerprint,"
        " account, amount_minor, currency, receipt || '-again', trace_id, start_id"
        " FROM tool_effects WHERE effect_key = %s", (job.effect_key,))
    lost = lab.approved(idempotent=True)
    lab.store.execute("UPDATE workflows SET state = 'unknown', review_reason = '' "
                      "WHERE id = %s", (lost.id,))
    findings, found = _both(lab)
    rules = {f.rule for f in findings}
    assert {"duplicate_effect", "succeeded_without_effect", "lost_workflow"} <= rules, findings
    kinds = {v.kind for v in found}
    assert {"duplicate_effect", "lost_workflow"} <= kinds
    assert audit.compare(findings, [(v.kind, v.effect_key) for v in found])["agree"] is True


def test_a_write_after_absent_and_a_false_outcome_are_found_by_both(lab: Any) -> None:
    """A ledger row from a start a fenced lookup had closed, and a failed workflow whose
    effect is in the ledger (forged into the tables): both checkers flag both, and agree."""
    job = _succeeded(lab, idempotent=True)
    lab.store.execute("UPDATE tool_fences SET closed_through = 5 WHERE effect_key = %s",
                      (job.effect_key,))
    failed = _succeeded(lab, idempotent=True)
    lab.store.execute("UPDATE workflows SET state = 'failed', result = NULL WHERE id = %s",
                      (failed.id,))
    findings, found = _both(lab)
    assert {"write_after_absent", "false_outcome"} <= {f.rule for f in findings}, findings
    assert {"write_after_absent", "false_outcome"} <= {v.kind for v in found}, found
    assert audit.compare(findings, [(v.kind, v.effect_key) for v in found])["agree"] is True


def test_the_comparison_fails_when_only_one_checker_flags_a_key() -> None:
    finding = audit.Finding("duplicate_effect", "wf", "key-1", "2 ledger rows")
    assert audit.compare([finding], [])["agree"] is False
    assert audit.compare([], [("lost_workflow", "key-2")])["agree"] is False
    # A kind the audit does not state is not a disagreement about keys.
    assert audit.compare([], [("budget_overrun", "key-3")])["agree"] is True
