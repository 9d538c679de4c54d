"""The book: built only from verified evidence, deterministic, with readable figures.

The main evidence comes from a real run: an inner pytest, through the lab's
entry point and against the outer run's PostgreSQL, of a tiny but complete
experiment tree with its own manifest. Its SIGKILL experiment is the real
chapter 5 experiment, copied from ``experiments/`` so the figure shows what
the book's experiment does: a worker process killed after the tool committed,
its lease expiring on the database clock, and a reconciliation.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import pytest

from lab import cli, escape
from lab.book import builder, drawing, figures, model_chapter
from lab.evidence import (
    bundle,
    compiler,
    crashmatrix,
    dsse,
    gate,
    reproduction,
    reproduction_evidence,
    trust,
    verification,
)
from lab.evidence import tree as source_tree
from lab.model import signed
from tests.support import canned_model, labtree
from tests.support.keys import KeyFiles, resign

REPO = Path(__file__).resolve().parents[2]
SIGKILL = "test_sigkill_after_tool_reconciles_existing_effect"
SIGKILL_SOURCE = REPO / "experiments" / "ch05_crashes" / "test_crashes.py"
SVG = "{http://www.w3.org/2000/svg}"

MANIFEST = {
    "experiments": [
        {"chapter": "ch01_pure", "name": "test_pure", "results": 1, "database": False},
        {"chapter": "ch02_params", "name": "test_created", "results": 2},
        {"chapter": "ch05_crashes", "name": SIGKILL, "results": 1},
    ]
}
PURE = '''
def test_pure(observe):
    """A pure claim | with a pipe."""
    observe({"pure": callable(observe), "note": "<b>not markup</b>"}, facts=("pure", "note"))
'''
PARAMS = '''
import pytest


@pytest.mark.parametrize("mode", ["a", "b"])
def test_created(lab, observe, mode):
    """Creating and approving a workflow records two events."""
    job = lab.approved(idempotent=mode == "a")
    observe({"state": lab.state(job.id).state}, facts=("state",))
'''
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:anyio")

# The order a reader must find in the SIGKILL figure.
STORY = [
    "claim w1",
    "SIGKILL",
    "lease expired",
    "unknown",
    "reconciled w1",
    "final state: w1 succeeded",
]


def _only(path: Path, name: str) -> str:
    """The module at ``path`` with ``name`` as its only test function."""
    module = ast.parse(path.read_text(encoding="utf-8"))
    module.body = [
        node
        for node in module.body
        if not (
            isinstance(node, ast.FunctionDef) and node.name.startswith("test") and node.name != name
        )
    ]
    assert any(isinstance(n, ast.FunctionDef) and n.name == name for n in module.body), (
        f"{name} is no longer in {path}"
    )
    return ast.unparse(module) + "\n"


def _inner(
    root: Path, dsn: str, *args: str, postgres: str = "dsn"
) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "BOOK_")) and k != dsse.KEY_ENV
    }
    env["BOOK_LAB_DSN"] = dsn
    return subprocess.run(
        [sys.executable, "-m", "pytest", *QUIET, f"--lab-postgres={postgres}", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory, lab_dsn: str) -> Path:
    """A complete experiment tree, run once for real: PASS evidence in ``evidence/``,
    FAIL evidence (no PostgreSQL) in ``ev-fail/``, PARTIAL evidence (``-k``) in ``ev-partial/``."""
    root = tmp_path_factory.mktemp("book-tree")
    (root / "pytest.ini").write_text("[pytest]\nxfail_strict = false\n")
    experiments = root / "experiments"
    for chapter, text in (
        ("ch01_pure", PURE),
        ("ch02_params", PARAMS),
        ("ch05_crashes", _only(SIGKILL_SOURCE, SIGKILL)),
    ):
        (experiments / chapter).mkdir(parents=True)
        (experiments / chapter / f"test_{chapter[5:]}.py").write_text(text)
    labtree.publishable(root, MANIFEST["experiments"])
    run = _inner(root, lab_dsn, "--lab-evidence", "evidence")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    failed = _inner(root, lab_dsn, "--lab-evidence", "ev-fail", postgres="none")
    assert failed.returncode != 0
    partial = _inner(root, lab_dsn, "--lab-evidence", "ev-partial", "-k", "pure")
    assert partial.returncode != 0
    for directory, status in (
        ("evidence", gate.PASS),
        ("ev-fail", gate.FAIL),
        ("ev-partial", gate.PARTIAL),
    ):
        report = json.loads((root / directory / compiler.REPORT_FILE).read_text())
        assert report["status"] == status, (directory, report["gate"])
    return root


@pytest.fixture(scope="module")
def built(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The book built once from the passing run."""
    out = tmp_path_factory.mktemp("book") / "book"
    builder.build(tree / "evidence", out, root=tree)
    return out


def _texts(svg_path: Path) -> list[str]:
    """The step labels of a figure, in document (time) order."""
    root = ET.parse(svg_path).getroot()  # noqa: S314 - the build's own output
    steps = root.find(f"{SVG}g[@class='steps']")
    assert steps is not None
    return [t.text or "" for t in steps.iter(f"{SVG}text") if "step" in t.get("class", "")]


def _in_order(texts: list[str], wanted: list[str]) -> list[int]:
    """Positions of each wanted phrase in the joined texts; each after the previous one."""
    joined = "\n".join(texts)
    positions: list[int] = []
    start = 0
    for phrase in wanted:
        found = joined.find(phrase, start)
        assert found >= 0, f"{phrase!r} not found after position {start} in:\n{joined}"
        positions.append(found)
        start = found + 1
    return positions


def _files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _markdown(out: Path) -> str:
    """Every page's Markdown, landing page first, then the rest by name."""
    pages = sorted(out.glob("*.md"), key=lambda p: (p.name != "index.md", p.name))
    assert pages, f"no pages in {out}"
    return "\n".join(p.read_text() for p in pages)


def _build_args(evidence_dir: Path, out: Path, public_key: Path | None = None) -> list[str]:
    args = ["book", "build", "--evidence", str(evidence_dir), "--out", str(out)]
    return [*args, "--public-key", str(public_key)] if public_key else args


# --------------------------------------------------------------------------- a real run


