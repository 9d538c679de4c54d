"""The import structure of ``lab/`` follows the layer table the README draws.

The README's "Layout" section holds the table between ``<!-- layers -->`` markers:
each row a layer, lowest first, naming its modules. Read from the AST, every
import of a ``lab`` module (at top level or inside a function) must point to the
same layer or a lower one, every module must sit in exactly one layer, and the
imports must form no cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lab"


def _layers() -> list[tuple[str, set[str]]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", text, re.S)
    assert block, "README.md has no <!-- layers --> table"
    layers: list[tuple[str, set[str]]] = []
    for line in block.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[1] or set(cells[0]) <= {"-", " "} or cells[0] == "layer":
            continue
        layers.append((cells[0], set(re.findall(r"`([a-z_]+)`", cells[1]))))
    return layers


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "lab":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lab."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("lab."))
    return found


def _modules() -> dict[str, set[str]]:
    return {
        path.stem: _imports(path) - {path.stem}
        for path in sorted(PACKAGE.glob("*.py"))
        if path.stem != "__init__"
    }


def test_every_module_sits_in_exactly_one_layer() -> None:
    """A module the table does not place (or places twice) fails, naming it."""
    placed: dict[str, list[str]] = {}
    for layer, members in _layers():
        for module in members:
            placed.setdefault(module, []).append(layer)
    present = set(_modules())
    assert sorted(present - set(placed)) == [], "modules missing from the README table"
    assert sorted(set(placed) - present) == [], "the README table names absent modules"
    assert {m: ls for m, ls in placed.items() if len(ls) > 1} == {}


def test_imports_point_down_the_layers() -> None:
    """No module imports a module of a higher layer."""
    rank = {module: index for index, (_, ms) in enumerate(_layers()) for module in ms}
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in _modules().items()
        for target in targets
        if target in rank and module in rank and rank[target] > rank[module]
    )
    assert upward == []


def test_no_import_cycle() -> None:
    """The import graph of ``lab/`` is acyclic (imports inside functions included)."""
    graph = _modules()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append([*trail[trail.index(target):], target] if target in trail
                              else [node, target])
            elif target not in state:
                visit(target, [*trail, target])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def _environment_table() -> set[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- environment -->(.*?)<!-- /environment -->", text, re.S)
    assert block, "README.md has no <!-- environment --> table"
    return set(re.findall(r"`((?:BOOK|LAB)_[A-Z0-9_]+)`", block.group(1)))


def _variables_in(paths: list[Path]) -> set[str]:
    """``BOOK_*``/``LAB_*`` names in string constants, less the line-protocol words."""
    from lab import protocol

    words = {value for value in vars(protocol).values() if isinstance(value, str)}
    found: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.update(re.findall(r"\b((?:BOOK|LAB)_[A-Z0-9_]*[A-Z0-9])\b", node.value))
    return found - words


def test_every_environment_variable_is_in_the_readme_table() -> None:
    """The code reads no ``BOOK_``/``LAB_`` variable the README's table leaves out."""
    code = sorted(PACKAGE.glob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    listed = _environment_table()
    # A prefix of a listed name (``LAB_EVIDENCE`` in a startswith) is not a variable.
    unlisted = sorted(name for name in _variables_in(code) - listed
                      if not any(known.startswith(name + "_") for known in listed))
    assert unlisted == [], "add these to the README's environment table"
