"""The house of ``lab/`` follows the floors table of ``docs/floors.toml``.

That data file (rendered by ``docs/architecture.md``) holds one entry per room (a
subpackage, or a group of top-level modules) on a floor, naming its modules and the pure
ones among them. Read from the AST, every import of a ``lab``
module (at top level or inside a function) must point to the same floor or a lower one,
every module must sit in exactly one room, the imports must form no cycle, and a pure
module imports no driver, starts no process and reads no environment variable. A module
imported by name is imported too: in a module that calls ``importlib.import_module`` (or
``__import__``), every string that is a ``lab`` module's dotted name is an arrow to it,
whether it is the call's literal argument or a constant the name is looked up in; and
anywhere, ``"lab.module:Class"`` (a class imported when needed) is an arrow to the module.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lab"
# What a pure module may not import: drivers, processes, sockets, the model runtime.
IMPURE_IMPORTS = ("psycopg", "httpx", "llama_cpp", "subprocess", "socket", "testcontainers",
                  "dbos", "langgraph", "sqlalchemy")


def _rows() -> list[tuple[int, str, set[str], set[str]]]:
    """(floor, room package, modules, pure modules) per room of ``docs/floors.toml``."""
    rooms = tomllib.loads((ROOT / "docs" / "floors.toml").read_text(encoding="utf-8"))["room"]
    rows: list[tuple[int, str, set[str], set[str]]] = []
    for room in rooms:
        package = room["package"]
        assert re.fullmatch(r"lab(?:\.[a-z_]+)*", package), f"a room names no package: {room}"
        prefix = "" if package == "lab" else package[4:] + "."
        rows.append((int(room["floor"]), package, {prefix + m for m in room["modules"]},
                     {prefix + m for m in room.get("pure", [])}))
    return rows


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _paths() -> dict[str, Path]:
    return {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports_by_name(tree: ast.Module) -> bool:
    """Whether ``tree`` calls ``importlib.import_module`` or ``__import__``."""
    return any(
        isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
            or (isinstance(node.func, ast.Name)
                and node.func.id in ("import_module", "__import__")))
        for node in ast.walk(tree)
    )


def _imports(path: Path, known: set[str]) -> set[str]:
    """The ``lab`` modules (dotted, without ``lab.``) that ``path`` imports: by an import
    statement, or, in a module that imports by name, by any string naming one."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    # "lab.module:Name" names a class to import when needed (``lab.parsing.add_options``
    # builds a command's flags so): an arrow wherever it is written.
    found.update(
        module[4:] for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        for module, colon, attribute in [node.value.partition(":")]
        if colon and attribute.isidentifier() and module.startswith("lab.")
        and module[4:] in known
    )
    if _imports_by_name(tree):
        found.update(
            node.value[4:] for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.startswith("lab.") and node.value[4:] in known
        )
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
            node.module == "lab" or node.module.startswith("lab.")
        ):
            base = node.module[4:]
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                found.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            found.update(a.name[4:] for a in node.names if a.name.startswith("lab."))
    return {name for name in found if name}


def _modules() -> dict[str, set[str]]:
    """Every module of the house (packages' ``__init__`` aside) and what it imports.

    Importing a package imports what its ``__init__`` imports (``lab.runtime.store``
    re-exports its face), so an arrow through a package is the arrows to those modules.
    """
    paths = _paths()
    known = set(paths)
    packages = {name for name, path in paths.items() if path.name == "__init__.py"}
    direct = {name: _imports(path, known) - {name} for name, path in paths.items()}

    def through(targets: set[str], seen: frozenset[str]) -> set[str]:
        found: set[str] = set()
        for target in targets:
            if target not in packages:
                found.add(target)
            elif target not in seen:
                found |= through(direct[target], seen | {target})
        return found

    return {
        name: through(direct[name], frozenset({name})) - {name}
        for name in paths
        if name not in packages
    }


def test_every_module_sits_in_exactly_one_room() -> None:
    """A module the table does not place (or places twice) fails, naming it."""
    placed: dict[str, list[str]] = {}
    for _, room, members, _ in _rows():
        for module in members:
            placed.setdefault(module, []).append(room)
    present = set(_modules())
    assert sorted(present - set(placed)) == [], "modules missing from docs/floors.toml"
    assert sorted(set(placed) - present) == [], "docs/floors.toml names absent modules"
    assert {m: rs for m, rs in placed.items() if len(rs) > 1} == {}
    for _, room, members, pure in _rows():
        assert pure <= members, f"{room}: pure modules not in the row: {sorted(pure - members)}"
        inside = {m.rsplit(".", 1)[0] if "." in m else "" for m in members}
        assert inside == {"" if room == "lab" else room[4:]}, f"{room} holds another room's module"


