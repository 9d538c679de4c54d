"""The crash-point matrix: every named boundary has a cell for every fault and tool kind,
every boundary the code reports is named in ``lab.protocol``, and the two cells the book
leads with hold on real processes and a real PostgreSQL."""

from __future__ import annotations

import ast
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from lab import errors, protocol, pytest_plugin
from lab.book import crashpoints as crashpoint_chapter
from lab.evidence import crashmatrix
from lab.faults import crashlate, crashpoints, crashscripts
from lab.pg import edge
from lab.runtime import store, toolprocess
from tests.support.signals import sigint_raises

LAB = Path(protocol.__file__).parent
PROTOCOL_WORDS = {
    protocol.READY, protocol.STAGE, protocol.DONE, protocol.ITEM, protocol.SKIP,
    protocol.LAUNCHED, protocol.OBSERVATION, protocol.REQUEST, protocol.ARMED, protocol.FAILED,
    protocol.FENCED, protocol.DSN_ENV, protocol.TOKEN_ENV,
}


def test_every_boundary_has_a_cell_for_every_fault_and_tool_kind():
    assert crashpoints.missing_cells() == []
    assert len(crashpoints.cells()) == (
        len(crashscripts.rows()) * len(crashpoints.FAULT_NAMES) * len(crashpoints.KINDS)
    )
    assert set(crashscripts.rows()) >= set(protocol.NAMES)
    for boundary, fault, kind in crashpoints.cells():
        found = crashpoints.script(boundary, fault, kind)
        if isinstance(found, crashpoints.NotApplicable):
            assert found.reason.strip(), (boundary, fault, kind)
        else:
            assert any(step[0] in crashpoints.FAULT_STEPS for step in found.steps), (
                f"{boundary}/{fault}/{kind} injects no fault"
            )


@pytest.mark.parametrize("when", ["queued", "while queueing"])
def test_an_interrupt_begins_no_further_cell(monkeypatch, when):
    """Ctrl-C (or a cancelled run) while cells run in their threads, once every cell is
    queued or while the queue still fills: the cells in flight end, the rest never begin,
    and the interrupt is raised. Leaving the thread pool used to wait for the whole
    matrix, past the grace an interrupted run gives its teardown.

    The cells in flight end only once the main thread has taken the signal and no queued
    cell is left pending (or after a deadline, so a matrix that never cancels them fails
    by its count, not by hanging): however late a loaded machine lets the main thread
    run its handler, no cell in flight can finish first and let a queued one begin.
    """
    pooled = sum(1 for c in crashpoints.cells() if c[1] != crashpoints.POSTGRES_RESTART)
    started: list[int] = []
    submitted: list[Future[Any]] = []
    heard = threading.Event()
    lock = threading.Lock()
    deadline = time.monotonic() + 10.0

    class Tracking(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
            future = super().submit(fn, *args, **kwargs)
            submitted.append(future)
            if when == "while queueing" and len(submitted) == 5:
                os.kill(os.getpid(), signal.SIGINT)  # taken here, in the main thread
            return future

    def queue_cancelled() -> bool:
        return heard.is_set() and not any(
            not future.running() and not future.done() for future in list(submitted))

    def cell(ctx: Any, index: int, boundary: str, fault: str, kind: str) -> dict[str, Any]:
        with lock:
            started.append(index)
            first = len(started) == 1
        if first and when == "queued":
            while len(submitted) < pooled and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: raised in the main thread
        while not queue_cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"boundary": boundary, "fault": fault, "kind": kind, "status": "held"}

    monkeypatch.setattr(crashpoints, "_run_cell", cell)
    monkeypatch.setattr(crashpoints, "ThreadPoolExecutor", Tracking)
    with sigint_raises(heard), pytest.raises(KeyboardInterrupt):
        crashpoints.run("postgresql://never-connected", jobs=2)
    assert 1 <= len(started) <= 2, f"{len(started)} of {pooled} cells began"
    assert all(future.done() for future in submitted), "a cell was left queued or running"


