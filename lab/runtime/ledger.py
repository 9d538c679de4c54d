"""The credit tool's ledger: its effects, written with group commit, and its lookup.

Every effect is committed before the tool answers its request, as before; what
changes is that requests arriving together share one transaction. One writer
thread takes every request waiting, writes them with one statement and one
commit, then answers each. While that commit waits for its WAL flush, the next
requests queue up and form the next group, so a busy tool spends one commit and
one round trip per group rather than per effect (PostgreSQL's own group commit,
done one level up, where the rows are known).

A group's outcome is each request's own:

* a row refused for its data (a check, an encoding) rolls the group back, and each
  of its requests is then written alone, so one bad request cannot fail others;
* a lost connection fails the whole group with ``psycopg.OperationalError``: the
  commit may have happened, which is what the tool's 503 tells the caller (who
  reconciles through the lookup);
* a request that waited longer than ``wait_s`` for the writer is answered with
  ``LedgerBusy`` and never written, so no write lands after its caller gave up.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, LiteralString

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from lab import names
from lab.runtime.plan import Receipt

# The most requests one transaction writes: a bound on a statement's size, far above
# what a loopback tool receives during one commit.
MAX_GROUP = 256


class LedgerBusy(Exception):
    """The ledger could not take the write in time: nothing was written."""


@dataclass(frozen=True)
class Effect:
    """One validated effect request, as the ledger writes it."""

    effect_key: str
    fingerprint: str
    account: str
    amount_minor: int
    currency: str
    trace_id: str | None
    start_id: str | None
    receipt: str = field(default_factory=lambda: names.new_id("rcpt"))

    def row(self) -> dict[str, Any]:
        """The columns the insert reads, by name."""
        return {"effect_key": self.effect_key, "fingerprint": self.fingerprint,
                "account": self.account, "amount_minor": self.amount_minor,
                "currency": self.currency, "receipt": self.receipt,
                "trace_id": self.trace_id, "start_id": self.start_id}


Outcome = Receipt | None
"""A written effect's receipt, or None: its idempotent key holds another plan's effect."""


@dataclass(frozen=True)
class _Waiting:
    """A request in the writer's queue: its effect, when it arrived, and its outcome."""

    effect: Effect
    arrived: float = field(default_factory=time.monotonic)
    outcome: Future[Outcome] = field(default_factory=Future)


# One statement for both kinds: the partial unique index only holds idempotent rows, so
# a non-idempotent ledger's rows never conflict and are all written.
_INSERT: LiteralString = """
    INSERT INTO tool_effects (effect_key, idempotent, fingerprint, account, amount_minor,
                              currency, receipt, trace_id, start_id)
    SELECT effect_key, %s, fingerprint, account, amount_minor, currency, receipt,
           trace_id, start_id
      FROM json_to_recordset(%s::json) AS r(
           effect_key text, fingerprint text, account text, amount_minor bigint,
           currency text, receipt text, trace_id text, start_id text)
    ON CONFLICT (effect_key) WHERE idempotent DO NOTHING
    RETURNING receipt
"""

# A group of one (a quiet tool's usual case) reads its row with ``json_to_record``: the
# planner then knows it is one row rather than guessing 100.
_INSERT_ONE: LiteralString = _INSERT.replace("json_to_recordset(", "json_to_record(")

_EXISTING = """
    SELECT effect_key, receipt, fingerprint FROM tool_effects
     WHERE effect_key = ANY(%s) AND idempotent
"""

_LOOKUP = """
    SELECT receipt, fingerprint FROM tool_effects WHERE effect_key = %s ORDER BY seq LIMIT 1
"""


