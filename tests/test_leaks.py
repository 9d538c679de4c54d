"""A failing experiment with secrets in scope leaks none of them: not to the terminal,
not to ``tests.jsonl``, not to ``runtime.json``.

A real ``lab run`` (a subprocess, on the outer run's PostgreSQL, as
``tests/test_reproduction.py`` runs it) of a tiny tree whose two experiments fail on
purpose: one with the crash-point run context (the DSN, the result keys) in its assertion,
the way a failed cell printed ``_Run(dsn='... password=...')`` (issue 41); one inside lab
code that takes the DSN as its argument, the frame pytest prints with its arguments. Both
take ``lab_dsn`` and hold a live credit tool, whose bearer token they write to a probe
file with the rest of what must not appear.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lab.evidence import compiler
from lab.pg import edge
from tests.support import labtree

FAILING = '''
import base64
import json
import os
from pathlib import Path

from lab import loopback
from lab.faults import crashpoints


def _probe(name, lab, lab_dsn, rig):
    """What this experiment holds and must not leak, for the outer test to look for."""
    keys = [base64.b64encode(k).decode() for k in lab.store.keys.keys.values()]
    Path(os.environ["LEAK_PROBE_DIR"], name).write_text(json.dumps(
        {"token": rig.service.token, "keys": keys, "dsn": str(lab_dsn)}))


def test_a_crash_point_cell_fails_with_its_run_in_scope(lab, lab_dsn):
    """Fails on purpose, a crash-point run context (DSN, keys) in the assertion."""
    rig = lab.credit_tool()
    _probe("cell.json", lab, lab_dsn, rig)
    ctx = crashpoints._Run(lab_dsn, "leakprobe", 17, lab.store.keys, False, None)
    assert ctx.seed == 18, f"the cell failed: {ctx}"


def test_lab_code_fails_with_the_dsn_as_its_argument(lab, lab_dsn):
    """Fails on purpose inside lab code whose frame's argument is a DSN with a password."""
    rig = lab.credit_tool()
    _probe("argument.json", lab, lab_dsn, rig)
    loopback.check_dsn(str(lab_dsn).replace("127.0.0.1", "192.0.2.1"))
'''
ENTRIES = [
    {"chapter": "ch01_leak", "name": "test_a_crash_point_cell_fails_with_its_run_in_scope",
     "results": 1, "database": True},
    {"chapter": "ch01_leak", "name": "test_lab_code_fails_with_the_dsn_as_its_argument",
     "results": 1, "database": True},
]


def test_a_failing_experiment_leaks_no_password_token_or_key(
    tmp_path: Path, lab_dsn: str
) -> None:
    password = edge.password_of(lab_dsn)
    assert password, "the run's PostgreSQL has no password: nothing to look for"
    root = tmp_path / "repo"
    chapter = root / "experiments" / "ch01_leak"
    chapter.mkdir(parents=True)
    (chapter / "test_leak.py").write_text(FAILING)
    labtree.publishable(root, ENTRIES)
    probes = tmp_path / "probes"
    probes.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LAB_EVIDENCE"))}
    env.update(BOOK_LAB_DSN=lab_dsn, LEAK_PROBE_DIR=str(probes))
    evidence = tmp_path / "evidence"
    done = subprocess.run(
        [sys.executable, "-m", "lab.cli", "run", "--evidence", str(evidence), "--",
         "--lab-postgres=dsn"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    terminal = done.stdout + done.stderr
    # The experiments ran and failed as meant, and their failures were reported.
    assert done.returncode == 1, terminal[-3000:]
    assert "the cell failed: _Run(seed=17, keep_schemas=False, restart=None)" in terminal
    assert "BoundaryViolation" in terminal or "loopback" in terminal, terminal[-3000:]
    held = [json.loads((probes / name).read_text()) for name in ("cell.json", "argument.json")]
    assert all(password in probe["dsn"] for probe in held)
    secrets = {"the database password": password}
    for number, probe in enumerate(held):
        secrets[f"tool token {number}"] = probe["token"]
        secrets.update({f"result key {i}": key for i, key in enumerate(probe["keys"])})
    written = {
        "the terminal": terminal,
        compiler.TESTS_FILE: (evidence / compiler.TESTS_FILE).read_text(),
        compiler.REPORT_FILE: (evidence / compiler.REPORT_FILE).read_text(),
    }
    assert "test_lab_code_fails_with_the_dsn_as_its_argument" in written[compiler.TESTS_FILE]
    leaks = [f"{what} in {where}" for what, secret in secrets.items()
             for where, text in written.items() if secret in text]
    assert leaks == []
