"""The crash-point matrix's late-request column: where a cell holds the request, and how
the harness lets it go and waits for the tool's answer.

A late request is one that arrives after its caller gave up (``lab worker
--tool-timeout``). A cell holds it in one of three places (``crashscripts.LATE_*``):

- the worker-tool link: a loopback proxy (``lab.faults.proxy``) partitioned from the
  start, so the worker's request waits in it; healing the link delivers it;
- in the tool: the tool process holds it before its ledger (``--pause``); releasing
  the tool lets it go on;
- the tool-database link: a second tool process reaches PostgreSQL through a proxy that
  is partitioned while the tool writes, so the INSERT waits in it; the cell's usual tool
  (direct) answers the recovery's lookup and the requeued attempt meanwhile.

The matrix judges what then happens: with a fenced lookup the late request is refused
(``BOOK_FENCED``), without one it is applied and a person decides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lab import errors, protocol
from lab.faults import proxy
from lab.faults.crashscripts import LATE_DATABASE, LATE_IN_TOOL, LATE_NETWORK
from lab.runtime import toolprocess

REFUSED = "refused"
MARK_TIMEOUT_S = 30.0  # the tool answers a mark at once; this is a loaded machine's bound
APPLIED = "applied"


@dataclass
class LateRig:
    """What one late cell needs besides the cell's usual tool: a proxy and, for the
    database link, the tool process behind it."""

    placement: str | None
    tools: toolprocess.ToolProcess
    link: proxy.Proxy | None = None
    behind_link: toolprocess.ToolProcess | None = field(default=None, repr=False)
    mark: int = 0

    @classmethod
    def start(
        cls, placement: str | None, tools: toolprocess.ToolProcess, dsn: str,
        tool_flags: tuple[str, ...],
    ) -> LateRig:
        """Start the cell's tool (and, by placement, its proxy or second tool)."""
        rig = cls(placement, tools)
        try:
            if placement == LATE_DATABASE:
                tools.start()
                rig.link, via = proxy.for_database(dsn, "tool-database")
                rig.behind_link = toolprocess.ToolProcess(
                    via, tools.schema, idempotent=tools.idempotent, token=tools.token,
                    fenced_lookup=tools.fenced_lookup, name="late-tool")
                rig.behind_link.start(*tool_flags)
                return rig
            tools.start(*tool_flags)
            if placement == LATE_NETWORK:
                rig.link = proxy.Proxy("127.0.0.1", tools.port, "worker-tool").start()
                rig.link.partition(proxy.BLACKHOLE)
            return rig
        except BaseException:
            # Cut short (an interrupt, a tool that never served): the caller holds no rig
            # to close, so what was started here is stopped here (the cell's tool is the
            # caller's to close).
            rig.close()
            raise

    @property
    def answering(self) -> toolprocess.ToolProcess:
        """The tool process the worker's request reaches (and whose stages a script waits
        for)."""
        return self.behind_link if self.behind_link is not None else self.tools

    def endpoint(self) -> str:
        """The endpoint the cell's worker is given."""
        if self.placement == LATE_NETWORK and self.link is not None:
            return f"http://127.0.0.1:{self.link.port}"
        return self.answering.endpoint

    def hold_database_link(self) -> None:
        """Partition the second tool's database link (its next statement waits in it)."""
        if self.link is None or self.placement != LATE_DATABASE:
            raise errors.CheckFailed("hold_database_link: this cell has no database link")
        self.link.partition(proxy.BLACKHOLE)

    def deliver(self) -> None:
        """Let the held request go on: heal its link, or release the tool holding it.

        The answers counted are the lines after a mark the tool writes now: a line the
        tool wrote before (the requeued attempt's effect, say) that the harness has not
        read yet is never taken for the late request's answer (a publishable run counted
        the requeued attempt's effect as a late request applied)."""
        answering = self.answering.current
        answering.send(toolprocess.MARK_COMMAND)
        answering.wait_for(f"{protocol.ARMED} {toolprocess.MARK_COMMAND}",
                           timeout=MARK_TIMEOUT_S)
        self.mark = len(answering.all_lines())
        if self.placement in (LATE_NETWORK, LATE_DATABASE) and self.link is not None:
            self.link.heal()
        elif self.placement == LATE_IN_TOOL:
            self.tools.current.release()
        else:
            raise errors.CheckFailed("deliver_late: the cell holds no late request")

    def answers(self) -> list[str]:
        """What the tool did with each request let go by ``deliver``, in order."""
        found = []
        for text in self.answering.current.all_lines()[self.mark:]:
            if text.startswith(f"{protocol.FENCED} "):
                found.append(REFUSED)
            elif text.startswith(f"{protocol.STAGE} {protocol.AFTER_EFFECT} "):
                found.append(APPLIED)
        return found

    def wait_answered(self, count: int, timeout: float) -> list[str]:
        """Wait until the tool refused or applied ``count`` late requests; their answers.
        A deadline passed names what was still awaited."""
        deadline = time.monotonic() + timeout
        while len(found := self.answers()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.answering.name}: {count} late request(s) delivered, {len(found)} "
                    f"refused or applied within {timeout}s; {self.answering.current.tail()}")
            time.sleep(0.02)
        return found

    def close(self) -> None:
        """Heal and stop the proxy, kill and reap the second tool."""
        if self.link is not None:
            self.link.heal()
            self.link.stop()
        if self.behind_link is not None:
            self.behind_link.close()