class Ledger:
    """The ledger in one schema, over ``pool`` (autocommit connections with dict rows).

    ``idempotent`` ledgers keep one effect per key; the others record every request.
    ``start`` runs the writer thread and ``stop`` ends it; ``record`` blocks until
    its request's transaction has committed (or failed).
    """

    def __init__(
        self, pool: ConnectionPool[psycopg.Connection[dict[str, Any]]], *, idempotent: bool,
        wait_s: float,
    ) -> None:
        self.idempotent = idempotent
        self._pool = pool
        self._wait_s = wait_s
        self._queue: deque[_Waiting] = deque()
        self._ready = threading.Condition()
        self._stopping = False
        self._writer: threading.Thread | None = None

    def start(self) -> None:
        """Run the writer thread (once: a running ledger is left as it is)."""
        if self._writer is not None:
            return
        self._stopping = False
        self._writer = threading.Thread(target=self._write_groups, name="ledger-writer",
                                        daemon=True)
        self._writer.start()

    def stop(self) -> None:
        """End the writer after the group it is writing; requests still queued get
        ``LedgerBusy`` (nothing of theirs was written)."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=10)
            self._writer = None
        with self._ready:
            left, self._queue = list(self._queue), deque()
        for waiting in left:
            waiting.outcome.set_exception(LedgerBusy("the tool is stopping"))

    def record(self, effect: Effect) -> Outcome:
        """Write ``effect`` (once per key when idempotent) and return its receipt.

        Raises ``psycopg.Error`` when the database failed (the write may have
        committed) and ``LedgerBusy`` when it was not written.
        """
        waiting = _Waiting(effect)
        with self._ready:
            if self._stopping or self._writer is None:
                raise LedgerBusy("the tool's ledger is not running")
            self._queue.append(waiting)
            self._ready.notify()
        return waiting.outcome.result()

    def find(self, effect_key: str) -> Receipt | None:
        """The authoritative lookup: the effect recorded under ``effect_key``, if any."""
        with self._pool.connection(timeout=self._wait_s) as conn:
            row = conn.execute(_LOOKUP, (effect_key,)).fetchone()
        return None if row is None else Receipt(row["receipt"], effect_key, row["fingerprint"])

    # -- the writer thread --

    def _write_groups(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._stopping:
                    self._ready.wait()
                if self._stopping:
                    return
                group = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_GROUP))]
            expired = time.monotonic() - self._wait_s
            late = [waiting for waiting in group if waiting.arrived < expired]
            for waiting in late:
                waiting.outcome.set_exception(LedgerBusy("the ledger was busy too long"))
            self._write([waiting for waiting in group if waiting.arrived >= expired])

    def _write(self, group: list[_Waiting]) -> None:
        """Write ``group`` in one transaction and settle each request; never raises."""
        if not group:
            return
        try:
            with self._pool.connection(timeout=self._wait_s) as conn:
                outcomes = self._insert(conn, [waiting.effect for waiting in group])
        except PoolTimeout as exc:
            for waiting in group:
                waiting.outcome.set_exception(LedgerBusy(str(exc)))
            return
        except psycopg.Error as exc:
            if len(group) > 1 and not isinstance(exc, psycopg.OperationalError):
                # A row was refused for its data, so nothing was written: each request
                # is written alone and gets its own answer.
                for waiting in group:
                    self._write([waiting])
                return
            for waiting in group:
                waiting.outcome.set_exception(exc)
            return
        except Exception as exc:  # a defect: every caller sees it rather than hanging
            for waiting in group:
                waiting.outcome.set_exception(exc)
            return
        for waiting, outcome in zip(group, outcomes, strict=True):
            waiting.outcome.set_result(outcome)

    def _insert(
        self, conn: psycopg.Connection[dict[str, Any]], effects: list[Effect]
    ) -> list[Outcome]:
        """Insert ``effects`` with one statement (autocommit: one commit) and return each
        one's outcome, in order."""
        if len(effects) == 1:
            statement, rows = _INSERT_ONE, json.dumps(effects[0].row())
        else:
            statement, rows = _INSERT, json.dumps([effect.row() for effect in effects])
        inserted = {row["receipt"] for row in conn.execute(statement, (self.idempotent, rows))}
        # A key already taken (idempotent rows are never removed, so the row that took it
        # is committed, or was inserted by this very statement) answers with its receipt.
        others = [e.effect_key for e in effects if e.receipt not in inserted]
        existing = {row["effect_key"]: row for row in
                    (conn.execute(_EXISTING, (others,)).fetchall() if others else [])}
        outcomes: list[Outcome] = []
        for effect in effects:
            if effect.receipt in inserted:
                outcomes.append(Receipt(effect.receipt, effect.effect_key, effect.fingerprint))
                continue
            held = existing[effect.effect_key]
            same = held["fingerprint"] == effect.fingerprint
            outcomes.append(Receipt(held["receipt"], effect.effect_key, held["fingerprint"])
                            if same else None)
        return outcomes
