"""``lab review`` reads are scoped to the reviewer's tenant: another tenant sees nothing.

Each command runs as a real ``lab`` process against the real PostgreSQL schema of the
test; a workflow of tenant A is put in manual review the way chapter 10 does (a
non-idempotent call whose reply is lost).
"""

from __future__ import annotations

from typing import Any

import pytest

from lab import errors, harness, review
from lab.runtime import store


def _in_review(lab: Any) -> store.Workflow:
    """A workflow of tenant A that waits for a person (its reply was lost)."""
    rig = lab.credit_tool(idempotent=False)
    job = lab.approved(idempotent=False)
    rig.service.drop_responses = True
    rig.worker.run_one()
    with pytest.raises(errors.ManualReview):
        rig.worker.reconcile(job.id)
    held = lab.state(job.id)
    assert held.state == "unknown" and held.tenant == "tenant-a"
    return held


def _review(lab: Any, tenant: str, *command: str) -> Any:
    return lab.run_cli("review", "--schema", lab.schema, "--tenant", tenant,
                       "--reviewer", f"reviewer-of-{tenant}", *command)


def test_review_list_shows_another_tenant_nothing_and_says_so(lab):
    job = _in_review(lab)
    own = _review(lab, "tenant-a", "list")
    assert own.returncode == 0, own.stderr
    assert job.id in own.stdout and job.review_reason in own.stdout
    stranger = _review(lab, "tenant-b", "list")
    assert stranger.returncode == 0, stranger.stderr
    assert stranger.stdout == "no workflow of tenant 'tenant-b' waits for review\n"
    assert stranger.stderr == ""


def test_review_show_of_another_tenants_workflow_is_no_workflow_in_one_line(lab):
    job = _in_review(lab)
    own = _review(lab, "tenant-a", "show", job.id)
    assert own.returncode == 0, own.stderr
    assert job.trace_id in own.stdout and '"tenant": "tenant-a"' in own.stdout
    stranger = _review(lab, "tenant-b", "show", job.id)
    assert stranger.returncode == errors.exit_code(errors.NotFound()), stranger.stderr
    assert stranger.stdout == ""
    # One line, worded as for a workflow that does not exist: nothing of tenant A's.
    assert stranger.stderr == (
        f"lab review show: no workflow {job.id!r} for a reviewer of tenant 'tenant-b'\n")
    absent = _review(lab, "tenant-b", "show", "wf-does-not-exist")
    assert absent.returncode == stranger.returncode
    assert absent.stderr == stranger.stderr.replace(job.id, "wf-does-not-exist")


def test_review_reads_need_the_reviewer_role(lab):
    job = _in_review(lab)
    approver = harness.APPROVER
    assert harness.REVIEWER.tenant == approver.tenant == job.tenant
    assert review.may_read(harness.REVIEWER, job)
    assert not review.may_read(approver, job)
    assert not review.may_read(harness.actor("tenant-b", "reviewer"), job)
