"""The gate: the verdict of a run, decided from the report's own rows.

``decide`` is pure and reads only what the signed report records (test outcomes,
experiment rows, collection errors, unreported tests, problems the plugin found,
the narrowing of the selection and the database reached), so the producer that
writes the verdict and the verifier that checks it compute it the same way: a
report whose ``status`` or ``gate.failures`` disagree with its rows is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lab.evidence import hermetic, observations
from lab.evidence.seed import SEED_EXPERIMENTS

PASS = "PASS"  # noqa: S105 - a verdict, not a password
FAIL = "FAIL"
PARTIAL = "PARTIAL"

# Outcomes of one test, folded from its setup, call and teardown reports.
PASSED = "passed"
FAILED = "failed"
ERROR = "error"
SKIPPED = "skipped"
XFAILED = "xfailed"
XPASSED = "xpassed"
NOT_RUN = "not run"  # setup and teardown passed but the body never ran (--setup-only)
MISSING = "missing"
# More than one report of a phase, or an outcome pytest itself never gives (a rerun).
RERUN = "rerun"

# The worst outcome wins when one experiment has several results.
_SEVERITY = (FAILED, RERUN, ERROR, NOT_RUN, XPASSED, XFAILED, SKIPPED)


@dataclass(frozen=True)
class Gate:
    """A verdict and every reason for it."""

    status: str
    failures: list[str]
    narrowed: list[str]
    missing: list[str]
    # How many of the seed's experiments were declared, run and passed (of ``required``).
    seed_floor: dict[str, int] = field(default_factory=dict)
    # PASS and hermetic (``hermetic.failures`` empty): the only evidence lab publish uses.
    publishable: bool = False
    # Why the run is not hermetic (a local run's verdict stands, but it is not published).
    local: list[str] = field(default_factory=list)


def fold_outcomes(outcomes: Sequence[str]) -> str:
    """One experiment's outcome from its results' outcomes."""
    distinct = set(outcomes)
    if not distinct:
        return MISSING
    if distinct == {PASSED}:
        return PASSED
    return next((o for o in _SEVERITY if o in distinct), FAILED)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _mappings(value: Any) -> list[Mapping[str, Any]]:
    return [item for item in _list(value) if isinstance(item, Mapping)]


def decide(report: Mapping[str, Any]) -> Gate:
    """The gate's verdict from a report's recorded facts.

    PASS only when every declared experiment produced exactly its declared results,
    all passed against a real database, the seed's 26 experiments are among them,
    nothing was skipped anywhere (tests as well as experiments), nothing failed, no
    problem was recorded, every observation key is classified as a fact or a
    measurement, the selection was not narrowed, the expected set came from
    the committed manifest, and the code that ran is the hashed, committed code of a
    clean tree (see ``_provenance_failures``).
    """
    gate = report.get("gate")
    narrowed = sorted(str(n) for n in _list(gate.get("narrowed") if isinstance(gate, Mapping)
                                            else None))
    failures = [str(p) for p in _list(report.get("problems"))]
    failures += environment_failures(report.get("environment"))
    failures += [
        f"collection error in {c.get('nodeid')}: {c.get('message')}"
        for c in _mappings(report.get("collection_errors"))
    ]
    failures += [f"{nodeid} was collected but never reported"
                 for nodeid in _list(report.get("unreported"))]
    tests = {str(t.get("nodeid")): t for t in _mappings(report.get("tests"))}
    missing: list[str] = []
    shortfalls: list[str] = []
    rows: dict[tuple[str, str], Mapping[str, Any]] = {}
    for row in _mappings(report.get("experiments")):
        rows.setdefault((str(row.get("chapter")), str(row.get("name"))), row)
        label = f"{row.get('chapter')}/{row.get('name')}"
        ran = [tests.get(str(nodeid), {}) for nodeid in _list(row.get("tests"))]
        expected = row.get("expected_results")
        if not row.get("declared"):
            failures.append(f"{label} ran but is not declared in the manifest")
        elif not ran:
            missing.append(label)
        elif isinstance(expected, int) and len(ran) != expected:
            # The declared count is exact (the rule ``lab manifest check`` applies too):
            # fewer is explained by a narrowed selection, more never is.
            problem = count_problem(label, expected, len(ran))
            if problem:
                (shortfalls if len(ran) < expected else failures).append(problem)
        for test in ran:
            nodeid = test.get("nodeid", "?")
            if test.get("outcome") != PASSED:
                failures.append(f"{nodeid} {test.get('outcome')}")
            elif _needs_database(row, test) and test.get("database") is not True:
                failures.append(f"{nodeid} did not reach a real database")
    failures += _row_failures(report, tests)
    # Outside the experiments too, anything but a pass fails: a skipped unit test in a
    # run that writes evidence is a claim the evidence would otherwise make silently.
    failures += [
        f"{t.get('nodeid')} {t.get('outcome')}"
        for t in tests.values()
        if t.get("experiment") is None and t.get("outcome") != PASSED
    ]
    # Every observation key is a fact or a measurement, so ``lab reproduce`` knows what
    # must come out the same; an undecided key is named with its test.
    for test in tests.values():
        failures += observations.gate_failures(test)
    if not report.get("postgresql"):
        failures.append("no real PostgreSQL database was provisioned for the run")
    seed_failures, seed_passed = _seed_floor(rows, tests, narrowed=bool(narrowed))
    failures += seed_failures
    failures += _selection_failures(report)
    failures += _provenance_failures(report)
    if not narrowed:
        # A narrowed selection explains absent results; it is reported as PARTIAL.
        failures += [f"{name} did not run" for name in missing]
        failures += shortfalls
    if failures:
        status = FAIL
    elif narrowed:
        status = PARTIAL
    else:
        status = PASS
    floor = {"required": len(SEED_EXPERIMENTS), "passed": seed_passed}
    local = hermetic.failures(report.get("run")) or hermetic.source_failures(report)
    return Gate(status, failures, narrowed, sorted(missing), floor,
                publishable=status == PASS and not local, local=local)


def _row_failures(
    report: Mapping[str, Any], tests: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """Each result has one row, listed by exactly one experiment row of its experiment:
    a result left out of its experiment's list, or listed twice, cannot hide."""
    failures: list[str] = []
    given = [str(t.get("nodeid")) for t in _mappings(report.get("tests"))]
    if len(given) != len(tests):
        failures.append("a result has more than one row")
    listed: dict[str, tuple[str, str]] = {}
    experiments: set[tuple[str, str]] = set()
    for row in _mappings(report.get("experiments")):
        key = (str(row.get("chapter")), str(row.get("name")))
        if key in experiments:
            failures.append(f"{key[0]}/{key[1]} has more than one experiment row")
        experiments.add(key)
        for nodeid in (str(n) for n in _list(row.get("tests"))):
            if nodeid in listed:
                failures.append(f"{nodeid} is listed more than once among the experiments")
            listed[nodeid] = key
            test = tests.get(nodeid)
            if test is None or (test.get("chapter"), test.get("experiment")) != key:
                failures.append(f"{nodeid} is listed by {key[0]}/{key[1]} but has no row "
                                "of that experiment")
    for nodeid, test in tests.items():
        if test.get("experiment") is not None and nodeid not in listed:
            failures.append(f"{nodeid} ({test.get('outcome')}) is a result no experiment "
                            "row lists")
    return failures


