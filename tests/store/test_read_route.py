"""A tiered store decides its read path once per kind of read (issue 32; confkv/store/read.py, ``ReadRoute``).

The plan is made when the read's signature changes, and the steps between call the native page read directly;
these tests check that it is made once, that it is made again whenever what it looked at changes (the library
switched off, the scores over the limit, a copy of the store), and that the reads stay what they were.
"""

from __future__ import annotations

import pytest
import torch

from confkv import profiling
from confkv.attention import KVSegment, read_plan
from confkv.attention.segments import PagedSegment
from confkv.native import loader
from confkv.native import pages as native_pages
from confkv.store import read as store_read

pytestmark = pytest.mark.skipif(not loader.available(), reason="the native library is not built here")

PROMPT, STEPS = 300, 8


def _model():
    from confkv.models.tiny import tiny_model

    return tiny_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)


def _prefilled(model, ids):
    from confkv.hf import ConfKVCache, prefill

    cache = ConfKVCache.for_model(model, memory=0.25)
    with torch.no_grad():
        prefill(model, cache, ids[:, :PROMPT], chunk=64)
    return cache


def _decode(model, cache, ids, start, steps):
    """Feed ids[:, start:start + steps] one at a time; the last step's logits [B, V]."""
    with torch.no_grad():
        for t in range(start, start + steps):
            logits = model(ids[:, t:t + 1], cache=cache).logits[:, -1]
    return logits


def _ids(model, batch=1, length=PROMPT + 3 * STEPS):
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))


def _counting(monkeypatch):
    """(plans, reads): the lists that grow by one per read plan made and per native page read (the C call)."""
    plans, reads = [], []
    real_plan, real_read = read_plan.plan, native_pages._read
    monkeypatch.setattr(read_plan, "plan", lambda *a, **k: plans.append(1) or real_plan(*a, **k))
    monkeypatch.setattr(native_pages, "_read", lambda *a, **k: reads.append(1) or real_read(*a, **k))
    return plans, reads


def test_the_decode_steps_of_a_tiered_store_plan_their_read_once_and_read_natively(monkeypatch):
    model = _model()
    ids = _ids(model)
    cache = _prefilled(model, ids)
    _decode(model, cache, ids, PROMPT, 2)  # the route of a one-token read is made here
    layers = model.config.num_hidden_layers
    plans, reads = _counting(monkeypatch)
    timers = profiling.Timers()
    with profiling.enabled(timers):
        _decode(model, cache, ids, PROMPT + 2, STEPS)
    assert len(reads) == STEPS * layers  # every read of every layer: the native page read
    assert len(plans) <= layers  # at most one new signature per layer (a rung's first page) in the steps
    assert dict(timers.fallbacks) == {}
    routes = [layer.store.read_route for layer in cache.layers]
    assert all(route is not None and route.reader is not None for route in routes)


def test_the_route_is_made_again_when_the_library_is_switched_off_and_on(monkeypatch):
    model = _model()
    ids = _ids(model)
    cache = _prefilled(model, ids)
    _decode(model, cache, ids, PROMPT, 2)
    layers = model.config.num_hidden_layers
    plans, reads = _counting(monkeypatch)
    timers = profiling.Timers()
    with profiling.enabled(timers):
        with loader.disabled():
            _decode(model, cache, ids, PROMPT + 2, 2)
        assert reads == [] and timers.fallbacks["native kernels unavailable"] == 2 * layers
        _decode(model, cache, ids, PROMPT + 4, 2)
    assert len(reads) == 2 * layers  # back on the native read after the block
    assert timers.fallbacks["native kernels unavailable"] == 2 * layers


def test_a_read_whose_scores_pass_the_limit_leaves_the_route_and_is_counted(monkeypatch):
    model = _model()
    ids = _ids(model)
    cache = _prefilled(model, ids)
    _decode(model, cache, ids, PROMPT, 2)
    _, reads = _counting(monkeypatch)
    # a limit the next read's scores pass (1 sequence x 6 query heads x hundreds of slots), the route made under
    # the real one: the signature's "scores fit" term changes, so the read is planned again and leaves
    monkeypatch.setattr(store_read, "MAX_SCORES", 100)
    monkeypatch.setattr(read_plan, "MAX_SCORES", 100)
    timers = profiling.Timers()
    with profiling.enabled(timers):
        _decode(model, cache, ids, PROMPT + 2, 1)
    assert reads == []
    assert timers.fallbacks["scores over MAX_SCORES"] == model.config.num_hidden_layers


