"""A run's conditions, hooks of the plugin: each experiment's wall-clock budget, read
from the manifest and armed over its setup and body (``lab.budget``; the plugin disarms
it after the body), and the load beside the run (``--lab-beside-load N``: N busy
processes for the whole session, started by the controller, named in the signed
command line).

On expiry the experiment fails naming what it waited for; the exception unwinds it
through its fixtures' finalizers, which kill and reap its processes, stop its server
and detach its mounts. A test outside the experiments directory has no budget.
"""

from __future__ import annotations

from typing import Any

import pytest

from lab import budget, errors, load, recorder

_MANIFEST_KEY = pytest.StashKey[Any]()
_LOAD_KEY = pytest.StashKey[Any]()
BESIDE_LOAD_OPTION = "--lab-beside-load"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the busy processes the run is to survive (in the controller only)."""
    config = session.config
    count = int(config.getoption(BESIDE_LOAD_OPTION, 0) or 0)
    if count and not hasattr(config, "workerinput"):
        config.stash[_LOAD_KEY] = load.start(count)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop them, whatever the session's end (a failure, an interrupt)."""
    spinners = session.config.stash.get(_LOAD_KEY, None)
    if spinners:
        load.stop(spinners)
        session.config.stash[_LOAD_KEY] = []


def experiment_budget(item: pytest.Item) -> float | None:
    """The wall-clock budget of an experiment (seconds), from the manifest: its own or
    the default; None for a test outside the experiments directory."""
    from lab.evidence import manifest

    experiments = recorder.experiments_path(item.config)
    try:
        chapter = item.path.resolve().relative_to(experiments.resolve()).parts[0]
    except (ValueError, IndexError):
        return None
    declared = item.config.stash.get(_MANIFEST_KEY, None)
    if declared is None:
        try:
            declared = manifest.load(recorder.manifest_path(item.config))
        except errors.LabError:
            declared = manifest.Manifest(manifest.DEFAULT_ABOUT, ())  # the gate says why
        item.config.stash[_MANIFEST_KEY] = declared
    budget_s: float = declared.budget((chapter, getattr(item, "originalname", item.name)))
    return budget_s


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    """Arm the experiment's budget over its setup and body (``lab.budget``): on expiry it
    fails naming what it waited for, and its fixtures' finalizers end what it started."""
    seconds = experiment_budget(item)
    if seconds is not None:
        budget.arm(seconds, item.nodeid)
    try:
        return (yield)
    except BaseException:
        budget.disarm()  # no body runs: the budget ends with the setup
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    """No budget runs over a teardown (its finalizers carry their own deadlines)."""
    budget.disarm()
    return (yield)
