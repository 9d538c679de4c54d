"""The check and the report of a chaos round (``lab.faults.chaos``): each population's
history loaded and judged by the invariants and by the independent SQL audit, waiting
out a database that is coming back but not one that is dead, and the report's numbers.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from lab import budget, errors
from lab.faults import audit, clocksteps, diskfull, invariants, proxy, traffic
from lab.faults.chaos_population import Population
from lab.faults.chaos_settings import Counts, Settings
from lab.pg import embedded
from lab.runtime import backoff, sealing, store


class Round(Protocol):
    """What the report reads of a chaos round (``lab.faults.chaos.Chaos``)."""

    settings: Settings
    counts: Counts
    populations: list[Population]
    proxies: dict[str, proxy.Proxy]
    partitions: proxy.Partitions
    disk: diskfull.DiskFull | None
    clock: clocksteps.ClockSteps | None
    strikes: traffic.Strikes
    release: traffic.Release | None


class Check:
    """Loads and audits a population's history against the round's server, noticing a
    dead postmaster (``require_server``) instead of retrying against it."""

    def __init__(self, dsn: str, keys: sealing.KeyCatalog, server: embedded.Server | None,
                 restarting: threading.Event) -> None:
        """``restarting`` is set while the round's restarter has the server down on purpose."""
        self.dsn, self.keys, self.server, self.restarting = dsn, keys, server, restarting

    def load(self, population: Population) -> invariants.History:
        """The population's history, waiting out a database that is still coming back."""
        patience = backoff.Backoff(base=0.1, cap=2.0, patience=60.0)
        while True:
            try:
                with budget.waiting(f"the history of {population.schema} (invariants)"):
                    return invariants.load(self.dsn, population.schema,
                                           open_result=self.keys.open,
                                           acknowledged=population.acknowledged)
            except errors.StoreError:
                self.require_server()
                if patience.exhausted:
                    raise
                time.sleep(patience.failed())

    def audit(self, population: Population) -> list[audit.Finding]:
        """The independent SQL audit of one population, waiting out a database coming back."""
        patience = backoff.Backoff(base=0.1, cap=2.0, patience=60.0)
        while True:
            try:
                with budget.waiting(f"the SQL audit of {population.schema}"):
                    return audit.run(self.dsn, population.schema,
                                     expected_workflows=population.size)
            except errors.StoreError:
                self.require_server()
                if patience.exhausted:
                    raise
                time.sleep(patience.failed())

    def require_server(self) -> None:
        """Fail at once, with the reason, when this run's postmaster died outside a fault
        that revives it (a restart in progress, a disk strike): ``alive`` reaps it, and
        no retry loop waits on a server nothing will bring back."""
        server = self.server
        if server is None or self.restarting.is_set() or server.alive():
            return
        if self.restarting.is_set():  # a restart began between the two looks
            return
        postmaster = server.cluster.postmaster
        code = postmaster.returncode if postmaster is not None else None
        raise errors.CheckFailed(
            f"PostgreSQL's postmaster died (exit code {code}) outside any fault of this run "
            f"that revives it: chaos stops here; server log: "
            f"{server.cluster.log_tail()[-300:]!r}")


def report(check: Check, round_: Round, durability: dict[str, str]) -> dict[str, Any]:
    """The round's report: every population's history checked by the invariants and by
    the independent SQL audit, with what was asked for, the faults and the recovery."""
    s = round_.settings
    tally = Tally()
    for population in round_.populations:
        _tally(check, population, tally)
    c = round_.counts
    comparison = audit.compare(tally.findings,
                               [(v.kind, v.effect_key) for v in tally.found])
    return {
        "audit": {**comparison, "findings": [vars(f) for f in tally.findings[:20]]},
        "checkers_agree": comparison["agree"],
        "run": s.describe(max_attempts=store.DEFAULT_MAX_ATTEMPTS,
                          proxied_links=sorted(round_.proxies)),
        "database": {
            "durable_mode_requested": s.durable,
            "durability": durability,
            "restarts": c.restarts,
            "restart_count": len(c.restarts),
            "down_s": round(sum(r["down_s"] for r in c.restarts), 3),
            "unreachable_reads": c.unreachable_reads,
        },
        "states": dict(sorted(tally.states.items())),
        "effects": tally.effects,
        "faults": _faults_report(round_, tally),
        "tool": {"calls": tally.calls, "lookups": tally.lookups},
        "workers": {
            "starts": c.worker_starts,
            "exits": dict(sorted(c.worker_exits.items())),
            "items_reported": dict(sorted(c.worker_items.items())),
            "killed_in_drain": c.drain_kills,
        },
        "recovery": {
            "leases_expired": c.leases_expired,
            "reconciled": dict(sorted(c.reconciled.items())),
            "undispatched_out_of_review": dict(sorted(c.undispatched.items())),
            "retried_next_pass": dict(sorted(c.recoverer_errors.items())),
        },
        "manual_reviews": sum(tally.reviews.values()),
        "manual_review_reasons": dict(sorted(tally.reviews.items())),
        "events": dict(sorted(tally.events.items())),
        "populations": tally.populations,
        "violations": tally.violations,
        "violation_count": len(tally.violations),
        "violations_by_kind": invariants.count_by_kind(tally.found),
    }