def test_a_clone_starts_without_the_route_and_decodes_as_its_original():
    model = _model()
    ids = _ids(model, batch=2)
    cache = _prefilled(model, ids)
    _decode(model, cache, ids, PROMPT, 3)
    twin = cache.clone()
    assert all(layer.store.read_route is None for layer in twin.layers)
    original = _decode(model, cache, ids, PROMPT + 3, STEPS)
    copied = _decode(model, twin, ids, PROMPT + 3, STEPS)
    assert torch.equal(original, copied)


def test_the_routed_read_gives_the_bits_of_the_checked_read(monkeypatch):
    """The same run twice: the store's route (checked once), and a route made at every read (page_read's own
    checks each time): the same logits to the last bit."""
    model = _model()
    ids = _ids(model, batch=2)
    routed = _decode(model, _prefilled(model, ids), ids, PROMPT, STEPS)
    real = store_read.ReadRoute.__init__

    def forget(self, signature, reader, kept):  # a signature no read matches: planned again at every read
        real(self, (object(),), reader, kept)

    monkeypatch.setattr(store_read.ReadRoute, "__init__", forget)
    plans, _ = _counting(monkeypatch)
    every_time = _decode(model, _prefilled(model, ids), ids, PROMPT, STEPS)
    assert len(plans) >= STEPS * model.config.num_hidden_layers
    assert torch.equal(routed, every_time)


def test_a_read_kind_names_what_the_plan_looks_at():
    keys = torch.zeros(1, 2, 5, 16)
    plain = KVSegment(keys, keys, None)
    assert plain.read_kind == KVSegment(keys.clone(), keys.clone(), None).read_kind  # the same kind, other tensors
    assert plain.read_kind != KVSegment(keys, keys, torch.ones(1, 1, 1, 5, dtype=torch.bool)).read_kind  # a mask
    assert plain.read_kind != KVSegment(keys.bfloat16(), keys, None).read_kind  # a dtype
    assert plain.read_kind != KVSegment(keys[:, :, :0], keys[:, :, :0], None).read_kind  # empty
    index, counts = torch.zeros(1, 2, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    valid = torch.ones(1, 2, 1, 8, dtype=torch.bool)

    def pages(bits, value_bits=None, rotation=None):
        return PagedSegment(index, counts, valid, bits, 8, 16, value_bits=value_bits, rotation=rotation)

    kinds = [pages(4).read_kind, pages(3).read_kind, pages(4, value_bits=2).read_kind,
             pages(4, rotation=object()).read_kind]
    assert len(set(kinds)) == len(kinds)
    assert pages(4).read_kind == pages(4).read_kind


def test_a_read_of_the_same_kind_inside_disabled_takes_the_torch_read(monkeypatch):
    """The library's state is part of the signature: the very read the route was made for, repeated inside
    ``loader.disabled()``, is planned again and goes to the torch read (every caller's torch code, as promised)."""
    model = _model()
    ids = _ids(model)
    cache = _prefilled(model, ids)
    seen = []
    real = store_read.AttentionRead._tiered_read
    monkeypatch.setattr(store_read.AttentionRead, "_tiered_read",
                        lambda self, *a: seen.append((self, a)) or real(self, *a))
    _decode(model, cache, ids, PROMPT, 1)
    store, args = seen[-1]
    native_out, _, _ = real(store, *args)
    _, reads = _counting(monkeypatch)
    timers = profiling.Timers()
    with loader.disabled(), profiling.enabled(timers):
        torch_out, _, _ = real(store, *args)
    assert reads == [] and timers.fallbacks["native kernels unavailable"] == 1
    torch.testing.assert_close(torch_out, native_out, atol=1e-5, rtol=1e-4)
    real(store, *args)
    assert len(reads) == 1  # out of the block: the native read again
