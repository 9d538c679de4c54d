"""Provenance: where each loaded module came from, as the gate reads it."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import _pytest.main
import pytest

from lab.evidence import provenance
from tests.support import labtree


def test_installed_plugin_inside_the_tree_is_named_by_its_distribution() -> None:
    """A virtualenv inside the tree (.venv/) holds installed code, not the tree's sources:
    its modules are named by their distribution, never by a path in the tree."""
    file = Path(_pytest.main.__file__)
    root = file.parents[3]  # a "tree" that contains site-packages, like a .venv inside it
    loaded = [provenance.Loaded("plugin", "_pytest.main", "_pytest.main", str(file))]
    described = provenance.describe(
        loaded, root=root, sources={}, lab_file=None, inifile=None, environ={}
    )
    (entry,) = described["modules"]
    version = importlib.metadata.version("pytest")
    assert entry["distribution"] == f"pytest=={version}"
    assert entry["path"] is None
    assert f"pytest=={version}" in described["distributions"]


def test_module_outside_any_distribution_keeps_its_path(tmp_path: Path) -> None:
    """A module file no distribution's RECORD lists keeps its absolute path and digest."""
    module = tmp_path / "stray_plugin.py"
    module.write_text("X = 1\n")
    loaded = [provenance.Loaded("plugin", "stray_plugin", "stray_plugin", str(module))]
    root = tmp_path / "tree"
    root.mkdir()
    described = provenance.describe(
        loaded, root=root, sources={}, lab_file=str(module), inifile=None, environ={}
    )
    (entry,) = described["modules"]
    assert entry["path"] == str(module.resolve())
    assert entry["distribution"] is None and entry["stdlib"] is False
    assert entry["sha256"] == provenance.sha256_file(module)
    assert described["lab"] == str(module.resolve())


@pytest.mark.parametrize("name", ["json", "types"])
def test_standard_library_modules_are_marked(name: str) -> None:
    """A plugin object whose class comes from the standard library is not a stray file."""
    module = __import__(name)
    loaded = [provenance.Loaded("plugin", name, name, module.__file__)]
    described = provenance.describe(
        loaded, root=Path.cwd(), sources={}, lab_file=None, inifile=None, environ={}
    )
    assert described["modules"][0]["stdlib"] is True


def test_the_standard_library_is_the_base_interpreters_not_the_venvs() -> None:
    """Inside a venv ``sysconfig`` puts ``platstdlib`` under the venv's prefix; a file
    there (outside site-packages) is no standard library, while the base interpreter's
    extension modules and zip are."""
    import _json  # an extension module of the base interpreter's lib-dynload

    assert sys.prefix != sys.base_prefix, "the lab's tests run in its venv"
    venv_lib = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert not provenance.is_stdlib((venv_lib / "planted.py").resolve())
    assert provenance.is_stdlib(Path(_json.__file__).resolve())
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    zipped = Path(sys.base_prefix) / "lib" / f"python{version}.zip"
    assert provenance.is_stdlib((zipped / "json" / "__init__.py").resolve())


def test_effective_arguments_and_environment_are_redacted(tmp_path: Path) -> None:
    """A DSN given through PYTEST_ADDOPTS or ini addopts never reaches the report."""
    from lab.evidence import compiler

    root = tmp_path / "repo"
    (root / "experiments").mkdir(parents=True)
    (root / "experiments" / "manifest.json").write_text("{}\n")
    dsn = "postgresql://lab:hunter7secret@127.0.0.1/db"
    environ = {"PYTEST_ADDOPTS": f"--lab-dsn={dsn} -q", "PYTHONPATH": "/opt/x"}
    values = labtree.seed_facts({
        "records": [], "collected": [], "experiments_prefix": "experiments/", "expected": [],
        "database": None, "command": ["pytest"],
        "arguments": {"command_line": ["--lab-dsn", dsn], "environment": [f"--lab-dsn={dsn}"],
                      "ini": ["--lab-dsn", dsn]},
    })
    report = compiler.compile_report(
        compiler.RunFacts(**values), root=root, signing={}, environ=environ
    )
    text = json.dumps(report)
    assert "hunter7secret" not in text
    assert report["selection"]["arguments"]["environment"] == ["--lab-dsn=<redacted>"]
    assert report["selection"]["arguments"]["ini"] == ["--lab-dsn", "<redacted>"]
    assert report["provenance"]["environment"]["PYTEST_ADDOPTS"] == "--lab-dsn=<redacted> -q"
    assert report["provenance"]["environment"]["PYTHONPATH"] == "/opt/x"



def test_installed_file_edited_in_place_is_not_vouched_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distribution vouches for its module only while the file matches its RECORD
    digest: edited in place, the module is reported by path and the gate fails it."""
    import base64
    import hashlib

    from lab.evidence import gate

    site = tmp_path / "site"
    info = site / "fakeplug-1.0.dist-info"
    info.mkdir(parents=True)
    module = site / "fakeplug.py"
    module.write_text("X = 1\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(module.read_bytes()).digest())
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplug\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("fakeplug\n")
    (info / "RECORD").write_text(
        f"fakeplug.py,sha256={digest.rstrip(b'=').decode()},{module.stat().st_size}\n"
        "fakeplug-1.0.dist-info/METADATA,,\nfakeplug-1.0.dist-info/RECORD,,\n"
    )
    monkeypatch.syspath_prepend(str(site))
    provenance._owners.cache_clear()
    try:
        assert provenance.owning_distribution("fakeplug", module.resolve()) == "fakeplug==1.0"
        module.write_text("X = 2  # edited in place\n")
        assert provenance.owning_distribution("fakeplug", module.resolve()) is None
        loaded = [provenance.Loaded("plugin", "fakeplug", "fakeplug", str(module))]
        described = provenance.describe(
            loaded, root=tmp_path / "tree", sources={}, lab_file=None, inifile=None,
            environ={},
        )
    finally:
        provenance._owners.cache_clear()
    report = {"sources": {}, "provenance": described, "commit": "c", "dirty": False}
    failures = gate._provenance_failures(report)
    assert f"plugin fakeplug ({module.resolve()}) was loaded from outside the hashed sources" \
        in failures


def test_a_forged_plain_pyc_beside_a_hashed_source_is_named(tmp_path: Path) -> None:
    """Worker and tool processes are plain interpreters that report nothing: a pyc whose
    header matches a hashed source but whose code is other is named wherever it sits."""
    import importlib.util
    import os
    import py_compile

    root = tmp_path / "tree"
    (root / "pkg").mkdir(parents=True)
    source = root / "pkg" / "mod.py"
    source.write_text("VALUE = 1\n")
    payload = tmp_path / "payload.py"
    payload.write_text("VALUE = 2\n")  # the same size as the source
    pyc = Path(importlib.util.cache_from_source(str(source)))
    py_compile.compile(str(payload), cfile=str(pyc), doraise=True)
    stat = source.stat()
    os.utime(payload, (stat.st_atime, stat.st_mtime))
    py_compile.compile(str(payload), cfile=str(pyc), doraise=True)
    sources = {"pkg/mod.py": provenance.sha256_file(source) or ""}
    found = provenance.vouch([], [], root=root, sources=sources)["unvouched"]
    assert [u["module"] for u in found] == ["pkg/mod.py"]
    assert "not compiled from its source" in found[0]["reason"]
    py_compile.compile(str(source), cfile=str(pyc), doraise=True)  # the honest pyc
    assert provenance.vouch([], [], root=root, sources=sources)["unvouched"] == []
