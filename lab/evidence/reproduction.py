"""Compare a run with its reproductions, experiment by experiment, fact by fact (pure).

``compare(original, reproductions)`` takes verified, schema-checked reports (the
original run and K re-runs of its commit) and returns a typed result:

- every **fact** of every result of every experiment with its original value and its
  value in each re-run; a fact *holds* in a run when the values are equal, and an
  experiment is the *same* when every fact held in every run. Which keys are facts is
  the committed declaration's word, never the original's: the re-runs run the commit's
  own ``observe(..., facts=, measurements=)`` and ``lab.evidence.observations`` rule, so
  a key is a measurement only when every re-run recorded it as one. A key the original
  calls by another kind than the commit declares is a difference (``misdeclared``):
  an original that calls every key a measurement does not reproduce;
- every **measurement** with its values side by side, never compared;
- each experiment's outcome in every run: a reproduction is identical only when every
  experiment passed in the original and in every re-run, and every fact held.

A result or a fact present in one run and not another is a difference (its value is
``ABSENT``): a claim that stopped being observed is not reproduced. ``to_json`` gives
the record the signed reproduction evidence carries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lab.evidence import gate, observations

# The value of a fact or measurement a run did not record.
ABSENT = "(absent)"
IDENTICAL = "identical"
DIFFERS = "differs"


@dataclass(frozen=True)
class Value:
    """One observed key of one result: its original value and its value in each re-run."""

    nodeid: str
    key: str  # the key, with "#n" for its n-th observation (n > 1) in the same result
    original: Any
    values: tuple[Any, ...]
    # The kind the re-runs (the commit's declaration) give the key, and the kind the
    # original's report claims for it (None: the original did not record the key).
    kind: str = observations.FACT
    original_kind: str | None = None

    @property
    def held(self) -> int:
        """In how many re-runs the value equals the original."""
        return sum(1 for value in self.values if value == self.original)

    @property
    def misdeclared(self) -> bool:
        """True when the original calls the key by another kind than the commit declares."""
        return self.original_kind is not None and self.original_kind != self.kind

    @property
    def same(self) -> bool:
        """True when the value held in every re-run and the original declared it as the
        commit does."""
        return self.held == len(self.values) and not self.misdeclared


@dataclass(frozen=True)
class ExperimentComparison:
    """One experiment across the original run and its re-runs."""

    chapter: str
    name: str
    original_outcome: str
    outcomes: tuple[str, ...]
    facts: tuple[Value, ...]
    measurements: tuple[Value, ...]

    @property
    def label(self) -> str:
        """``chapter/name``."""
        return f"{self.chapter}/{self.name}"

    @property
    def differing(self) -> tuple[Value, ...]:
        """The facts that did not hold in every re-run."""
        return tuple(fact for fact in self.facts if not fact.same)

    @property
    def same(self) -> bool:
        """True when every fact held in every re-run."""
        return not self.differing

    @property
    def passed(self) -> bool:
        """True when the experiment passed in the original and in every re-run."""
        return all(o == gate.PASSED for o in (self.original_outcome, *self.outcomes))


@dataclass(frozen=True)
class Comparison:
    """The whole comparison: one entry per experiment, in the original's order."""

    runs: int
    experiments: tuple[ExperimentComparison, ...]

    @property
    def identical(self) -> bool:
        """Every experiment passed everywhere and every fact held in every re-run."""
        return bool(self.experiments) and all(e.same and e.passed for e in self.experiments)

    @property
    def verdict(self) -> str:
        """``identical`` or ``differs``."""
        return IDENTICAL if self.identical else DIFFERS


