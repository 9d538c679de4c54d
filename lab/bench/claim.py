"""``lab bench claim``: claim latency as the finished history grows, and the query plan.

1k, 100k and 1M finished workflows are bulk-inserted with one ``INSERT ... SELECT
generate_series`` cloning a workflow made through the API; claims alternate between
history sizes so drift cancels; the plan is ``EXPLAIN (ANALYZE, BUFFERS)`` of the
store's own claim query.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from psycopg import sql
from psycopg.types.json import Jsonb
from rich.table import Table

from lab import errors
from lab.bench import measure
from lab.bench.measure import fmt, ratio, rnd
from lab.pg import edge
from lab.runtime import store

DEFAULT_HISTORY = (1_000, 100_000, 1_000_000)
CLAIM_SAMPLES = 300
CLAIM_WARMUP = 20
GOAL_RATIO_1M_OVER_1K = 1.3

# Rows are cloned from one workflow made through the API, so columns the schema gains later
# are copied as the store filled them; only identity, state and times are overridden.
_CLONE_OVERRIDES: dict[str, sql.Composable] = {
    "id": sql.SQL("%(prefix)s::text || g"),
    "operation": sql.SQL("%(prefix)s::text || g"),
    "state": sql.SQL("%(state)s::text"),
    "result": sql.SQL("%(result)s::jsonb"),
    "fence": sql.SQL("%(fence)s::bigint"),
    "attempt": sql.SQL("%(fence)s::integer"),
    "ready_at": sql.SQL("now() - %(age)s::interval + g * interval '1 ms'"),
    "created_at": sql.SQL("now() - %(age)s::interval + g * interval '1 ms'"),
    "updated_at": sql.SQL("now() - %(age)s::interval + g * interval '1 ms' + interval '50 ms'"),
}


def clone_query(columns: Sequence[str]) -> sql.Composed:
    """One ``INSERT ... SELECT ... generate_series`` cloning the template row ``count`` times."""
    return sql.SQL(
        "INSERT INTO workflows ({columns}) SELECT {values} FROM workflows AS t "
        "CROSS JOIN generate_series(1, %(count)s) AS g WHERE t.id = %(template)s"
    ).format(
        columns=sql.SQL(", ").join(sql.Identifier(name) for name in columns),
        values=sql.SQL(", ").join(
            _CLONE_OVERRIDES.get(name, sql.SQL("t.{}").format(sql.Identifier(name)))
            for name in columns
        ),
    )


def _fill(dsn: str, schema: str, history: int, ready: int) -> float:
    """Bulk-insert ``history`` succeeded and ``ready`` due workflows; return the seconds taken."""
    with store.Store.open(dsn, schema, max_connections=1, application_name="lab-bench") as db:
        created = db.create(measure.PROPOSER, "template", measure.sample_plan())
        db.approve(measure.APPROVER, created.id, created.fingerprint, timedelta(hours=1))
    started = time.perf_counter()
    with edge.session(dsn, "fill the claim history", schema=schema) as conn:
        columns = [str(row["attname"]) for row in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'workflows'::regclass "
            "AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum"
        ).fetchall()]
        query = clone_query(columns)
        conn.execute(query, {"prefix": "hist_", "state": "succeeded", "fence": 1,
                             "result": Jsonb({"receipt": "history"}), "age": "1 day",
                             "count": history, "template": created.id})
        conn.execute(query, {"prefix": "ready_", "state": "ready", "fence": 0,
                             "result": None, "age": "1 minute",
                             "count": ready, "template": created.id})
        # As autovacuum would have by then: visibility map set, statistics current.
        conn.execute("VACUUM (ANALYZE) workflows")
    return time.perf_counter() - started


def _explain(dsn: str, schema: str) -> str:
    # ANALYZE runs the claim: inside a transaction rolled back, so no work is taken.
    with edge.session(dsn, "explain the claim", schema=schema) as conn, \
            conn.transaction(force_rollback=True):
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + store.CLAIM_QUERY).fetchall()
    return "\n".join(str(row["QUERY PLAN"]) for row in rows)


def claim_latency(dsn: str, sizes: Sequence[int], samples: int = CLAIM_SAMPLES) -> dict[str, Any]:
    """Claim latency with each history size, interleaving sizes so drift cancels."""
    if not sizes or any(size < 0 for size in sizes):
        raise errors.UsageError("history sizes must be non-negative")
    schemas = {size: measure.new_schema("bench_claim") for size in sizes}
    stores: dict[int, store.Store] = {}
    report: dict[str, Any] = {"samples": samples, "warmup": CLAIM_WARMUP, "sizes": {}}
    try:
        for size, schema in schemas.items():
            store.create_schema(dsn, schema)
            fill_seconds = _fill(dsn, schema, size, samples + CLAIM_WARMUP)
            report["sizes"][size] = {"fill_seconds": round(fill_seconds, 2),
                                     "plan": _explain(dsn, schema)}
            stores[size] = store.Store.open(dsn, schema, max_connections=1)
        timings: dict[int, list[float]] = {size: [] for size in sizes}
        for index in range(samples + CLAIM_WARMUP):
            for size in sizes:
                started = time.perf_counter()
                claimed = stores[size].claim("bench-claimer", timedelta(minutes=5))
                elapsed = time.perf_counter() - started
                if claimed is None:
                    raise errors.CheckFailed(f"no ready work left in the {size} history")
                if index >= CLAIM_WARMUP:
                    timings[size].append(elapsed)
        for size in sizes:
            report["sizes"][size].update(measure.latency_summary(timings[size]))
            report["sizes"][size]["execution_ms"] = _execution_ms(report["sizes"][size]["plan"])
    finally:
        for db in stores.values():
            db.close()
        for schema in schemas.values():
            edge.drop_schema(dsn, schema)
    smallest, largest = min(sizes), max(sizes)
    low, high = report["sizes"][smallest], report["sizes"][largest]
    report["ratio_p50_largest_over_smallest"] = rnd(ratio(high["p50_ms"], low["p50_ms"]), 3)
    report["ratio_p99_largest_over_smallest"] = rnd(ratio(high["p99_ms"], low["p99_ms"]), 3)
    report["smallest"], report["largest"] = smallest, largest
    report["goal_ratio"] = GOAL_RATIO_1M_OVER_1K
    return report


def _execution_ms(plan_text: str) -> float | None:
    match = re.search(r"Execution Time: ([\d.]+) ms", plan_text)
    return float(match.group(1)) if match else None


def claim_table(report: Mapping[str, Any]) -> Table:
    """Claim latency per history size."""
    table = Table(title=f"claim latency ({report['samples']} claims per history size)")
    for column in ("finished history", "p50 ms", "p99 ms", "max ms", "plan exec ms", "fill s"):
        table.add_column(column, justify="right")
    for size, figures in report["sizes"].items():
        table.add_row(f"{size:,}", fmt(figures["p50_ms"]), fmt(figures["p99_ms"]),
                      fmt(figures["max_ms"]), fmt(figures["execution_ms"]),
                      fmt(figures["fill_seconds"]))
    return table