def _tally(check: Check, population: Population, tally: Tally) -> None:
    """Check one population's history, add its row and its counts to ``tally``."""
    assert population.service is not None
    history = check.load(population)
    found = invariants.check(history)
    tally.violations += [{"schema": population.schema, **v.to_json()} for v in found]
    tally.found += found
    tally.findings += check.audit(population)
    states = Counter(wf.state for wf in history.workflows)
    reviews = Counter(wf.review_reason for wf in history.workflows if wf.state == "unknown")
    events = Counter(e.kind for e in history.events)
    service = population.service
    tally.populations.append({
        "label": population.label,
        "schema": population.schema,
        "workflows": len(history.workflows),
        "worker_processes": len(population.slots),
        "states": dict(sorted(states.items())),
        "effects": len(history.effects),
        "tool_calls": service.calls,
        "dropped_replies": service.dropped,
        "rejected_429": service.rejected,
        "lookups": service.lookups,
        # Keys a fenced lookup answered "absent" for, and requests refused after that.
        "keys_closed_by_lookup": len(history.absences),
        "late_writes_refused": service.fenced,
        "manual_reviews": dict(sorted(reviews.items())),
        "events": dict(sorted(events.items())),
        "violations": len(found),
    })
    tally.states += states
    tally.reviews += reviews
    tally.events += events
    tally.effects += len(history.effects)
    tally.dropped += service.dropped
    tally.rejected += service.rejected
    tally.calls += service.calls
    tally.lookups += service.lookups
    tally.closed += len(history.absences)
    tally.refused_late += service.fenced

def _faults_report(round_: Round, tally: Tally) -> dict[str, Any]:
    """The report's ``faults``: what was injected, and what the tool refused or lost."""
    c = round_.counts
    return {
        "kills": c.kills,
        "kill_timer_without_target": c.kill_misses,
        "backend_terminations": c.backend_terminations,
        "termination_timer_without_backend": c.termination_misses,
        "dropped_replies": tally.dropped,
        "rejected_429": tally.rejected,
        "keys_closed_by_lookup": tally.closed,
        "late_writes_refused": tally.refused_late,
        "postgres_restarts": len(c.restarts),
        "partitions": len(round_.partitions.log),
        "partition_log": round_.partitions.log,
        "proxy_resets": sum(p.resets for p in round_.proxies.values()),
        "disk_full": round_.disk.report() if round_.disk is not None else {"count": 0},
        "clock_steps": round_.clock.report() if round_.clock is not None else {"count": 0},
        # Per kind: how many strikes met work in flight (ready or running, a worker alive).
        "in_flight": round_.strikes.report(),
        "release": round_.release.describe() if round_.release is not None else None,
    }


@dataclass
class Tally:
    """What the report adds up over the populations."""

    populations: list[dict[str, Any]] = field(default_factory=list)
    violations: list[dict[str, str]] = field(default_factory=list)
    found: list[invariants.Violation] = field(default_factory=list)
    findings: list[audit.Finding] = field(default_factory=list)
    states: Counter[str] = field(default_factory=Counter)
    reviews: Counter[str] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)
    effects: int = 0
    dropped: int = 0
    rejected: int = 0
    calls: int = 0
    lookups: int = 0
    closed: int = 0
    refused_late: int = 0