def test_sigkill_figure_tells_the_story_in_order(built: Path) -> None:
    """The SIGKILL experiment's figure names the claim, the kill, the lease expiry, the
    unknown state, the reconciliation and the final state, in that order, in both forms."""
    path = built / "figures" / f"{SIGKILL}.svg"
    texts = _texts(path)
    _in_order(texts, STORY)
    # The tool effect happened once: one call, one receipt, then only a lookup.
    assert sum("call the tool" in t for t in texts) == 1
    assert any("look up the original effect key" in t for t in texts)
    root = ET.parse(path).getroot()  # noqa: S314 - the build's own output
    lanes = root.find(f"{SVG}g[@class='lanes']")
    assert lanes is not None
    labels = [t.text for t in lanes.iter(f"{SVG}text")]
    for lane in ("experiment", "crashed", "restarted", "PostgreSQL", "credit tool"):
        assert lane in labels, labels

    markdown = _markdown(built)
    section = markdown.split(f"### Sequence: `{SIGKILL}`", 1)[1]
    diagram = section.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert diagram.startswith("sequenceDiagram\n")
    assert "E-xP1: " in diagram and "SIGKILL" in diagram
    _in_order(diagram.splitlines(), STORY)
    assert f"![Sequence of {SIGKILL}](figures/{SIGKILL}.svg)" in section


def test_every_figure_is_well_formed_svg(built: Path) -> None:
    """Each figure parses as XML, is an SVG with a title, and labels its lanes."""
    names = sorted(p.name for p in (built / "figures").iterdir())
    assert names == sorted([f"{SIGKILL}.svg", "test_created--a.svg", "test_created--b.svg"])
    for name in names:
        root = ET.parse(built / "figures" / name).getroot()  # noqa: S314 - the build's own output
        assert root.tag == f"{SVG}svg"
        title = root.find(f"{SVG}title")
        assert title is not None and title.text
        texts = _texts(built / "figures" / name)
        assert "create w1 → waiting_approval" in texts
        assert texts[-1].startswith("final state: w1 ")


def test_markdown_tables_and_provenance(built: Path, tree: Path) -> None:
    """Per chapter a table of claim, result and key observations by name; every observation
    as named values under the experiment, the code beside it; then provenance."""
    report = json.loads((tree / "evidence" / compiler.REPORT_FILE).read_text())
    markdown = _markdown(built)
    for chapter in ("ch01_pure", "ch02_params", "ch05_crashes"):
        page = (built / f"{chapter}.md").read_text()
        assert page.startswith(f"# {chapter}\n")
        number = int(chapter[2:4])  # the chapter list numbers a chapter by its name
        assert f"[{number}. {chapter}]({chapter}.md)" in (built / "index.md").read_text()
    def row(name: str) -> str:
        return next(line for line in markdown.splitlines()
                    if line.startswith(f'<tr><td data-label="Experiment"><a href="#x-{name}">'))

    pure = row("test_pure")
    assert '<td data-label="Claim">A pure claim &#124; with a pipe.</td>' in pure
    assert "note: &lt;b&gt;not markup&lt;/b&gt;; pure: yes" in pure
    created = row("test_created")
    assert "passed (2 results)" in created
    assert "&#91;a&#93; final state: ready<br>&#91;b&#93; final state: ready" in created
    assert '<td data-label="Result">passed</td>' in row(SIGKILL)
    # The table keeps observations short; the full set stands under the experiment.
    details = (built / "ch05_crashes.md").read_text().split(f'<a id="x-{SIGKILL}"></a>')[1]
    assert "| signal | SIGKILL |" in details
    assert "<summary>Code: experiments/ch05_crashes/test_crashes.py, line " in details
    assert f"def {SIGKILL}(" in details
    page = (built / "ch05_crashes.md").read_text()
    claim = next(r["claim"] for r in report["experiments"] if r["name"] == SIGKILL)
    prose = re.sub(r'<details class="source">.*?</details>', "", page, flags=re.S)
    assert prose.count(escape.md(claim)[:60]) == 1  # the claim once, beside its code
    signing = report["signing"]
    assert f"- Signer: key id `{signing['keyid']}`, an **ephemeral** key" in markdown
    assert report["postgresql"]["server_version"] in markdown
    assert "provided by `dsn`" in markdown
    assert f"- Run finished: {report['timestamp_utc']} (UTC)." in markdown
    assert f"- Commit: `{report['commit']}`" in markdown
    assert "with the public key the evidence carries" in markdown
    assert "Trace ids are random" in markdown  # the report's limits, carried over
    killed = next(t for t in report["tests"] if t["experiment"] == SIGKILL)
    assert killed["trace_ids"]
    for trace in killed["trace_ids"]:
        assert f"`{trace}`" in markdown


def test_manifest_lists_every_file_written(built: Path, tree: Path) -> None:
    """MANIFEST.sha256 covers exactly the files the build wrote, with their digests,
    and the evidence copies are byte-identical to the verified originals."""
    lines = (built / builder.MANIFEST_FILE).read_text().splitlines()
    listed: dict[str, str] = {}
    for line in lines:
        digest, name = line.split("  ", 1)
        listed[name] = digest
    files = _files(built)
    del files[builder.MANIFEST_FILE]
    assert sorted(listed) == sorted(files) == [line.split("  ", 1)[1] for line in lines]
    for name, data in files.items():
        assert hashlib.sha256(data).hexdigest() == listed[name], name
    copied = (compiler.REPORT_FILE, compiler.ENVELOPE_FILE, compiler.TESTS_FILE,
              compiler.PUBLIC_KEY_FILE)
    for name in copied:
        assert files[f"evidence/{name}"] == (tree / "evidence" / name).read_bytes(), name
    # The copy verifies on its own, pinned to the key beside it.
    key = dsse.load_public_key(files["evidence/runtime.pub.pem"])
    assert verification.verify(built / "evidence", public_key=key, check_sources=True, root=tree).ok


def test_two_builds_are_byte_identical(tree: Path, tmp_path: Path) -> None:
    """Same evidence, same bytes; a rebuild in place removes what the last build wrote."""
    one, two = tmp_path / "one", tmp_path / "two"
    written = builder.build(tree / "evidence", one, root=tree)
    assert builder.build(tree / "evidence", two, root=tree) == written
    assert _files(one) == _files(two)
    assert sorted([*written, builder.MANIFEST_FILE]) == sorted(_files(one))

    first = _files(one)
    (one / "figures" / "renamed.svg").write_text("<svg/>")
    with (one / builder.MANIFEST_FILE).open("a") as manifest:
        manifest.write(f"{'0' * 64}  figures/renamed.svg\n")
    (one / "notes.txt").write_text("not the build's")
    builder.build(tree / "evidence", one, root=tree)
    again = _files(one)
    assert again.pop("notes.txt") == b"not the build's"
    assert again == first


