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
* a request that waited longer than ``wait_s`` for the writer, its connection or its
  statement is answered with ``LedgerBusy`` and not written by this tool. That is
  defence in depth, not a proof: a statement held in a partitioned link to the database
  can still commit whenever the link heals.

The proof is the fence. Each request carries the fence of the start that sent it, and
the lookup is fenced: a lookup at fence F that finds no effect for a key records so (a
tombstone in ``tool_fences``, in the lookup's own transaction), and the ledger refuses
every later write of that key from a start at fence F or older (``Fenced``: a conflict,
never applied). Writes and lookups of one key lock the same ``tool_fences`` row, so
whichever commits first is seen by the other: "absent" at fence F is final, however late
a request of that start arrives.
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


class Fenced:
    """A write refused because a lookup already answered "absent" for its key at its
    start's fence or a later one: the request will never take effect."""

    def __init__(self, effect_key: str, closed_through: int) -> None:
        self.effect_key = effect_key
        self.closed_through = closed_through

    def __repr__(self) -> str:
        return f"Fenced({self.effect_key!r}, closed_through={self.closed_through})"


@dataclass(frozen=True)
class Absent:
    """A lookup's "no effect" answer. ``final`` when it was fenced: no request of a start
    at ``fence`` or older can take effect after it."""

    effect_key: str
    fence: int | None

    @property
    def final(self) -> bool:
        """True when this absence is a proof (a fenced lookup recorded it)."""
        return self.fence is not None


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
    fence: int = 0
    receipt: str = field(default_factory=lambda: names.new_id("rcpt"))

    def row(self) -> dict[str, Any]:
        """The columns the insert reads, by name."""
        return {"effect_key": self.effect_key, "fingerprint": self.fingerprint,
                "account": self.account, "amount_minor": self.amount_minor,
                "currency": self.currency, "receipt": self.receipt,
                "trace_id": self.trace_id, "start_id": self.start_id, "fence": self.fence}


Outcome = Receipt | Fenced | None
"""A written effect's receipt; ``Fenced`` when a fenced lookup closed its start; None: its
idempotent key holds another plan's effect."""


@dataclass(frozen=True)
class _Waiting:
    """A request in the writer's queue: its effect, when it arrived, and its outcome."""

    effect: Effect
    arrived: float = field(default_factory=time.monotonic)
    outcome: Future[Outcome] = field(default_factory=Future)


# One statement for both kinds. ``f`` locks each key's fence row (creating it at -1, "no
# lookup yet"): ON CONFLICT DO UPDATE waits for a lookup holding that row and returns the
# row's latest committed version, so a write that follows a fenced "absent" sees its
# tombstone. Only rows whose start is newer than the key's tombstone are inserted. The
# partial unique index only holds idempotent rows, so a non-idempotent ledger's rows never
# conflict there. Keys are locked in key order (no deadlock between two groups).
# The statement answers each request by receipt: "written", or "fenced" with the bound.
_INSERT: LiteralString = """
    WITH r AS (
        SELECT * FROM json_to_recordset(%(rows)s::json) AS r(
            effect_key text, fingerprint text, account text, amount_minor bigint,
            currency text, receipt text, trace_id text, start_id text, fence bigint)
    ), f AS (
        INSERT INTO tool_fences AS t (effect_key)
        SELECT DISTINCT effect_key FROM r ORDER BY effect_key
        ON CONFLICT (effect_key) DO UPDATE SET closed_through = t.closed_through
        RETURNING t.effect_key, t.closed_through
    ), w AS (
        INSERT INTO tool_effects (effect_key, idempotent, fingerprint, account, amount_minor,
                                  currency, receipt, trace_id, start_id, fence)
        SELECT r.effect_key, %(idempotent)s, r.fingerprint, r.account, r.amount_minor,
               r.currency, r.receipt, r.trace_id, r.start_id, r.fence
          FROM r JOIN f USING (effect_key)
         WHERE r.fence > f.closed_through
        ON CONFLICT (effect_key) WHERE idempotent DO NOTHING
        RETURNING receipt
    )
    SELECT receipt, 'written' AS answer, NULL::bigint AS closed_through FROM w
    UNION ALL
    SELECT r.receipt, 'fenced', f.closed_through
      FROM r JOIN f USING (effect_key) WHERE r.fence <= f.closed_through
"""

# A group of one (a quiet tool's usual case) reads its row with ``json_to_record``: the
# planner then knows it is one row rather than guessing 100.
_INSERT_ONE: LiteralString = _INSERT.replace("json_to_recordset(", "json_to_record(")

_EXISTING = """
    SELECT effect_key, receipt, fingerprint FROM tool_effects
     WHERE effect_key = ANY(%s) AND idempotent
"""

_COUNT_REFUSED = """
    UPDATE tool_fences SET refused_writes = refused_writes + 1 WHERE effect_key = ANY(%s)
"""

# The fenced lookup, in one transaction: lock the key's fence row first (a write of the key
# holds it until its commit), then read the ledger, then (absent only) raise the tombstone.
_LOCK_FENCE = """
    INSERT INTO tool_fences AS t (effect_key) VALUES (%s)
    ON CONFLICT (effect_key) DO UPDATE SET closed_through = t.closed_through
"""

_CLOSE_FENCE = """
    UPDATE tool_fences SET closed_through = greatest(closed_through, %s),
                           absent_answers = absent_answers + 1
     WHERE effect_key = %s
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

    def record_all(self, effects: list[Effect]) -> list[Outcome | psycopg.Error | LedgerBusy]:
        """``record`` for each of ``effects`` at once (a batch request's), each one's outcome
        or error in order: they join the writer's queue together, so they share a group.
        """
        waiting = [_Waiting(effect) for effect in effects]
        with self._ready:
            if self._stopping or self._writer is None:
                return [LedgerBusy("the tool's ledger is not running") for _ in effects]
            self._queue.extend(waiting)
            self._ready.notify()
        outcomes: list[Outcome | psycopg.Error | LedgerBusy] = []
        for each in waiting:
            try:
                outcomes.append(each.outcome.result())
            except (psycopg.Error, LedgerBusy) as exc:
                outcomes.append(exc)
        return outcomes

    def find(self, effect_key: str, fence: int | None = None) -> Receipt | Absent:
        """The authoritative lookup: the effect recorded under ``effect_key``, or ``Absent``.

        With a ``fence`` the lookup is fenced: an absent answer is recorded as a tombstone
        in the same transaction, so no write of that key from a start at ``fence`` or older
        can land afterwards (``Absent.final``). Without one, absent means "not yet".
        """
        deadline = time.monotonic() + self._wait_s
        with self._pool.connection(timeout=self._wait_s) as conn:
            _check_deadline(deadline)
            if fence is None:
                row = conn.execute(_LOOKUP, (effect_key,)).fetchone()
            else:
                with conn.transaction():
                    conn.execute(_LOCK_FENCE, (effect_key,))
                    row = conn.execute(_LOOKUP, (effect_key,)).fetchone()
                    if row is None:
                        conn.execute(_CLOSE_FENCE, (fence, effect_key))
        if row is None:
            return Absent(effect_key, fence)
        return Receipt(row["receipt"], effect_key, row["fingerprint"])

    def fences(self, effect_key: str) -> dict[str, int] | None:
        """The key's tombstone row (closed_through, absent_answers, refused_writes), if any."""
        with self._pool.connection(timeout=self._wait_s) as conn:
            row = conn.execute(
                "SELECT closed_through, absent_answers, refused_writes FROM tool_fences"
                " WHERE effect_key = %s", (effect_key,)).fetchone()
        return None if row is None else dict(row)

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
        # The group's deadline is its oldest request's: no request of it is written by this
        # tool after its own wait ran out (the pool wait and the statement are bounded too).
        deadline = min(waiting.arrived for waiting in group) + self._wait_s
        try:
            with self._pool.connection(timeout=max(deadline - time.monotonic(), 0.001)) as conn:
                _check_deadline(deadline)
                outcomes = self._insert(conn, [waiting.effect for waiting in group])
        except (PoolTimeout, LedgerBusy) as exc:
            for waiting in group:
                waiting.outcome.set_exception(LedgerBusy(str(exc)))
            return
        except psycopg.errors.QueryCanceled:
            # statement_timeout: the statement was cancelled, so nothing of it committed.
            for waiting in group:
                waiting.outcome.set_exception(LedgerBusy("the ledger's statement timed out"))
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
        answers = {row["receipt"]: row for row in
                   conn.execute(statement, {"idempotent": self.idempotent, "rows": rows})}
        fenced = [e.effect_key for e in effects
                  if e.receipt in answers and answers[e.receipt]["answer"] == "fenced"]
        if fenced:
            conn.execute(_COUNT_REFUSED, (fenced,))
        # A key already taken (idempotent rows are never removed, so the row that took it
        # is committed, or was inserted by this very statement) answers with its receipt.
        others = [e.effect_key for e in effects if e.receipt not in answers]
        existing = {row["effect_key"]: row for row in
                    (conn.execute(_EXISTING, (others,)).fetchall() if others else [])}
        outcomes: list[Outcome] = []
        for effect in effects:
            answer = answers.get(effect.receipt)
            if answer is not None and answer["answer"] == "fenced":
                outcomes.append(Fenced(effect.effect_key, answer["closed_through"]))
                continue
            if answer is not None:
                outcomes.append(Receipt(effect.receipt, effect.effect_key, effect.fingerprint))
                continue
            held = existing[effect.effect_key]
            same = held["fingerprint"] == effect.fingerprint
            outcomes.append(Receipt(held["receipt"], effect.effect_key, held["fingerprint"])
                            if same else None)
        return outcomes


def _check_deadline(deadline: float) -> None:
    """``LedgerBusy`` when ``deadline`` (``time.monotonic()``) has passed: do not write."""
    if time.monotonic() >= deadline:
        raise LedgerBusy("the ledger was busy too long")
