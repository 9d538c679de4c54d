"""``lab chaos --hosts``: the chaos round spread over lab hosts, with failovers, faults
between hosts and skewed clocks.

The layout (``layout``): with 4 to 16 hosts, ``db1`` and ``db2`` hold the workflow
database, a primary and a streaming standby (``lab.hosts.replication``, ``sync`` or
``async``), ``tool`` the credit tools (each population's ``ToolService``, served on that
host's address from a thread inside it), and ``w1`` .. ``wK`` the worker processes, one
slot after another over the worker hosts. With 3 hosts there is no host left for
workers: they run on ``tool`` beside the tools, so a partition between a worker and the
tool is no fault there (the partition kinds then cut worker from database, or the pair).

Workers reach the database and the tool through a ``lab.hosts.shaper.Shaper`` on their own
host (its loopback; its upstream sockets are made inside the host, so what cuts the host
cuts them), with the multi-host read-write DSN over the shapers' ports: after a failover
libpq finds the new primary. The controller (this process, on no host) reaches the
servers by their unix sockets and each tool through a shaper of its own that is never
shaped; the invariant checker and the SQL audit read the final primary.

While the round's usual faults run (worker SIGKILLs, backend terminations, lost replies,
429s), two more threads strike:

- every ``--failover-every`` seconds (give or take half) a **failover**: the primary is
  fenced (its process group SIGKILLed), the standby promoted, and the old primary rejoins
  as a standby with ``pg_rewind``; the no-primary window and the rejoin's duration are
  recorded;
- every ``--net-fault-every`` ms (give or take half) one **fault between hosts** for
  ``--net-fault-for`` ms, the kinds taken in turn (a shuffled cycle): ``partition`` and
  ``one_way`` (neighbour entries to a MAC no host has, worker from primary or tool, or
  primary from standby),
  ``delay``, ``jitter`` and ``reorder`` on a worker host's links (``tc netem`` where the
  kernel has ``sch_netem``, else the shapers), ``loss`` (an nftables rule dropping a share
  of a worker host's packets) and ``clock_step`` (a worker host's clock stepped to a new
  offset within ``--skew-max``).

With ``--skew-max`` every worker host starts with its own clock offset (libfaketime, a
clock file per host that every worker there reads). The fault phase lasts until the
``--min-failovers`` and ``--min-net-faults`` (per kind) happened too; a round that ends
short of either says so and fails.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from psycopg import conninfo

from lab import errors, protocol
from lab.faults import chaos
from lab.faults.chaos_population import Population, worker_flags
from lab.faults.chaos_settings import Settings, spread
from lab.hosts import netfaults, network, replication
from lab.hosts.shaper import Shape, Shaper
from lab.pg import faketime
from lab.runtime import processes

DB_HOSTS = ("db1", "db2")
TOOL_HOST = "tool"
# The shapes a network fault of each kind gives a worker host's links (ms; share).
DELAY_MS = (50, 250)
JITTER_MS = 100
REORDER = (100, 0.5)
LOSS_PCT = 20.0


def layout(count: int) -> dict[str, str]:
    """Host name -> what it holds, for ``count`` hosts (see the module)."""
    roles = {"db1": "workflow database: primary at the start",
             "db2": "workflow database: streaming standby", TOOL_HOST: "credit tools"}
    if count == 3:
        roles[TOOL_HOST] = "credit tools and the worker processes"
    roles.update({f"w{i}": "worker processes" for i in range(1, count - 2)})
    return roles


def worker_hosts(count: int) -> list[str]:
    """The hosts worker processes run on."""
    return [TOOL_HOST] if count == 3 else [f"w{i}" for i in range(1, count - 2)]


def refusal(euid: int | None = None) -> str | None:
    """Why ``--hosts`` cannot run here for user ``euid`` (ours by default), in one line,
    or None: lab hosts need root (network namespaces, a bridge), and the loss fault
    nftables' ``nft``."""
    if (os.geteuid() if euid is None else euid) != 0:
        return ("--hosts needs root (network namespaces and a bridge); "
                "run as root or leave --hosts out")
    reason = network.refusal()
    if reason is None and not os.access(network.program("nft"), os.X_OK):
        reason = "the loss fault needs nftables' nft: apt-get install nftables"
    return f"--hosts: {reason}" if reason else None


