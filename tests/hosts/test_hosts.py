"""Lab hosts: network namespaces on a bridge of their own, isolated from everything else,
torn down without a trace, and the kernel-made network faults between them."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from lab import errors, loopback
from lab.hosts import netfaults, network

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="lab hosts need root")


@pytest.fixture(scope="module")
def two() -> Iterator[network.Hosts]:
    if os.geteuid() != 0:
        pytest.skip("lab hosts need root")
    with network.Hosts(["a", "b"]) as built:
        yield built


def _udp(source: network.Host, target: network.Host) -> bool:
    """Whether one datagram from ``source`` reaches ``target`` within half a second."""
    receiver = target.inside(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    sender = source.inside(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    try:
        receiver.bind((target.address, 0))
        receiver.settimeout(0.5)
        sender.sendto(b"x", (target.address, receiver.getsockname()[1]))
        try:
            receiver.recvfrom(8)
        except TimeoutError:
            return False
        return True
    finally:
        receiver.close()
        sender.close()


def test_non_root_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(errors.ProvisioningError) as refused:
        network.Hosts(["a"])
    assert "need root" in str(refused.value) and "\n" not in str(refused.value)


def test_bad_host_names_are_refused() -> None:
    for names in (["A"], ["a", "a"], [], ["x" * 9]):
        with pytest.raises((errors.UsageError, errors.ProvisioningError)):
            network.Hosts(names)


def test_hosts_reach_each_other_and_nothing_outside_the_bridge(two: network.Hosts) -> None:
    """A host reaches another host on the bridge, and no address outside it: not the
    machine's own addresses nor its loopback (a listener there, which the machine itself
    reaches), not a public address; the kernel's own error says why for each."""
    a, b = two["a"], two["b"]
    listener = b.inside(lambda: socket.create_server((b.address, 0)))
    # A listener of the machine itself, on every address it has (a host must reach none).
    outside = socket.create_server(("0.0.0.0", 0))  # noqa: S104
    port = outside.getsockname()[1]
    own = network.outside_addresses()
    try:
        assert network.probe(a, b.address, listener.getsockname()[1]) == "connected"
        # The machine reaches its own listener on every address it has...
        for address in ["127.0.0.1", *own]:
            assert network.probe(None, address, port) == "connected"
        # ...a host reaches none of them: no route leaves the link-local network, and its
        # loopback is its own (nobody listens on that port there).
        assert {address: network.probe(a, address, port) for address in own} == {
            address: "ENETUNREACH" for address in own}
        assert network.probe(a, "127.0.0.1", port) == "ECONNREFUSED"
        assert network.probe(a, "1.1.1.1", 80) == "ENETUNREACH"
        assert network.probe(a, "10.0.0.1", 80) == "ENETUNREACH"
        # An address of the range that is no host on the bridge: nobody answers.
        assert network.probe(a, "169.254.255.254", 80, timeout=1.0) in ("timeout",
                                                                         "EHOSTUNREACH")
    finally:
        listener.close()
        outside.close()
    assert all(network.NETWORK.supernet_of(
        network.ipaddress.IPv4Network(f"{addr}/32")) for addr in two.addresses())
    assert [e["what"] for e in two.events[:2]] == ["built", "checked"]