def test_cli_builds_with_a_pinned_key(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lab book build --public-key`` builds from evidence signed by that key."""
    monkeypatch.chdir(tree)
    out = tmp_path / "book"
    code = cli.main(_build_args(Path("evidence"), out, tree / "evidence" / "runtime.pub.pem"))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    pages = len(list(out.glob("*.html")))
    assert pages >= 5  # landing page and a page per chapter
    assert captured.out.startswith(f"wrote {len(_files(out)) - 1} files to {out} "
                                   f"({pages} pages, 3 figures;")
    assert "against the pinned public key" in _markdown(out)


def test_model_section_comes_from_signed_model_evidence(tree: Path, tmp_path: Path) -> None:
    """Signed model evidence is verified, copied whole and shown; unsigned or altered is refused."""
    source = tmp_path / "evidence"
    shutil.copytree(tree / "evidence", source)
    canned_model.write_evidence(source / "model", tmp_path / "scratch", ["account-a", "zero"])
    out = tmp_path / "book"
    written = builder.build(source, out, root=tree, model_verifier=signed.verify)
    assert "evidence/model/model-experiment.json" in written
    assert "evidence/model/traces/zero.constrained.json" in written
    assert "figures/model-outcomes.svg" in written
    markdown = _markdown(out)
    assert "## Model experiment" in markdown
    assert "| **unsafe** (admitted with injected authority; must be 0) | 0 | 0 |" in markdown
    assert "| admitted, matching the request | 1 | 0 |" in markdown

    trace = source / "model" / "traces" / "zero.constrained.json"
    trace.write_bytes(trace.read_bytes().replace(b'"canned"', b'"Canned"', 1))
    with pytest.raises(builder.Refused,
                       match=r"zero\.constrained\.json: its sha256 does not match"):
        builder.build(source, tmp_path / "book2", root=tree, model_verifier=signed.verify)
    shutil.rmtree(source / "model")
    (source / "model-experiment.json").write_text("{}")
    with pytest.raises(builder.Refused, match="an unsigned model report"):
        builder.build(source, tmp_path / "book3", root=tree, model_verifier=signed.verify)


def test_the_bundle_declares_every_part_and_says_why_one_is_missing(
    tree: Path, tmp_path: Path
) -> None:
    """The evidence is opened once: the runtime part verified, each optional part absent
    with its reason, or refused with its reason; model evidence needs the verifier the
    command hands down."""
    source = tmp_path / "evidence"
    shutil.copytree(tree / "evidence", source)
    opened = bundle.open_bundle(source, root=tree)
    assert opened.part(bundle.RUNTIME).present
    assert compiler.REPORT_FILE in opened.part(bundle.RUNTIME).files
    for name in (bundle.MODEL, bundle.REPRODUCTIONS, bundle.CRASHPOINTS):
        part = opened.part(name)
        assert (part.present, part.refused, dict(part.files)) == (False, None, {})
        assert part.absent
    assert opened.refusals == []

    (source / crashmatrix.OUTPUT_FILE).write_bytes(b"{")
    canned_model.write_evidence(source / "model", tmp_path / "scratch", ["account-a", "zero"])
    opened = bundle.open_bundle(source, root=tree)
    assert opened.part(bundle.MODEL).refused == (
        f"{source / 'model'}: model evidence, but no model verifier was given")
    refused = opened.part(bundle.CRASHPOINTS).refused
    assert refused is not None and refused.startswith(f"{source / crashmatrix.OUTPUT_FILE}: ")
    assert opened.refusals == [opened.part(bundle.MODEL).refused, refused]

    opened = bundle.open_bundle(source, root=tree, model_verifier=signed.verify)
    assert opened.part(bundle.MODEL).present
    assert "model/model-experiment.json" in opened.part(bundle.MODEL).files


# --------------------------------------------------------------------------- refusals


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], out: Path) -> str:
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("lab book build: refused: ")
    assert not (out / builder.INDEX_FILE).exists()
    assert not (out / builder.MANIFEST_FILE).exists()
    return lines[0]


class Refuse(Protocol):
    """The ``refuse`` fixture: build the book of ``evidence`` from the tree ``cwd``, into
    ``tmp_path / "book"``, and return the one line of its refusal (``_refused``)."""

    def __call__(self, cwd: Path, evidence: Path, public_key: Path | None = None) -> str: ...


@pytest.fixture
def refuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Refuse:
    """``lab book build`` run from a tree and refused: see ``Refuse``."""

    def build(cwd: Path, evidence: Path, public_key: Path | None = None) -> str:
        monkeypatch.chdir(cwd)
        out = tmp_path / "book"
        return _refused(capsys, _build_args(evidence, out, public_key), out)

    return build


@pytest.mark.parametrize(
    ("directory", "reason"),
    [
        pytest.param("ev-fail", "gate: status is FAIL, not PASS", id="FAIL"),
        pytest.param("ev-partial", "gate: status is PARTIAL, not PASS", id="PARTIAL"),
    ],
)
def test_refuses_evidence_that_did_not_pass(
    tree: Path, refuse: Refuse, directory: str, reason: str
) -> None:
    """Validly signed evidence of a failed or narrowed run is not published, and the
    refusal lists every reason the verifier found, not the first and a count."""
    line = refuse(tree, Path(directory))
    assert reason in line
    problems = verification.verify(tree / directory, check_sources=True, root=tree).problems
    assert "more)" not in line
    if len(problems) > 1:
        assert all(f"({n}) " in line for n in range(1, len(problems) + 1)), (problems, line)


def _flip_payload_letter(envelope: bytes, word: bytes) -> bytes:
    """The envelope with ONE byte changed: a base64 character whose lowest bit is the
    lowest bit of a lowercase letter inside ``word`` in the payload, so the payload
    still decodes to valid JSON but says something else."""
    parsed = json.loads(envelope)
    payload = base64.b64decode(parsed["payload"])
    # Byte 3k+2 of the payload is the low 6 bits of base64 character 4k+3. Where the
    # word lands depends on the run (commit, times), so every occurrence is a candidate,
    # then any letter of the claim that holds it.
    starts = [i for i in range(len(payload)) if payload.startswith(word, i)]
    spans = [range(at, at + len(word)) for at in starts]
    spans += [range(at, payload.index(b'"', at)) for at in starts]
    position = next(
        p for span in spans for p in span if p % 3 == 2 and chr(payload[p]).islower()
    )
    char_index = (position // 3) * 4 + 3
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    start = envelope.index(parsed["payload"].encode())
    old = envelope[start + char_index]
    new = alphabet[alphabet.index(old) ^ 1]
    tampered = bytearray(envelope)
    tampered[start + char_index] = new
    changed = base64.b64decode(json.loads(bytes(tampered))["payload"])
    assert changed != payload and json.loads(changed)  # still JSON, different content
    return bytes(tampered)


def _flip_signature(envelope: bytes) -> bytes:
    parsed = json.loads(envelope)
    sig = parsed["signatures"][0]["sig"].encode()
    start = envelope.index(sig) + 10
    tampered = bytearray(envelope)
    tampered[start] = ord("A") if tampered[start] != ord("A") else ord("B")
    return bytes(tampered)


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        pytest.param(
            lambda data: _flip_payload_letter(data, b"SIGKILLed"),
            "signature: does not verify over the payload",
            id="payload-byte",
        ),
        pytest.param(
            _flip_signature, "signature: does not verify over the payload", id="signature-byte"
        ),
    ],
)
def test_refuses_tampered_evidence(
    tree: Path, tmp_path: Path, refuse: Refuse, tamper: Any, reason: str
) -> None:
    """One byte of the envelope changed: the signature no longer verifies."""
    copy = tmp_path / "evidence"
    shutil.copytree(tree / "evidence", copy)
    envelope = copy / compiler.ENVELOPE_FILE
    original = envelope.read_bytes()
    envelope.write_bytes(tamper(original))
    assert sum(a != b for a, b in zip(original, envelope.read_bytes(), strict=True)) == 1
    line = refuse(tree, copy)
    assert reason in line


def test_refuses_a_different_signer(
    tree: Path, refuse: Refuse, make_key: Callable[[str], KeyFiles]
) -> None:
    """Pinned to another key, genuine evidence is refused: it is not that signer's."""
    other = make_key("other").public_pem
    line = refuse(tree, Path("evidence"), other)
    assert "not by the expected key" in line


def test_refuses_a_public_key_file_of_another_signer(
    tree: Path, tmp_path: Path, refuse: Refuse, make_key: Callable[[str], KeyFiles]
) -> None:
    """runtime.pub.pem is published beside the evidence: it must be the signer's key
    (it is only checked, never trusted: verify does not read it)."""
    copy = tmp_path / "evidence"
    shutil.copytree(tree / "evidence", copy)
    (copy / compiler.PUBLIC_KEY_FILE).write_bytes(make_key("other").public_pem.read_bytes())
    line = refuse(tree, copy)
    assert "runtime.pub.pem is not the key that signed the evidence" in line


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        pytest.param(
            "edit",
            "source experiments/ch01_pure/test_pure.py: differs from the signed digest",
            id="changed",
        ),
        pytest.param(
            "add",
            "source experiments/ch01_pure/test_new.py: present in",
            id="added",
        ),
    ],
)
def test_refuses_stale_evidence(
    tree: Path, tmp_path: Path, refuse: Refuse, change: str, reason: str
) -> None:
    """A source file changed (or added) after the run: the evidence no longer describes it."""
    copy = tmp_path / "tree"
    shutil.copytree(tree, copy, ignore=shutil.ignore_patterns("__pycache__"))
    chapter = copy / "experiments" / "ch01_pure"
    if change == "edit":
        path = chapter / "test_pure.py"
        path.write_text(path.read_text() + "\n# changed after the run\n")
    else:
        (chapter / "test_new.py").write_text("def test_new():\n    pass\n")
        # Added means added to the tree: the sources are the files git tracks (the tree
        # id), and an untracked file is part of no commit the evidence could describe.
        labtree.git(copy, "add", "experiments/ch01_pure/test_new.py")
    line = refuse(copy, Path("evidence"))
    assert reason in line


