"""Lab hosts: network namespaces this run creates, joined through a bridge of their own.

Each host is a Linux network namespace holding one veth end (``eth0``) with one address
from the IPv4 link-local range 169.254.0.0/16, which no router forwards. The other ends
are ports of a bridge living in a namespace of its own, which has no address at all.
No namespace has a default route and none forwards: a packet from a host reaches
another host on the bridge, or nothing. ``Hosts.check`` proves it from the kernel's own
answers (``ip -json``, ``/proc/sys``) before the first packet; a topology that fails the
check is torn down and refused.

Everything is torn down by ``Hosts.close`` (and by ``with``): processes started inside a
host are killed first, then the namespaces go, which removes their veth ends and the
bridge with them. Every command runs with a deadline.

A thread can enter a host (``Host.inside``): the kernel's network namespace is per
thread, and a process started from that thread (``subprocess``) is born inside the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import logging
import os
import re
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lab import errors, loopback

log = logging.getLogger("lab.hosts")

T = TypeVar("T")

NETWORK = ipaddress.IPv4Network("169.254.0.0/16")
PREFIX = 16
NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_COMMAND_TIMEOUT = 20.0
_NAME = re.compile(r"[a-z][a-z0-9]{0,7}")
MAX_HOSTS = 32
# The MAC address a partition sends a host's frames to (``netfaults``): locally
# administered and unicast, and no host's (``Hosts.check`` refuses a host that has it),
# so a frame addressed to it reaches no one.
NOWHERE = "02:6c:61:62:00:00"


# Where the hosts' system programs are looked for (``program``), in this order.
SYSTEM_DIRECTORIES = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")

# Waits for EOF on stdin (its owner closed it, or died), then deletes the namespaces named
# on its command line that still exist; their veth pairs and the bridge go with them.
_REAPER = r"""
import os, signal, subprocess, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
sys.stdin.buffer.read()
for name in sys.argv[1:]:
    if os.path.exists(os.path.join("/run/netns", name)):
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=20)
"""


def refusal() -> str | None:
    """Why hosts cannot be made here (one line), or None when they can: they need root."""
    if os.geteuid() != 0:
        return ("lab hosts need root (network namespaces, veth pairs and a bridge); "
                "run as root or leave the hosts chapter out")
    if not os.access("/usr/sbin/ip", os.X_OK) and not os.access("/sbin/ip", os.X_OK):
        return "lab hosts need iproute2's ip: apt-get install iproute2"
    return None


def program(name: str) -> str:
    """The system program ``name`` by its absolute path in the system's own directories,
    never through ``PATH``: a publishable run's sandbox has ``PATH=/usr/bin:/bin``, and
    ``sysctl``, ``tc`` and ``nft`` live in ``/usr/sbin``. A program that is not installed
    keeps its bare name, so running it fails naming it."""
    for directory in SYSTEM_DIRECTORIES:
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK):
            return path
    return name


def command(*argv: str, netns: str | None = None, timeout: float = _COMMAND_TIMEOUT) -> str:
    """Run ``argv`` (in network namespace ``netns``) with a deadline; its stdout, or a
    one-line ``errors.ProvisioningError`` naming the program."""
    inner = [program(argv[0]), *argv[1:]]
    full = [program("ip"), "netns", "exec", netns, *inner] if netns else inner
    try:
        done = subprocess.run(full, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        raise errors.ProvisioningError(f"{argv[0]} did not finish within {timeout:g} s: "
                                       f"{' '.join(argv[:4])}") from None
    except OSError as exc:
        raise errors.ProvisioningError(f"{argv[0]} could not run: {exc}") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["?"]
        raise errors.ProvisioningError(f"{' '.join(argv[:4])} failed: {lines[-1]}")
    return done.stdout


def _setns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path`` (setns(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise errors.ProvisioningError(f"setns into {path} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class Host:
    """One lab host: its name, namespace, address and the link to the bridge."""

    name: str
    netns: str
    address: str
    port: str  # the bridge-side veth end, in the bridge's namespace
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def inside(self, action: Callable[[], T]) -> T:
        """``action()`` run on a thread that entered this host: sockets it opens and
        processes it starts live in the host. Its exception is raised here."""
        box: list[T] = []
        failure: list[BaseException] = []

        def body() -> None:
            try:
                _setns(f"{NETNS_DIR}/{self.netns}")
                box.append(action())
            except BaseException as exc:  # handed to the caller's thread
                failure.append(exc)

        thread = threading.Thread(target=body, name=f"in-{self.name}", daemon=True)
        thread.start()
        thread.join()
        if failure:
            raise failure[0]
        return box[0]

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` as a process inside this host (killed when the hosts close)."""
        child: subprocess.Popen[Any] = self.inside(lambda: subprocess.Popen(argv, **kwargs))
        self.processes.append(child)
        return child

    def run(self, *argv: str, timeout: float = _COMMAND_TIMEOUT) -> str:
        """Run a command inside this host with a deadline; its stdout."""
        return command(*argv, netns=self.netns, timeout=timeout)


