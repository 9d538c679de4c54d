"""Network faults between lab hosts, made with the kernel's own tools (iproute2, nftables).

- A **partition** loses, on the wire, every IPv4 packet one host sends to another: in the
  sender's namespace the receiver's address gets a permanent neighbour entry naming a
  MAC address no host has (``network.NOWHERE``), so its frames leave the sender and the bridge
  floods them to ports whose hosts all drop them as not theirs. Silent, as a cut cable
  is: the sender sees no error, only no answer, and TCP retransmits into the void.
  iproute2 alone (no nftables, no ``tc`` action, no kernel module a bare machine may
  lack). A **one-way** partition loses one direction only (A's packets to B; B's to A
  still arrive); a full one loses both. Healing deletes the entry: the sender asks ARP
  again and its next packet arrives.
- A host **isolated** has its cable pulled: its bridge port is set down (iproute2 alone),
  so it reaches nobody and nobody reaches it until it is **rejoined**.
- **Loss** on a host's link: an nftables rule in the bridge's namespace dropping that
  share of what the host sends (``numgen random``; needs the ``nft`` program). **Delay,
  jitter and reordering** need ``tc netem``; a kernel built without ``sch_netem``
  refuses them in one line (nothing is changed).

Every fault and every heal is recorded in ``Hosts.events`` (what, between whom, and the
settings), so the evidence says what the network did. ``Faults.heal_all`` undoes all.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

from lab import errors
from lab.hosts.network import NOWHERE, Host, Hosts, command


@dataclass(frozen=True)
class LinkFault:
    """``tc netem`` settings for one host's outgoing packets (times in ms, rates in %)."""

    delay_ms: int = 0
    jitter_ms: int = 0
    loss_pct: float = 0.0
    reorder_pct: float = 0.0

    def validate(self) -> None:
        """``errors.UsageError`` for settings netem would refuse or that make no sense."""
        if not 0 <= self.delay_ms <= 10_000 or not 0 <= self.jitter_ms <= self.delay_ms:
            raise errors.UsageError("delay must be 0-10000 ms and jitter at most the delay")
        if not 0 <= self.loss_pct <= 100 or not 0 <= self.reorder_pct <= 100:
            raise errors.UsageError("loss and reorder are percentages (0-100)")
        if self.reorder_pct and not self.delay_ms:
            raise errors.UsageError("reordering needs a delay (netem reorders by not delaying)")

    def netem_args(self) -> list[str]:
        """The ``tc qdisc ... netem`` arguments for these settings."""
        args: list[str] = []
        if self.delay_ms:
            args += ["delay", f"{self.delay_ms}ms"]
            if self.jitter_ms:
                args += [f"{self.jitter_ms}ms"]
        if self.loss_pct:
            args += ["loss", f"{self.loss_pct:g}%"]
        if self.reorder_pct:
            args += ["reorder", f"{self.reorder_pct:g}%"]
        return args or ["delay", "0ms"]

    def describe(self) -> str:
        """The settings in one line, for the evidence."""
        return (f"delay={self.delay_ms}ms jitter={self.jitter_ms}ms loss={self.loss_pct:g}% "
                f"reorder={self.reorder_pct:g}%")


TABLE = "lab"
CHAIN = "forward"