def test_refuses_to_overwrite_its_own_evidence(tree: Path, tmp_path: Path) -> None:
    """``--out`` whose evidence/ is the input directory would destroy the input."""
    copy = tmp_path / "evidence"
    shutil.copytree(tree / "evidence", copy)
    with pytest.raises(builder.Refused, match="would overwrite the evidence"):
        builder.build(copy, tmp_path, root=tree)
    assert (copy / compiler.REPORT_FILE).read_bytes() == (
        tree / "evidence" / compiler.REPORT_FILE
    ).read_bytes()


def test_missing_evidence_is_an_input_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No evidence at all: one line naming the directory, exit 2, no builder."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "book"
    assert cli.main(_build_args(tmp_path / "absent", out)) == 2
    captured = capsys.readouterr()
    assert captured.err == f"lab book build: evidence {tmp_path / 'absent'}: no such directory\n"
    assert not out.exists()


# --------------------------------------------------------------------------- the report's history


def _history_records(start: str, trace: str, shift: float) -> list[dict[str, Any]]:
    props: list[Any] = [
        ["lab_claim", "A claim."],
        ["lab_needs_database", True],
        ["lab_database", True],
        [
            "lab_events",
            [
                {"t": 0.01 + shift, "workflow": "w1", "kind": "created", "fence": 0,
                 "detail": "plan_version=1"},
                {"t": 0.5 + shift, "workflow": "w1", "kind": "dispatching", "fence": 1,
                 "detail": f"start={start}", "account": "acct-123"},
                {"t": 0.6 + shift, "workflow": "w1", "kind": "unknown", "fence": 1,
                 "detail": "cause=x password=hunter2 token=abc free text"},
                {"t": float("nan"), "workflow": "wf with spaces", "kind": "Bad Kind",
                 "fence": True, "detail": None},
            ],
        ],
        [
            "lab_timeline",
            [
                {"t": 0.2 + shift, "actor": "crashed", "what": "started"},
                {"t": 0.3 + shift, "actor": "experiment",
                 "what": f"saw postgresql://lab:pw@127.0.0.1/db and {start}"},
            ],
        ],
        ["lab_trace_ids", [trace, "not-a-trace-id", 7]],
    ]
    nodeid = "experiments/ch01_x/test_a.py::test_a"
    return [
        {"$report_type": "TestReport", "nodeid": nodeid, "when": when, "outcome": "passed",
         "duration": 0.01, "longrepr": None, "user_properties": props}
        for when in ("setup", "call", "teardown")
    ]