def _mappings(value: Any) -> list[Mapping[str, Any]]:
    return [item for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


def _observed(test: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """``{key label: (kind, value)}`` of one result's observations, in recorded order."""
    raw = test.get("observations")
    recorded = raw if isinstance(raw, list) else []
    raw_kinds = test.get("observation_kinds")
    all_kinds = raw_kinds if isinstance(raw_kinds, list) else []
    seen: dict[str, int] = {}
    found: dict[str, tuple[str, Any]] = {}
    for index, observation in enumerate(recorded):
        if not isinstance(observation, Mapping):
            continue
        kinds = all_kinds[index] if index < len(all_kinds) else {}
        table = kinds if isinstance(kinds, Mapping) else {}
        for key, value in observation.items():
            seen[key] = seen.get(key, 0) + 1
            label = key if seen[key] == 1 else f"{key}#{seen[key]}"
            found[label] = (str(table.get(key, observations.UNCLASSIFIED)), value)
    return found


class _Run:
    """One report, indexed: experiment rows by (chapter, name) and results by node id."""

    def __init__(self, report: Mapping[str, Any]) -> None:
        self.rows: dict[tuple[str, str], Mapping[str, Any]] = {}
        for row in _mappings(report.get("experiments")):
            self.rows.setdefault((str(row.get("chapter")), str(row.get("name"))), row)
        self.tests = {str(t.get("nodeid")): t for t in _mappings(report.get("tests"))}

    def outcome(self, key: tuple[str, str]) -> str:
        row = self.rows.get(key)
        return str(row.get("outcome")) if row is not None else gate.MISSING

    def nodeids(self, key: tuple[str, str]) -> list[str]:
        row = self.rows.get(key)
        raw = row.get("tests") if row is not None else None
        return [str(n) for n in raw] if isinstance(raw, list) else []

    def observed(self, nodeid: str) -> dict[str, tuple[str, Any]]:
        test = self.tests.get(nodeid)
        return _observed(test) if test is not None else {}


def _experiment(
    key: tuple[str, str], original: _Run, reruns: Sequence[_Run]
) -> ExperimentComparison:
    nodeids = list(dict.fromkeys(original.nodeids(key)))
    for run in reruns:
        nodeids += [n for n in run.nodeids(key) if n not in nodeids]
    facts: list[Value] = []
    measurements: list[Value] = []
    for nodeid in nodeids:
        before = original.observed(nodeid)
        after = [run.observed(nodeid) for run in reruns]
        labels = list(before)
        for seen in after:
            labels += [label for label in seen if label not in labels]
        for label in labels:
            claimed, value = before.get(label, (None, ABSENT))
            # The commit's declaration, as its re-runs recorded it: a measurement only
            # when every re-run that saw the key called it one.
            kinds = {seen[label][0] for seen in after if label in seen}
            kind = observations.MEASUREMENT if kinds == {observations.MEASUREMENT} \
                else observations.FACT
            entry = Value(nodeid, label, value,
                          tuple(seen.get(label, (kind, ABSENT))[1] for seen in after),
                          kind=kind, original_kind=claimed)
            # A misdeclared key is shown and judged with the facts, whatever its kind.
            compared = kind == observations.FACT or entry.misdeclared
            (facts if compared else measurements).append(entry)
    return ExperimentComparison(
        chapter=key[0],
        name=key[1],
        original_outcome=original.outcome(key),
        outcomes=tuple(run.outcome(key) for run in reruns),
        facts=tuple(facts),
        measurements=tuple(measurements),
    )


def compare(original: Mapping[str, Any], reproductions: Sequence[Mapping[str, Any]]) -> Comparison:
    """The original report against each re-run's report (at least one).

    Experiments come in the original's order, then any only a re-run has. A key is
    compared as a fact unless every re-run recorded it as a measurement; the original's
    recorded kinds are never trusted, only checked against the re-runs'.
    """
    if not reproductions:
        raise ValueError("compare needs at least one reproduction")
    first = _Run(original)
    reruns = [_Run(report) for report in reproductions]
    keys = list(first.rows)
    for run in reruns:
        keys += [key for key in run.rows if key not in keys]
    return Comparison(len(reruns), tuple(_experiment(key, first, reruns) for key in keys))


def _value_json(value: Value) -> dict[str, Any]:
    return {"nodeid": value.nodeid, "key": value.key, "original": value.original,
            "values": list(value.values), "held": value.held, "kind": value.kind,
            "original_kind": value.original_kind}


def to_json(comparison: Comparison) -> dict[str, Any]:
    """The comparison as the JSON the reproduction evidence signs."""
    return {
        "verdict": comparison.verdict,
        "runs": comparison.runs,
        "summary": {
            "experiments": len(comparison.experiments),
            "identical_in_facts": sum(1 for e in comparison.experiments if e.same),
            "passed_everywhere": sum(1 for e in comparison.experiments if e.passed),
        },
        "experiments": [
            {
                "chapter": e.chapter,
                "name": e.name,
                "same": e.same,
                "passed": e.passed,
                "original_outcome": e.original_outcome,
                "outcomes": list(e.outcomes),
                "facts": [_value_json(f) for f in e.facts],
                "measurements": [_value_json(m) for m in e.measurements],
            }
            for e in comparison.experiments
        ],
    }
