"""A cold tier that reads every page (the bit ladder under a byte target) hands the same packed segment over from one
read to the next while its pages do not change (:class:`confkv.tiers.cold_read.EveryPageRead`), and the native read
uses what it worked out from that segment again (``PagedSegment.native_args``). Both are only ways of not building
the same thing twice: a cache decodes the same with them as without, a change of the pages makes a new segment, a
segment copied with a field changed is worked out again, and a copied cache does not keep them.
"""

from __future__ import annotations

import copy

import pytest
import torch

from confkv.hf import ConfKVCache, prefill
from confkv.models import tiny_model
from confkv.native import pages as native_pages
from confkv.native.loader import available
from confkv.tiers import cold_read
from confkv.tiers.ladder import LadderTier
from decode_stream import decode_logits

pytestmark = pytest.mark.skipif(not available(), reason="the packed pages are handed to the native read")


def _stream(steps: int, monkeypatch, cached: bool = True, batch: int = 1):
    """A tiny Llama at memory=0.25 through 200 tokens of prefill and ``steps`` decode steps; per step and layer, the
    page segments the read took (by identity); the logits and the cache."""
    if not cached:
        monkeypatch.setattr(cold_read.EveryPageRead, "serves", lambda self, *args: False)
    handed = []
    real = native_pages._read

    def read(lib, query, segments, *args, **kwargs):
        handed.append([s for s in segments if hasattr(s, "counts")])
        return real(lib, query, segments, *args, **kwargs)

    monkeypatch.setattr(native_pages, "_read", read)
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, memory=0.25)
    ids = torch.randint(0, 250, (batch, 200 + steps), generator=torch.Generator().manual_seed(5))
    logits = decode_logits(model, cache, ids, 200, 64)
    monkeypatch.undo()
    return logits, handed, cache


@pytest.mark.parametrize("batch", [1, 2])
def test_a_cache_decodes_the_same_with_the_segment_kept_as_without(batch, monkeypatch):
    logits, handed, cache = _stream(60, monkeypatch, batch=batch)
    want, fresh, want_cache = _stream(60, monkeypatch, cached=False, batch=batch)
    assert torch.equal(logits, want) and cache.kv_bytes() == want_cache.kv_bytes()
    layers = len(cache.layers)
    same = sum(a is b for step, after in zip(handed, handed[layers:]) for a, b in zip(step, after))
    assert same > len(handed) // 2  # most steps hand over the segment of the step before
    assert not any(a is b for step, after in zip(fresh, fresh[layers:]) for a, b in zip(step, after))


def test_a_new_segment_when_the_pages_change(monkeypatch):
    _, handed, cache = _stream(70, monkeypatch)
    layers = len(cache.layers)
    rung_reads = [[(id(s), s.width) for s in step] for step in handed[::layers]]  # layer 0, step by step
    changes = [(a, b) for a, b in zip(rung_reads, rung_reads[1:]) if a != b]
    assert changes, "no page changed in 70 steps: the test needs a longer stream"
    # a segment is handed over again only while its pages are the same: when the width (pages) changed, so did the object
    for before, after in zip(rung_reads, rung_reads[1:]):
        for (id_a, width_a), (id_b, width_b) in zip(before, after):
            assert width_a == width_b or id_a != id_b


def test_a_copied_cache_keeps_neither():
    model, cache, ids = _prefilled()
    assert _a_kept_read(cache, model, ids).segment.native_args is not None
    twin = copy.deepcopy(cache)
    for layer in twin.layers:
        if isinstance(layer.store.cold, LadderTier):
            assert all(rung._every_page is None for rung in layer.store.cold.rungs)
    # and the copy decodes as the original does (its own pages read, not the original's)
    with torch.no_grad():
        a = model(ids[:, -1:], cache=cache).logits
        b = model(ids[:, -1:], cache=twin).logits
    assert torch.equal(a, b)


def _prefilled():
    """A tiny Llama, its cache at memory=0.25 prefilled with 200 of ``ids``' 260 tokens: (model, cache, ids)."""
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, memory=0.25)
    ids = torch.randint(0, 250, (1, 260), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        prefill(model, cache, ids[:, :200], chunk=64)
    return model, cache, ids


def _a_kept_read(cache, model, ids) -> cold_read.EveryPageRead:
    """Decode ``ids`` past the prefill until some rung keeps an every-page read at the end of a step (a rung whose
    pages changed in the step's fit has none), and return it."""
    for t in range(200, ids.shape[1]):
        with torch.no_grad():
            model(ids[:, t:t + 1], cache=cache)
        kept = [rung._every_page for layer in cache.layers for rung in layer.store.cold.rungs
                if rung._every_page is not None]
        if kept:
            return kept[0]
    raise AssertionError("no rung kept its every-page read")


def test_a_segment_copied_with_a_field_changed_is_worked_out_again():
    model, cache, ids = _prefilled()
    segment = _a_kept_read(cache, model, ids).segment
    assert segment.native_args is not None
    fewer = copy.copy(segment)
    fewer.counts = torch.zeros_like(segment.counts)  # no sequence reads a page
    keep: list = []
    native_pages._paged(fewer, keep)
    assert keep[1] is not segment.native_args[3][1] and int(keep[1].sum()) == 0


def test_new_page_tensors_let_the_kept_read_go():
    """A rung whose page tensors are replaced (a page dropped or added under the ladder's exact capacity) lets its
    kept segment go at once, so the old tensors are freed then, not at the next read (they are no longer counted)."""
    model, cache, ids = _prefilled()
    kept = _a_kept_read(cache, model, ids)
    rung = next(rung for layer in cache.layers for rung in layer.store.cold.rungs if rung._every_page is kept)
    rung.drop_pages(torch.zeros(*kept.segment.index.shape[:2], 1, dtype=torch.int64))
    assert rung._every_page is None


def test_a_page_tensor_replaced_in_the_dict_is_not_read_through_the_kept_segment():
    """The setter of ``pages`` lets the kept segment go with a new dict; a tensor replaced inside the dict bypasses it,
    and the kept segment (whose pointers are the old tensor's) must not serve the next read."""
    model, cache, ids = _prefilled()
    kept = _a_kept_read(cache, model, ids)
    rung = next(rung for layer in cache.layers for rung in layer.store.cold.rungs if rung._every_page is kept)
    index = kept.segment.index
    assert rung._paged(index, torch.full(index.shape[:1], 10 ** 6), index.shape[2], kept.segment.rotation,
                       every=True) is kept.segment  # nothing replaced: the kept segment
    rung.pages["key_codes"] = rung.pages["key_codes"].clone()
    fresh = rung._paged(index, torch.full(index.shape[:1], 10 ** 6), index.shape[2], kept.segment.rotation, every=True)
    assert fresh is not kept.segment and fresh.key_codes is rung.pages["key_codes"]
