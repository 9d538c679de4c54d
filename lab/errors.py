"""The lab's exceptions.

Every failure the lab reports is a ``LabError``; driver errors (psycopg, httpx)
are translated at the edge, in ``store`` and ``tool``, and chained with
``from exc`` so nothing above them ever handles a driver exception::

    LabError
    ├── Rejected            untrusted input refused by admission
    ├── BoundaryViolation   a target outside loopback, or an unsafe endpoint
    ├── Conflict            the request contradicts what is stored
    │   └── ReceiptMismatch a receipt that does not prove this workflow's effect
    ├── Denied              the actor has no right to do this
    ├── NotFound            no such workflow
    ├── Stale               the caller's fence or lease is no longer current
    ├── IntegrityFailure    a stored record failed its digest or binding: fail closed
    ├── ManualReview        only a person may decide what happens next
    ├── StoreError          PostgreSQL could not be reached or refused the write
    ├── ProvisioningError   no PostgreSQL could be provided for a run
    └── ToolError           the tool could not be used
        ├── RateLimited     a trusted 429: nothing happened, retry later
        ├── OutcomeUnknown  the request may have taken effect: reconcile
        ├── ToolUnavailable the request never reached the tool: retry later
        └── ToolRefused     the tool answered with a definite refusal
"""

from __future__ import annotations


class LabError(Exception):
    """The lab failed to do what was asked."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class Rejected(LabError):
    """Proposal rejected by strict admission."""


class BoundaryViolation(LabError):
    """Target is outside the loopback boundary."""


class Conflict(LabError):
    """Request conflicts with the stored workflow."""


class ReceiptMismatch(Conflict):
    """Receipt does not match the workflow's fingerprint and effect key."""


class Denied(LabError):
    """Actor is not allowed to do this."""


class NotFound(LabError):
    """No such workflow."""


class Stale(LabError):
    """Fence or lease is no longer current."""


class IntegrityFailure(LabError):
    """Stored record failed verification: refusing to act on it."""


class ManualReview(LabError):
    """Outcome cannot be decided automatically: a person must review it."""

    def __init__(self, message: str | None = None, *, reason: str = "manual_review") -> None:
        super().__init__(message)
        self.reason = reason


class StoreError(LabError):
    """PostgreSQL could not complete the operation."""


class ProvisioningError(LabError):
    """No PostgreSQL server could be provided for this run."""


class ToolError(LabError):
    """The tool could not be used."""


class RateLimited(ToolError):
    """Tool answered 429: nothing happened, retry after a backoff."""


class OutcomeUnknown(ToolError):
    """Tool request may have taken effect: the outcome must be reconciled."""


class ToolUnavailable(ToolError):
    """Tool could not be reached: the request was never delivered."""


class ToolRefused(ToolError):
    """Tool refused the request with a definite answer."""
