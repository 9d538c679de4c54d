"""lab.evidence.environment: the installed set against uv.lock, on a real site-packages directory.

Each test lays out a small site-packages in tmp_path the way an installer does (a
``*.dist-info`` with METADATA and a RECORD of sha256 digests), writes a tiny ``uv.lock``,
and checks it with the same code a run uses; no database is needed.
"""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from lab import errors
from lab.evidence import environment

ROOT = Path(__file__).resolve().parents[2]

LOCK = """\
version = 1
revision = 3
requires-python = ">=3.11"

[[package]]
name = "demo-pkg"
version = "1.0"
source = { registry = "https://pypi.org/simple" }
wheels = [{ url = "https://example.invalid/demo_pkg-1.0-py3-none-any.whl", hash = "sha256:00" }]

[[package]]
name = "forked"
version = "2.0"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "forked"
version = "2.1"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "durable-agent-lab"
version = "0.1.0"
source = { editable = "." }
"""


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


def install(site: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """Lay out ``name`` as an installer would: its files, METADATA and a hashed RECORD."""
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    (dist_info / "METADATA").write_bytes(metadata)
    rows = [f"{dist_info.name}/METADATA,{_record_hash(metadata)},{len(metadata)}"]
    for relative, data in files.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        rows.append(f"{relative},{_record_hash(data)},{len(data)}")
    # Bytecode and RECORD itself are listed without a hash, as pip and uv write them.
    module = next(iter(files), "x.py").split("/")[0]
    rows.append(f"{module}/__pycache__/__init__.cpython-311.pyc,,")
    rows.append(f"{dist_info.name}/RECORD,,")
    (dist_info / "RECORD").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return dist_info


@pytest.fixture
def lock(tmp_path: Path) -> Path:
    path = tmp_path / "uv.lock"
    path.write_text(LOCK, encoding="utf-8")
    return path


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A site-packages with demo-pkg 1.0 (locked) and the lab's own editable install."""
    site = tmp_path / "site-packages"
    install(site, "demo-pkg", "1.0", {"demo_pkg/__init__.py": b"VALUE = 1\n",
                                      "demo_pkg/data.txt": b"data\n"})
    install(site, "durable-agent-lab", "0.1.0", {"__editable__.lab.pth": b"/src\n"})
    return site


def test_an_environment_that_is_the_lock_matches(lock: Path, site: Path) -> None:
    """Every installed distribution locked at its version, every file as RECORD says."""
    result = environment.check(lock, [site])
    assert result.matches, result.differences
    assert result.differences == ()
    assert result.checked_distributions == 2
    assert result.lock_sha256 == hashlib.sha256(lock.read_bytes()).hexdigest()
    assert result.to_json() == {
        "lock_sha256": result.lock_sha256, "matches": True, "differences": [],
        "checked_distributions": 2,
    }


def test_one_edited_file_is_named(lock: Path, site: Path) -> None:
    """A file edited after the install differs from its RECORD hash, by distribution and path."""
    (site / "demo_pkg" / "__init__.py").write_bytes(b"VALUE = 2\n")
    result = environment.check(lock, [site])
    assert not result.matches
    assert result.differences == ("demo-pkg 1.0: demo_pkg/__init__.py differs from RECORD",)


def test_a_deleted_file_is_named(lock: Path, site: Path) -> None:
    """A file RECORD lists that is gone is a difference too."""
    (site / "demo_pkg" / "data.txt").unlink()
    assert environment.check(lock, [site]).differences == (
        "demo-pkg 1.0: demo_pkg/data.txt is missing (listed in RECORD)",
    )


def test_a_version_the_lock_does_not_pin_differs(lock: Path, tmp_path: Path) -> None:
    """An installed version other than the locked one is named with the locked versions."""
    site = tmp_path / "other-site"
    install(site, "demo-pkg", "0.9", {"demo_pkg/__init__.py": b"VALUE = 0\n"})
    install(site, "Forked", "1.9", {"forked/__init__.py": b""})
    result = environment.check(lock, [site])
    # Metadata directories are visited in sorted order: "Forked-…" before "demo_pkg-…".
    assert result.differences == ("Forked 1.9 locked as 2.0 or 2.1", "demo-pkg 0.9 locked as 1.0")


def test_an_extra_distribution_differs(lock: Path, site: Path) -> None:
    """A distribution the lock does not know is an extra one, by name and version."""
    install(site, "stray", "1.2", {"stray/__init__.py": b""})
    result = environment.check(lock, [site])
    assert result.differences == ("extra distribution stray 1.2 not in the lock",)


def test_the_first_of_a_name_on_the_path_is_the_one_checked(lock: Path, site: Path,
                                                            tmp_path: Path) -> None:
    """A shadowed copy later on the search path is not what imports load: not checked."""
    later = tmp_path / "later"
    install(later, "demo-pkg", "0.1", {"demo_pkg/__init__.py": b""})
    result = environment.check(lock, [site, later, tmp_path / "absent"])
    assert result.matches and result.checked_distributions == 2


def test_differences_are_capped(lock: Path, site: Path) -> None:
    """The first differences are listed, then how many more there were."""
    for index in range(3):
        install(site, f"stray{index}", "1", {f"stray{index}/__init__.py": b""})
    result = environment.check(lock, [site], max_differences=2)
    assert result.differences == (
        "extra distribution stray0 1 not in the lock",
        "extra distribution stray1 1 not in the lock",
        "... and 1 more differences",
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"version = [", "not TOML"),
        (b"\xff\xfe", "not TOML"),
        (b"version = 1\n", "no [[package]] entries"),
        (b'[[package]]\nname = "a"\n', "package a has no version"),
        (b"[[package]]\nversion = '1'\n", "package 1 has no name"),
    ],
)
def test_a_bad_lock_is_one_line_input_error(tmp_path: Path, site: Path, content: bytes,
                                            message: str) -> None:
    """A lock that is not a uv lock raises InputError naming the file and the fault."""
    path = tmp_path / "uv.lock"
    path.write_bytes(content)
    with pytest.raises(errors.InputError) as raised:
        environment.check(path, [site])
    text = str(raised.value)
    assert text.startswith(f"lock file {path}: ") and message in text and "\n" not in text


