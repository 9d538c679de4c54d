"""The interpreter that starts a hermetic run and seals its evidence is checked first.

``lab.evidence.caller`` judges the caller's own interpreter: its distributions against
the lock and their RECORDs, its start-up hooks, the modules it imported. Each case
runs in a child interpreter of a fresh venv under ``tmp_path`` holding *copies* of the
distributions the lab imports (copied byte for byte, never linked: uv installs from a
cache shared by every venv on the machine, so a file edited through a link would be
edited everywhere), tampers with the copy only, and this pytest process imports
nothing from it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from lab import errors
from tests.support import labtree

ROOT = Path(__file__).resolve().parents[2]
# What the child imports before the check: the modules a ``lab`` command has loaded.
IMPORTS = "import lab.cli, lab.runner, lab.publish"
CHECK = f"""
import sys
{IMPORTS}
from lab import errors
from lab.evidence import caller
try:
    caller.require()
except errors.LabError as exc:
    sys.exit(str(exc))
print("clean")
"""
# ``lab run --hermetic`` itself, in the child: refused before it writes anything.
RUN = ("import sys; from lab import cli; "
       "sys.exit(cli.main(['run', '--hermetic', '--evidence', 'evidence']))")
# The lock's own project is the tree, put on the child's path by a path file.
PROJECT = "durable-agent-lab"


def _child_environment() -> dict[str, str]:
    """PATH, and where this run keeps bytecode: a child must not write ``__pycache__``
    into the checkout (a hermetic run's exported tree is hashed file by file)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin"), "PYTHONDONTWRITEBYTECODE": "1"}
    for name in ("PYTHONPYCACHEPREFIX", "LAB_HERMETIC_COMMIT", "LAB_HERMETIC_TREE"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def _child(python: Path, script: str, cwd: Path,
           extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-c", script], cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False,
                          env={**_child_environment(), **(extra or {})})


@functools.cache
def _needed() -> tuple[str, ...]:
    """The distributions whose modules a child running ``IMPORTS`` loads (probed in a
    child of this interpreter, so this process imports nothing more)."""
    script = (f"import json, sys; {IMPORTS}; "
              "print(json.dumps(sorted({n.partition('.')[0] for n in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=True, env=_child_environment())
    owners = importlib.metadata.packages_distributions()
    names = {dist for top in json.loads(done.stdout) for dist in owners.get(top, [])}
    return tuple(sorted(name for name in names if name.lower() != PROJECT))


def _copy_distribution(name: str, site: Path) -> None:
    """Every file ``name``'s RECORD lists, copied (content and mtime: its bytecode stays
    its source's) from where it is installed to the same place under ``site``."""
    dist = importlib.metadata.distribution(name)
    base = Path(str(dist.locate_file("")))
    for entry in dist.files or []:
        source = base / str(entry)
        target = Path(os.path.normpath(site / str(entry)))
        if not source.is_file() or not target.is_relative_to(site.parents[2]):
            continue  # bytecode RECORD names but nobody compiled; a script outside the venv
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)  # a new file, never a link to the shared cache's


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv of the base interpreter with copies of the distributions the lab imports
    and a path file (no code) putting this checkout on ``sys.path``."""
    venv = tmp_path_factory.mktemp("caller") / "venv"
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = venv / Path(sysconfig.get_path("purelib", vars={"base": "."}))
    for name in _needed():
        _copy_distribution(name, site)
    (site / "lab-tree.pth").write_text(f"{ROOT}\n", encoding="utf-8")
    return venv


@pytest.fixture
def venv(pristine: Path, tmp_path: Path) -> tuple[Path, Path]:
    """This test's own copy of ``pristine`` (to tamper with): its python and site-packages."""
    copy = tmp_path / "venv"
    shutil.copytree(pristine, copy, symlinks=True)
    site = copy / Path(sysconfig.get_path("purelib", vars={"base": "."}))
    return copy / "bin" / "python", site


def _refusal(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode != 0, done.stdout
    lines = done.stderr.strip().splitlines()
    assert lines, done
    return lines[-1]


def test_a_clean_copy_of_the_environment_passes(venv: tuple[Path, Path], tmp_path: Path) -> None:
    """The copied distributions match the lock and their RECORDs: nothing to refuse."""
    python, _site = venv
    done = _child(python, CHECK, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "clean"


def test_an_edited_installed_module_is_refused_naming_it(
    venv: tuple[Path, Path], tmp_path: Path
) -> None:
    """An imported module edited after the install is named as a module nothing vouches
    for; an edited file nobody imported yet, by the RECORD check."""
    python, site = venv
    imported = site / "rich" / "__init__.py"
    imported.write_text(imported.read_text(encoding="utf-8") + "# planted\n", encoding="utf-8")
    line = _refusal(_child(python, CHECK, tmp_path))
    assert f"module rich from {imported}" in line, line
    assert "matches no installed distribution's RECORD" in line, line

    imported.write_text(imported.read_text(encoding="utf-8").removesuffix("# planted\n"),
                        encoding="utf-8")
    assert _child(python, CHECK, tmp_path).returncode == 0
    unimported = site / "rich" / "__main__.py"
    unimported.write_text("print('planted')\n", encoding="utf-8")
    line = _refusal(_child(python, CHECK, tmp_path))
    assert "rich/__main__.py differs from RECORD" in line, line


def test_a_planted_sitecustomize_or_code_running_pth_is_refused(
    venv: tuple[Path, Path], tmp_path: Path
) -> None:
    """Start-up code no distribution's RECORD lists is named, whether it ran or not, and
    so is a ``sys.path`` entry that ``PYTHONPATH`` added."""
    python, site = venv
    planted = site / "sitecustomize.py"
    planted.write_text("import os\n", encoding="utf-8")
    line = _refusal(_child(python, CHECK, tmp_path))
    assert f"start-up hook {planted}" in line and "sitecustomize" in line, line

    planted.unlink()
    hook = site / "zz-planted.pth"
    hook.write_text("import os\n", encoding="utf-8")
    line = _refusal(_child(python, CHECK, tmp_path))
    assert f"start-up hook {hook}: a .pth that executes code" in line, line

    # One on PYTHONPATH: the entry itself is refused, whatever it holds.
    hook.unlink()
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "sitecustomize.py").write_text("import os\n", encoding="utf-8")
    line = _refusal(_child(python, CHECK, tmp_path, {"PYTHONPATH": str(custom)}))
    assert f"sys.path entry {custom} is neither" in line, line


def test_a_hermetic_run_from_a_tampered_interpreter_writes_nothing(
    venv: tuple[Path, Path], tmp_path: Path
) -> None:
    """``lab run --hermetic`` on a tampered interpreter: exit 3 (the environment), one
    line naming the file, no evidence directory, the checkout untouched."""
    python, site = venv
    tampered = site / "rich" / "__init__.py"
    tampered.write_text(tampered.read_text(encoding="utf-8") + "# planted\n", encoding="utf-8")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("a commit to run\n", encoding="utf-8")
    labtree.commit(repo)
    done = _child(python, RUN, repo)
    assert done.returncode == errors.EXIT_ENVIRONMENT, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("lab run: this interpreter"), lines
    assert str(tampered) in lines[0], lines
    assert not (repo / "evidence").exists()
    assert labtree.git(repo, "status", "--porcelain", "--ignored") == ""
