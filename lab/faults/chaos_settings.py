"""What a chaos run is asked to do and what it counts: settings, the split, fault timing.

Pure: no I/O. ``lab.faults.chaos`` runs a round with these settings.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lab import errors, protocol
from lab.options import option

LEASE_S = 1.0
HEARTBEAT_S = 0.25
BACKOFF_S = 0.1
IDLE_EXIT_S = 2.0
DRAIN_TIMEOUT_S = 120.0
# The faults ``lab chaos --hosts`` strikes between hosts, one kind at a time, in turn.
NET_FAULT_KINDS = ("partition", "one_way", "delay", "jitter", "loss", "reorder", "clock_step")
MIN_HOSTS, MAX_HOSTS = 3, 16
REPLICATION_MODES = ("sync", "async")


@dataclass(frozen=True)
class HostFlags:
    """``lab chaos --hosts`` and ``lab soak --hosts``: the run spread over lab hosts (0:
    one machine, as before), its replication, failovers, faults between hosts and clock
    skew (times as the flags say: failovers in s, network faults in ms, skew in s)."""

    hosts: int = 0
    replication: str = "sync"
    failover_every: float = 0.0
    min_failovers: int = 0
    net_fault_every: float = 0.0
    net_fault_for: float = 600.0
    min_net_faults: int = 0
    skew_max: int = 0

    @property
    def enabled(self) -> bool:
        """Whether the run is spread over lab hosts."""
        return self.hosts > 0

    def kinds(self) -> tuple[str, ...]:
        """The network fault kinds this run strikes: clock steps only with a skew."""
        return tuple(k for k in NET_FAULT_KINDS if k != "clock_step" or self.skew_max > 0)

    def validate(self) -> None:
        """``errors.UsageError`` (one line) for flags that cannot make a run."""
        if not self.enabled:
            default = HostFlags()
            given = ["--" + name.replace("_", "-") for name in self.__dataclass_fields__
                     if getattr(self, name) != getattr(default, name)]
            if given:
                raise errors.UsageError(f"{given[0]} needs --hosts")
            return
        if not MIN_HOSTS <= self.hosts <= MAX_HOSTS:
            raise errors.UsageError(f"hosts must be between {MIN_HOSTS} and {MAX_HOSTS}")
        if self.replication not in REPLICATION_MODES:
            raise errors.UsageError("replication must be sync or async")
        if self.failover_every < 0 or 0 < self.failover_every < 5:
            raise errors.UsageError("failover-every must be 0 (never) or at least 5 seconds")
        if not 0 <= self.min_failovers <= 100:
            raise errors.UsageError("min-failovers must be between 0 and 100")
        if self.min_failovers and not self.failover_every:
            raise errors.UsageError("min-failovers needs failover-every")
        if self.net_fault_every < 0 or 0 < self.net_fault_every < 100:
            raise errors.UsageError("net-fault-every must be 0 (never) or at least 100 ms")
        if not 50 <= self.net_fault_for <= 30_000:
            raise errors.UsageError("net-fault-for must be between 50 and 30000 ms")
        if not 0 <= self.min_net_faults <= 1000:
            raise errors.UsageError("min-net-faults must be between 0 and 1000")
        if self.min_net_faults and not self.net_fault_every:
            raise errors.UsageError("min-net-faults needs net-fault-every")
        if not 0 <= self.skew_max <= 3600:
            raise errors.UsageError("skew-max must be between 0 and 3600 seconds")

    @classmethod
    def from_options(cls, options: Any) -> HostFlags:
        """The flags of ``lab chaos`` or ``lab soak`` options (fields of the same names)."""
        return cls(**{f: getattr(options, f) for f in cls.__dataclass_fields__})

    def describe(self) -> dict[str, Any]:
        """The ``run.hosts`` section of a report: what was asked for."""
        return {"hosts": self.hosts, "replication": self.replication,
                "failover_every_s": self.failover_every, "min_failovers": self.min_failovers,
                "net_fault_every_ms": self.net_fault_every,
                "net_fault_for_ms": self.net_fault_for,
                "min_net_faults_per_kind": self.min_net_faults, "skew_max_s": self.skew_max,
                "net_fault_kinds": list(self.kinds())}


# Said for a flag whose default each command declares itself (soak's faults are on).
OWN_DEFAULT = "each command's own"
# The flags ``lab chaos`` and ``lab soak`` share, each declared once: its default (or
# OWN_DEFAULT) and ``lab.options.option``'s spelling and help. The lab-hosts flags'
# defaults are ``HostFlags``'s, which ``HostFlags.from_options`` reads back.
FAULT_FLAGS: dict[str, tuple[Any, dict[str, Any]]] = {
    "workers": (4, {"help": "worker processes at a time"}),
    "batch": (1, {"help": "each worker's --batch: workflows claimed and in flight together, "
                          "in shared transactions"}),
    "concurrency": (1, {"help": "each worker's --concurrency: workflows in flight, each in "
                                "its own transactions (an alternative to --batch)"}),
    "drop_replies": (OWN_DEFAULT, {"help": "share of replies lost"}),
    "reject_429": (OWN_DEFAULT, {"help": "share of 429 answers"}),
    "non_idempotent_share": (0.2, {"help": "share of workflows on the non-idempotent tool"}),
    "partition_for": (OWN_DEFAULT, {"metavar": "MS", "help": "how long a partition lasts"}),
    "disk_full_every": (OWN_DEFAULT, {
        "metavar": "MS", "help": "fill the data directory's filesystem about every MS (0: never)"}),
    "disk_full_for": (2000.0, {
        "metavar": "MS", "help": "how long each disk-full fault holds the filesystem full"}),
    "disk_full_mb": (OWN_DEFAULT, {
        "metavar": "MB", "help": "size of the filesystem the data directory is mounted on"}),
    "disk_full_fs": ("auto", {
        "choices": ("auto", "tmpfs", "loop"),
        "help": "tmpfs (RAM), loop (an ext4 image on disk), auto: tmpfs, else loop"}),
    "clock_step_every": (OWN_DEFAULT, {
        "metavar": "MS", "help": "step the server's clock about every MS (0: never)"}),
    "clock_step_max": (OWN_DEFAULT, {
        "metavar": "S", "help": "largest clock offset, forward or back, in seconds"}),
    "hosts": (HostFlags.hosts, {
        "metavar": "N", "help": "spread the run over N lab hosts (3-16; 0: one machine): db1 "
                                "and db2 a replicated pair, tool, w1.. the workers (root)"}),
    "replication": (HostFlags.replication, {
        "choices": REPLICATION_MODES, "help": "with --hosts: how the standby follows the primary"}),
    "failover_every": (HostFlags.failover_every, {
        "metavar": "S", "help": "with --hosts: fence the primary, promote the standby and "
                                "rejoin the old one about every S seconds (0: never)"}),
    "min_failovers": (HostFlags.min_failovers, {
        "metavar": "N", "help": "the fault phase lasts until N failovers happened; fewer fails"}),
    "net_fault_every": (HostFlags.net_fault_every, {
        "metavar": "MS", "help": "with --hosts: one fault between hosts about every MS, the "
                                 "kinds in turn: partition, one_way, delay, jitter, loss, "
                                 "reorder, clock_step (0: never)"}),
    "net_fault_for": (HostFlags.net_fault_for, {
        "metavar": "MS", "help": "how long each fault between hosts lasts"}),
    "min_net_faults": (HostFlags.min_net_faults, {
        "metavar": "N", "help": "the fault phase lasts until each kind struck N times; fewer "
                                "fails"}),
    "skew_max": (HostFlags.skew_max, {
        "metavar": "S", "help": "with --hosts: worker hosts' clocks offset, and stepped, up "
                                "to S seconds either way (libfaketime; 0: true clocks, no "
                                "clock_step)"}),
}


def fault_option(name: str, default: Any = OWN_DEFAULT) -> Any:
    """The options field of ``name``, a flag ``lab chaos`` and ``lab soak`` share (see
    ``FAULT_FLAGS``); ``default`` is the command's own where the two differ."""
    shared, spelling = FAULT_FLAGS[name]
    if (shared == OWN_DEFAULT) == (default == OWN_DEFAULT):
        raise TypeError(f"{name}: give its default in FAULT_FLAGS or here, not both "
                        "or neither")
    return option(shared if default == OWN_DEFAULT else default, **spelling)