def test_the_command_exits_0_1_and_2(lock: Path, site: Path, tmp_path: Path) -> None:
    """python -m lab.evidence.environment: 0 and JSON when it matches, 1 when it differs, 2 and
    one line without a traceback when the lock cannot be read."""
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lab.evidence.environment", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, check=False)

    matching = run("--lock", str(lock), "--path", str(site))
    assert matching.returncode == 0 and '"matches": true' in matching.stdout
    (site / "demo_pkg" / "data.txt").write_bytes(b"changed\n")
    differing = run("--lock", str(lock), "--path", str(site))
    assert differing.returncode == 1
    assert "demo_pkg/data.txt differs from RECORD" in differing.stdout
    absent = tmp_path / "nothing.lock"
    missing = run("--lock", str(absent), "--path", str(site))
    assert missing.returncode == 2
    assert missing.stderr == f"lab.evidence.environment: lock file {absent}: no such file\n"


def test_an_edited_dependency_fails_the_gate_and_shows_in_verify(lock: Path, site: Path) -> None:
    """Issue 26: one file of an installed distribution edited after the install makes the
    run's recorded environment differ from the lock; the gate fails it by name and the
    verifier's first line says the environment differs."""
    from lab.evidence import gate, verification

    clean = environment.check(lock, [site]).to_json()
    assert gate.environment_failures(clean) == []
    assert "environment = uv.lock" in verification.environment_note({"environment": clean})
    (site / "demo_pkg" / "data.txt").write_bytes(b"payload\n")
    edited = environment.check(lock, [site]).to_json()
    assert gate.environment_failures(edited) == [
        "environment: the installed set differs from uv.lock: "
        "demo-pkg 1.0: demo_pkg/data.txt differs from RECORD"
    ]
    assert verification.environment_note({"environment": edited}) == (
        "environment DIFFERS from uv.lock")
    assert gate.environment_failures(None) == []  # a checkout without a lock


def test_the_report_records_the_checkout_lock(tmp_path: Path) -> None:
    """The compiler records the environment only against the checkout's own uv.lock; an
    unreadable lock is recorded as a difference, never raised."""
    from lab.evidence import compiler

    assert compiler.installed_environment(tmp_path) is None
    (tmp_path / "uv.lock").write_bytes(b"\x00 not toml")
    recorded = compiler.installed_environment(tmp_path)
    assert recorded is not None and recorded["matches"] is False
    assert recorded["differences"] and "uv.lock" in recorded["differences"][0]