def test_a_late_rig_cut_short_stops_the_tool_it_started(lab_dsn, monkeypatch):
    """A late-database cell's second tool, interrupted as it starts: the rig was never
    returned for its cell to close, so it stops what it started itself."""
    schema = f"cp_cut_{secrets.token_hex(3)}"
    late: list[toolprocess.ToolProcess] = []
    real_start = toolprocess.ToolProcess.start

    def start(self: toolprocess.ToolProcess, *flags: str,
              timeout: float = 30.0) -> toolprocess.ToolProcess:
        real_start(self, *flags, timeout=timeout)
        if self.name == "late-tool":
            late.append(self)
            raise KeyboardInterrupt
        return self

    monkeypatch.setattr(toolprocess.ToolProcess, "start", start)
    tools = toolprocess.ToolProcess(lab_dsn, schema, idempotent=True,
                                    token=secrets.token_urlsafe(18))
    try:
        with store.Store.open(lab_dsn, schema, create=True):
            with pytest.raises(KeyboardInterrupt):
                crashlate.LateRig.start(crashscripts.LATE_DATABASE, tools, lab_dsn, ())
            (rig_tool,) = late
            assert rig_tool.incarnations, "the second tool never started"
            assert not any(child.alive() for child in rig_tool.incarnations)
            assert tools.current.alive(), "the cell's own tool is its caller's to close"
    finally:
        for started in (tools, *late):
            started.close()
        edge.drop_schema(lab_dsn, schema)


def test_every_boundary_can_be_reached_by_some_cell():
    runnable = {b for b, f, k in crashpoints.cells()
                if isinstance(crashpoints.script(b, f, k), crashpoints.Script)}
    assert runnable == set(crashscripts.rows())
    assert {crashscripts.boundary_of(row) for row in runnable} == set(protocol.NAMES)


def test_a_boundary_added_without_a_cell_fails_the_coverage_check(monkeypatch):
    added = protocol.Boundary("after_new_step", protocol.WORKER, "a step nobody scripted")
    monkeypatch.setattr(protocol, "BOUNDARIES", (*protocol.BOUNDARIES, added))
    monkeypatch.setattr(protocol, "NAMES", (*protocol.NAMES, added.name))
    missing = crashpoints.missing_cells()
    assert missing == [
        crashpoints.cell_id(added.name, fault, kind)
        for fault in crashpoints.FAULT_NAMES for kind in crashpoints.KINDS
    ]
    with pytest.raises(errors.CheckFailed, match="after_new_step"):
        crashpoints.run("postgresql://unused@127.0.0.1/none")


def _stage_calls() -> list[tuple[str, ast.Call]]:
    """Every call of a ``_stage``, ``on_stage`` or ``_stages`` (a batch's items together)
    hook in ``lab/``, with its module."""
    calls = []
    for path in sorted(LAB.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("_stage", "on_stage", "_stages") and node.args):
                calls.append((path.name, node))
    return calls


def test_the_code_reports_exactly_the_named_boundaries():
    reported: set[str] = set()
    for module, call in _stage_calls():
        first = call.args[0]
        assert (isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name)
                and first.value.id == "protocol"), (
            f"{module}:{call.lineno}: a boundary must be named by a lab.protocol constant"
        )
        reported.add(getattr(protocol, first.attr))
    assert reported == set(protocol.NAMES), (
        f"named but never reported: {set(protocol.NAMES) - reported}; "
        f"reported but not named: {reported - set(protocol.NAMES)}"
    )


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def test_protocol_words_are_spelled_only_in_lab_protocol():
    offenders = []
    for path in sorted(LAB.rglob("*.py")):
        if path.name == "protocol.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docs):
                words = set(node.value.replace("=", " ").split())
                if words & PROTOCOL_WORDS:
                    offenders.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert offenders == []