def test_the_probe_sees_a_route_out_when_a_host_has_one(two: network.Hosts) -> None:
    """The isolation test can fail: given a route to the machine's side (a veth pair to
    the test's own namespace, with addresses), the same probe reaches a listener there.
    Removed afterwards, and the host passes its check again."""
    a = two["a"]
    peer = f"lx{two.run_id}"
    network.command("ip", "netns", "add", peer)
    try:
        network.command("ip", "link", "add", "px0", "type", "veth", "peer", "name", "px1",
                        "netns", a.netns, netns=peer)
        network.command("ip", "addr", "add", "10.231.0.1/24", "dev", "px0", netns=peer)
        network.command("ip", "link", "set", "px0", "up", netns=peer)
        network.command("ip", "link", "set", "lo", "up", netns=peer)
        a.run("ip", "addr", "add", "10.231.0.2/24", "dev", "px1")
        a.run("ip", "link", "set", "px1", "up")
        server = subprocess.Popen(
            [network.program("ip"), "netns", "exec", peer, sys.executable, "-I", "-S", "-c",
             "import socket,time\ns=socket.create_server(('10.231.0.1', 8089))\n"
             "print('up', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "up"
            assert network.probe(a, "10.231.0.1", 8089) == "connected"
            with pytest.raises(errors.ProvisioningError, match="interfaces"):
                two.check()
        finally:
            server.kill()
            server.wait(timeout=10)
    finally:
        # Deleting one end of a veth pair removes both at once. Deleting the namespace alone
        # frees its devices later, on the kernel's cleanup work queue: under load px1 outlived
        # the delete, and the probe met ECONNREFUSED from a namespace on its way out.
        if "px1" in a.run("ip", "-o", "link", "show"):
            a.run("ip", "link", "delete", "px1")
        network.command("ip", "netns", "delete", peer)
    assert network.probe(a, "10.231.0.1", 8089) == "ENETUNREACH"
    two.check()


def test_a_changed_host_fails_the_check(two: network.Hosts) -> None:
    a = two["a"]
    a.run("ip", "route", "add", "10.9.0.0/16", "dev", "eth0")
    try:
        with pytest.raises(errors.ProvisioningError, match=r"a route to 10\.9\.0\.0/16"):
            two.check()
    finally:
        a.run("ip", "route", "del", "10.9.0.0/16", "dev", "eth0")
    two.check()


@needs_root
def test_teardown_leaves_no_namespace_and_kills_host_processes() -> None:
    with network.Hosts(["solo"]) as built:
        child = built["solo"].popen(["sleep", "60"])
        run_id = built.run_id
        assert network.leftovers(run_id)
    assert network.leftovers(run_id) == []
    assert child.poll() is not None


def test_partitions_full_and_one_way_then_healed(two: network.Hosts) -> None:
    a, b = two["a"], two["b"]
    faults = netfaults.Faults(two)
    assert _udp(a, b) and _udp(b, a)
    faults.partition("a", "b", one_way=True)
    assert (_udp(a, b), _udp(b, a)) == (False, True)
    faults.heal("a", "b")
    faults.partition("a", "b")
    assert (_udp(a, b), _udp(b, a)) == (False, False)
    faults.heal_all()
    assert _udp(a, b) and _udp(b, a)
    kinds = [(e["what"], e.get("between", "")) for e in two.events if e["what"] != "checked"]
    assert ("partition", "a->b") in kinds and ("partition", "a<->b") in kinds


def test_a_partition_is_silent_to_an_open_connection_and_healing_delivers(
    two: network.Hosts,
) -> None:
    """As a cut cable: ``a`` writes into an open TCP connection to ``b`` without an error,
    ``b`` receives nothing while ``a`` is cut from it, and TCP's retransmission delivers
    the bytes once the partition heals."""
    a, b = two["a"], two["b"]
    faults = netfaults.Faults(two)
    listener = b.inside(lambda: socket.create_server((b.address, 0)))
    sender = a.inside(lambda: socket.create_connection(
        (b.address, listener.getsockname()[1]), timeout=5))
    receiver, _ = listener.accept()
    try:
        receiver.settimeout(1.0)
        faults.partition("a", "b", one_way=True)
        assert sender.send(b"cut") == 3
        with pytest.raises(TimeoutError):
            receiver.recv(8)
        faults.heal("a", "b")
        receiver.settimeout(10.0)
        assert receiver.recv(8) == b"cut"
    finally:
        faults.heal_all()
        for sock in (sender, receiver, listener):
            sock.close()


@pytest.mark.skipif(shutil.which("nft") is None, reason="loss needs nftables")
def test_total_loss_on_a_link_drops_what_the_host_sends(two: network.Hosts) -> None:
    a, b = two["a"], two["b"]
    faults = netfaults.Faults(two)
    faults.shape("a", netfaults.LinkFault(loss_pct=100))
    try:
        assert not _udp(a, b)
        assert _udp(b, a)
    finally:
        faults.heal_all()
    assert _udp(a, b)


def test_link_fault_settings_are_checked() -> None:
    for bad in (netfaults.LinkFault(delay_ms=-1), netfaults.LinkFault(jitter_ms=5),
                netfaults.LinkFault(loss_pct=101), netfaults.LinkFault(reorder_pct=5)):
        with pytest.raises(errors.UsageError):
            bad.validate()
    assert netfaults.LinkFault(delay_ms=50, jitter_ms=5, reorder_pct=10).netem_args() == [
        "delay", "50ms", "5ms", "reorder", "10%"]


def test_the_loopback_guard_learns_exactly_the_hosts_addresses() -> None:
    env = {loopback.HOSTS_ENV: "169.254.7.1,169.254.7.2"}
    dsn = "host=169.254.7.1,169.254.7.2 port=5432,5432 dbname=postgres user=u"
    assert "hostaddr=169.254.7.1,169.254.7.2" in loopback.check_dsn(dsn, env)
    for outside in ("169.254.7.3", "10.0.0.1", "169.254.007.1"):
        with pytest.raises(errors.BoundaryViolation):
            loopback.check_dsn(f"host={outside} dbname=postgres", env)
    with pytest.raises(errors.BoundaryViolation):
        loopback.check_dsn("host=127.0.0.1 dbname=postgres", {loopback.HOSTS_ENV: "10.0.0.1"})
    with pytest.raises(errors.BoundaryViolation):
        loopback.check_endpoint("http://169.254.7.9:80")
    loopback.learn(["169.254.7.9"])
    try:
        assert loopback.check_endpoint("http://169.254.7.9:80") == "http://169.254.7.9:80"
    finally:
        loopback.forget(["169.254.7.9"])
    with pytest.raises(errors.BoundaryViolation):
        loopback.learn(["192.168.0.1"])


@needs_root
def test_a_killed_owner_leaves_no_namespace_behind() -> None:
    """The process that built the hosts is SIGKILLed: its reaper deletes the namespaces."""
    script = ("import os, signal, sys\nfrom lab.hosts import network\n"
              "built = network.Hosts(['k']).__enter__()\nprint(built.run_id, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    run_id = done.stdout.strip()
    assert run_id and done.returncode == -9
    deadline = time.monotonic() + 30
    while network.leftovers(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert network.leftovers(run_id) == []


def test_the_hosts_programs_are_found_without_sbin_on_the_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A publishable run's sandbox has PATH=/usr/bin:/bin; the hosts' system programs
    (sysctl, tc, nft live in /usr/sbin) are found by absolute path all the same (every
    chapter 17 experiment failed in a genuine lab publish with "exec of sysctl failed")."""
    from lab.hosts import network

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert network.program("sysctl") == "/usr/sbin/sysctl"
    assert network.command("sysctl", "-n", "kernel.ostype").strip() == "Linux"
    assert network.program("no-such-program-here") == "no-such-program-here"