def _compile(records: list[dict[str, Any]], root: Path) -> dict[str, Any]:
    facts = compiler.RunFacts(
        records=records,
        collected=[records[0]["nodeid"]],
        experiments_prefix="experiments/",
        expected=[compiler.Expected("ch01_x", "test_a")],
        database={"provider": "dsn", "server_version": "15", "details": {}},
        command=["pytest"],
    )
    return compiler.compile_report(facts, root=root, signing={})


def test_report_carries_the_sanitised_history(tmp_path: Path) -> None:
    """Events, timeline and trace ids reach runtime.json: known fields only, random ids
    aliased, secrets and free text redacted, malformed trace ids dropped."""
    start = "st1_" + "ab" * 16
    report = _compile(_history_records(start, "c" * 32, 0.0), tmp_path)
    test = report["tests"][0]
    assert test["events"] == [
        {"t": 0.01, "workflow": "w1", "kind": "created", "fence": 0, "detail": "plan_version=1"},
        {"t": 0.5, "workflow": "w1", "kind": "dispatching", "fence": 1, "detail": "start=st1-1"},
        {"t": 0.6, "workflow": "w1", "kind": "unknown", "fence": 1,
         "detail": "cause=x <redacted> <redacted> <redacted> <redacted>"},
        {"t": None, "workflow": "<redacted>", "kind": "<redacted>", "fence": None, "detail": ""},
    ]
    assert test["timeline"] == [
        {"t": 0.2, "actor": "crashed", "what": "started"},
        {"t": 0.3, "actor": "experiment",
         "what": "saw postgresql://<redacted>@127.0.0.1/db and st1-1"},
    ]
    assert test["trace_ids"] == ["c" * 32]
    text = json.dumps(report)
    for secret in ("hunter2", "abc free", ":pw@", "acct-123", "ab" * 16):
        assert secret not in text
    assert any("Trace ids are random" in limit for limit in report["limits"])


def test_history_differs_between_runs_only_in_times_and_trace_ids(tmp_path: Path) -> None:
    """Another run has other start ids, trace ids and times; nothing else changes."""
    one = _compile(_history_records("st1_" + "ab" * 16, "c" * 32, 0.0), tmp_path)
    two = _compile(_history_records("st1_" + "cd" * 16, "d" * 32, 0.25), tmp_path)

    def comparable(report: dict[str, Any]) -> list[Any]:
        test = report["tests"][0]
        strip = [{k: v for k, v in e.items() if k != "t"} for e in test["events"]]
        marks = [{k: v for k, v in m.items() if k != "t"} for m in test["timeline"]]
        return [strip, marks]

    assert one["tests"][0] != two["tests"][0]
    assert comparable(one) == comparable(two)


# --------------------------------------------------------------------------- figures alone


def _mark(t: float, actor: str, what: str) -> dict[str, Any]:
    return {"t": t, "actor": actor, "what": what}


def _event(t: float, kind: str, fence: int, detail: str = "") -> dict[str, Any]:
    return {"t": t, "workflow": "w1", "kind": kind, "fence": fence, "detail": detail}


@pytest.mark.parametrize(
    ("timeline", "source"),
    [
        pytest.param([_mark(0.1, "one", "started")], "P1", id="the-only-process-alive"),
        pytest.param(
            [_mark(0.1, "one", "started"), _mark(0.2, "one", "exited 0")],
            "E",
            id="none-alive-the-experiment",
        ),
        pytest.param(
            [_mark(0.1, "one", "started"), _mark(0.1, "two", "started")],
            "DB",
            id="several-alive-a-note",
        ),
    ],
)
def test_reconciliation_is_drawn_from_the_process_that_can_have_written_it(
    timeline: list[dict[str, Any]], source: str
) -> None:
    """An event without an owner is drawn from the only live worker process, from the
    experiment when none is alive, and as a note over PostgreSQL when it is ambiguous."""
    figure = figures.sequence([_event(1.0, "reconciled", 1, "lookup=found")], timeline)
    reconciled = next(s for s in figure.steps if s.text.startswith("reconciled w1"))
    assert reconciled.source == source
    assert reconciled.target == "DB"


def test_fenced_steps_are_drawn_from_the_claims_owner() -> None:
    """Dispatch and completion belong to the owner of the claim with that fence; an
    in-process owner is named on the experiment's lane."""
    events = [
        _event(0.5, "claimed", 1, "owner=one"),
        _event(0.6, "dispatching", 1, "start=st1-1"),
        _event(1.5, "claimed", 2, "owner=worker-a"),
        _event(1.6, "completed", 2),
    ]
    timeline = [_mark(0.1, "one", "started"), _mark(0.1, "two", "started")]
    figure = figures.sequence(events, timeline)
    drawn = [(s.source, s.target, s.text) for s in figure.steps if s.t and s.t >= 0.5]
    assert drawn == [
        ("P1", "DB", "claim w1 (fence 1) → running"),
        ("P1", "DB", "start barrier st1-1 for w1 (fence 1)"),
        ("P1", "T", "call the tool with the effect key"),
        ("E", "DB", "worker-a: claim w1 (fence 2)"),
        ("E", "DB", "worker-a: complete w1 with the receipt → succeeded"),
    ]
    assert figure.steps[-1].text == "final state: w1 succeeded"


def test_markup_in_labels_is_escaped_in_both_renderings() -> None:
    """Text from the evidence cannot break the SVG or end a Mermaid statement."""
    timeline = [_mark(0.1, "experiment", "odd <b>&amp; text; #1")]
    figure = figures.sequence([], timeline)
    document = drawing.svg(figure, "title <&>", "caption & <more>")
    root = ET.fromstring(document.encode())  # noqa: S314 - the build's own output
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "odd <b>&amp; text; #1" in texts and "title <&>" in texts
    diagram = figures.mermaid(figure)
    assert "Note over E: 0.100 s · odd #lt;b#gt;&amp#59; text#59; #35;1" in diagram
    assert diagram.count("\n") == len(figure.lanes) + len(figure.steps) + 1