class Hosts:
    """The run's hosts and their bridge; see the module. Use as a context manager."""

    def __init__(self, names: list[str], run: str | None = None) -> None:
        reason = refusal()
        if reason is not None:
            raise errors.ProvisioningError(reason)
        if not 1 <= len(names) <= MAX_HOSTS or len(set(names)) != len(names):
            raise errors.UsageError(f"hosts need 1 to {MAX_HOSTS} distinct names")
        for name in names:
            if not _NAME.fullmatch(name):
                raise errors.UsageError("a host name is 1-8 lowercase letters or digits, "
                                        "starting with a letter")
        self.run_id = run or secrets.token_hex(3)
        self.bridge_ns = f"lab-{self.run_id}-bridge"
        # A random third octet: two runs at once share no address even by accident.
        self._subnet = 1 + secrets.randbelow(250)
        self.hosts: dict[str, Host] = {}
        self.events: list[dict[str, str]] = []
        self._names = names
        self._made: list[str] = []
        every = [self.bridge_ns, *(f"lab-{self.run_id}-{name}" for name in names)]
        # Outlives us: if this process dies (even by SIGKILL), it deletes the namespaces.
        self._reaper: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER, *every], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    # -- building --------------------------------------------------------------------------

    def __enter__(self) -> Hosts:
        try:
            self._build()
            self.check()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record(self, what: str, **detail: str) -> None:
        """Note an event of the topology (built, checked, a fault) for the evidence."""
        self.events.append({"what": what, **detail})

    def _build(self) -> None:
        self._add_netns(self.bridge_ns)
        command("ip", "link", "add", "br0", "type", "bridge", netns=self.bridge_ns)
        command("ip", "link", "set", "br0", "up", netns=self.bridge_ns)
        for index, name in enumerate(self._names, start=1):
            netns = f"lab-{self.run_id}-{name}"
            self._add_netns(netns)
            outer, inner = f"lb{self.run_id}{index:02d}", f"lh{self.run_id}{index:02d}"
            address = str(NETWORK.network_address + (self._subnet << 8) + index)
            # Made in the bridge's namespace, so neither end ever exists in ours.
            command("ip", "link", "add", outer, "type", "veth", "peer", "name", inner,
                    "netns", netns, netns=self.bridge_ns)
            command("ip", "link", "set", outer, "master", "br0", "up", netns=self.bridge_ns)
            command("ip", "link", "set", inner, "name", "eth0", netns=netns)
            command("ip", "addr", "add", f"{address}/{PREFIX}", "dev", "eth0", netns=netns)
            command("ip", "link", "set", "eth0", "up", netns=netns)
            command("ip", "link", "set", "lo", "up", netns=netns)
            self.hosts[name] = Host(name, netns, address, outer)
        # The loopback guard admits exactly these addresses, here and in host processes.
        loopback.learn(self.addresses())
        self.record("built", bridge=self.bridge_ns,
                    hosts=" ".join(f"{h.name}={h.address}" for h in self.hosts.values()))

    def _add_netns(self, netns: str) -> None:
        command("ip", "netns", "add", netns)
        self._made.append(netns)
        # A new namespace forwards nothing by default; say so rather than trust it.
        command("sysctl", "-q", "-w", "net.ipv4.ip_forward=0", netns=netns)
        command("sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1", netns=netns)

    # -- the check before the first packet -------------------------------------------------

    def check(self) -> None:
        """Refuse (``errors.ProvisioningError``) unless every host holds only ``lo`` and
        ``eth0`` with its one link-local address, routes only to 169.254.0.0/16 with no
        default route and forwards nothing, and the bridge's namespace has no address."""
        problems: list[str] = []
        for host in self.hosts.values():
            problems += [f"{host.name}: {p}" for p in _host_problems(host)]
        problems += [f"bridge: {p}" for p in _bridge_problems(self.bridge_ns, self.hosts)]
        if problems:
            raise errors.ProvisioningError("the lab hosts failed their isolation check: "
                                           + "; ".join(problems[:3]))
        self.record("checked", rule="link-local only, no default route, nothing forwarded")

    # -- reading ---------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def addresses(self) -> list[str]:
        """Every host's address, in the order the hosts were named."""
        return [host.address for host in self.hosts.values()]

    def env(self) -> dict[str, str]:
        """What a process started inside a host needs in its environment: the hosts'
        addresses, for its loopback guard (``lab.loopback.HOSTS_ENV``)."""
        return {loopback.HOSTS_ENV: ",".join(self.addresses())}

    def topology(self) -> dict[str, Any]:
        """What the run built, for the evidence: hosts, addresses, the bridge."""
        return {"network": f"{NETWORK}", "bridge": "br0 (own namespace, no address)",
                "hosts": {h.name: h.address for h in self.hosts.values()}}

    # -- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process started inside a host, then delete every namespace this run
        made (the veth pairs and the bridge go with them). Safe to call twice."""
        for host in self.hosts.values():
            for child in host.processes:
                if child.poll() is None:
                    child.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=10)
            host.processes.clear()
        loopback.forget(self.addresses())
        failures: list[str] = []
        for netns in reversed(self._made):
            try:
                command("ip", "netns", "delete", netns)
            except errors.ProvisioningError as exc:
                failures.append(str(exc))
        self._made.clear()
        reaper, self._reaper = self._reaper, None
        if reaper is not None and reaper.stdin is not None:
            reaper.stdin.close()  # nothing left for it to delete: it exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                reaper.wait(timeout=_COMMAND_TIMEOUT * 2)
        if failures:
            log.error("lab hosts: teardown left something behind: %s", "; ".join(failures))
            raise errors.ProvisioningError(f"lab hosts teardown failed: {failures[0]}")


# A fresh interpreter inside a host (isolated, no site: no egress guard of ours), so the
# kernel alone answers: "connected", or the errno's name of the failed connect.
_PROBE = r"""
import errno, socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except TimeoutError:
    print("timeout")
