"""The lab's exceptions, and the one table that maps them to exit codes.

Every failure the lab reports is a ``LabError``; driver errors (psycopg, httpx)
are translated at the edge, in ``store``, ``tool`` and ``cluster``, and chained
with ``from exc`` so nothing above them ever handles a driver exception::

    LabError
    ├── UsageError          the command was used wrongly                   (exit 2)
    │   └── InputError      a file or stdin is missing, too big or malformed (exit 2)
    ├── EvidenceError       evidence failed to compile, sign or verify     (exit 1)
    │   └── Refused         publication refused: the evidence does not allow it
    ├── CheckFailed         a check ran and said no (violations, a failed report)
    ├── MissingExtra        an optional dependency is not installed        (exit 3)
    ├── Rejected            untrusted input refused by admission
    ├── BoundaryViolation   a target outside loopback, or an unsafe endpoint
    ├── Conflict            the request contradicts what is stored
    │   └── ReceiptMismatch a receipt that does not prove this workflow's effect
    ├── Denied              the actor has no right to do this
    ├── NotFound            no such workflow
    ├── Stale               the caller's fence or lease is no longer current
    ├── IntegrityFailure    a stored record failed its digest or binding: fail closed
    ├── ManualReview        only a person may decide what happens next
    ├── StoreError          PostgreSQL could not be reached or refused the write (exit 3)
    ├── ProvisioningError   no PostgreSQL could be provided for a run      (exit 3)
    ├── EnvironmentFailure  a hermetic run's export, venv or caller not the lock's (exit 3)
    └── ToolError           the tool could not be used                     (exit 3)
        ├── RateLimited     a trusted 429: nothing happened, retry later
        ├── OutcomeUnknown  the request may have taken effect: reconcile
        ├── ToolUnavailable the request never reached the tool: retry later
        └── ToolRefused     the tool answered with a definite refusal
            ├── StartFenced     a fenced lookup closed this start: never applied
            └── NoFencedLookup  the tool cannot prove absence: a person decides

Exit codes of every ``lab`` subcommand (``exit_code`` is the only place that
decides them; ``lab.cli.main`` prints the one-line message)::

    0    success: the gate said PASS, the evidence verified, the work was done
    1    a verdict that says no: gate FAIL or PARTIAL, verification failed,
         invariant violations, publication refused, a proposal rejected, a
         workflow that conflicts, is stale, denied or needs a person
    2    usage or bad input: arguments, unreadable or malformed files
    3    the environment failed: PostgreSQL, the tool, a missing extra
    130  interrupted (Ctrl-C)
"""

from __future__ import annotations


class LabError(Exception):
    """The lab failed to do what was asked."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class UsageError(LabError):
    """The command was used wrongly."""


class InputError(UsageError):
    """An input file or stream is missing, too large, not a regular file or malformed."""


class EvidenceError(LabError):
    """Evidence could not be compiled, signed or verified."""


class Refused(EvidenceError):
    """Publication refused: the evidence does not allow it."""


class CheckFailed(LabError):
    """A check ran and found a problem."""


class MissingExtra(LabError):
    """An optional dependency of this command is not installed."""


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


class EnvironmentFailure(LabError):
    """A hermetic run's exported tree or locked environment could not be made, or the
    interpreter that would start and seal it is not the lock's environment."""


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


class StartFenced(ToolRefused):
    """Tool refused an effect request because a fenced lookup already answered "absent"
    for its start: the request never took effect and never will."""


class NoFencedLookup(ToolRefused):
    """Tool cannot prove absence: it offers no fenced lookup (a person decides)."""


EXIT_OK = 0
EXIT_VERDICT = 1
EXIT_USAGE = 2
EXIT_ENVIRONMENT = 3
EXIT_INTERRUPTED = 130
# What each code means, for the reference page (``lab.reference``) and ``lab --help``.
EXIT_MEANINGS = {
    EXIT_OK: "success: the gate said PASS, the evidence verified, the work was done",
    EXIT_VERDICT: "a verdict that says no: gate FAIL or PARTIAL, verification failed, invariant "
                  "violations, publication refused, a proposal rejected, a workflow that "
                  "conflicts, is stale, denied or needs a person",
    EXIT_USAGE: "usage or bad input: arguments, unreadable or malformed files",
    EXIT_ENVIRONMENT: "the environment failed: PostgreSQL unreachable or refusing, the tool, "
                      "a missing extra, a hermetic clone or venv, a calling interpreter "
                      "that is not the lock's",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


def exit_code(exc: BaseException) -> int:
    """The exit code of a ``lab`` command that ended with ``exc`` (see the module table)."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, UsageError):
        return EXIT_USAGE
    if isinstance(
        exc, StoreError | ProvisioningError | EnvironmentFailure | ToolError | MissingExtra
    ):
        return EXIT_ENVIRONMENT
    return EXIT_VERDICT