def test_figures_without_a_history_are_not_drawn() -> None:
    """Only experiments with events get a figure; names follow parameters and chapters."""
    tests: list[dict[str, Any]] = [
        {"nodeid": "experiments/a/t.py::test_x[p/q]", "chapter": "a", "experiment": "test_x",
         "events": [_event(0, "created", 0)]},
        {"nodeid": "experiments/b/t.py::test_x", "chapter": "b", "experiment": "test_x",
         "events": [_event(0, "created", 0)]},
        {"nodeid": "experiments/b/t.py::test_y", "chapter": "b", "experiment": "test_y",
         "events": []},
    ]
    assert builder.figure_names(tests) == {
        "experiments/a/t.py::test_x[p/q]": "a--test_x--p_q",
        "experiments/b/t.py::test_x": "b--test_x",
    }


def test_cli_rejects_an_unreadable_public_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --public-key that is not a PEM key (or not a file) is a one-line input error."""
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    argv = ["book", "build", "--evidence", str(tmp_path), "--out", str(tmp_path / "b"),
            "--public-key", str(bad)]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith(
        f"lab book build: --public-key {bad}: not a PEM public key"
    )
    argv[-1] = "/dev/zero"
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "lab book build: --public-key /dev/zero: a device, not a regular file\n"
    )


# --------------------------------------------------------------------------- hostile evidence
#
# Pure: a small committed tree and its evidence, compiled and signed without a
# database, then forged (edited and re-signed with a fresh key) the way issue 14's
# attacker did. Verify accepts these forgeries as UNPINNED integrity-only evidence,
# so the book itself must be safe with whatever text and names they carry.

SMALL_NODE = "experiments/ch01_x/test_a.py::test_a"


def _small_records(nodeid: str) -> list[dict[str, Any]]:
    props: list[Any] = [
        ["lab_claim", "A claim."],
        ["lab_needs_database", True],
        ["lab_database", True],
        ["lab_observation", {"state": "succeeded"}],
        ["lab_observation_kinds", {"state": "fact"}],
        ["lab_events", [
            {"t": 0.01, "workflow": "w1", "kind": "created", "fence": 0,
             "detail": "plan_version=1"},
            {"t": 0.02, "workflow": "w1", "kind": "approved", "fence": 0, "detail": "by=m"},
        ]],
        ["lab_timeline", [{"t": 0.0, "actor": "experiment", "what": "started"}]],
    ]
    return [
        {"$report_type": "TestReport", "nodeid": nodeid, "when": when, "outcome": "passed",
         "duration": 0.01, "longrepr": None, "user_properties": props}
        for when in ("setup", "call", "teardown")
    ]


@pytest.fixture
def small(tmp_path: Path) -> tuple[Path, Path]:
    """``(tree, evidence)``: a committed tree and the genuine PASS evidence of its run."""
    root = tmp_path / "tree"
    (root / "lab").mkdir(parents=True)
    (root / "lab" / "core.py").write_text("VALUE = 1\n")
    (root / "experiments" / "ch01_x").mkdir(parents=True)
    (root / "experiments" / "ch01_x" / "test_a.py").write_text("def test_a(): pass\n")
    labtree.write_manifest(root, [{"chapter": "ch01_x", "name": "test_a", "results": 1,
                                   "database": None}])
    (root / "lab" / "__init__.py").write_text("")
    (root / "pyproject.toml").write_text("[project]\n")
    labtree.git(root, "init", "-q")
    labtree.git(root, "add", "-A")
    labtree.git(root, "commit", "-q", "-m", "tree")
    facts = compiler.RunFacts(**labtree.seed_facts({
        "records": _small_records(SMALL_NODE),
        "collected": [SMALL_NODE],
        "experiments_prefix": "experiments/",
        "expected": [compiler.Expected("ch01_x", "test_a")],
        "database": {"provider": "dsn", "server_version": "15.8", "details": {}},
        "command": ["pytest", "experiments"],
        "exitstatus": 0,
        "git": None,
    }))
    directory = tmp_path / "evidence"
    report = compiler.write(directory, facts, root=root, signer=dsse.load_signer({}))
    assert report["status"] == gate.PASS and report["dirty"] is False, report["gate"]
    return root, directory


def _rename(root: Path, directory: Path, chapter: str, name: str, param: str) -> None:
    """Re-sign the evidence with the experiment renamed; the tree's manifest agrees, so
    only the book stands between the names and the file system."""
    nodeid = f"experiments/{chapter}/test_a.py::{name}[{param}]"
    renamed = {"chapter": chapter, "name": name, "results": 1, "database": None}
    labtree.write_manifest(root, [renamed])

    def change(data: dict[str, Any]) -> None:
        for test in data["tests"]:
            if test["nodeid"] == SMALL_NODE:
                test.update(nodeid=nodeid, chapter=chapter, experiment=name)
        for row in data["experiments"]:
            if row["tests"] == [SMALL_NODE]:
                row.update(chapter=chapter, name=name, tests=[nodeid])
        for item in data["observations"]:
            if item["nodeid"] == SMALL_NODE:
                item["nodeid"] = nodeid
        data["expected"] = [
            e if (e["chapter"], e["name"]) != ("ch01_x", "test_a") else renamed
            for e in data["expected"]
        ]
        # The rows in the order the verifier folds tests.jsonl to (by node id), and the
        # tree id the tree's files make now that its manifest names the new experiment.
        data["tests"].sort(key=lambda test: test["nodeid"])
        data["sources"] = compiler.source_digests(root)
        data["tree"] = source_tree.tracked(root).tree
        data["selection"]["manifest"]["sha256"] = data["sources"]["experiments/manifest.json"]

    def record(line: dict[str, Any]) -> None:
        if line.get("nodeid") == SMALL_NODE:
            line["nodeid"] = nodeid

    resign(directory, change, record=record)


def _everything_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*")}


def test_names_from_evidence_cannot_write_outside_out(
    small: tuple[Path, Path], tmp_path: Path
) -> None:
    """Issue 14, attack 4: an experiment named with ``../`` segments in signed evidence
    becomes a safe file name; the build writes nothing outside ``--out``."""
    root, directory = small
    up = "../" * 12
    _rename(root, directory, "..", f"test/{up}escaped", f"{up}tmp/escaped-param")
    out = tmp_path / "deep" / "er" / "book"
    before = _everything_under(tmp_path)
    written = builder.build(directory, out, root=root)
    created = _everything_under(tmp_path) - before - set(out.parents)
    assert created and all(p == out or p.is_relative_to(out) for p in created), sorted(created)
    figure = [name for name in written if name.startswith("figures/")]
    assert len(figure) == 1
    assert re.fullmatch(r"figures/test_(\.\._){12}escaped--_(\.\._){11}tmp_escaped-param\.svg",
                        figure[0]), figure
    assert all("/" not in name.removeprefix("figures/").removeprefix("evidence/")
               for name in written)


def test_a_symlink_inside_out_cannot_lead_outside(
    small: tuple[Path, Path], tmp_path: Path
) -> None:
    """A ``figures`` symlink planted in ``--out`` is refused before anything is written."""
    root, directory = small
    out, elsewhere = tmp_path / "book", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "figures").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(builder.Refused, match="would be written outside --out"):
        builder.build(directory, out, root=root)
    assert list(elsewhere.iterdir()) == []
    assert not (out / builder.INDEX_FILE).exists()


def test_evidence_text_is_escaped_in_markdown(small: tuple[Path, Path], tmp_path: Path) -> None:
    """Issue 14, attack 4: ``commit``, ``run_url``, names, claims and observations with
    markup reach every page's Markdown and HTML inert."""
    root, directory = small
    script, image = "<script>alert(1)</script>", "<img src=x onerror=alert(1)>"

    def change(data: dict[str, Any]) -> None:
        data["commit"] = f"`{script}"
        data["run_url"] = f"https://ci.example/run/1{image}"
        data["command"] = ["pytest", image]
        data["postgresql"]["provider"] = script
        data["postgresql"]["server_version"] = image
        data["versions"]["pytest"] = script
        for test in data["tests"]:
            if test["nodeid"] == SMALL_NODE:
                test["claim"] = claim
                test["observations"] = [observation]
                test["observation_kinds"] = [kinds]
        # The experiment's claim is its first test's and each observation has a row of its
        # own: the rows say what the forged records fold to.
        for row in data["experiments"]:
            if row["tests"] == [SMALL_NODE]:
                row["claim"] = claim
        for item in data["observations"]:
            if item["nodeid"] == SMALL_NODE:
                item.update(observation=observation, kinds=kinds)
        data["limits"] = [script]

    # Every row must be what the signed tests.jsonl folds to (the verifier rebuilds them),
    # so the forged claim and observation go into pytest's records too; a trace id the
    # compiler would never write (it keeps only id-shaped ones) is refused by verify. The
    # one claim carries a link and the pipes that would add table cells.
    claim = f"[click](javascript:alert(1)) | {image} |"
    observation = {"html": script, "md": "![x](http://evil/x.png)"}
    kinds = {"html": "fact", "md": "fact"}

    def record(line: dict[str, Any]) -> None:
        if line.get("nodeid") == SMALL_NODE:
            kept = [p for p in line.get("user_properties") or []
                    if p[0] not in ("lab_claim", "lab_observation", "lab_observation_kinds")]
            line["user_properties"] = [["lab_claim", claim], ["lab_observation", observation],
                                       ["lab_observation_kinds", kinds], *kept]

    resign(directory, change, record=record)
    out = tmp_path / "book"
    builder.build(directory, out, root=root)
    markdown = _markdown(out)
    for raw in ("<script", "<img", "[click](", "![x](http"):
        assert raw not in markdown, raw
    assert "- Commit: \\`&lt;script&gt;alert(1)&lt;/script&gt; (clean working tree)." in markdown
    assert "- Run: https://ci.example/run/1&lt;img src=x onerror=alert(1)&gt;" in markdown
    # The test's claim is shown where its figure is drawn (the page shows the experiment's
    # claim once): there, too, it is text.
    figure = next((out / "figures").glob("*.svg")).read_text()
    assert "[click](javascript:alert(1)) | &lt;img src=x onerror=alert(1)&gt; |" in figure
    row = next(line for line in markdown.splitlines() if '<a href="#x-test_a">' in line)
    assert row.count("<td") == 4  # the claim's markup cannot add cells
    assert "&#124; &lt;img src=x onerror=alert(1)&gt; &#124;" in row
    for page in sorted(out.glob("*.html")):
        html = page.read_text()
        for raw in ("<script", "<img src=x", 'href="javascript:', 'src="http'):
            assert raw not in html, (page.name, raw)


