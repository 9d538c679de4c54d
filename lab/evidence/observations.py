"""Facts and measurements: every observation key is classified when it is recorded.

A **fact** is expected to be identical on every run of the same commit (effects, final
states, review reasons, the counts a claim is about); ``lab reproduce`` compares facts
and fails on any difference. A **measurement** may vary between runs (durations,
timings, throughput, trace and random ids); it is shown side by side, never compared.

The rule, in order, for each top-level key of ``observe({...})``:

1. a key named in both ``facts=`` and ``measurements=`` is ``unclassified``;
2. a key named in ``facts=`` is a fact, in ``measurements=`` a measurement;
3. a key whose name matches ``MEASUREMENT_NAMES`` (case-insensitive globs) is a
   measurement;
4. a key whose value holds a non-integral number anywhere (a JSON float, also inside
   lists and objects) is ``unclassified``: a float is usually measured, so a float that
   is a fact must be declared, and so must a float that is a measurement under another name;
5. anything else (strings, integers, booleans, null, containers of them) is a fact.

An observation with an ``unclassified`` key (or a key the report carries no kind for)
fails the gate, naming the test and the key, so the split cannot rot. Pure: the gate,
the verifier and the plugin share this one rule.
"""

from __future__ import annotations

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


def holds_float(value: Any) -> bool:
    """True when ``value`` is, or contains anywhere, a non-integral JSON number (a float)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return True
    if isinstance(value, Mapping):
        return any(holds_float(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(holds_float(v) for v in value)
    return False


def classify(
    observation: Mapping[str, Any],
    *,
    facts: Iterable[str] = (),
    measurements: Iterable[str] = (),
) -> dict[str, str]:
    """The kind of each key of ``observation`` by the module's rule.

    Raises ``ValueError`` naming every declared key the observation does not hold:
    an override that names nothing would silently classify nothing.
    """
    declared_facts, declared_measurements = set(facts), set(measurements)
    stray = sorted((declared_facts | declared_measurements) - set(observation))
    if stray:
        raise ValueError(f"observe: declared keys not in the observation: {', '.join(stray)}")
    kinds: dict[str, str] = {}
    for key, value in observation.items():
        if key in declared_facts and key in declared_measurements:
            kinds[key] = UNCLASSIFIED
        elif key in declared_facts:
            kinds[key] = FACT
        elif key in declared_measurements or _is_measurement_name(key):
            kinds[key] = MEASUREMENT
        elif holds_float(value):
            kinds[key] = UNCLASSIFIED
        else:
            kinds[key] = FACT
    return kinds


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
