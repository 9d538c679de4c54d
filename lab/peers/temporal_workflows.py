"""The Temporal workflow definitions of the peer chapter (``ch16_peer_temporal``).

Kept apart from ``lab.peers.temporal_peer`` because Temporal's workflow sandbox re-imports
a workflow's module on every run: this one imports only the standard library and the SDK.
Activities are named, not imported (``lab.peers.temporal_peer`` defines them).

Three versions of one workflow type, ``lab_peer_credit``, as a team would ship them:

``v1``          wait for an approval signal when asked to, then run the credit activity
``v2``          a code change: a notification activity first, then the credit
``v2-patched``  the same change behind ``workflow.patched``, Temporal's versioning API

The workflow's input carries its settings (the activity's timeouts and retry policy), so
what each experiment configured is in Temporal's own history.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy

WORKFLOW = "lab_peer_credit"
CREDIT_ACTIVITY = "lab_peer_credit_activity"
NOTIFY_ACTIVITY = "lab_peer_notify_activity"
APPROVE_SIGNAL = "approve"
PATCH = "notify-before-credit"


def retry_policy(settings: dict[str, Any]) -> RetryPolicy:
    """The credit activity's retry policy from the workflow's settings (0: unlimited)."""
    return RetryPolicy(
        initial_interval=timedelta(seconds=float(settings["retry_initial_s"])),
        backoff_coefficient=1.0,
        maximum_attempts=int(settings["max_attempts"]),
    )


async def _credit(body: dict[str, Any]) -> dict[str, Any]:
    settings = body["settings"]
    result: dict[str, Any] = await workflow.execute_activity(
        CREDIT_ACTIVITY,
        body["work"],
        start_to_close_timeout=timedelta(seconds=float(settings["start_to_close_s"])),
        retry_policy=retry_policy(settings),
    )
    return result


async def _notify() -> None:
    await workflow.execute_activity(NOTIFY_ACTIVITY, "credit",
                                    start_to_close_timeout=timedelta(seconds=10))


class _Approvable:
    """What every version shares: the approval signal and the wait for it.

    The SDK reads a workflow's handlers from its class and the bases it inherits from
    (``inspect.getmembers``), so the signal is declared once, here."""

    def __init__(self) -> None:
        self.approval: dict[str, Any] | None = None

    @workflow.signal(name=APPROVE_SIGNAL)
    def approve(self, approval: dict[str, Any]) -> None:
        """Record the approval a person sent."""
        self.approval = approval

    async def _approved(self, body: dict[str, Any]) -> None:
        if body["settings"].get("await_approval"):
            await workflow.wait_condition(lambda: self.approval is not None)


@workflow.defn(name=WORKFLOW)
class CreditV1(_Approvable):
    """Version 1: (approval), then the credit activity."""

    @workflow.run
    async def run(self, body: dict[str, Any]) -> dict[str, Any]:
        """The credit, once approved when approval is asked for."""
        await self._approved(body)
        return await _credit(body)


@workflow.defn(name=WORKFLOW)
class CreditV2(_Approvable):
    """Version 2, unguarded: a notification activity is inserted before the credit."""

    @workflow.run
    async def run(self, body: dict[str, Any]) -> dict[str, Any]:
        """Notify, then credit."""
        await self._approved(body)
        await _notify()
        return await _credit(body)


@workflow.defn(name=WORKFLOW)
class CreditV2Patched(_Approvable):
    """Version 2 behind ``workflow.patched``: histories of v1 replay without the notice."""

    @workflow.run
    async def run(self, body: dict[str, Any]) -> dict[str, Any]:
        """Notify (new executions only), then credit."""
        await self._approved(body)
        if workflow.patched(PATCH):
            await _notify()
        return await _credit(body)


VARIANTS: dict[str, type] = {"v1": CreditV1, "v2": CreditV2, "v2-patched": CreditV2Patched}
