"""A replicated PostgreSQL on lab hosts: what a synchronous pair keeps through a failover,
and what an asynchronous one loses when its standby was cut off."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from lab import errors
from lab.hosts import netfaults, network, replication
from lab.pg import edge

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="lab hosts need root"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="partitions need nftables"),
]


@pytest.fixture
def hosts() -> Iterator[network.Hosts]:
    with network.Hosts(["db1", "db2"]) as built:
        yield built


def _rows(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [int(row[0]) for row in conn.execute("SELECT x FROM t ORDER BY x")]


def _insert(dsn: str, value: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO t VALUES (%s)", (value,))


@contextmanager
def _pair_with_one_row(
    hosts: network.Hosts, mode: str
) -> Iterator[tuple[replication.Replicated, str]]:
    """``(pair, local)``: db1 and db2 replicated in ``mode``, table ``t`` created and its
    first row (1) inserted through ``local``, the pair's local DSN."""
    with replication.Replicated(hosts, "db1", "db2", mode=mode) as pair:
        local = pair.local_dsn()
        with psycopg.connect(local, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (x int)")
        _insert(local, 1)
        yield pair, local


def test_a_synchronous_commit_waits_for_the_standby_and_survives_failover(
    hosts: network.Hosts,
) -> None:
    faults = netfaults.Faults(hosts)
    with _pair_with_one_row(hosts, "sync") as (pair, local):
        faults.partition("db1", "db2")
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (_insert(local, 2), done.set()), daemon=True)
        waiter.start()
        with psycopg.connect(pair.local_dsn(pair.primary), autocommit=True) as conn:
            def waiting() -> bool:
                row = conn.execute("SELECT count(*) FROM pg_stat_activity "
                                   "WHERE wait_event = 'SyncRep'").fetchone()
                return row is not None and row[0] == 1
            pair.wait_until("a commit waiting for the standby", waiting, within=30)
        assert not done.is_set()
        faults.heal("db1", "db2")
        waiter.join(timeout=30)
        assert done.is_set(), "the commit never came back after the heal"
        steps = pair.failover()
        assert [s["step"] for s in steps] == ["fenced", "promoted", "commits alone"]
        assert _rows(pair.local_dsn()) == [1, 2]
        _insert(pair.local_dsn(), 3)
        assert pair.describe()["nodes"]["db2"]["role"] == "primary"
        old = pair.rejoin()
        _insert(pair.local_dsn(), 4)  # synchronous again: acknowledged once db1 has it
        assert _rows(pair.local_dsn(old)) == [1, 2, 3, 4]
        assert [s["step"] for s in pair.steps][-2:] == ["pg_rewind", "rejoined"]


def test_an_asynchronous_failover_loses_what_the_cut_off_standby_never_got(
    hosts: network.Hosts,
) -> None:
    faults = netfaults.Faults(hosts)
    with _pair_with_one_row(hosts, "async") as (pair, local):
        pair.wait_until("the standby to replay the first row",
                   lambda: pair.replay_lag_bytes() == 0, within=30)
        faults.partition("db1", "db2")
        _insert(local, 2)  # acknowledged by the primary alone
        assert _rows(pair.local_dsn(pair.primary)) == [1, 2]
        pair.failover()
        assert _rows(pair.local_dsn()) == [1], "the acknowledged row 2 is lost"


def test_a_teardown_drops_its_schema_without_waiting_for_a_cut_off_standby(
    hosts: network.Hosts,
) -> None:
    """A synchronous primary whose standby is cut off makes every commit wait (the test
    above); dropping a test's schema there must not (an experiment that failed before
    fencing its old primary once hung a run's teardown for good)."""
    faults = netfaults.Faults(hosts)
    with _pair_with_one_row(hosts, "sync") as (_pair, local):
        with psycopg.connect(local, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA t_dropped")
        faults.partition("db1", "db2")
        dropped = threading.Thread(target=edge.drop_schema, args=(local, "t_dropped"),
                                   daemon=True)
        dropped.start()
        dropped.join(timeout=60)
        assert not dropped.is_alive(), "dropping the schema waited for the cut-off standby"
        with psycopg.connect(local, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_namespace "
                               "WHERE nspname = 't_dropped'").fetchone()
        assert row == (0,)


def test_bad_pairs_are_refused(hosts: network.Hosts) -> None:
    with pytest.raises(errors.UsageError):
        replication.Replicated(hosts, "db1", "db1")
    with pytest.raises(errors.UsageError):
        replication.Replicated(hosts, "db1", "db2", mode="semi")