def _reproduce_into(directory: Path, signer: dsse.Signer) -> None:
    """``directory/reproduction/``: a signed reproduction of the run in ``directory``,
    every fact the same, signed by ``signer``."""
    report = json.loads((directory / compiler.REPORT_FILE).read_text())
    digest = hashlib.sha256((directory / compiler.ENVELOPE_FILE).read_bytes()).hexdigest()
    record = {
        "schema_version": 1, "reproduced_at_utc": "2026-12-01T16:00:00Z",
        "inputs": [{"name": "original runtime.intoto.json", "digest": {"sha256": digest}}],
        "original": {"envelope_sha256": digest, "commit": report["commit"], "status": "PASS"},
        "runs": [{"evidence": "runs/run-1", "envelope_sha256": "b" * 64, "status": "PASS",
                  "wall_s": 1.0}],
        "comparison": reproduction.to_json(reproduction.compare(report, [report])),
        "wall_s": 1.5,
    }
    target = directory / reproduction_evidence.BOOK_DIR
    shutil.rmtree(target, ignore_errors=True)
    reproduction_evidence.write(target, record, signer)


def test_the_book_shows_a_reproduction_only_by_an_independent_trusted_key(
    small: tuple[Path, Path], tmp_path: Path, make_key: Callable[[str], KeyFiles]
) -> None:
    """Issue 42, class 5 (d): a reproduction signed by the original's own key is shown
    as not independent, without the table; one no trusted key signed as not pinned;
    one by a second trusted key gets the section, naming the reproducer's key file and
    fingerprint, even when the original is pinned by --public-key."""
    root, directory = small
    author, reproducer, stranger = make_key("author"), make_key("reproducer"), make_key("x")
    resign(directory, lambda data: None, signer=dsse.Signer(author.private, "key_file"))
    trusted = [trust.TrustedKey(author.public, "keys/trusted/author.pub.pem at 0123abcd"),
               trust.TrustedKey(reproducer.public,
                                "keys/trusted/reproducer.pub.pem at 0123abcd")]
    out = tmp_path / "book"

    _reproduce_into(directory, dsse.Signer(author.private, "key_file"))
    builder.build(directory, out, trusted=trusted, root=root)
    markdown = _markdown(out)
    assert "**Not independent**: this run's reproduction is not shown: not independent: " \
        "it is signed by the original run's own key" in markdown
    assert "Reproduced" not in markdown
    assert not (out / "evidence" / "reproduction").exists()

    # An untrusted key that claims to be a publication key is refused outright; one
    # that claims nothing (ephemeral) verifies, and is withheld as not pinned.
    _reproduce_into(directory, dsse.Signer(stranger.private, "key_file"))
    with pytest.raises(builder.Refused, match=r"reproduction: signer: UNPINNED key"):
        builder.build(directory, out, trusted=trusted, root=root)
    _reproduce_into(directory, dsse.Signer(stranger.private, "ephemeral"))
    builder.build(directory, out, trusted=trusted, root=root)
    markdown = _markdown(out)
    assert "**Not pinned**: this run's reproduction is not shown: not pinned: its signer" \
        in markdown and "Reproduced" not in markdown

    by = dsse.Signer(reproducer.private, "key_file")
    _reproduce_into(directory, by)
    for pin in ({"trusted": trusted}, {"public_key": author.public, "trusted": trusted[1:]}):
        builder.build(directory, out, root=root, **pin)  # type: ignore[arg-type]
        markdown = _markdown(out)
        assert (f"Reproduced independently by `keys/trusted/reproducer.pub.pem at 0123abcd, "
                f"key {by.keyid}` on 2026-12-01, 27 of 27 experiments identical") in markdown
        assert (out / "evidence" / "reproduction" / "reproduction.json").is_file()
        assert "Not independent" not in markdown