class Faults:
    """The network faults of one set of hosts; see the module."""

    def __init__(self, hosts: Hosts) -> None:
        self.hosts = hosts
        self._rules: dict[str, int] = {}  # the lossy host -> its nftables rule's handle
        self._cut: set[tuple[str, str]] = set()  # (sender, receiver) partitioned
        self._shaped: set[str] = set()
        self._isolated: set[str] = set()
        self._table = False

    def _host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise errors.UsageError(f"no lab host named {name!r}") from None

    def _nft(self, *args: str) -> str:
        return command("nft", *args, netns=self.hosts.bridge_ns)

    def _add_rule(self, key: str, *match: str) -> None:
        if key in self._rules:
            return
        if not self._table:
            self._nft("add", "table", "bridge", TABLE)
            self._nft("add", "chain", "bridge", TABLE, CHAIN,
                      "{ type filter hook forward priority 0; policy accept; }")
            self._table = True
        echoed = self._nft("--echo", "--handle", "add", "rule", "bridge", TABLE, CHAIN,
                           *match, "drop")
        found = re.search(r"# handle (\d+)", echoed)
        if found is None:
            raise errors.ProvisioningError("nft did not say which rule it added")
        self._rules[key] = int(found.group(1))

    def _delete_rule(self, key: str) -> None:
        handle = self._rules.pop(key, None)
        if handle is not None:
            self._nft("delete", "rule", "bridge", TABLE, CHAIN, "handle", str(handle))

    def partition(self, a: str, b: str, *, one_way: bool = False) -> None:
        """Cut ``a`` from ``b``: both directions, or only ``a``'s packets to ``b``."""
        source, target = self._host(a), self._host(b)
        if source is target:
            raise errors.UsageError("a host cannot be partitioned from itself")
        pairs = [(source, target)] if one_way else [(source, target), (target, source)]
        for sender, receiver in pairs:
            if (sender.name, receiver.name) in self._cut:
                continue
            sender.run("ip", "neigh", "replace", receiver.address, "lladdr", NOWHERE,
                       "nud", "permanent", "dev", "eth0")
            self._cut.add((sender.name, receiver.name))
        self.hosts.record("partition", between=f"{a}->{b}" if one_way else f"{a}<->{b}",
                          kind="one-way" if one_way else "full")

    def heal(self, a: str, b: str) -> None:
        """Remove every partition between ``a`` and ``b`` (either direction)."""
        for sender, receiver in ((a, b), (b, a)):
            if (sender, receiver) in self._cut:
                self._host(sender).run("ip", "neigh", "del", self._host(receiver).address,
                                       "dev", "eth0")
                self._cut.discard((sender, receiver))
        self.hosts.record("heal", between=f"{a}<->{b}")

    def isolate(self, name: str) -> None:
        """Pull host ``name``'s cable: its bridge port goes down."""
        host = self._host(name)
        command("ip", "link", "set", host.port, "down", netns=self.hosts.bridge_ns)
        self._isolated.add(name)
        self.hosts.record("isolated", host=name)

    def rejoin(self, name: str) -> None:
        """Plug host ``name``'s cable back in."""
        host = self._host(name)
        command("ip", "link", "set", host.port, "up", netns=self.hosts.bridge_ns)
        self._isolated.discard(name)
        self.hosts.record("rejoined", host=name)

    def shape(self, name: str, fault: LinkFault) -> None:
        """Apply ``fault`` to everything host ``name`` sends (replacing an earlier one)."""
        fault.validate()
        host = self._host(name)
        if (fault.delay_ms or fault.reorder_pct) and not netem_available(host):
            raise errors.ProvisioningError(
                "delay, jitter and reordering need tc netem, which this kernel lacks "
                "(no sch_netem); loss and partitions work without it")
        self.unshape(name, record=False)
        if fault.delay_ms or fault.reorder_pct:
            host.run("tc", "qdisc", "replace", "dev", "eth0", "root", "netem",
                     *fault.netem_args())
        if fault.loss_pct:
            # numgen draws 0..9999: hundredths of a per cent.
            share = round(fault.loss_pct * 100)
            draw = [] if share >= 10000 else ["numgen", "random", "mod", "10000", "<", str(share)]
            self._add_rule(name, "iifname", host.port, *draw)
        self._shaped.add(name)
        self.hosts.record("link", host=name, fault=fault.describe())

    def unshape(self, name: str, *, record: bool = True) -> None:
        """Remove the link fault of host ``name``."""
        if name not in self._shaped:
            return
        self._delete_rule(name)
        host = self._host(name)
        if netem_available(host):
            with contextlib.suppress(errors.ProvisioningError):  # none was set: fine
                host.run("tc", "qdisc", "del", "dev", "eth0", "root")
        self._shaped.discard(name)
        if record:
            self.hosts.record("link-cleared", host=name)

    def heal_all(self) -> None:
        """Remove every partition and link fault."""
        for a, b in sorted(self._cut):
            if (a, b) in self._cut:  # a full partition's other half went with the first
                self.heal(a, b)
        for name in list(self._shaped):
            self.unshape(name)
        for name in list(self._isolated):
            self.rejoin(name)


_netem: list[bool] = []


def netem_available(host: Host) -> bool:
    """Whether this kernel has ``sch_netem`` (asked once, on a host's link)."""
    if not _netem:
        try:
            host.run("tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", "0ms")
            host.run("tc", "qdisc", "del", "dev", "eth0", "root")
            _netem.append(True)
        except errors.ProvisioningError:
            _netem.append(False)
    return _netem[0]
