"""scripts/fetch-model, offline: the digest decides, and a verified copy is never refetched."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import io
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

import pytest

from lab import model

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fetch-model"
CONTENT = b"GGUF pretend weights " * 1000
DIGEST = hashlib.sha256(CONTENT).hexdigest()


@pytest.fixture(scope="module")
def fetch_model() -> ModuleType:
    """The script imported as a module (it has no .py suffix)."""
    loader = importlib.machinery.SourceFileLoader("fetch_model", str(SCRIPT))
    spec = importlib.util.spec_from_loader("fetch_model", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class Opener:
    """A fake network: serves fixed bytes and counts requests."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.urls: list[str] = []

    def __call__(self, url: str) -> BinaryIO:
        self.urls.append(url)
        return io.BytesIO(self.body)


def refuse_network(url: str) -> BinaryIO:
    raise AssertionError(f"the script tried to download {url}")


def test_pins_are_the_seeds_and_the_labs(fetch_model: ModuleType) -> None:
    assert fetch_model.SHA256 == model.PINNED_SHA256
    assert model.PINNED.revision == fetch_model.REVISION
    assert model.PINNED.file == fetch_model.FILE_NAME
    assert fetch_model.URL == (
        "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF/resolve/"
        "9217f5db79a29953eb74d5343926648285ec7e67/qwen2.5-0.5b-instruct-q4_k_m.gguf"
    )


def test_verified_copy_is_kept_without_downloading(fetch_model: ModuleType, tmp_path: Path) -> None:
    dest = tmp_path / "model.gguf"
    dest.write_bytes(CONTENT)
    before = dest.stat().st_mtime_ns
    assert fetch_model.fetch(dest, sha256=DIGEST, opener=refuse_network) is False
    assert dest.read_bytes() == CONTENT
    assert dest.stat().st_mtime_ns == before


def test_missing_file_is_downloaded_verified_and_moved_into_place(
    fetch_model: ModuleType, tmp_path: Path
) -> None:
    dest = tmp_path / "sub" / "model.gguf"
    opener = Opener(CONTENT)
    assert fetch_model.fetch(dest, url="https://example.invalid/m", sha256=DIGEST, opener=opener)
    assert opener.urls == ["https://example.invalid/m"]
    assert dest.read_bytes() == CONTENT
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.gguf"]
    # A second call finds the verified copy and does not download again.
    assert fetch_model.fetch(dest, sha256=DIGEST, opener=refuse_network) is False


def test_wrong_download_is_deleted_and_never_moved_into_place(
    fetch_model: ModuleType, tmp_path: Path
) -> None:
    dest = tmp_path / "model.gguf"
    with pytest.raises(fetch_model.FetchError, match="expected " + DIGEST):
        fetch_model.fetch(dest, sha256=DIGEST, opener=Opener(CONTENT + b"tampered"))
    assert list(tmp_path.iterdir()) == []


def test_stale_copy_is_replaced_only_by_a_verified_download(
    fetch_model: ModuleType, tmp_path: Path
) -> None:
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"an older, different file")
    with pytest.raises(fetch_model.FetchError):
        fetch_model.fetch(dest, sha256=DIGEST, opener=Opener(b"also wrong"))
    assert dest.read_bytes() == b"an older, different file"
    assert fetch_model.fetch(dest, sha256=DIGEST, opener=Opener(CONTENT)) is True
    assert dest.read_bytes() == CONTENT


def test_network_failure_leaves_nothing_behind(fetch_model: ModuleType, tmp_path: Path) -> None:
    def broken(url: str) -> BinaryIO:
        raise OSError("connection refused")

    dest = tmp_path / "model.gguf"
    with pytest.raises(fetch_model.FetchError, match="connection refused"):
        fetch_model.fetch(dest, sha256=DIGEST, opener=broken)
    assert list(tmp_path.iterdir()) == []


def test_only_https_is_fetched(fetch_model: ModuleType) -> None:
    with pytest.raises(fetch_model.FetchError, match="non-https"):
        fetch_model._open_url("http://huggingface.co/model.gguf")


def test_command_reports_a_verified_copy_offline(
    fetch_model: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dest = tmp_path / "model.gguf"
    dest.write_bytes(CONTENT)
    monkeypatch.setattr(fetch_model, "SHA256", DIGEST)
    monkeypatch.setattr(fetch_model, "_open_url", refuse_network)
    assert fetch_model.main(["--dest", str(dest)]) == 0
    assert "verified copy already present" in capsys.readouterr().out


def test_command_fails_in_one_line_on_a_bad_download(
    fetch_model: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(fetch_model, "_open_url", Opener(b"not the model"))
    assert fetch_model.main(["--dest", str(tmp_path / "model.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("fetch-model: downloaded file has sha256")
    assert list(tmp_path.iterdir()) == []


def test_script_runs_standalone() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "--dest" in done.stdout