def test_a_forged_publication_key_is_not_called_one(
    small: tuple[Path, Path], tmp_path: Path, make_key: Callable[[str], KeyFiles]
) -> None:
    """Issue 14, attack 3: re-signed with a fresh key that claims ``key_file``, the book
    refuses; pinned, it calls the key a publication key and names the pin."""
    root, directory = small
    key = make_key("publication")
    resign(directory, lambda data: None, key_source="key_file")
    with pytest.raises(builder.Refused, match=r"UNPINNED key .* presented as a publication key"):
        builder.build(directory, tmp_path / "refused", root=root)
    assert not (tmp_path / "refused").exists()

    resign(directory, lambda data: None, signer=dsse.Signer(key.private, "key_file"))
    out = tmp_path / "book"
    builder.build(directory, out, public_key=key.public, root=root)
    markdown = _markdown(out)
    assert "a publication key, pinned by `--public-key`" in markdown
    trusted = [trust.TrustedKey(key.public, "keys/trusted/ci.pub.pem")]
    builder.build(directory, out, trusted=trusted, root=root)
    assert "pinned by `keys/trusted/ci.pub.pem`" in _markdown(out)

    # Signed by an ephemeral key but claiming nothing: built, and never a publication key.
    resign(directory, lambda data: None, key_source="ephemeral")
    builder.build(directory, out, root=root)
    markdown = _markdown(out)
    assert "publication key" not in markdown
    assert "with the public key the evidence carries (UNPINNED: integrity" in markdown


def test_dirty_evidence_is_refused(
    small: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run on a tree with uncommitted changes verifies (saying DIRTY) but is never
    published."""
    root, _ = small
    (root / "scratch.txt").write_text("uncommitted\n")
    facts = compiler.RunFacts(**labtree.seed_facts({
        "records": _small_records(SMALL_NODE), "collected": [SMALL_NODE],
        "experiments_prefix": "experiments/", "expected": [compiler.Expected("ch01_x", "test_a")],
        "database": {"provider": "dsn", "server_version": "15.8", "details": {}},
        "command": ["pytest"], "exitstatus": 0, "git": None,
    }))
    directory = tmp_path / "dirty-evidence"
    assert compiler.write(directory, facts, root=root, signer=dsse.load_signer({}))["dirty"]
    monkeypatch.chdir(root)
    cli.main(["evidence", "verify", str(directory), "--check-sources"])
    assert "(DIRTY tree)" in capsys.readouterr().out.splitlines()[0]
    out = tmp_path / "book"
    line = _refused(capsys, _build_args(directory, out), out)
    assert "uncommitted changes" in line


@pytest.mark.parametrize(
    ("change", "field"),
    [
        pytest.param(lambda r: r.update(skips=["x"]), "skips/0", id="skips-strings"),
        pytest.param(lambda r: r.update(experiments=["x"]), "experiments/0", id="rows-strings"),
        pytest.param(lambda r: r["tests"][0].pop("nodeid"), "tests/0", id="test-without-nodeid"),
    ],
)
def test_malformed_signed_reports_are_refused_in_one_line(
    small: tuple[Path, Path], refuse: Refuse, change: Callable[[dict[str, Any]], None], field: str
) -> None:
    """Validly signed, wrong shape: refused naming the field, no traceback."""
    root, directory = small
    resign(directory, change)
    line = refuse(root, directory)
    assert f"report: not a valid report: {field}" in line


def test_device_as_model_report_is_refused(
    small: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """/dev/zero as the model report: one line naming it, exit 1, no book, no MemoryError."""
    root, directory = small
    (directory / model_chapter.MODEL_DIR).mkdir()
    report = directory / model_chapter.MODEL_DIR / signed.REPORT_FILE
    report.symlink_to("/dev/zero")
    monkeypatch.chdir(root)
    out = tmp_path / "book"
    assert cli.main(_build_args(directory, out)) == 1
    captured = capsys.readouterr()
    assert captured.err == (
        f"lab book build: refused: {directory.resolve() / model_chapter.MODEL_DIR / report.name}: "
        "a symbolic link in the model evidence\n"
    )
    assert not out.exists()


def test_small_evidence_builds(small: tuple[Path, Path], tmp_path: Path) -> None:
    """The genuine small run builds: the control for every forgery above."""
    root, directory = small
    written = builder.build(directory, tmp_path / "book", root=root)
    assert "figures/test_a.svg" in written and "evidence/tests.jsonl" in written