def _demo_wheel(directory: Path) -> Path:
    """A real wheel of demo-pkg 1.0, with its RECORD (what the lock's hash would name)."""
    dist_info = "demo_pkg-1.0.dist-info"
    members = {"demo_pkg/__init__.py": b"VALUE = 1\n",
               f"{dist_info}/METADATA": b"Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n",
               f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"}
    rows = []
    for name, data in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(data)}")
    record = "\n".join([*rows, f"{dist_info}/RECORD,,"]) + "\n"
    members[f"{dist_info}/RECORD"] = record.encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return wheel


def _hermetic_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                    install_into: Any) -> None:
    """The hermetic install's steps without uv or the index: the verified wheels are one
    demo wheel, and ``install_into(venv, wheel)`` plays the installer."""
    from lab import runner

    wheel = _demo_wheel(tmp_path / "wheels")
    monkeypatch.setattr(runner, "_uv", lambda _tree, _scratch: "uv")
    monkeypatch.setattr(runner, "locked_requirements",
                        lambda _uv, _tree, scratch: scratch / "requirements.txt")
    monkeypatch.setattr(runner, "fetch_wheels", lambda *_args: [wheel])
    monkeypatch.setattr(runner, "_install_locked",
                        lambda venv, _uv, _requirements, found: install_into(venv, found[0]))


def test_a_hermetic_venv_edited_after_its_build_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached hermetic venv is reused only while every file in it is one the lock's
    verified wheels install, with the wheel's digest: one edited in place is thrown away
    and installed again from the wheels."""
    from lab import runner

    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "uv.lock").write_text(LOCK, encoding="utf-8")
    cache = tmp_path / "hermetic"
    builds: list[Path] = []

    def unpack(venv: Path, wheel: Path) -> None:
        builds.append(venv)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(runner._site_packages(venv))

    _hermetic_steps(monkeypatch, tmp_path, unpack)
    site, _ = runner.install_environment(tree, cache, tmp_path)
    assert len(builds) == 1 and (site / "demo_pkg" / "__init__.py").is_file()
    assert runner.install_environment(tree, cache, tmp_path)[0] == site
    assert len(builds) == 1, "an intact venv is reused"
    with (site / "demo_pkg" / "__init__.py").open("a") as module:
        module.write("import os  # a payload\n")
    again, _ = runner.install_environment(tree, cache, tmp_path)
    assert len(builds) == 2, "the edited venv was reused"
    assert (again / "demo_pkg" / "__init__.py").read_bytes() == b"VALUE = 1\n"


def test_a_fresh_hermetic_build_that_differs_from_the_lock_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An install whose files are not its verified wheels' (a poisoned installer cache) is
    an environment failure naming the difference, and leaves no venv to reuse."""
    from lab import runner

    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "uv.lock").write_text(LOCK, encoding="utf-8")

    def poisoned(venv: Path, wheel: Path) -> None:
        site = runner._site_packages(venv)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
        (site / "demo_pkg" / "__init__.py").write_bytes(b"VALUE = 2\n")

    _hermetic_steps(monkeypatch, tmp_path, poisoned)
    with pytest.raises(errors.EnvironmentFailure, match=r"demo_pkg/__init__\.py: differs"):
        runner.install_environment(tree, tmp_path / "hermetic", tmp_path)
    assert [p.name for p in (tmp_path / "hermetic").iterdir()] == []


def test_a_hermetic_run_installs_its_own_uv_never_the_callers(tmp_path: Path) -> None:
    """The uv a hermetic run installs with comes from the tree's pinned requirements into
    the run's scratch, by pip with every wheel's sha256: a uv planted in the caller's
    ``.tools/uv-venv`` (writable, and run before the sandbox) is never run."""
    from lab import runner

    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    pinned = (ROOT / "scripts" / "uv-requirements.txt").read_text(encoding="utf-8")
    (tree / "scripts" / "uv-requirements.txt").write_text(pinned, encoding="utf-8")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    uv = Path(runner._uv(tree, scratch))
    assert uv.is_relative_to(scratch) and uv.is_file()
    version = subprocess.run([str(uv), "--version"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    assert version.split()[1] in pinned, version
    # A requirements file whose digests match no wheel: pip refuses, and so does the run.
    wrong = re.sub(r"sha256:[0-9a-f]{64}", "sha256:" + "0" * 64, pinned)
    (tree / "scripts" / "uv-requirements.txt").write_text(wrong, encoding="utf-8")
    with pytest.raises(errors.EnvironmentFailure, match="installing uv"):
        runner._uv(tree, tmp_path / "other")
