"""Eviction invariants of the core cache, checked after every step on tiny models."""

import pytest
import torch

import confkv.hf.cache as cache_module
from confkv import StoreConfig
from confkv.hf import ConfKVCache, prefill
from confkv.models import tiny_model
from confkv.store import LayerStore

N_HIGH, N_LOW, PROTECT, SINKS = 12, 20, 4, 2


def _scripted_confidence(monkeypatch, pattern):
    """Replace the confidence by a scripted per-step sequence (one value per step, all sequences)."""
    calls = {"step": 0}

    def fake(logits, config=None):
        value = pattern[min(calls["step"], len(pattern) - 1)]
        calls["step"] += 1
        return torch.full((logits.shape[0],), float(value))

    monkeypatch.setattr(cache_module, "confidence_of", fake)


def _record_appends(monkeypatch):
    """Keep every key/value a store receives, per (store, batch, head, position)."""
    original_append, original_place = LayerStore.append, LayerStore._place_new_tokens
    seen: dict = {}

    def place(self, padding):
        positions = original_place(self, padding)
        new = positions.shape[1]
        keys, values = self.recent.keys[:, :, -new:], self.recent.values[:, :, -new:]
        valid = self.recent.valid[:, -new:]
        for b in range(keys.shape[0]):
            for i in range(new):
                if valid[b, i]:
                    seen[(id(self), b, int(positions[b, i]))] = (keys[b, :, i].clone(), values[b, :, i].clone())
        return positions

    monkeypatch.setattr(LayerStore, "_place_new_tokens", place)
    return seen


def _check_store(store, seen, budget_by_seq):
    for region in (store.old, store.recent):
        for b in range(region.valid.shape[0]):
            for slot in torch.nonzero(region.valid[b]).flatten().tolist():
                for h in range(region.keys.shape[1]):
                    pos = int(region.positions[b, h, slot])
                    key, value = seen[(id(store), b, pos)]
                    assert torch.equal(region.keys[b, h, slot], key[h]), "kept key changed"
                    assert torch.equal(region.values[b, h, slot], value[h]), "kept value changed"
    kept = store.kept_counts()
    assert (kept <= budget_by_seq).all(), (kept, budget_by_seq)
    # protected: the PROTECT most recent and the SINKS first real tokens of each sequence, in every head
    for b in range(kept.shape[0]):
        real = int(store.seen_real[b])
        must = set(range(max(real - PROTECT, 0), real)) | set(range(min(SINKS, real)))
        for h in range(store.recent.keys.shape[1]):
            held = set(store.old.positions[b, h][store.old.valid[b]].tolist())
            held |= set(store.recent.positions[b, h][store.recent.valid[b]].tolist())
            assert must <= held, (b, h, sorted(must - held))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_budget_protection_and_bit_identity_every_step(monkeypatch, arch):
    pattern = [0.0] * 20 + [1.0] * 8 + [0.0] * 14 + [1.0] * 6 + [0.0] * 12
    _scripted_confidence(monkeypatch, pattern)
    seen = _record_appends(monkeypatch)
    model = tiny_model(arch, seed=3)
    cache = ConfKVCache.for_model(model, "confkv", n_high=N_HIGH, n_low=N_LOW, protect=PROTECT, sinks=SINKS)
    ids = torch.randint(0, 250, (2, 60), generator=torch.Generator().manual_seed(0))
    kept_trace = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            model(ids[:, t:t + 1], cache=cache, use_cache=True)
            budget = N_HIGH if pattern[t] >= 0.5 else N_LOW
            for layer_idx in cache.managed:
                _check_store(cache.layers[layer_idx].store, seen, torch.tensor([budget, budget]))
            kept_trace.append(int(cache.layers[cache.managed[0]].store.kept_counts()[0]))
    # the sawtooth: grows by one per uncertain step up to N_LOW, drops to N_HIGH when confident
    assert kept_trace[19] == N_LOW and kept_trace[20] == kept_trace[27] == N_HIGH
    assert kept_trace[28] == N_HIGH + 1 and kept_trace[35] == kept_trace[41] == N_LOW and kept_trace[42] == N_HIGH
    assert [s.budget[0].item() for s in cache.trace.steps][:29] == [N_LOW] * 20 + [N_HIGH] * 8 + [N_LOW]
    if arch == "gemma3":  # sliding layers keep their own window (8 - 1 tokens), untouched by the policy
        for layer in cache.layers:
            if layer.is_sliding:
                assert (layer.store.kept_counts() == 7).all()


def test_per_sequence_budgets_in_a_batch(monkeypatch):
    calls = {"n": 0}

    def fake(logits, config=None):
        calls["n"] += 1
        return torch.tensor([1.0, 0.0])  # sequence 0 confident, sequence 1 not

    monkeypatch.setattr(cache_module, "confidence_of", fake)
    model = tiny_model("llama", seed=1)
    cache = ConfKVCache.for_model(model, "confkv", n_high=N_HIGH, n_low=N_LOW, protect=PROTECT, sinks=SINKS)
    ids = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for t in range(ids.shape[1]):
            model(ids[:, t:t + 1], cache=cache, use_cache=True)
    assert cache.kept_counts()[0].tolist() == [N_HIGH, N_LOW]


def test_chunked_prefill_peak_is_budget_plus_chunk(monkeypatch):
    model = tiny_model("llama", seed=2)
    cache = ConfKVCache.for_model(model, "confkv", n_high=N_HIGH, n_low=N_LOW, protect=PROTECT, sinks=SINKS,
                                  store=StoreConfig(prefill_chunk=7))
    peaks = []
    original = LayerStore.append

    def append(self, keys, values):
        original(self, keys, values)
        peaks.append(self.physical_length)

    monkeypatch.setattr(LayerStore, "append", append)
    ids = torch.randint(0, 250, (1, 100), generator=torch.Generator().manual_seed(2))
    prefill(model, cache, ids)
    assert max(peaks) <= N_LOW + 7
    assert len(cache.trace) == 15  # ceil(100 / 7) chunks, each closed by an eviction
    assert (cache.kept_counts() <= N_LOW).all()
    assert cache.get_seq_length() == 100


def test_kv_bytes_are_the_tensors_bytes():
    model = tiny_model("llama", seed=2)
    cache = ConfKVCache.for_model(model, "window", budget=10)
    ids = torch.randint(0, 250, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for t in range(30):
            model(ids[:, t:t + 1], cache=cache, use_cache=True)
    store = cache.layers[0].store
    held = sum(t.nbytes for r in (store.old, store.recent) for t in (r.keys, r.values))
    assert store.kv_bytes() == held == 2 * 2 * 2 * 10 * 16 * 4  # K+V, batch 2, 2 heads, 10 tokens, dim 16, fp32
    assert cache.trace.steps[-1].kv_bytes.sum().item() == cache.kv_bytes()
