"""``lab review``: what a person sees and decides about work in manual review."""

from __future__ import annotations

import argparse
import json
import os
import sys

from rich.console import Console
from rich.table import Table

from lab import errors, protocol
from lab.runtime import store


def cli_main(args: argparse.Namespace) -> int:
    """Body of ``lab review list|show|requeue|resolve``; the DSN comes from BOOK_LAB_DSN."""
    dsn = os.environ.get(protocol.DSN_ENV, "")
    if not dsn:
        raise errors.UsageError(f"lab review needs {protocol.DSN_ENV} in its environment")
    reviewer = store.Actor(tenant=args.tenant, subject=args.reviewer, role="reviewer")
    # A pipe gets whole identifiers rather than a table cut to 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    with store.Store.open(dsn, args.schema, max_connections=1,
                          application_name="lab-review") as db:
        if args.review_command == "list":
            table = Table("workflow", "attempt", "fence", "reason", "cancel requested")
            for item in db.in_review():
                table.add_row(item.id, str(item.attempt), str(item.fence),
                              item.review_reason or "(not yet reviewed)",
                              "yes" if item.cancel_requested else "no")
            console.print(table)
        elif args.review_command == "show":
            item = db.get(args.workflow)
            start = db.barrier_for(item.id, item.fence)
            print(json.dumps({
                "workflow": item.id,
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
        elif args.review_command == "requeue":
            item = db.requeue_reviewed(reviewer, args.workflow, force=args.force,
                                       reason=args.reason)
            print(f"requeued {item.id}: state {item.state}")
        else:
            item = db.resolve_reviewed(reviewer, args.workflow, args.outcome, args.reason)
            print(f"resolved {item.id}: state {item.state}")
    return 0