def test_matrix_files_are_size_and_shape_checked():
    with pytest.raises(errors.InputError, match="not JSON"):
        crashmatrix.load(b"{")
    with pytest.raises(errors.InputError, match="not a lab-crashpoints"):
        crashmatrix.load(b'{"format": "other"}')
    with pytest.raises(errors.InputError, match="larger"):
        crashmatrix.load(b" " * (crashmatrix.MAX_MATRIX_BYTES + 1))
    bad_cell = {"format": crashmatrix.FORMAT, "cells": [{"boundary": 1}], "boundaries": [],
                "faults": [], "kinds": []}
    with pytest.raises(errors.InputError, match="malformed cell"):
        crashmatrix.load(json.dumps(bad_cell).encode())


def _must_show(matrix: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    cells = {cell["id"]: cell for cell in matrix["cells"]}
    return (cells[f"{protocol.AFTER_EFFECT}/{crashpoints.WORKER_SIGKILL}/idempotent"],
            cells[f"{protocol.AFTER_EFFECT}/{crashpoints.WORKER_SIGKILL}/non_idempotent"])


def test_sigkill_after_effect_reconciles_idempotent_and_reviews_non_idempotent(
    request, lab_dsn
):
    """SIGKILL of the worker after the tool committed the effect, before the reply: the
    idempotent cell settles automatically by lookup, the non-idempotent one waits for a
    person with the reason; each has exactly one effect and no invariant is violated."""
    matrix = crashpoints.run(lab_dsn, seed=3, jobs=2,
                             only=[f"{protocol.AFTER_EFFECT}/{crashpoints.WORKER_SIGKILL}/"])
    pytest_plugin.reached_database(request.node)
    idempotent, non_idempotent = _must_show(matrix)
    assert matrix["violation_count"] == 0, matrix["cells"]
    assert idempotent["reached"] and non_idempotent["reached"]
    assert (idempotent["status"], idempotent["final_state"], idempotent["effects"]) == (
        crashpoints.AUTOMATIC, "succeeded", 1)
    assert idempotent["recovery"] == ["lease_expired", "reconciled_found"]
    assert idempotent["tool_calls"] == 1 and idempotent["lookups"] == 1
    assert idempotent["process_exits"] == [-9]
    assert (non_idempotent["status"], non_idempotent["final_state"],
            non_idempotent["effects"]) == (crashpoints.PERSON, "unknown", 1)
    assert non_idempotent["why"] == "non_idempotent_dispatched"
    assert non_idempotent["tool_calls"] == 1 and non_idempotent["lookups"] == 0
    rendered = "\n".join(crashpoint_chapter.render_markdown(matrix, signed_note="test"))
    assert "person: non_idempotent_dispatched" in rendered


def _sample_matrix() -> dict[str, Any]:
    cells = []
    for boundary, fault, kind in crashpoints.cells():
        found = crashpoints.script(boundary, fault, kind)
        if isinstance(found, crashpoints.NotApplicable):
            cells.append({"id": crashpoints.cell_id(boundary, fault, kind), "boundary": boundary,
                          "fault": fault, "kind": kind, "status": crashmatrix.NOT_APPLICABLE,
                          "why": found.reason})
            continue
        person = kind == crashpoints.NON_IDEMPOTENT
        cells.append({
            "id": crashpoints.cell_id(boundary, fault, kind), "boundary": boundary,
            "fault": fault, "kind": kind, "reached": True,
            "status": crashmatrix.PERSON if person else crashmatrix.AUTOMATIC,
            "final_state": "unknown" if person else "succeeded", "effects": 1,
            "why": "non_idempotent_dispatched" if person else "", "tool_calls": 1,
            "lookups": 0 if person else 1, "recovery_s": 1.0, "violations": [],
        })
    matrix = crashpoints.assemble(cells, seed=1, jobs=2, complete=True)
    matrix["timing"] = {"wall_s": 1.0}
    return matrix


def test_chapter_has_a_row_per_boundary_and_a_column_per_fault_and_kind():
    matrix = _sample_matrix()
    assert crashmatrix.passed(matrix)
    lines = crashpoint_chapter.render_markdown(matrix, signed_note="signed")
    # One table per fault, narrow enough for a phone: a column per tool kind.
    headers = [line for line in lines if line.startswith("| Boundary")]
    assert len(headers) == len(crashpoints.FAULT_NAMES)
    assert all(h.count("|") - 1 == 1 + len(crashpoints.KINDS) for h in headers)
    assert [line.split("`")[1] for line in lines if line.startswith("**Fault ")] == list(
        crashpoints.FAULT_NAMES)
    rows = [line for line in lines if line.startswith(("| `after_", "| `batch_"))]
    assert [row.split("`")[1] for row in rows] == (
        list(crashscripts.rows()) * len(crashpoints.FAULT_NAMES))
    assert all("missing" not in row for row in rows)
    count = len(protocol.NAMES)
    assert f"{count} of {count} boundaries reached" in "\n".join(lines)
    assert "non_idempotent_fenced" in headers[0]


def test_the_book_publishes_only_the_matrix_the_run_signed():
    data = crashmatrix.canonical_json(_sample_matrix())
    signed = {"tests": [{"observations": [{crashmatrix.SIGNED_KEY: crashmatrix.digest(data)}]}]}
    lines, _ = crashpoint_chapter.book_section(signed, data)
    assert "signed with the run" in "\n".join(lines)
    other = {"tests": [{"observations": [{crashmatrix.SIGNED_KEY: "0" * 64}]}]}
    with pytest.raises(errors.Refused, match="not the matrix the signed run recorded"):
        crashpoint_chapter.book_section(other, data)
    assert crashpoint_chapter.book_section(signed, None) == ([], {})


def test_the_chapter_draws_one_figure_per_distinct_outcome():
    matrix = _sample_matrix()
    data = crashmatrix.canonical_json(matrix)
    signed = {"tests": [{"observations": [{crashmatrix.SIGNED_KEY: crashmatrix.digest(data)}]}]}
    lines, drawn = crashpoint_chapter.book_section(signed, data, "figures")
    distinct = {crashmatrix.outcome(c) for c in matrix["cells"]
                if c["status"] != crashmatrix.NOT_APPLICABLE}
    assert len(drawn) == len(distinct) >= 1
    text = "\n".join(lines)
    for path, svg in drawn.items():
        assert f"]({path})" in text
        assert svg.startswith(b"<svg") or svg.startswith(b"<?xml")


def test_a_violation_or_an_unreached_boundary_fails_the_matrix():
    matrix = _sample_matrix()
    matrix["cells"][0]["status"] = crashmatrix.NOT_REACHED
    matrix["cells"][0]["reached"] = False
    rebuilt = crashpoints.assemble(matrix["cells"], seed=1, jobs=2, complete=True)
    assert not crashmatrix.passed(rebuilt)
    matrix = _sample_matrix()
    matrix["cells"][0]["violations"] = [{"kind": "duplicate_effect", "workflow_id": "w",
                                         "effect_key": "k", "detail": "2 rows"}]
    matrix["cells"][0]["status"] = crashmatrix.VIOLATION
    rebuilt = crashpoints.assemble(matrix["cells"], seed=1, jobs=2, complete=True)
    assert not crashmatrix.passed(rebuilt)
    assert "VIOLATION duplicate_effect" in crashmatrix.outcome(rebuilt["cells"][0])


@pytest.mark.parametrize(("argv", "message"), [
    (["--jobs", "0"], "--jobs must be between 1 and 16"),
    (["--only", "after_nothing"], "--only after_nothing matches no cell"),
])
def test_bad_arguments_are_a_one_line_usage_error(argv, message):
    done = subprocess.run([sys.executable, "-m", "lab.cli", "crashpoints", *argv],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == errors.EXIT_USAGE
    assert done.stderr.strip().splitlines() == [f"lab crashpoints: {message}"]
    assert done.stdout == ""


def test_without_a_restartable_server_the_postgres_column_is_left_out_with_the_reason():
    matrix = crashpoints.assemble([], seed=1, jobs=1, complete=False, restartable=False)
    assert crashpoints.POSTGRES_RESTART not in {f["name"] for f in matrix["faults"]}
    assert matrix["omitted_faults"] == [
        {"name": crashpoints.POSTGRES_RESTART, "why": crashpoints.NO_RESTART}]
    assert "postgres_restart" in "\n".join(
        crashpoint_chapter.render_markdown(matrix, signed_note="unsigned"))


def test_a_recurring_boundary_is_armed_only_once_the_tool_holds_the_request():
    """Every cell at ``after_heartbeat`` (a boundary that recurs from the claim on) arms the
    worker's switch through its stdin, and only after the tool reported the request: the
    order the cell needs is created by the script, not left to the scheduler."""
    for fault in crashpoints.FAULT_NAMES:
        for kind in crashpoints.KINDS:
            found = crashpoints.script(protocol.AFTER_HEARTBEAT, fault, kind)
            assert isinstance(found, crashpoints.Script)
            assert "--armed-by-stdin" in found.worker_flags
            verbs = [step[0] for step in found.steps]
            assert verbs[:2] == [crashpoints.TOOL_STAGE, crashpoints.ARM_WORKER], verbs


def test_a_heartbeat_before_the_request_does_not_stop_the_worker_early(
    request, lab_dsn, monkeypatch
):
    """With heartbeats every 10 ms the worker beats before its request leaves (what load
    did to the 100 ms beat): the disarmed crash switch lets it pass, and the cell still
    kills it at a heartbeat with the request in the tool: one call, one effect, a person."""
    monkeypatch.setattr(crashscripts, "SLOW_TOOL_HEARTBEAT_S", 0.01)
    cell = f"{protocol.AFTER_HEARTBEAT}/{crashpoints.WORKER_SIGKILL}/{crashpoints.NON_IDEMPOTENT}"
    matrix = crashpoints.run(lab_dsn, seed=3, jobs=1, only=[cell])
    pytest_plugin.reached_database(request.node)
    # The prefix also names the kind with a fenced lookup: this test is about the other.
    (found,) = [c for c in matrix["cells"] if c["id"] == cell]
    assert (found["status"], found["effects"], found["tool_calls"], found["why"]) == (
        crashpoints.PERSON, 1, 1, "non_idempotent_dispatched"), found
    assert found["process_exits"] == [-9]


def test_every_late_cell_gives_up_then_recovers_then_delivers_the_request():
    """A late-request cell holds the request past the worker's own (short) client timeout,
    settles the workflow as an operator would while the request is still held, and only
    then lets it go and waits for the tool's answer: the request arrives after "absent"
    was answered, which is the case the fenced lookup exists for. Each of the three
    places a request can wait is some cell's."""
    placements = set()
    for row, fault, kind in crashpoints.cells():
        found = crashpoints.script(row, fault, kind)
        if fault != crashscripts.LATE_REQUEST or isinstance(found, crashpoints.NotApplicable):
            continue
        assert found.late is not None, (row, kind)
        placements.add(found.late)
        assert "--tool-timeout" in found.worker_flags, (row, kind)
        verbs = [step[0] for step in found.steps]
        order = [crashscripts.LATE_TIMED_OUT, crashscripts.RECOVER, crashscripts.DELIVER_LATE,
                 crashscripts.LATE_ANSWERED]
        assert [v for v in verbs if v in order] == order, (row, kind, verbs)
    assert placements == {crashscripts.LATE_NETWORK, crashscripts.LATE_IN_TOOL,
                          crashscripts.LATE_DATABASE}


def test_cells_moved_from_a_person_to_automatic_are_listed_with_their_proof():
    """A cell that waits for a person without the fenced lookup and settles automatically
    with it is listed, with the reconciliation's proof; a cell that waits for a person
    either way is not."""
    matrix = _sample_matrix()
    for cell in matrix["cells"]:
        if cell["kind"] == crashscripts.NON_IDEMPOTENT_FENCED and cell.get("reached"):
            late = cell["fault"] == crashscripts.LATE_REQUEST
            cell["status"] = crashmatrix.AUTOMATIC if late else crashmatrix.PERSON
            cell["history"] = [{"workflow": "w", "kind": "reconciled",
                                "detail": "lookup=absent closed_through=1"}] if late else []
    moved = crashmatrix.moved_to_automatic(matrix)
    late_rows = [row for row, fault, kind in crashpoints.cells()
                 if fault == crashscripts.LATE_REQUEST and kind == crashscripts.NON_IDEMPOTENT
                 and isinstance(crashpoints.script(row, fault, kind), crashpoints.Script)]
    assert [m["boundary"] for m in moved] == late_rows
    assert all(m["proof"] == ["lookup=absent closed_through=1"] for m in moved)
    text = "\n".join(crashpoint_chapter.render_markdown(matrix, signed_note="signed"))
    assert f"{len(moved)} cells wait for a person" in text
    assert "proof: lookup=absent closed\\_through=1" in text or \
        "proof: lookup=absent closed_through=1" in text
    # Settled automatically without a fenced absent (a worker that carried on, by timing):
    # not moved by the fenced lookup, so not listed.
    for cell in matrix["cells"]:
        if cell["kind"] == crashscripts.NON_IDEMPOTENT_FENCED and cell.get("reached"):
            cell["history"] = []
    assert crashmatrix.moved_to_automatic(matrix) == []


def test_a_late_request_is_refused_after_a_fenced_absent_and_applied_without_one(
    request, lab_dsn
):
    """The request after the start barrier waits in the worker-tool link past the client's
    timeout; recovery settles the workflow; then the link heals. With a fenced lookup
    (idempotent, and non-idempotent with one) the lookup's "absent" closed the start, the
    late request is refused and the requeued attempt makes the one effect, automatically.
    Without one a person decides, and the late request is applied: one effect each way."""
    row = f"{protocol.AFTER_BARRIER}/{crashscripts.LATE_REQUEST}/"
    matrix = crashpoints.run(lab_dsn, seed=5, jobs=3, only=[row])
    pytest_plugin.reached_database(request.node)
    cells = {cell["kind"]: cell for cell in matrix["cells"]}
    assert matrix["violation_count"] == 0, matrix["cells"]
    for kind in (crashscripts.IDEMPOTENT, crashscripts.NON_IDEMPOTENT_FENCED):
        found = cells[kind]
        assert (found["status"], found["final_state"], found["effects"]) == (
            crashmatrix.AUTOMATIC, "succeeded", 1), found
        assert found["late"] == {"placement": crashscripts.LATE_NETWORK,
                                 "answers": ["refused"]}, found
        assert found["recovery"] == ["reconciled_requeued", "ran_again"], found
    without = cells[crashscripts.NON_IDEMPOTENT]
    assert (without["status"], without["effects"], without["late"]["answers"]) == (
        crashmatrix.PERSON, 1, ["applied"]), without
    assert [m["boundary"] for m in crashmatrix.moved_to_automatic(matrix)] == [
        protocol.AFTER_BARRIER]


def test_a_batch_killed_with_all_its_requests_in_the_tool_settles_each_workflow(
    request, lab_dsn
):
    """A ``--batch 3`` worker SIGKILLed while the tool holds all three of its requests
    (every one sent, none answered): the tool then commits them, the leases expire, and
    each workflow is reconciled by lookup: three succeeded, three effects, no person."""
    cell = f"{crashscripts.BATCH_AFTER_REQUEST}/{crashpoints.WORKER_SIGKILL}/idempotent"
    matrix = crashpoints.run(lab_dsn, seed=5, jobs=1, only=[cell])
    pytest_plugin.reached_database(request.node)
    (found,) = matrix["cells"]
    assert (found["status"], found["workflows"], found["final_state"], found["effects"]) == (
        crashmatrix.AUTOMATIC, crashscripts.BATCH_SIZE, "succeeded", crashscripts.BATCH_SIZE
    ), found
    assert found["tool_calls"] == crashscripts.BATCH_SIZE and found["process_exits"] == [-9]