def _seed_floor(
    rows: Mapping[tuple[str, str], Mapping[str, Any]],
    tests: Mapping[str, Mapping[str, Any]],
    *,
    narrowed: bool,
) -> tuple[list[str], int]:
    """Every seed experiment declared, run and passed, whatever the manifest says.

    A narrowed run may leave seed experiments unrun (it is PARTIAL at best), but it
    may not leave them undeclared.
    """
    failures: list[str] = []
    passed = 0
    for chapter, name in SEED_EXPERIMENTS:
        label = f"{chapter}/{name}"
        row = rows.get((chapter, name))
        if row is None or not row.get("declared"):
            failures.append(f"seed experiment {label} is not declared in the manifest")
            continue
        outcomes = [str(tests.get(str(n), {}).get("outcome")) for n in _list(row.get("tests"))]
        if not outcomes:
            if not narrowed:
                failures.append(f"seed experiment {label} did not run")
        elif fold_outcomes(outcomes) != PASSED:
            failures.append(f"seed experiment {label} did not pass ({fold_outcomes(outcomes)})")
        else:
            passed += 1
    return failures, passed


def _selection_failures(report: Mapping[str, Any]) -> list[str]:
    """The expected set must come from the committed manifest, hashed among the sources."""
    selection = report.get("selection")
    manifest = selection.get("manifest") if isinstance(selection, Mapping) else None
    if not isinstance(manifest, Mapping):
        return ["the report does not record which manifest gave the expected set"]
    committed = f"{report.get('experiments_dir') or ''}manifest.json"
    path = manifest.get("path")
    if path != committed:
        return [f"the expected set came from {path}, not the committed {committed}: "
                "a run against another manifest is never publishable"]
    sources = report.get("sources")
    digest = sources.get(committed) if isinstance(sources, Mapping) else None
    if digest is None or manifest.get("sha256") != digest:
        return [f"the manifest that was read is not the hashed {committed}"]
    return []