class Topology:
    """The hosts, the replicated pair and the network faults of one round."""

    def __init__(self, settings: Settings) -> None:
        self.flags = settings.hosts
        self.roles = layout(self.flags.hosts)
        self.hosts = network.Hosts(list(self.roles))
        self.faults = netfaults.Faults(self.hosts)
        self.pair: replication.Replicated | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Topology:
        try:
            self._stack.enter_context(self.hosts)
            self.pair = self._stack.enter_context(replication.Replicated(
                self.hosts, "db1", "db2", mode=self.flags.replication))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Heal the network, stop the servers, tear the hosts down."""
        try:
            self.faults.heal_all()
        finally:
            self._stack.close()

    @property
    def dsn(self) -> str:
        """The controller's DSN: every server's unix socket, read-write sessions only."""
        assert self.pair is not None
        return self.pair.local_dsn()


def _socket_in(host: network.Host) -> Callable[[], socket.socket]:
    return lambda: host.inside(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))


class HostChaos(chaos.Chaos):
    """A chaos round on a ``Topology``; see the module."""

    def __init__(self, topology: Topology, settings: Settings,
                 log: Callable[[str], None] | None = None) -> None:
        super().__init__(topology.dsn, settings, log=log)
        self.topology = topology
        self.flags = settings.hosts
        self.workers_on = worker_hosts(self.flags.hosts)
        self.shapers: dict[str, list[Shaper]] = {name: [] for name in self.workers_on}
        self.relays: list[Shaper] = []
        self.worker_dsn_on: dict[str, str] = {}
        self.tool_port_on: dict[tuple[str, str], int] = {}  # (host, population code)
        root = random.Random(settings.seed ^ 0x4057)
        self._failover_rng = random.Random(root.getrandbits(64))
        self._net_rng = random.Random(root.getrandbits(64))
        self._skew_rng = random.Random(root.getrandbits(64))
        self._shaper_seed = root.getrandbits(32)
        self.failovers: list[dict[str, Any]] = []
        self.net_faults: list[dict[str, Any]] = []
        self.net_counts: Counter[str] = Counter()
        self.netem = netfaults.netem_available(topology.hosts[self.workers_on[0]])
        self._clock_dir = tempfile.mkdtemp(prefix="lab-chaos-clocks-")
        self.offsets: dict[str, int] = {}
        self.skew: dict[str, Any] = {"initial": {}, "measured": {}, "steps": []}

    # -- the populations on their hosts -------------------------------------------------------

    def _start_populations(self) -> None:
        tool_host = self.topology.hosts[TOOL_HOST]
        for population in self.populations:
            population.start(serve=lambda service: self._serve(service, tool_host))
        self._start_shapers()
        self._start_clocks()

    def _serve(self, service: Any, tool_host: network.Host) -> str:
        """Start ``service`` inside the tool host, on its address; a relay for us."""
        tool_host.inside(lambda: service.start(address=tool_host.address))
        port = int(service.endpoint.rsplit(":", 1)[1])
        listener = socket.create_server(("127.0.0.1", 0))
        relay = Shaper(f"controller-tool-{port}", listener, (tool_host.address, port),
                       _socket_in(tool_host), self._shaper_seed).start()
        self.relays.append(relay)
        return f"http://127.0.0.1:{relay.port}"

    def _start_shapers(self) -> None:
        """On every worker host: a shaper to each server and to each population's tool."""
        assert self.topology.pair is not None
        hosts = self.topology.hosts
        for name in self.workers_on:
            host = hosts[name]
            ports = []
            targets = [(node.name, node.host.address, replication.PORT)
                       for node in self.topology.pair.nodes]
            targets += [(f"tool-{p.code}", hosts[TOOL_HOST].address,
                         int(p.service.endpoint.rsplit(":", 1)[1]))
                        for p in self.populations if p.service is not None]
            for label, address, port in targets:
                listener = host.inside(lambda: socket.create_server(("127.0.0.1", 0)))
                shaper = Shaper(f"{name}-{label}", listener, (address, port), _socket_in(host),
                                self._shaper_seed + len(self.shapers[name])).start()
                self.shapers[name].append(shaper)
                if label.startswith("tool-"):
                    self.tool_port_on[(name, label[5:])] = shaper.port
                else:
                    ports.append(str(shaper.port))
            params = conninfo.conninfo_to_dict(self.topology.pair.client_dsn())
            params.update(host=",".join("127.0.0.1" for _ in ports), port=",".join(ports))
            self.worker_dsn_on[name] = conninfo.make_conninfo(**params)  # type: ignore[arg-type]

    def _clock_file(self, host: str) -> str:
        return os.path.join(self._clock_dir, f"{host}.faketime")

    def _set_clock(self, host: str, offset: int) -> None:
        staged = self._clock_file(host) + ".new"
        with open(staged, "w", encoding="ascii") as handle:
            handle.write(f"{offset:+d}\n")
        os.replace(staged, self._clock_file(host))
        self.offsets[host] = offset

    def _start_clocks(self) -> None:
        """Each worker host's clock offset, drawn within ``--skew-max``, and checked."""
        if not self.flags.skew_max:
            return
        for name in self.workers_on:
            offset = self._skew_rng.randint(-self.flags.skew_max, self.flags.skew_max)
            self._set_clock(name, offset)
            self.skew["initial"][name] = offset
            self.skew["measured"][name] = round(self._wall_offset(name), 1)
            self.topology.hosts.record("clock", host=name, offset=f"{offset:+d} s")

    def _clock_env(self, host: str) -> dict[str, str]:
        if not self.flags.skew_max:
            return {}
        return {"LD_PRELOAD": str(faketime.find_faketime()),
                "FAKETIME_TIMESTAMP_FILE": self._clock_file(host),
                "FAKETIME_CACHE_DURATION": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}

    def _wall_offset(self, host: str) -> float:
        """How far from real time a process on ``host`` finds its wall clock (s)."""
        probe = self.topology.hosts[host].popen(
            [sys.executable, "-I", "-S", "-c", "import time; print(time.time())"],
            env={**os.environ, **self._clock_env(host)}, stdout=subprocess.PIPE,
            text=True)
        before = time.time()
        out, _ = probe.communicate(timeout=60)
        return float(out.strip()) - (before + time.time()) / 2

    def _spawn(self, population: Population, slot: int) -> None:
        """A looping worker exec'd inside its host, through that host's shapers."""
        assert population.service is not None
        index = sum(len(p.slots) for p in self.populations[:self.populations.index(population)])
        host = self.workers_on[(index + slot) % len(self.workers_on)]
        population.generation += 1
        name = f"{self.token}{population.code}{slot}-{population.generation}"
        argv = [sys.executable, "-m", "lab.cli", "worker", "--schema", population.schema,
                "--tool", f"http://127.0.0.1:{self.tool_port_on[(host, population.code)]}",
                "--name", name, *worker_flags(self.settings)]
        env = {**processes.child_env(self.worker_dsn_on[host], self.keys),
               protocol.TOKEN_ENV: population.service.token, "PYTHONUNBUFFERED": "1",
               **self.topology.hosts.env(), **self._clock_env(host)}
        population.slots[slot] = self.topology.hosts[host].inside(
            lambda: processes.WorkerProcess(argv, env, name, fork=False))
        self.counts.worker_starts += 1

    # -- failovers and network faults -----------------------------------------------------------

    def _start_database_faults(self) -> None:
        super()._start_database_faults()
        threads = []
        if self.flags.failover_every > 0:
            threads.append(threading.Thread(target=self._guarded,
                                            args=(self._failover_loop, "failover"),
                                            name="chaos-failovers", daemon=True))
        if self.flags.net_fault_every > 0:
            threads.append(threading.Thread(target=self._guarded,
                                            args=(self._net_loop, "network fault"),
                                            name="chaos-net-faults", daemon=True))
        for thread in threads:
            self._fault_threads.append(thread)
            thread.start()

    def _guarded(self, loop: Callable[[], None], what: str) -> None:
        try:
            loop()
        except errors.LabError as exc:  # surfaced by the supervisor, never swallowed
            self._restart_failure = exc
        except BaseException as exc:
            failure = errors.CheckFailed(f"chaos --hosts: the {what} thread failed: {exc!r}")
            failure.__cause__ = exc
            self._restart_failure = failure

    def _failover_loop(self) -> None:
        pair = self.topology.pair
        assert pair is not None
        while not self._stop_restarts.wait(spread(self._failover_rng,
                                                  self.flags.failover_every * 1000)):
            if not self._strike("failover"):
                break
            # What the standby had not replayed as the primary died: what async may lose.
            try:
                lag: int | None = pair.replay_lag_bytes()
            except errors.ProvisioningError:
                lag = None  # the primary did not answer: the failover goes on regardless
            began = time.monotonic()
            old = pair.fence().name
            fenced = time.monotonic()
            new = pair.promote().name
            promoted = time.monotonic()
            pair.rejoin()
            rejoined = time.monotonic()
            record = {"at_s": round(began - self._began, 2), "fenced": old, "promoted": new,
                      "fence_s": round(fenced - began, 3),
                      "no_primary_s": round(promoted - began, 3),
                      "rejoin_s": round(rejoined - promoted, 3), "mode": pair.mode,
                      "standby_lag_bytes_before": lag}
            self.failovers.append(record)
            self._log(f"failover {len(self.failovers)}: {old} fenced, {new} promoted after "
                      f"{record['no_primary_s']} s, {old} rejoined in {record['rejoin_s']} s")

    def _net_loop(self) -> None:
        cycle: list[str] = []
        kinds = list(self.flags.kinds())
        while not self._stop_restarts.wait(spread(self._net_rng, self.flags.net_fault_every)):
            if not cycle:
                cycle = kinds[:]
                self._net_rng.shuffle(cycle)
            kind = cycle.pop()
            if not self._strike(kind):
                break
            at = time.monotonic() - self._began
            record, undo = self._strike_net(kind)
            time.sleep(self.flags.net_fault_for / 1000.0)
            record.update(undo() or {})
            record.update(kind=kind, at_s=round(at, 2),
                          for_s=round(time.monotonic() - self._began - at, 3))
            self.net_faults.append(record)
            self.net_counts[kind] += 1

    def _strike_net(self, kind: str) -> tuple[dict[str, Any], Callable[[], dict[str, Any] | None]]:
        """Start one network fault of ``kind``: its record and how to end it."""
        rng, faults = self._net_rng, self.topology.faults
        assert self.topology.pair is not None
        worker = rng.choice(self.workers_on)
        if kind in ("partition", "one_way"):
            # Read once, and maybe none: the failover thread may be between fence and promote.
            primary = next((n.name for n in self.topology.pair.nodes if n.role == "primary"),
                           None)
            pairs = [(a, b) for a, b in ((worker, primary), (worker, TOOL_HOST), DB_HOSTS)
                     if b is not None and a != b]
            a, b = rng.choice(pairs)
            if kind == "one_way" and rng.random() < 0.5:
                a, b = b, a
            faults.partition(a, b, one_way=kind == "one_way")
            arrow = "->" if kind == "one_way" else "<->"
            return ({"between": f"{a}{arrow}{b}", "path": "neighbour entry"},
                    lambda: faults.heal(a, b))
        if kind == "loss":
            faults.shape(worker, netfaults.LinkFault(loss_pct=LOSS_PCT))
            return ({"host": worker, "loss_pct": LOSS_PCT, "path": "nftables"},
                    lambda: faults.unshape(worker))
        if kind == "clock_step":
            before = self.offsets.get(worker, 0)
            after = before
            while after == before:
                after = rng.randint(-self.flags.skew_max, self.flags.skew_max)
            self._set_clock(worker, after)
            self.topology.hosts.record("clock-step", host=worker, offset=f"{after:+d} s")
            step = {"host": worker, "from_s": before, "to_s": after, "path": "libfaketime"}
            self.skew["steps"].append({**step, "at_s": round(time.monotonic() - self._began, 2)})
            return step, lambda: None
        shape = self._shape(kind, rng)
        if self.netem:
            faults.shape(worker, netfaults.LinkFault(
                delay_ms=shape.delay_ms, jitter_ms=shape.jitter_ms,
                reorder_pct=shape.reorder_share * 100))
            return ({"host": worker, "shape": shape.describe(), "path": "netem"},
                    lambda: faults.unshape(worker))
        shapers = self.shapers[worker]
        reordered = sum(s.reordered for s in shapers)
        for shaper in shapers:
            shaper.set_shape(shape)

        def unshape() -> dict[str, Any]:
            for shaper in shapers:
                shaper.set_shape(Shape())
            return {"reordered_chunks": sum(s.reordered for s in shapers) - reordered}

        return {"host": worker, "shape": shape.describe(), "path": "shaper"}, unshape

    @staticmethod
    def _shape(kind: str, rng: random.Random) -> Shape:
        if kind == "delay":
            return Shape("delay", delay_ms=rng.randint(*DELAY_MS))
        if kind == "jitter":
            return Shape("jitter", delay_ms=JITTER_MS, jitter_ms=JITTER_MS)
        return Shape("reorder", delay_ms=REORDER[0], reorder_share=REORDER[1])

    def _more_faults_needed(self) -> bool:
        return bool(self.shortfalls())

    def shortfalls(self) -> list[str]:
        """What the minimums asked for and did not get (one line each)."""
        short = []
        if len(self.failovers) < self.flags.min_failovers:
            short.append(f"{len(self.failovers)} failovers, --min-failovers "
                         f"{self.flags.min_failovers}")
        for kind in self.flags.kinds() if self.flags.min_net_faults else ():
            if self.net_counts[kind] < self.flags.min_net_faults:
                short.append(f"{self.net_counts[kind]} {kind} faults, --min-net-faults "
                             f"{self.flags.min_net_faults}")
        return short

    def _heal(self) -> None:
        super()._heal()
        self.topology.faults.heal_all()
        for shapers in self.shapers.values():
            for shaper in shapers:
                shaper.set_shape(Shape())

    # -- the report ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        report = super().run()
        report["hosts"] = self.hosts_report()
        return report

    def hosts_report(self) -> dict[str, Any]:
        """The report's ``hosts``: layout, failovers, network faults, skew, shortfalls."""
        pair = self.topology.pair
        assert pair is not None
        windows = [f["no_primary_s"] for f in self.failovers]
        rejoins = [f["rejoin_s"] for f in self.failovers]
        paths = {kind: sorted({f["path"] for f in self.net_faults if f["kind"] == kind})
                 for kind in self.flags.kinds()}
        return {
            "run_id": self.topology.hosts.run_id,
            "layout": self.topology.roles,
            "addresses": {h.name: h.address for h in self.topology.hosts.hosts.values()},
            "replication": pair.describe(),
            "final_primary": pair.primary.name,
            "netem_available": self.netem,
            "paths": paths,
            "failover_count": len(self.failovers),
            "failovers": self.failovers,
            "no_primary_s": _stats(windows),
            "rejoin_s": _stats(rejoins),
            "failover_steps": list(pair.steps),
            "net_fault_counts": {k: self.net_counts[k] for k in self.flags.kinds()},
            "net_faults": self.net_faults,
            "skew": {**self.skew, "final": dict(self.offsets)},
            "shapers": {s.name: s.report() for ss in self.shapers.values() for s in ss},
            "shortfalls": self.shortfalls(),
        }

    def close(self) -> list[str]:
        problems = super().close()
        for shaper in [*self.relays, *(s for ss in self.shapers.values() for s in ss)]:
            try:
                shaper.stop()
            except errors.LabError as exc:
                problems.append(str(exc))
        shutil.rmtree(self._clock_dir, ignore_errors=True)
        return problems


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"min": 0.0, "mean": 0.0, "max": 0.0}
    return {"min": min(values), "mean": round(sum(values) / len(values), 3),
            "max": max(values)}


def run(settings: Settings, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One round on lab hosts built for it and torn down after, pass or fail: the report
    (``hosts`` added to the chaos report; ``cleanup`` what could not be undone)."""
    reason = refusal()
    if reason is not None:
        raise errors.ProvisioningError(reason)
    settings.validate()
    began = time.monotonic()
    with Topology(settings) as topology:
        setup_s = time.monotonic() - began
        if log is not None:
            log(f"{settings.hosts.hosts} hosts and the {settings.hosts.replication} pair up "
                f"in {setup_s:.1f}s: " + ", ".join(f"{n} ({r})" for n, r in topology.roles.items()))
        round_ = HostChaos(topology, settings, log=log)
        try:
            report = round_.run()
        finally:
            problems = round_.close()
        report["cleanup"] = problems
        report["timing"]["hosts_setup_s"] = round(setup_s, 2)
    report["timing"]["wall_with_hosts_s"] = round(time.monotonic() - began, 2)
    return report
