"""The sandbox of publishable runs and the parent's seal (issue 42).

The sandbox is run for real (``/usr/bin/bwrap``, which ``scripts/test`` installs from
Debian; without it these tests fail saying so): a probe inside it reports what it can
see, write and reach. The seal is exercised on evidence the compiler writes: a run that
signed with an ephemeral key is re-signed by the parent's key and verifies pinned to it;
a run that held a key of its own, or whose rows are not its signed log's, is refused and
nothing is written.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from lab import errors, sandbox
from lab.evidence import compiler, dsse, seal, verification
from tests.support import labtree

PROBE = r"""
import json, os, socket, sys
port, outside = int(sys.argv[1]), sys.argv[2]
seen = {"env": dict(os.environ), "tmp": sorted(os.listdir("/tmp")),
        "outside_file": os.path.exists(outside), "hostname": socket.gethostname()}
try:
    open("/usr/lab-sandbox-probe", "w")
    seen["usr_writable"] = True
except OSError:
    seen["usr_writable"] = False
try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    seen["reached_host_loopback"] = True
except OSError:
    seen["reached_host_loopback"] = False
seen["interfaces"] = sorted(name for _, name in socket.if_nameindex())
print(json.dumps(seen))
"""


def _require_bwrap() -> None:
    if not sandbox.available():
        pytest.fail(f"the sandbox tests need {sandbox.BWRAP}: {sandbox.INSTALL_HINT}")


def test_the_sandbox_sees_only_what_it_is_given(tmp_path: Path) -> None:
    """Inside: exactly the given environment (plus bwrap's PWD), a fresh /tmp, no file of
    the machine's /tmp, a read-only /usr, its own hostname, and a network namespace of its
    own: a server listening on the machine's loopback cannot be reached."""
    _require_bwrap()
    outside = tmp_path / "caller-secret"
    outside.write_text("x")
    work = tmp_path / "work"
    work.mkdir()
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        port = listener.getsockname()[1]
        layout = sandbox.Layout(read_only=(Path(sys.base_prefix).resolve(),),
                                writable=(work,), workdir=work)
        env = sandbox.fixed_environment({"PATH": "/caller/bin", "BOOK_RUN_URL": "https://ci.example/run/1",
                                         "HOME": str(work)})
        done = subprocess.run(sandbox.command(layout, env, [
            str(Path(sys.base_prefix) / "bin" / "python3"), "-I", "-c", PROBE, str(port),
            str(outside)]), capture_output=True, text=True, timeout=120, check=False)
    finally:
        listener.close()
    assert done.returncode == 0, done.stderr
    seen: dict[str, Any] = json.loads(done.stdout)
    assert seen["env"] == {**env, "PWD": str(work)}
    assert seen["env"]["PATH"] == sandbox.PATH
    # /tmp is a fresh tmpfs: only the directories leading to the bound work dir exist.
    leading = work.parts[2] if work.parts[1] == "tmp" else None
    assert seen["tmp"] == ([leading] if leading else [])
    assert seen["outside_file"] is False
    assert seen["usr_writable"] is False
    assert seen["hostname"] == sandbox.HOSTNAME
    assert seen["reached_host_loopback"] is False
    assert seen["interfaces"] == ["lo"]


def test_chapter_17s_hosts_can_be_made_inside_the_sandbox(tmp_path: Path) -> None:
    """A host of chapter 17 is a network namespace entered with ``ip netns exec``, which
    mounts that namespace's own sysfs on /sys: inside the sandbox it works, and the
    machine's /sys is not what it sees (every ch17 experiment failed in a publishable run
    before the sandbox had a /sys mount point)."""
    _require_bwrap()
    work = tmp_path / "work"
    work.mkdir()
    layout = sandbox.Layout(read_only=(), writable=(work,), workdir=work)
    script = ("ip netns add lab-probe && "
              "ip netns exec lab-probe /usr/sbin/sysctl -q -w net.ipv4.ip_forward=0 && "
              "ip netns exec lab-probe ls /sys/class/net && ip netns del lab-probe")
    done = subprocess.run(sandbox.command(layout, sandbox.fixed_environment({}),
                                          ["/bin/sh", "-c", script]),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    # The new namespace's sysfs: its own loopback only, none of the machine's interfaces.
    assert done.stdout.split() == ["lo"], done.stdout


def test_a_missing_bwrap_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without bubblewrap a hermetic run is refused before anything runs, naming the fix."""
    monkeypatch.setattr(sandbox, "BWRAP", "/nonexistent/bwrap")
    with pytest.raises(errors.EnvironmentFailure, match="apt-get install bubblewrap"):
        sandbox.require()


def test_the_trusted_base_names_the_kernel_interpreter_and_server() -> None:
    """What a sandboxed run trusts is recorded with digests, not names alone."""
    base = sandbox.trusted_base(Path(sys.base_prefix) / "bin" / "python3", None)
    assert base["kernel"].startswith("Linux ")
    assert len(base["interpreter"]["sha256"]) == 64
    assert base["postgresql_binaries"] == {}


# --------------------------------------------------------------------------- the seal


def _evidence(tmp_path: Path, signer: dsse.Signer) -> tuple[Path, Path]:
    """A passing one-experiment run's evidence, signed by ``signer``, and its tree."""
    root = labtree.one_experiment_tree(tmp_path)
    directory = tmp_path / "ev"
    compiler.write(directory, compiler.RunFacts(**labtree.one_experiment_facts()), root=root,
                   signer=signer)
    return directory, root


def _key_file(tmp_path: Path) -> tuple[Path, ed25519.Ed25519PrivateKey]:
    key = ed25519.Ed25519PrivateKey.generate()
    path = tmp_path / "publication.pem"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path, key


def test_the_parent_seals_with_the_key_the_run_never_saw(tmp_path: Path) -> None:
    """A run signed with an ephemeral key is re-signed by the parent: it verifies pinned
    to the publication key, says who sealed it, and carries the trusted base."""
    directory, root = _evidence(tmp_path, dsse.load_signer({}))
    path, key = _key_file(tmp_path)
    signer = dsse.load_signer({dsse.KEY_ENV: str(path)})
    report = seal.seal(directory, signer, {"kernel": "Linux test"})
    assert report["signing"][seal.SEALED_BY] == seal.PARENT
    assert report["trusted_base"] == {"kernel": "Linux test"}
    verdict = verification.verify(directory, check_sources=True, root=root,
                                  public_key=key.public_key())
    assert verdict.ok, verdict.problems


def test_a_run_that_held_a_key_or_changed_its_rows_is_not_sealed(tmp_path: Path) -> None:
    """The seal refuses a run that signed with a key of its own (the key entered the run)
    and a report whose rows are not its signed log's; it writes nothing then."""
    path, _ = _key_file(tmp_path)
    keyed, _ = _evidence(tmp_path / "keyed", dsse.load_signer({dsse.KEY_ENV: str(path)}))
    before = {p.name: p.read_bytes() for p in keyed.iterdir()}
    with pytest.raises(errors.EvidenceError, match="must never enter the run"):
        seal.seal(keyed, dsse.load_signer({}), {})
    assert {p.name: p.read_bytes() for p in keyed.iterdir()} == before

    forged, _ = _evidence(tmp_path / "forged", dsse.load_signer({}))
    report_path = forged / compiler.REPORT_FILE
    report = json.loads(report_path.read_bytes())
    report["tests"][0]["outcome"] = "failed"
    report_path.write_bytes(compiler.dumps_report(report))
    with pytest.raises(errors.EvidenceError, match="sealing"):
        seal.seal(forged, dsse.load_signer({}), {})


def test_the_book_prints_the_trusted_base() -> None:
    """The book's provenance names what a sealed run trusted, digests included; a run that
    was not sandboxed has no such line."""
    from lab.book import pages

    base = sandbox.trusted_base(Path(sys.base_prefix) / "bin" / "python3", None)
    base["packages"] = {"bubblewrap": "0.8.0-2+deb12u1"}
    text = "\n".join(pages.trusted_base_lines({"trusted_base": base}))
    assert "Trusted base" in text and base["interpreter"]["sha256"] in text
    assert "bubblewrap" in text and base["kernel"] in text
    assert pages.trusted_base_lines({}) == []
