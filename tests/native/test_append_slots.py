"""New slots appended to per-slot tensors in one C call (``confkv.native.pages.append_slots``, ``c/append.c``): the
bytes of ``torch.cat`` (and of a zero pad where no row is given), for the hot region's decode-step append and the
cold tier's demotion into its open page; tensors it does not take are declined; a cache that appends this way
decodes as one that concatenates."""

from __future__ import annotations

import pytest
import torch

from confkv import native
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.native import pages as native_pages
from decode_stream import decode_logits, same_cache_state

pytestmark = [pytest.mark.usefixtures("nan_filled_empty"),
              pytest.mark.skipif(not native.available(), reason="native kernels unavailable")]


@pytest.mark.parametrize("batch, heads, length, slots", [(1, 3, 40, 1), (3, 2, 0, 4), (2, 1, 7, 3)])
def test_the_slots_are_the_cats_bytes(batch, heads, length, slots):
    gen = torch.Generator().manual_seed(batch + 10 * slots)
    sources = [torch.randn(batch, heads, length, 8, generator=gen).to(torch.bfloat16),
               torch.randint(0, 99, (batch, heads, length), generator=gen),
               torch.rand(batch, heads, length, generator=gen),
               torch.rand(batch, heads, length, generator=gen)]
    news = [torch.randn(batch, slots, heads, 8, generator=gen).to(torch.bfloat16).transpose(1, 2),  # strided
            torch.randint(0, 99, (batch, 1, 1), generator=gen).expand(batch, heads, slots),  # one row repeated
            torch.rand(batch, heads, 2 * slots, generator=gen)[:, :, ::2],  # every other slot
            None]  # zeros
    got = native_pages.append_slots(sources, news)
    assert got is not None
    for made, source, new in zip(got, sources, news):
        want = torch.nn.functional.pad(source, (0, slots)) if new is None else torch.cat([source, new], dim=2)
        assert made.dtype == want.dtype and made.shape == want.shape and made.is_contiguous()
        assert torch.equal(made, want)


def test_what_it_does_not_take_is_declined():
    source = torch.zeros(1, 2, 3, 4)
    row = torch.zeros(1, 2, 1, 4)
    assert native_pages.append_slots([source], [None]) is None  # no row to take the slot count from
    assert native_pages.append_slots([source], [row.double()]) is None  # another dtype
    assert native_pages.append_slots([source], [torch.zeros(1, 2, 1, 8)[..., ::2]]) is None  # a strided row
    assert native_pages.append_slots([torch.zeros(1, 3, 2, 4).transpose(1, 2)], [row]) is None  # not contiguous
    assert native_pages.append_slots([source, torch.zeros(1, 2, 5)], [row, None]) is None  # another length
    assert native_pages.append_slots([source], [torch.zeros(1, 3, 1, 4)]) is None  # other heads
    assert native_pages.append_slots([source], [row, row]) is None  # not one row per source


@pytest.mark.parametrize("memory, batch", [(0.25, 1), (0.125, 2)])
def test_a_cache_that_appends_in_one_call_decodes_as_one_that_concatenates(memory, batch, monkeypatch):
    calls = []
    real = native_pages.append_slots

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    def stream(one_call: bool):
        monkeypatch.setattr(native_pages, "append_slots", counted if one_call else lambda *a: None)
        torch.manual_seed(0)
        model = tiny_model("llama")
        cache = ConfKVCache.for_model(model, memory=memory, page_size=16, group_size=16)
        ids = torch.randint(0, 250, (batch, 260), generator=torch.Generator().manual_seed(6))
        logits = decode_logits(model, cache, ids, 200, chunk=32)
        monkeypatch.undo()
        return logits, cache

    want, reference = stream(one_call=False)
    got, cache = stream(one_call=True)
    # each decode step's demotion into the open page, in every layer (model(...) appends the hot region's token
    # with the store's own append; the lean decoder's one-call append: tests/store/test_append_one.py)
    assert sum(calls) >= 60 * len(cache.layers) * 3 // 4 and all(calls)
    assert torch.equal(got, want)
    same_cache_state(cache, reference)
