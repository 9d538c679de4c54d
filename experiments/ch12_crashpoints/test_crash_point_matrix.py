"""Chapter 12: every named durable boundary, every fault, every tool kind: a table, not a
sample."""

from __future__ import annotations

import pytest

from lab import protocol
from lab.evidence import crashmatrix
from lab.faults import crashpoints, crashscripts


@pytest.mark.long_running
def test_every_crash_point_keeps_every_invariant(
    killable_postgres, reached_database, evidence_artifact, observe
):
    """A worker process stopped dead, its reply lost, the tool killed and restarted, its
    request held past the client's timeout and delivered late, or the PostgreSQL server
    killed and restarted, at each named boundary of the worker's and the reconciler's
    paths and with a batch's requests all in the tool, for an idempotent tool and a
    non-idempotent one without and with a fenced lookup: every boundary is reached, the
    invariant checker finds nothing, every cell ends settled automatically or waiting for
    a person with a reason, every late request meeting a fenced lookup is refused, and
    every late-request cell that waits for a person without the fenced lookup settles
    automatically with it."""
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
    answers = crashmatrix.late_answers(matrix)
    moved = crashmatrix.moved_to_automatic(matrix)
    late_rows = sorted(cell["boundary"] for cell in matrix["cells"]
                       if cell["fault"] == crashscripts.LATE_REQUEST
                       and cell["kind"] == crashscripts.NON_IDEMPOTENT
                       and cell["status"] != crashmatrix.NOT_APPLICABLE)
    late_moved = sorted(m["boundary"] for m in moved
                        if m["fault"] == crashscripts.LATE_REQUEST)
    observe({
        crashmatrix.SIGNED_KEY: crashmatrix.digest(data),
        "coverage": f"{coverage['reached']}/{coverage['defined']} boundaries reached",
        "cells": matrix["summary"],
        "violations": matrix["violation_count"],
        "sigkill_after_effect": {
            "idempotent": crashmatrix.outcome(idempotent),
            "non_idempotent": crashmatrix.outcome(non_idempotent),
        },
        "late_requests": {kind: dict(sorted(counts.items()))
                          for kind, counts in sorted(answers.items())},
        "late_cells_moved_to_automatic": late_moved,
        "moved_to_automatic": [f"{m['boundary']}/{m['fault']}" for m in moved],
        "wall_s": matrix["timing"]["wall_s"],
    }, measurements=(crashmatrix.SIGNED_KEY, "cells", "moved_to_automatic"),
        facts=("coverage", "violations", "sigkill_after_effect", "late_requests",
               "late_cells_moved_to_automatic"))
    assert matrix["violation_count"] == 0, [c for c in matrix["cells"] if c.get("violations")]
    assert coverage["missing"] == [] and coverage["reached"] == len(protocol.NAMES)
    assert matrix["summary"][crashmatrix.NOT_REACHED] == 0
    assert crashmatrix.passed(matrix)
    assert matrix["omitted_faults"] == []
    assert {f["name"] for f in matrix["faults"]} == set(crashpoints.FAULT_NAMES)
    assert (idempotent["status"], idempotent["effects"]) == (crashmatrix.AUTOMATIC, 1)
    assert (non_idempotent["status"], non_idempotent["effects"], non_idempotent["why"]) == (
        crashmatrix.PERSON, 1, "non_idempotent_dispatched")
    # A late request that meets a fenced lookup never applies; without one it does, and
    # a person decides.
    fenced_kinds = (crashscripts.IDEMPOTENT, crashscripts.NON_IDEMPOTENT_FENCED)
    assert all(set(answers[kind]) == {"refused"} for kind in fenced_kinds), answers
    assert set(answers[crashscripts.NON_IDEMPOTENT]) == {"applied"}, answers
    assert late_rows and late_moved == late_rows, (late_rows, moved)
