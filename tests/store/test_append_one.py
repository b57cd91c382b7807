"""A decode step of a store that does not decode in place (under a memory target, with an INT8 older region, ...)
appends its token and places its position in fewer calls (``AttentionRead._append_one``): the output and the whole
state are those of ``append`` + ``attend``, byte for byte, step after step."""

from __future__ import annotations

import copy

import pytest
import torch

from confkv.config import StoreConfig
from confkv.hf import ConfKVCache, prefill
from confkv.models import tiny_model
from confkv.store import read as read_module

pytestmark = pytest.mark.usefixtures("nan_filled_empty")


def _same_region(a, b) -> None:
    for name in ("keys", "values", "positions", "valid", "key_scale", "value_scale"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.stats.keys() == b.stats.keys() and all(torch.equal(a.stats[k], b.stats[k]) for k in a.stats)
    assert a.all_valid == b.all_valid


@pytest.mark.parametrize("setting", ["preset", "int8", "preset-batch"])
def test_a_decode_step_leaves_what_append_and_attend_leave(setting, monkeypatch):
    model = tiny_model("llama")
    batch = 2 if setting == "preset-batch" else 1
    if setting == "int8":
        cache = ConfKVCache.for_model(model, "h2o", budget=40, protect=4, store=StoreConfig(kv_int8=True, fp_window=8))
    else:
        cache = ConfKVCache.for_model(model, memory=0.25)
    ids = torch.randint(0, 250, (batch, 150), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        prefill(model, cache, ids, chunk=64)
    taken = []
    real = read_module.AttentionRead._append_one
    monkeypatch.setattr(read_module.AttentionRead, "_append_one", lambda self, *a: taken.append(1) or real(self, *a))
    gen = torch.Generator().manual_seed(3)
    for layer in cache.layers:
        lean, reference = copy.deepcopy(layer.store), copy.deepcopy(layer.store)
        kv_heads, dim = lean.recent.keys.shape[1], lean.recent.keys.shape[3]
        dtype = lean.recent.keys.dtype
        for step in range(12):
            keys = torch.randn(batch, kv_heads, 1, dim, generator=gen).to(dtype)
            values = torch.randn(batch, kv_heads, 1, dim, generator=gen).to(dtype)
            query = torch.randn(batch, 2 * kv_heads, 1, dim, generator=gen).to(dtype)
            out = lean.decode_step(keys, values, query, scaling=dim ** -0.5)
            reference.append(keys, values)
            want = reference.attend(query, scaling=dim ** -0.5)
            assert torch.equal(out, want), step
            assert torch.equal(lean.seen_real, reference.seen_real) and lean.seen_tokens == reference.seen_tokens
            assert lean.pending == reference.pending == 0 and lean.last_queries == reference.last_queries
            _same_region(lean.recent, reference.recent)
            _same_region(lean.old, reference.old)
            budget = torch.full((batch,), lean.physical_length - 1)  # an eviction every step
            lean.end_step(budget)
            reference.end_step(budget)
            _same_region(lean.recent, reference.recent)
            _same_region(lean.old, reference.old)
            assert lean.kv_bytes() == reference.kv_bytes()
    assert len(taken) == 12 * len(cache.layers)


def test_a_decode_step_with_more_queries_than_keys_gets_the_clear_error():
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, memory=0.25)
    with torch.no_grad():
        prefill(model, cache, torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(2)), chunk=64)
    store = cache.layers[0].store
    kv_heads, dim, dtype = store.recent.keys.shape[1], store.recent.keys.shape[3], store.recent.keys.dtype
    keys = torch.zeros(1, kv_heads, 1, dim, dtype=dtype)
    with pytest.raises(RuntimeError, match="2 queries but 1 new keys in this layer"):
        store.decode_step(keys, keys, torch.zeros(1, 2 * kv_heads, 2, dim, dtype=dtype), scaling=1.0)
