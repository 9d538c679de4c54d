"""The manifest tooling: exact counts, kept flags, readable diffs, and collection without a
database."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab import errors
from lab.evidence import gate, manifest
from lab.evidence.manifest import Entry, Manifest

CHAPTER = '''
import pytest


@pytest.mark.parametrize("n", [1, 2])
def test_two(n):
    """Two results."""
    assert n


def test_one():
    """One result."""
'''


def test_count_problem_is_exact_in_both_directions():
    assert gate.count_problem("ch/t", 2, 2) is None
    assert gate.count_problem("ch/t", 1, 4) == "ch/t produced 4 results but declares 1"
    assert gate.count_problem("ch/t", 3, 2) == "ch/t produced 2 of 3 results"


def test_differences_name_each_undeclared_absent_and_miscounted_experiment():
    declared = [Entry("ch1", "test_a", 1), Entry("ch1", "test_gone", 1), Entry("ch2", "test_b", 2)]
    found = {("ch1", "test_a"): 1, ("ch2", "test_b"): 3, ("ch3", "test_new"): 1}
    assert manifest.differences(declared, found) == [
        "ch1/test_gone is declared in the manifest but was not collected",
        "ch2/test_b produced 3 results but declares 2",
        "ch3/test_new is not declared in the manifest (1 collected)",
    ]
    assert manifest.differences(declared[:1], {("ch1", "test_a"): 1}) == []


def test_sync_keeps_seed_and_database_and_follows_collection_order():
    current = Manifest("about", (
        Entry("ch1", "test_a", 1, seed=True, database=False),
        Entry("ch1", "test_gone", 1, seed=True),
    ))
    found = {("ch0", "test_new"): 2, ("ch1", "test_a"): 3}
    assert manifest.synced(current, found) == Manifest("about", (
        Entry("ch0", "test_new", 2),
        Entry("ch1", "test_a", 3, seed=True, database=False),
    ))


def test_render_is_one_line_per_entry_and_parses_back():
    value = Manifest("about", (Entry("ch1", "test_a", 2, seed=True), Entry("ch2", "test_b")))
    text = manifest.render(value)
    assert manifest.parse(text) == value
    assert '    {"chapter": "ch1", "name": "test_a", "results": 2, "seed": true},' in text


def test_the_repository_manifest_is_in_its_rendered_form():
    path = Path(__file__).resolve().parents[2] / "experiments" / "manifest.json"
    text = path.read_text(encoding="utf-8")
    assert manifest.render(manifest.parse(text)) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[]", "'experiments' list"),
        ('{"experiments": [], "extra": 1}', "unknown keys"),
        ('{"experiments": [{"chapter": "c", "name": "x"}]}', "bad name"),
        ('{"experiments": [{"chapter": "c", "name": "test_x", "results": 0}]}', "positive"),
        ('{"experiments": [{"chapter": "c", "name": "test_x", "results": true}]}', "positive"),
        ('{"experiments": [{"chapter": "c", "name": "test_x", "seed": "yes"}]}', "seed"),
        ('{"experiments": [{"chapter": "c", "name": "test_x", "colour": 1}]}', "unknown keys"),
        ('{"experiments": [{"chapter": "c", "name": "test_x"}, {"chapter": "c", '
         '"name": "test_x"}]}', "declared twice"),
    ],
)
def test_malformed_manifests_are_refused_with_one_line(text, message):
    with pytest.raises(errors.InputError, match=message):
        manifest.parse(text)


def test_an_oversized_manifest_is_refused_before_parsing(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_bytes(b" " * (manifest.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(errors.InputError, match=r"over the \d+-byte limit"):
        manifest.load(path)


def _lab(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lab.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)


def test_sync_then_check_on_a_new_chapter_without_a_database(tmp_path):
    """sync writes exact counts and prints the diff; check then passes; a later change to the
    parameters makes check fail naming the experiment, and leaves the file alone."""
    chapter = tmp_path / "experiments" / "ch01_new"
    chapter.mkdir(parents=True)
    (chapter / "test_new.py").write_text(CHAPTER, encoding="utf-8")
    synced = _lab("manifest", "sync", cwd=tmp_path)
    assert synced.returncode == 0, synced.stderr
    assert '+    {"chapter": "ch01_new", "name": "test_two", "results": 2, "seed": false},' \
        in synced.stdout
    written = json.loads((tmp_path / "experiments" / "manifest.json").read_text())
    assert [(e["name"], e["results"]) for e in written["experiments"]] == [
        ("test_two", 2), ("test_one", 1)
    ]
    assert _lab("manifest", "check", cwd=tmp_path).returncode == 0
    assert not (tmp_path / "evidence").exists(), "collection wrote evidence"
    before = (tmp_path / "experiments" / "manifest.json").read_text()
    (chapter / "test_new.py").write_text(CHAPTER.replace("[1, 2]", "[1, 2, 3]"))
    checked = _lab("manifest", "check", cwd=tmp_path)
    assert checked.returncode == 1
    assert "ch01_new/test_two produced 3 results but declares 2" in checked.stdout
    assert (tmp_path / "experiments" / "manifest.json").read_text() == before


def test_a_collection_error_is_bad_input_naming_pytest_s_message(tmp_path):
    chapter = tmp_path / "experiments" / "ch01_broken"
    chapter.mkdir(parents=True)
    (chapter / "test_broken.py").write_text("import no_such_module_xyz\n")
    result = _lab("manifest", "check", cwd=tmp_path)
    assert result.returncode == 2
    assert "collecting" in result.stderr and "no_such_module_xyz" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
