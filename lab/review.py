"""``lab review``: what a person sees and decides about work in manual review."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from lab import errors, protocol
from lab.options import option
from lab.runtime import store


@dataclass(frozen=True, kw_only=True)
class ReviewOptions:
    """``lab review list``, and what every ``lab review`` subcommand is given: the flags
    of ``lab review`` itself (each subcommand's own are declared by its class below)."""

    schema: str = option(help="the schema holding the workflows")
    tenant: str = option(
        "tenant-a", help="the reviewer's tenant: every read and decision is limited to it")
    reviewer: str = option("reviewer", help="who decides (recorded)")


# The one positional every decision names.
_WORKFLOW_HELP = "the workflow's id"


@dataclass(frozen=True, kw_only=True)
class ShowOptions(ReviewOptions):
    """``lab review show WORKFLOW``."""

    workflow: str = option(help=_WORKFLOW_HELP, positional=True)


@dataclass(frozen=True, kw_only=True)
class RequeueOptions(ReviewOptions):
    """``lab review requeue WORKFLOW [--force --reason TEXT]``."""

    workflow: str = option(help=_WORKFLOW_HELP, positional=True)
    force: bool = option(
        False, help="requeue although a start barrier exists (needs --reason)")
    reason: str = option("", help="why (recorded; required with --force)")


@dataclass(frozen=True, kw_only=True)
class ResolveOptions(ReviewOptions):
    """``lab review resolve WORKFLOW --as OUTCOME --reason TEXT``."""

    workflow: str = option(help=_WORKFLOW_HELP, positional=True)
    outcome: str = option(help="what the person found happened", flags=("--as",),
                          choices=("failed", "succeeded"))
    reason: str = option(help="why (recorded)")


def may_read(reviewer: store.Actor, workflow: store.Workflow) -> bool:
    """Whether ``reviewer`` may see ``workflow``: a reviewer of the workflow's own tenant.

    Every review read (``list``, ``show``) passes through this decision; the store's
    writes (``requeue``, ``resolve``) check the same two things under the row's lock.
    """
    return reviewer.role == "reviewer" and reviewer.tenant == workflow.tenant


def _readable(db: store.Store, reviewer: store.Actor, workflow_id: str) -> store.Workflow:
    """``workflow_id`` if ``reviewer`` may read it; otherwise ``errors.NotFound``, worded
    the same whether it belongs to another tenant or does not exist, so the answer tells
    a stranger nothing about another tenant's work."""
    missing = errors.NotFound(
        f"no workflow {workflow_id!r} for a reviewer of tenant {reviewer.tenant!r}")
    try:
        item = db.get(workflow_id)
    except errors.NotFound:
        raise missing from None
    if not may_read(reviewer, item):
        raise missing
    return item


def cli_main(options: ReviewOptions) -> int:
    """Body of ``lab review list|show|requeue|resolve`` (by the options' kind); the DSN
    comes from BOOK_LAB_DSN. Every read and every decision is scoped to the reviewer's
    tenant (``--tenant``) and role."""
    dsn = os.environ.get(protocol.DSN_ENV, "")
    if not dsn:
        raise errors.UsageError(f"lab review needs {protocol.DSN_ENV} in its environment")
    reviewer = store.Actor(tenant=options.tenant, subject=options.reviewer, role="reviewer")
    # A pipe gets whole identifiers rather than a table cut to 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    with store.Store.open(dsn, options.schema, max_connections=1,
                          application_name="lab-review") as db:
        if isinstance(options, ShowOptions):
            item = _readable(db, reviewer, options.workflow)
            start = db.barrier_for(item.id, item.fence)
            print(json.dumps({
                "workflow": item.id,
                "tenant": item.tenant,
                "state": item.state,
                "review_reason": item.review_reason,
                "attempt": item.attempt,
                "max_attempts": item.max_attempts,
                "fence": item.fence,
                "trace_id": item.trace_id,
                "start_barrier": start.start_id if start else None,
                "proof": "no start barrier: never dispatched" if start is None
                else "start barrier committed: may have been dispatched",
                "events": [f"{e['kind']} fence={e['fence']} {e['detail']}".strip()
                           for e in db.events(item.id)],
            }, indent=2))
        elif isinstance(options, RequeueOptions):
            item = db.requeue_reviewed(reviewer, options.workflow, force=options.force,
                                       reason=options.reason)
            print(f"requeued {item.id}: state {item.state}")
        elif isinstance(options, ResolveOptions):
            item = db.resolve_reviewed(reviewer, options.workflow, options.outcome,
                                       options.reason)
            print(f"resolved {item.id}: state {item.state}")
        else:
            waiting = [item for item in db.in_review(reviewer.tenant)
                       if may_read(reviewer, item)]
            if not waiting:
                print(f"no workflow of tenant {reviewer.tenant!r} waits for review")
                return 0
            table = Table("workflow", "attempt", "fence", "reason", "cancel requested",
                          title=f"tenant {reviewer.tenant}: {len(waiting)} in review")
            for item in waiting:
                table.add_row(item.id, str(item.attempt), str(item.fence),
                              item.review_reason or "(not yet reviewed)",
                              "yes" if item.cancel_requested else "no")
            console.print(table)
    return 0