def test_a_module_imported_by_name_is_an_arrow(tmp_path: Path) -> None:
    """``importlib.import_module("lab.cli")``, or a constant naming ``lab.cli`` in a module
    that imports by name, counts as importing ``lab.cli``: an arrow up by name is seen like
    any other. A module that never imports by name only mentions what it names, except a
    ``"lab.module:Class"`` name (a class imported when needed), which is an arrow."""
    known = set(_paths())
    literal = tmp_path / "literal.py"
    literal.write_text('import importlib\nimportlib.import_module("lab.cli")\n'
                       '__import__("lab.errors")\n')
    assert _imports(literal, known) == {"cli", "errors"}
    looked_up = tmp_path / "looked_up.py"
    looked_up.write_text('from importlib import import_module\n'
                         'PRELOAD = ("lab.runtime.worker", "lab.no_such_module", "json")\n'
                         'for name in PRELOAD:\n    import_module(name)\n')
    assert _imports(looked_up, known) == {"runtime.worker"}
    mentioned = tmp_path / "mentioned.py"
    mentioned.write_text('ARGV = ["python", "-m", "lab.cli", "worker"]\n')
    assert _imports(mentioned, known) == set()
    deferred = tmp_path / "deferred.py"
    deferred.write_text('add_options(parser, "lab.runtime.processes:WorkerOptions")\n'
                        'LABEL = "lab.cli: the top floor"\n')
    assert _imports(deferred, known) == {"runtime.processes"}


def test_the_fork_server_preloads_only_what_its_caller_may_import() -> None:
    """The fork server imports what ``lab.runtime.processes`` tells it to: modules of that
    module's floor or below (and the standard library), never a program above it."""
    from lab.runtime import processes

    floor = {module: number for number, _, ms, _ in _rows() for module in ms}
    mine = floor["runtime.processes"]
    preloaded = [name[4:] for name in processes.PRELOAD if name.startswith("lab.")]
    assert preloaded, "the fork server preloads none of the lab: its point is lost"
    assert [name for name in preloaded if floor.get(name, mine + 1) > mine] == []


def test_subpackages_are_documented() -> None:
    """Every subpackage has a docstring saying what lives in it."""
    bare = sorted(
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("__init__.py")
        if path.parent != PACKAGE and not ast.get_docstring(ast.parse(path.read_text()))
    )
    assert bare == []


def test_imports_point_down_the_floors() -> None:
    """No module imports a module of a higher floor."""
    floor = {module: number for number, _, ms, _ in _rows() for module in ms}
    upward = sorted(
        f"{module} (floor {floor[module]}) -> {target} (floor {floor[target]})"
        for module, targets in _modules().items()
        for target in targets
        if target in floor and module in floor and floor[target] > floor[module]
    )
    assert upward == []


def test_a_room_imports_nothing_it_is_told_never_to() -> None:
    """A room's ``never`` packages are out of bounds although lower: the book reads the
    evidence bundle, never the fault tools or the model that produced the evidence."""
    rooms = tomllib.loads((ROOT / "docs" / "floors.toml").read_text(encoding="utf-8"))["room"]
    book = next(room for room in rooms if room["package"] == "lab.book")
    assert set(book.get("never", [])) >= {"lab.faults", "lab.model"}
    graph = _modules()
    crossing = sorted(
        f"{module} -> {target}"
        for room in rooms
        for module in graph
        if room["package"] != "lab" and module.startswith(room["package"][4:] + ".")
        for target in graph[module]
        for banned in room.get("never", [])
        if f"lab.{target}".startswith(banned + ".") or f"lab.{target}" == banned
    )
    assert crossing == []


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


def _impurities(path: Path) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found += [n for n in names if n.split(".")[0] in IMPURE_IMPORTS]
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            found.append(f"os.{node.attr}")
    return found


def test_pure_modules_import_no_driver_and_read_no_environment() -> None:
    """A module the table calls pure, and every ``lab`` module it imports, is pure."""
    graph = _modules()
    paths = _paths()
    pure = {module for _, _, _, ps in _rows() for module in ps}
    problems: list[str] = []
    for module in sorted(pure):
        problems += [f"{module}: {what}" for what in _impurities(paths[module])]
        problems += [f"{module} imports {target}, which is not pure"
                     for target in sorted(graph[module]) if target not in pure]
    assert problems == []


def _environment_table() -> set[str]:
    """Every variable ``docs/environment.toml`` lists."""
    entries = tomllib.loads(
        (ROOT / "docs" / "environment.toml").read_text(encoding="utf-8"))["variable"]
    return {name for entry in entries for name in entry["names"]}


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


def test_every_environment_variable_is_in_the_table() -> None:
    """The code reads no ``BOOK_``/``LAB_`` variable ``docs/environment.toml`` leaves out."""
    code = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    listed = _environment_table()
    # A prefix of a listed name (``LAB_EVIDENCE`` in a startswith) is not a variable.
    unlisted = sorted(name for name in _variables_in(code) - listed
                      if not any(known.startswith(name + "_") for known in listed))
    assert unlisted == [], "add these to docs/environment.toml"


MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_80_lines() -> None:
    """A function (or method) of ``lab/`` longer than 80 lines, decorators aside, fails:
    split it into named steps."""
    long = sorted(
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES
    )
    assert long == []
