"""Chapter 9: random crashes and faults at once, then an independent invariant check."""

from __future__ import annotations

from lab.faults import chaos


def test_chaos_round_keeps_every_invariant(lab_dsn, reached_database, observe):
    """Worker processes SIGKILLed at random, their database backends terminated, replies
    dropped after commit and 429s answered, all at once: after the drain no effect is
    duplicated, lost, replayed or recorded under a stale fence, and every workflow is
    finished or waiting for a person with a reason."""
    settings = chaos.Settings(
        workflows=120,
        workers=3,
        duration=20.0,
        kill_every_ms=200.0,
        terminate_every_ms=2000.0,
        drop_replies=0.1,
        reject_429=0.1,
        non_idempotent_share=0.2,
        # With seed 1 each tool's seeded fault stream answers 429 and drops a reply within
        # its first six calls, so both faults happen however slow the machine is.
        seed=1,
        drain_timeout=60.0,
    )
    report = chaos.run(lab_dsn, settings)
    reached_database()
    faults = report["faults"]
    observe({
        "seed": settings.seed,
        "workflows": settings.workflows,
        "worker_processes": settings.workers,
        "lease_s": settings.lease,
        "heartbeat_s": settings.heartbeat,
        "states": report["states"],
        "effects": report["effects"],
        "kills": faults["kills"],
        "backend_terminations": faults["backend_terminations"],
        "dropped_replies": faults["dropped_replies"],
        "rejected_429": faults["rejected_429"],
        "leases_expired": report["recovery"]["leases_expired"],
        "manual_reviews": report["manual_reviews"],
        "manual_review_reasons": report["manual_review_reasons"],
        "violations": report["violation_count"],
        "fault_phase_s": report["timing"]["fault_phase_s"],
        "wall_s": report["timing"]["wall_s"],
    }, measurements=(
        # How a random round unfolds varies run to run; the invariants are the facts.
        "states", "effects", "kills", "backend_terminations", "dropped_replies",
        "rejected_429", "leases_expired", "manual_reviews", "manual_review_reasons",
    ), facts=("seed", "workflows", "worker_processes", "violations"))
    assert report["violations"] == [], report["violations"][:10]
    assert sum(report["states"].values()) == settings.workflows
    assert faults["kills"] > 0, "no worker was killed: the round proved nothing about crashes"
    assert faults["dropped_replies"] > 0, "no reply was dropped after commit"
    assert faults["rejected_429"] > 0, "the tool never answered 429"