except OSError as exc:
    print(errno.errorcode.get(exc.errno or 0, type(exc).__name__))
"""


def probe(host: Host | None, address: str, port: int, timeout: float = 2.0) -> str:
    """Try a TCP connection from inside ``host`` (None: from the namespace this process
    lives in, outside every host) to ``address``:``port``, in a process of its own:
    ``"connected"``, ``"timeout"``, or the name of the errno the kernel gave
    (``ENETUNREACH``: no route; ``ECONNREFUSED``: nobody listens there)."""
    return command(sys.executable, "-I", "-S", "-c", _PROBE, address, str(port),
                   f"{timeout:g}", netns=host.netns if host else None,
                   timeout=timeout + _COMMAND_TIMEOUT).strip()


def outside_addresses() -> list[str]:
    """The IPv4 addresses of the namespace this process lives in, loopback excepted (the
    machine's own addresses; none in the sandbox of a publishable run, which has only
    its own loopback)."""
    found: list[str] = []
    for entry in json.loads(command("ip", "-json", "-4", "addr", "show") or "[]"):
        for info in entry.get("addr_info", []):
            if not ipaddress.ip_address(info["local"]).is_loopback:
                found.append(str(info["local"]))
    return found


def leftovers(run_id: str) -> list[str]:
    """Namespaces of run ``run_id`` that still exist (a teardown check for tests)."""
    try:
        present = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(name for name in present if name.startswith(f"lab-{run_id}-"))


def _ip_json(netns: str, *what: str) -> list[dict[str, Any]]:
    parsed: list[dict[str, Any]] = json.loads(command("ip", "-json", *what, netns=netns) or "[]")
    return parsed


def _sysctl(netns: str, key: str) -> str:
    return command("sysctl", "-n", key, netns=netns).strip()


def _host_problems(host: Host) -> list[str]:
    problems: list[str] = []
    links = {link["ifname"]: link for link in _ip_json(host.netns, "link", "show")}
    if set(links) != {"lo", "eth0"}:
        problems.append(f"interfaces {sorted(links)}, want lo and eth0")
    if "eth0" in links and links["eth0"].get("link_type") != "ether":
        problems.append("eth0 is not an ethernet (veth) link")
    if "eth0" in links and links["eth0"].get("address") == NOWHERE:
        problems.append(f"eth0 has the address partitions send to ({NOWHERE})")
    for entry in _ip_json(host.netns, "addr", "show"):
        for info in entry.get("addr_info", []):
            local = ipaddress.ip_address(info["local"])
            if entry["ifname"] == "lo" and local.is_loopback:
                continue
            if entry["ifname"] == "eth0" and str(local) == host.address:
                continue
            problems.append(f"unexpected address {local} on {entry['ifname']}")
    for route in _ip_json(host.netns, "route", "show", "table", "all"):
        dst = route.get("dst", "")
        if dst == "default" or route.get("gateway"):
            problems.append(f"a route via a gateway ({dst})")
        elif (route.get("type", "unicast") == "unicast" and route.get("table", "main") == "main"
              and ipaddress.ip_network(dst, strict=False) != NETWORK):
            problems.append(f"a route to {dst}")
    if _sysctl(host.netns, "net.ipv4.ip_forward") != "0":
        problems.append("forwards IPv4")
    return problems


def _bridge_problems(netns: str, hosts: dict[str, Host]) -> list[str]:
    problems: list[str] = []
    ports = {h.port for h in hosts.values()}
    for entry in _ip_json(netns, "addr", "show"):
        for info in entry.get("addr_info", []):
            if not (entry["ifname"] == "lo" and ipaddress.ip_address(info["local"]).is_loopback):
                problems.append(f"address {info['local']} on {entry['ifname']}")
    names = {link["ifname"] for link in _ip_json(netns, "link", "show")}
    if names != {"lo", "br0", *ports}:
        problems.append(f"interfaces {sorted(names)}")
    for route in _ip_json(netns, "route", "show"):
        problems.append(f"a route to {route.get('dst')}")
    if _sysctl(netns, "net.ipv4.ip_forward") != "0":
        problems.append("forwards IPv4")
    return problems


@contextlib.contextmanager
def hosts(names: list[str]) -> Iterator[Hosts]:
    """``Hosts(names)`` built, checked, and torn down on leaving, pass or fail."""
    with Hosts(names) as built:
        yield built