def release_option(default: float | None, default_said: str) -> Any:
    """``--release-over``, for chaos and soak alike (their defaults differ, and so does how
    the help says it)."""
    return option(default, metavar="S",
                  help="approve a round's workflows in waves over S seconds of its fault "
                       f"phase, so faults meet work in flight (default: {default_said})")


@dataclass(frozen=True)
class Settings:
    """One chaos run's parameters (times in seconds unless the name says ms)."""

    workflows: int = 500
    workers: int = 4
    duration: float = 60.0
    kill_every_ms: float = 200.0
    drop_replies: float = 0.1
    reject_429: float = 0.1
    terminate_every_ms: float = 2000.0
    non_idempotent_share: float = 0.2
    seed: int = 42
    restart_every_ms: float = 0.0
    partition_every_ms: float = 0.0
    partition_for_ms: float = 1000.0
    latency_ms: float = 0.0
    durable: bool = False
    min_restarts: int = 0
    disk_full_every_ms: float = 0.0
    disk_full_for_ms: float = 2000.0
    disk_full_mb: int = 96
    disk_full_fs: str = "auto"
    clock_step_every_ms: float = 0.0
    clock_step_max_s: int = 60
    lease: float = LEASE_S
    heartbeat: float = HEARTBEAT_S
    backoff: float = BACKOFF_S
    idle_exit: float = IDLE_EXIT_S
    drain_timeout: float = DRAIN_TIMEOUT_S
    batch: int = 1  # each worker's ``--batch``: workflows claimed and in flight together
    # Each worker's ``--concurrency``: workflows in flight, each in its own transactions.
    concurrency: int = 1
    # Approve the round's workflows in waves over this many seconds of the fault phase
    # (``lab.faults.traffic``), so faults meet work in flight; 0 approves all at once.
    release_over: float = 0.0
    # The non-idempotent tool offers the fenced lookup, so its unknowns whose lookup is
    # absent are requeued with proof instead of waiting for a person.
    non_idempotent_fenced: bool = False
    # Spread over lab hosts (``lab.faults.chaos_hosts``); off by default.
    hosts: HostFlags = field(default_factory=HostFlags)

    @property
    def proxied(self) -> bool:
        """Whether the links run through fault proxies (partitions or latency asked for)."""
        return self.partition_every_ms > 0 or self.latency_ms > 0

    def describe(self, *, max_attempts: int, proxied_links: list[str]) -> dict[str, Any]:
        """The ``run`` section of a chaos report: what was asked for, in its units."""
        return {
            "seed": self.seed,
            "workflows": self.workflows,
            "worker_processes": self.workers,
            "max_fault_duration_s": self.duration,
            "kill_every_ms_mean": self.kill_every_ms,
            "terminate_backend_every_ms_mean": self.terminate_every_ms,
            "drop_reply_rate": self.drop_replies,
            "reject_429_rate": self.reject_429,
            "non_idempotent_share": self.non_idempotent_share,
            "non_idempotent_fenced_lookup": self.non_idempotent_fenced,
            "lease_s": self.lease,
            "heartbeat_s": self.heartbeat,
            "backoff_s": self.backoff,
            "idle_exit_s": self.idle_exit,
            "worker_batch": self.batch,
            "worker_concurrency": self.concurrency,
            "release_over_s": self.release_over,
            "max_attempts": max_attempts,
            "layout": "one schema per tool mode, each with its own tool service and workers",
            "restart_postgres_every_ms": self.restart_every_ms,
            "partition_every_ms": self.partition_every_ms,
            "partition_for_ms": self.partition_for_ms,
            "latency_ms": self.latency_ms,
            "proxied_links": proxied_links,
            "disk_full_every_ms": self.disk_full_every_ms,
            "disk_full_for_ms": self.disk_full_for_ms,
            "disk_full_volume_mb": self.disk_full_mb if self.disk_full_every_ms else 0,
            "disk_full_fs_asked": self.disk_full_fs if self.disk_full_every_ms else "",
            "clock_step_every_ms": self.clock_step_every_ms,
            "clock_step_max_s": self.clock_step_max_s if self.clock_step_every_ms else 0,
            "hosts": self.hosts.describe() if self.hosts.enabled else None,
        }

    def validate(self) -> None:
        """Raise ``errors.UsageError`` for settings that cannot make a bounded run."""
        if not 1 <= self.workflows <= 100_000:
            raise errors.UsageError("workflows must be between 1 and 100000")
        if not 1 <= self.workers <= 64:
            raise errors.UsageError("workers must be between 1 and 64")
        if not 1 <= self.batch <= protocol.MAX_BATCH:
            raise errors.UsageError(f"batch must be between 1 and {protocol.MAX_BATCH}")
        if not 1 <= self.concurrency <= protocol.MAX_CONCURRENCY:
            raise errors.UsageError(
                f"concurrency must be between 1 and {protocol.MAX_CONCURRENCY}")
        if self.batch > 1 and self.concurrency > 1:
            raise errors.UsageError("batch and concurrency are alternatives (shared or own "
                                    "transactions): set one of them")
        if not 0 < self.duration <= 3600:
            raise errors.UsageError("duration must be between 0 and 3600 seconds")
        if not 0 <= self.release_over <= self.duration:
            raise errors.UsageError("release-over must be between 0 and the fault phase's "
                                    "length")
        if min(self.kill_every_ms, self.terminate_every_ms, self.restart_every_ms,
               self.partition_every_ms) < 0:
            raise errors.UsageError("fault intervals must not be negative (0 means never)")
        if self.restart_every_ms and self.restart_every_ms < 1000:
            raise errors.UsageError("restart-postgres-every must be at least 1000 ms")
        if not 0 <= self.min_restarts <= 100:
            raise errors.UsageError("min-restarts must be between 0 and 100")
        if self.min_restarts and not self.restart_every_ms:
            raise errors.UsageError("min-restarts needs restart-postgres-every")
        if min(self.disk_full_every_ms, self.clock_step_every_ms) < 0:
            raise errors.UsageError("fault intervals must not be negative (0 means never)")
        if self.disk_full_every_ms and self.disk_full_every_ms < 1000:
            raise errors.UsageError("disk-full-every must be at least 1000 ms")
        if not 0 < self.disk_full_for_ms <= 30_000:
            raise errors.UsageError("disk-full-for must be between 0 and 30000 ms")
        if not 48 <= self.disk_full_mb <= 4096:
            raise errors.UsageError("disk-full-mb must be between 48 and 4096")
        if self.disk_full_fs not in ("auto", "tmpfs", "loop"):
            raise errors.UsageError("disk-full-fs must be auto, tmpfs or loop")
        if self.clock_step_every_ms and self.clock_step_every_ms < 1000:
            raise errors.UsageError("clock-step-every must be at least 1000 ms")
        if not 1 <= self.clock_step_max_s <= 3600:
            raise errors.UsageError("clock-step-max must be between 1 and 3600 seconds")
        if not 0 < self.partition_for_ms <= 30_000:
            raise errors.UsageError("partition-for must be between 0 and 30000 ms")
        if not 0 <= self.latency_ms <= 1000:
            raise errors.UsageError("latency must be between 0 and 1000 ms")
        for name in ("drop_replies", "reject_429", "non_idempotent_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise errors.UsageError(f"{name} must lie between 0 and 1")
        if not 0 < self.heartbeat < self.lease:
            raise errors.UsageError("heartbeat must be positive and shorter than the lease")
        self.hosts.validate()
        if self.hosts.enabled:
            clash = [flag for flag, value in (
                ("--restart-postgres-every", self.restart_every_ms),
                ("--partition-every", self.partition_every_ms), ("--latency", self.latency_ms),
                ("--disk-full-every", self.disk_full_every_ms),
                ("--clock-step-every", self.clock_step_every_ms)) if value]
            if clash:
                raise errors.UsageError(f"{clash[0]} is the one-machine fault; with --hosts "
                                        "use --failover-every and --net-fault-every")
        sizes = split(self)
        if any(size > 0 and slots == 0 for _, size, slots in sizes):
            raise errors.UsageError("a mixed population needs at least two worker processes")


def require_server(settings: Settings, *, restart: bool, volume: bool,
                   steppable: bool) -> None:
    """Raise ``errors.ProvisioningError`` when the database faults asked for need a server
    this run does not have: one it can restart, fill, or whose clock it can step."""
    if settings.restart_every_ms > 0 and not restart:
        raise errors.ProvisioningError(
            "--restart-postgres-every needs a server this run started (the embedded "
            "provider): a given DSN's server cannot be restarted by the lab"
        )
    if settings.disk_full_every_ms > 0 and not volume:
        raise errors.ProvisioningError(
            "--disk-full-every needs an embedded server on a size-limited filesystem "
            "this run mounted (lab chaos starts one; a given DSN's server cannot be filled)"
        )
    if settings.clock_step_every_ms > 0 and not steppable:
        raise errors.ProvisioningError(
            "--clock-step-every needs an embedded server under libfaketime this run "
            "started (a given DSN's server clock cannot be stepped)"
        )


def split(settings: Settings) -> list[tuple[bool, int, int]]:
    """(idempotent, workflows, worker processes) for each non-empty population."""
    non_idempotent = round(settings.workflows * settings.non_idempotent_share)
    idempotent = settings.workflows - non_idempotent
    if idempotent and non_idempotent:
        non_slots = min(settings.workers - 1, max(1, round(settings.workers * (
            settings.non_idempotent_share))))
        return [(True, idempotent, settings.workers - non_slots), (False, non_idempotent,
                                                                     non_slots)]
    return [(bool(idempotent), settings.workflows, settings.workers)]


def interval(rng: random.Random, mean_ms: float) -> float:
    """Seconds to the next fault, exponential with ``mean_ms`` (0 means never)."""
    return math.inf if mean_ms <= 0 else rng.expovariate(1000.0 / mean_ms)

def spread(rng: random.Random, every_ms: float) -> float:
    """Seconds to the next database fault: ``every_ms`` give or take half (0: never).

    Bounded rather than exponential, so "every 8000 ms" means that to the reader:
    a restart or partition comes at least every 1.5 intervals.
    """
    return math.inf if every_ms <= 0 else rng.uniform(0.5, 1.5) * every_ms / 1000.0


@dataclass
class Counts:
    """Fault and recovery counters; written by one thread each, read at the end."""

    kills: int = 0
    kill_misses: int = 0
    backend_terminations: int = 0
    termination_misses: int = 0
    worker_starts: int = 0
    worker_exits: Counter[str] = field(default_factory=Counter)
    worker_items: Counter[str] = field(default_factory=Counter)
    drain_kills: int = 0
    leases_expired: int = 0
    reconciled: Counter[str] = field(default_factory=Counter)
    recoverer_errors: Counter[str] = field(default_factory=Counter)
    undispatched: Counter[str] = field(default_factory=Counter)
    unreachable_reads: int = 0
    restarts: list[dict[str, float]] = field(default_factory=list)
    fault_thread_errors: Counter[str] = field(default_factory=Counter)
