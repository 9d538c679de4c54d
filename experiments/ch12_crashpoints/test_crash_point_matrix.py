"""Chapter 12: every named durable boundary, every fault, both tool kinds: a table, not a sample."""

from __future__ import annotations

import pytest

from lab import protocol
from lab.evidence import crashmatrix
from lab.faults import crashpoints


@pytest.mark.long_running
def test_every_crash_point_keeps_every_invariant(
    killable_postgres, reached_database, evidence_artifact, observe
):
    """A worker process stopped dead, its reply lost, the tool killed and restarted, or the
    PostgreSQL server killed and restarted, at each named boundary of the worker's and the
    reconciler's paths, for an idempotent and a non-idempotent tool: every boundary is
    reached, the invariant checker finds nothing, and every cell ends settled automatically
    or waiting for a person with a reason."""
    # Its own durable server: the run's shared one cannot be killed under other experiments.
    matrix = crashpoints.run(killable_postgres.provisioned.dsn, seed=17, jobs=4,
                             restart=killable_postgres.crash_restart)
    reached_database()
    data = crashmatrix.canonical_json(matrix)
    evidence_artifact(crashmatrix.OUTPUT_FILE, data)
    cells = {cell["id"]: cell for cell in matrix["cells"]}
    after_effect = f"{protocol.AFTER_EFFECT}/{crashpoints.WORKER_SIGKILL}"
    idempotent, non_idempotent = cells[f"{after_effect}/idempotent"], cells[
        f"{after_effect}/non_idempotent"]
    coverage = matrix["coverage"]
    observe({
        crashmatrix.SIGNED_KEY: crashmatrix.digest(data),
        "coverage": f"{coverage['reached']}/{coverage['defined']} boundaries reached",
        "cells": matrix["summary"],
        "violations": matrix["violation_count"],
        "sigkill_after_effect": {
            "idempotent": crashmatrix.outcome(idempotent),
            "non_idempotent": crashmatrix.outcome(non_idempotent),
        },
        "wall_s": matrix["timing"]["wall_s"],
    }, measurements=(crashmatrix.SIGNED_KEY, "cells"), facts=("coverage", "violations",
                                                              "sigkill_after_effect"))
    assert matrix["violation_count"] == 0, [c for c in matrix["cells"] if c.get("violations")]
    assert coverage["missing"] == [] and coverage["reached"] == len(protocol.NAMES)
    assert matrix["summary"][crashmatrix.NOT_REACHED] == 0
    assert crashmatrix.passed(matrix)
    assert matrix["omitted_faults"] == []
    assert {f["name"] for f in matrix["faults"]} == set(crashpoints.FAULT_NAMES)
    assert (idempotent["status"], idempotent["effects"]) == (crashmatrix.AUTOMATIC, 1)
    assert (non_idempotent["status"], non_idempotent["effects"], non_idempotent["why"]) == (
        crashmatrix.PERSON, 1, "non_idempotent_dispatched")
