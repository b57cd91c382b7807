"""The lean decoder (confkv/hf/lean.py) gives the model's own logits, step by step, over the same cache."""

import pytest
import torch

from confkv.config import StoreConfig
from confkv.errors import UnsupportedModelError
from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LEAN_MODEL_TYPES, LeanDecoder
from confkv.models import tiny_model

POLICIES = [
    ("full", {}, StoreConfig()),
    ("streaming", {"budget": 20, "sinks": 2}, StoreConfig()),
    ("confkv", {"n_high": 16, "n_low": 28, "tau": 0.02, "protect": 4},
     StoreConfig(kv_int8=True, fp_window=8, move_block=8)),
    ("confkv-r", {"budget": 16, "protect": 4, "bits": 4, "page_size": 4, "group_size": 4, "k": 2}, StoreConfig()),
]


def _prompt(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 250, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(1, batch):  # left padding
        mask[b, : 3 * b] = 0
    return ids, mask


def _decode_both(model, name, params, store, batch, steps=24, prompt=30):
    """Prefill the same prompt into two caches, then decode the same tokens: model(...) vs the lean decoder."""
    ids, mask = _prompt(batch, prompt + steps, seed=batch)
    lean = LeanDecoder(model)
    caches = [ConfKVCache.for_model(model, name, store=store, **params) for _ in range(2)]
    for cache in caches:
        prefill(model, cache, ids[:, :prompt], attention_mask=mask[:, :prompt], chunk=8)
    pairs = []
    for t in range(prompt, prompt + steps):
        token, seen_mask = ids[:, t:t + 1], mask[:, : t + 1]
        positions = (seen_mask.long().cumsum(-1) - 1).masked_fill(seen_mask == 0, 1)[:, -1:]
        reference = model(input_ids=token, cache=caches[0], attention_mask=seen_mask, position_ids=positions,
                          logits_to_keep=1).logits[:, -1]
        pairs.append((reference, lean(token, caches[1], attention_mask=seen_mask)))
    return pairs, caches


@pytest.mark.parametrize("arch", LEAN_MODEL_TYPES)
@pytest.mark.parametrize("name,params,store", POLICIES, ids=[p[0] for p in POLICIES])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_lean_logits_equal_the_models_forward(arch, name, params, store, asymmetric):
    model = tiny_model(arch, asymmetric=asymmetric)
    pairs, (reference, lean) = _decode_both(model, name, params, store, batch=1)
    for expected, got in pairs:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the same eviction and bytes: the step was closed by the LM head's hook in both
    assert [s.kept.tolist() for s in lean.trace.steps] == [s.kept.tolist() for s in reference.trace.steps]
    assert lean.trace.total_kv_bytes() == reference.trace.total_kv_bytes()
    if name != "full":
        assert int(lean.kept_counts().max()) < 54  # something was evicted, so the test covers eviction


@pytest.mark.parametrize("name,params,store", POLICIES[1:3], ids=[p[0] for p in POLICIES[1:3]])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_lean_with_left_padding_equals_the_models_forward(name, params, store, asymmetric):
    model = tiny_model("llama", asymmetric=asymmetric)
    pairs, _ = _decode_both(model, name, params, store, batch=3)
    for expected, got in pairs:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_lean_prefill_of_several_tokens_equals_the_models_forward(asymmetric):
    model = tiny_model("qwen2", asymmetric=asymmetric)
    ids, _ = _prompt(2, 40)
    caches = [ConfKVCache.for_model(model, "streaming", budget=20, sinks=2) for _ in range(2)]
    lean = LeanDecoder(model)
    for begin in range(0, 40, 10):
        chunk = ids[:, begin:begin + 10]
        expected = model(input_ids=chunk, cache=caches[0], logits_to_keep=1).logits[:, -1]
        torch.testing.assert_close(lean(chunk, caches[1]), expected, rtol=1e-5, atol=1e-5)
    assert caches[1].get_seq_length() == 40


@pytest.mark.parametrize("arch", ["gpt2", "gemma3"])
def test_other_architectures_are_refused_with_the_fix(arch):
    with pytest.raises(UnsupportedModelError, match="model\\(...\\) or confkv.hf.generate"):
        LeanDecoder(tiny_model(arch))


def test_bad_mask_and_cache_are_refused():
    model = tiny_model("llama")
    lean = LeanDecoder(model)
    cache = ConfKVCache.for_model(model, "full")
    with pytest.raises(ValueError, match="attention_mask must be"):
        lean(torch.ones(1, 3, dtype=torch.long), cache, attention_mask=torch.ones(1, 2, dtype=torch.long))
    from transformers import DynamicCache
    with pytest.raises(TypeError, match="ConfKVCache"):
        lean(torch.ones(1, 3, dtype=torch.long), DynamicCache())


@pytest.mark.parametrize("page_format", ["kivi", "hadamard"])
def test_lean_logits_equal_the_models_forward_under_the_memory_preset(page_format):
    """The memory preset through the lean decoder, its ladder holding pages on every rung (plain, and
    ``kivi+hadamard`` pages read packed in their rotation): the model's own logits and the same bytes."""
    model = tiny_model("llama", asymmetric=True, head_dim=32)
    params = {"memory": 0.35, "page_size": 8, "group_size": 8, "format": page_format}
    pairs, (reference, lean) = _decode_both(model, "tiered", params, StoreConfig(), batch=1, steps=12, prompt=200)
    for expected, got in pairs:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert lean.trace.total_kv_bytes() == reference.trace.total_kv_bytes()
    assert all(rung.num_pages > 0 for rung in lean.layers[0].store.cold.rungs[:2])  # pages were read, stepped down
