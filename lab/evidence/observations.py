"""Facts and measurements: every observation key is declared, and classified when recorded.

A **fact** is expected to be identical on every run of the same commit (effects, final
states, review reasons, the counts a claim is about); ``lab reproduce`` and ``lab
evidence compare`` compare facts and fail on any difference. A **measurement** may vary
between runs (durations, timings, throughput, trace and random ids, which of two racing
processes won); it is shown side by side, never compared.

Nothing is a fact by default: an author decides, for each key, whether every genuine run
of the commit observes the same value. The rule, in order, for each top-level key of
``observe({...}, facts=(...), measurements=(...))``:

1. a key named in both ``facts=`` and ``measurements=`` is ``unclassified``;
2. a key named in ``facts=`` is a fact, in ``measurements=`` a measurement;
3. a key whose name matches ``MEASUREMENT_NAMES`` (case-insensitive globs: durations,
   rates, ids) is a measurement: its name declares it;
4. any other key is **undeclared**: ``classify`` raises ``Undeclared`` with the
   declaration to add, so a string, a list or a count is never a fact by accident (a
   race's winner recorded as a fact did not reproduce: issue 41).

``undeclared_in_source`` finds rule 4 in an experiment's source before it runs (the
plugin fails such an experiment at collection, naming file, line and key), as
``constant_in_source`` finds an observation of literals only; ``classify``
enforces it when the value is recorded. An observation with an ``unclassified`` key (or a
key the report carries no kind for) fails the gate, naming the test and the key, so the
split cannot rot. Pure: the gate, the verifier and the plugin share this one rule.
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

FACT = "fact"
MEASUREMENT = "measurement"
UNCLASSIFIED = "unclassified"
KINDS = (FACT, MEASUREMENT)

# Key names that are measurements by default (matched case-insensitively, whole name).
MEASUREMENT_NAMES = (
    "*_s", "*_ms", "*_us", "*_ns", "*seconds*", "*duration*", "elapsed*", "*_per_s",
    "trace*", "*_id", "*_ids",
)


def _is_measurement_name(key: str) -> bool:
    lowered = key.lower()
    return any(fnmatch.fnmatchcase(lowered, pattern) for pattern in MEASUREMENT_NAMES)


class Undeclared(ValueError):
    """Keys of an observation whose kind is neither declared nor given by their name."""


def declaration_hint(keys: Iterable[str]) -> str:
    """The one-line message for undeclared ``keys``, with the declaration to add."""
    names = tuple(keys)
    listed = ", ".join(repr(k) for k in names)
    return (f"observe: {listed} {'has' if len(names) == 1 else 'have'} no declared kind: "
            f"add facts={names!r} if every run of the commit observes the same value, "
            f"else measurements={names!r}")


def classify(
    observation: Mapping[str, Any],
    *,
    facts: Iterable[str] = (),
    measurements: Iterable[str] = (),
) -> dict[str, str]:
    """The kind of each key of ``observation`` by the module's rule.

    Raises ``ValueError`` naming every declared key the observation does not hold (an
    override that names nothing would silently classify nothing), and ``Undeclared``
    naming every key whose kind is neither declared nor given by its name.
    """
    declared_facts, declared_measurements = set(facts), set(measurements)
    stray = sorted((declared_facts | declared_measurements) - set(observation))
    if stray:
        raise ValueError(f"observe: declared keys not in the observation: {', '.join(stray)}")
    kinds: dict[str, str] = {}
    undeclared: list[str] = []
    for key in observation:
        if key in declared_facts and key in declared_measurements:
            kinds[key] = UNCLASSIFIED
        elif key in declared_facts:
            kinds[key] = FACT
        elif key in declared_measurements or _is_measurement_name(key):
            kinds[key] = MEASUREMENT
        else:
            undeclared.append(key)
    if undeclared:
        raise Undeclared(declaration_hint(undeclared))
    return kinds


def _literal_names(node: ast.expr) -> set[str] | None:
    """The strings of a literal tuple or list of strings; None when not such a literal."""
    if isinstance(node, ast.Tuple | ast.List) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return {str(e.value) for e in node.elts if isinstance(e, ast.Constant)}
    return None


def undeclared_in_source(source: str, filename: str = "<source>") -> dict[str, list[str]]:
    """Rule 4 found in ``source`` before it runs, by the name of the function holding the
    ``observe({...})`` call: one message per call naming file, line and keys.

    Only what the source fixes is judged: a literal dict's literal keys, with literal
    ``facts=``/``measurements=`` tuples; anything computed is left to ``classify``.
    """
    found: dict[str, list[str]] = {}
    for function, call in observe_calls(source, filename):
        if not isinstance(call.args[0], ast.Dict):
            continue
        declared: set[str] = set()
        judged = True
        for keyword in call.keywords:
            if keyword.arg in ("facts", "measurements"):
                names = _literal_names(keyword.value)
                judged = judged and names is not None
                declared |= names or set()
        keys = [k.value for k in call.args[0].keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        missing = [k for k in keys if k not in declared and not _is_measurement_name(k)]
        if judged and missing:
            found.setdefault(function, []).append(
                f"{filename}:{call.lineno}: {declaration_hint(missing)}")
    return found


def observe_calls(source: str, filename: str = "<source>") -> list[tuple[str, ast.Call]]:
    """Every ``observe(...)`` call with an argument in ``source``, in source order, with
    the name of the function holding it (``""`` at module level). A file that does not
    parse has none (pytest reports it)."""
    try:
        tree = ast.parse(source, filename)
    except SyntaxError:
        return []
    calls: list[tuple[str, ast.Call]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name)
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                    and child.func.id == "observe" and child.args):
                calls.append((function, child))
            visit(child, function)

    visit(tree, "")
    return calls


def constant_in_source(source: str, filename: str = "<source>") -> dict[str, list[str]]:
    """Constant observations in ``source``, by the name of the function holding the call.

    Flagged: ``observe(...)`` given a dict (or value) whose values are all constants, and
    any key whose value is the literal ``True`` or ``False`` (a conclusion, not what was
    read back). A string label beside measured values is fine.
    """
    found: dict[str, list[str]] = {}
    for function, call in observe_calls(source, filename):
        problems = _judge_constant(call, filename)
        if problems:
            found.setdefault(function, []).extend(problems)
    return found


def constant_observations(source: str, filename: str = "<source>") -> list[str]:
    """Every constant observation of ``source`` (see ``constant_in_source``)."""
    return [p for found in constant_in_source(source, filename).values() for p in found]


def _judge_constant(call: ast.Call, filename: str) -> list[str]:
    value = call.args[0]
    where = f"{filename}:{call.lineno}"
    problems = []
    if isinstance(value, ast.Dict):
        for key, item in zip(value.keys, value.values, strict=True):
            if isinstance(item, ast.Constant) and isinstance(item.value, bool):
                name = key.value if isinstance(key, ast.Constant) else "?"
                problems.append(f"key {name!r} is the literal {item.value} ({where})")
    if _constant(value):
        keys = [k.value for k in getattr(value, "keys", []) if isinstance(k, ast.Constant)]
        named = f" ({', '.join(map(str, keys))})" if keys else ""
        problems.append(f"every value{named} is a literal ({where})")
    return problems


def _constant(node: ast.expr) -> bool:
    """True for a value fixed in the source: a literal, or a container of literals."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
        return True
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return all(_constant(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(v is not None and _constant(v) for v in node.values)
    return False


def undecided(observation: Any, kinds: Any) -> list[str]:
    """The keys of a recorded ``observation`` whose recorded kind is not fact or measurement.

    Reads untrusted report rows: a key with no kind, or ``kinds`` that is not an
    object, counts as undecided; an observation that is not an object is reported
    as the single pseudo-key ``(not an object)``.
    """
    if not isinstance(observation, Mapping):
        return ["(not an object)"]
    table = kinds if isinstance(kinds, Mapping) else {}
    return [str(key) for key in observation if table.get(key) not in KINDS]


def gate_failures(test: Mapping[str, Any]) -> list[str]:
    """One failure per undecided key of one test row's observations, naming test and key."""
    observations = test.get("observations")
    if not isinstance(observations, list):
        return []
    raw_kinds = test.get("observation_kinds")
    kinds = raw_kinds if isinstance(raw_kinds, list) else []
    nodeid = test.get("nodeid", "?")
    failures: list[str] = []
    for index, observation in enumerate(observations):
        table = kinds[index] if index < len(kinds) else None
        failures += [
            f"{nodeid}: observation key {key!r} is neither a fact nor a measurement "
            "(declare it: observe(..., facts=(...)) or measurements=(...))"
            for key in undecided(observation, table)
        ]
    return failures