def _provenance_failures(report: Mapping[str, Any]) -> list[str]:
    """The code that ran must be the code the evidence hashes, from a clean commit.

    ``lab`` must come from the hashed sources; every conftest pytest loaded must be a
    hashed, git-tracked file; every plugin module must be a hashed, tracked source, a
    module of an installed distribution the report lists, or the standard library; the
    ini file must be hashed; the tree must be a clean git checkout.
    """
    failures: list[str] = []
    if not report.get("commit"):
        failures.append("no git commit is known for the sources: evidence outside a git "
                        "checkout is never publishable")
    if report.get("dirty") is not False:
        failures.append("the working tree has uncommitted changes (or its state is unknown): "
                        "evidence of a dirty tree is never publishable")
    provenance = report.get("provenance")
    if not isinstance(provenance, Mapping):
        return [*failures, "the report does not record what code ran (no provenance)"]
    raw_sources = report.get("sources")
    sources: Mapping[str, Any] = raw_sources if isinstance(raw_sources, Mapping) else {}
    lab = provenance.get("lab")
    if lab != "lab/__init__.py" or lab not in sources:
        failures.append(f"lab was imported from {lab}, not from the hashed sources")
    inifile = provenance.get("inifile")
    if isinstance(inifile, Mapping) and not _hashed(inifile, sources):
        failures.append(f"the ini file {inifile.get('path')} is not among the hashed sources")
    failures += _ran_failures(provenance.get("ran"))
    installed = {str(d) for d in _list(provenance.get("distributions"))}
    for module in _mappings(provenance.get("modules")):
        kind = module.get("kind")
        label = (f"conftest {module.get('path')}" if kind == "conftest"
                 else f"{kind} {module.get('name')} ({module.get('path')})")
        if kind == "conftest" or module.get("distribution") is None:
            if module.get("stdlib") is True and kind != "conftest":
                continue
            if not _hashed(module, sources):
                failures.append(f"{label} was loaded from outside the hashed sources")
            elif module.get("tracked") is not True:
                failures.append(f"{label} is not a file tracked by git")
        elif str(module.get("distribution")) not in installed:
            failures.append(f"{label} claims distribution {module.get('distribution')}, "
                            "which the report does not list as installed")
    return failures


def _ran_failures(ran: Any) -> list[str]:
    """Every module that ran must be vouched for, and no start-up hook may run outside
    the environment's distributions (``provenance.vouch`` recorded what it found)."""
    if not isinstance(ran, Mapping):
        return ["the report does not record which modules ran (provenance.ran)"]
    failures = [
        f"module {u.get('module')} ran from {u.get('file')}, which {u.get('reason')}"
        if not str(u.get("reason", "")).startswith("its ")
        else f"module {u.get('module')} ({u.get('file')}): {u.get('reason')}"
        for u in _mappings(ran.get("unvouched"))
    ]
    shown = len(_list(ran.get("unvouched")))
    count = ran.get("unvouched_count")
    if isinstance(count, int) and count > shown:
        failures.append(f"... and {count - shown} more modules nothing vouches for")
    failures += [
        f"start-up hook {h.get('kind')} {h.get('file')} runs code outside the environment's "
        "distributions" for h in _mappings(ran.get("startup_hooks"))
    ]
    return failures


def _hashed(entry: Mapping[str, Any], sources: Mapping[str, Any]) -> bool:
    path = entry.get("path")
    return isinstance(path, str) and path in sources and sources[path] == entry.get("sha256")


def _needs_database(row: Mapping[str, Any], test: Mapping[str, Any]) -> bool:
    """The manifest's word when it gives one, else whether the test asked for the database."""
    declared = row.get("needs_database")
    if isinstance(declared, bool):
        return declared
    return test.get("needs_database") is True


def count_problem(label: str, declared: int, produced: int) -> str | None:
    """The exact-count rule: a message naming ``label`` unless ``produced == declared``.

    Used by ``lab manifest check`` (``produced`` = collected results) and by the gate
    (``produced`` = results that ran). A count below or above the declaration is a
    difference: cutting parameters must not go unnoticed, nor adding them.
    """
    if produced == declared:
        return None
    if produced < declared:
        return f"{label} produced {produced} of {declared} results"
    return f"{label} produced {produced} results but declares {declared}"


def environment_failures(recorded: Any) -> list[str]:
    """The gate's word on the run's environment: a run whose installed set differs from
    the checkout's ``uv.lock`` (a version, an extra distribution, a file of a
    distribution edited after install) is not evidence of the locked code. Nothing
    recorded (a checkout without a lock) is no failure here."""
    if not isinstance(recorded, Mapping) or recorded.get("matches") is True:
        return []
    differences = [str(d) for d in _list(recorded.get("differences"))]
    first = f": {differences[0]}" if differences else ""
    more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
    return [f"environment: the installed set differs from uv.lock{first}{more}"]

