"""The native page read updates the hot regions' statistics (a policy's linear update: CONF-KV's EMA) and the
cold tier's page heat in place from its masses (``AttentionRead._updates_in_place``, kernels.c's ``update_in_place``):
the cache decodes the same logits and leaves the same state, byte for byte, as when the Python below the read makes
those updates (``policy.observe``, ``cold.observe_read``), step after step."""

from __future__ import annotations

import pytest
import torch

from confkv import native
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.native import pages as native_pages
from confkv.store import read as read_module
from decode_stream import decode_logits, same_cache_state

pytestmark = [pytest.mark.usefixtures("nan_filled_empty"),
              pytest.mark.skipif(not native.available(), reason="native kernels unavailable")]


def _stream(monkeypatch, make_cache, ids, prompt, *, in_place: bool):
    """(logits, cache, reads whose updates the native read made) of a stream with the in-place updates on or off."""
    made = []
    real = read_module.AttentionRead._tiered_read

    def counted(self, *args):
        result = real(self, *args)
        made.append(result[2])
        return result

    with monkeypatch.context() as patch:  # (scoped: the poisoned empties of nan_filled_empty stay for both streams)
        patch.setattr(read_module.AttentionRead, "_tiered_read", counted)
        if not in_place:
            patch.setattr(read_module.AttentionRead, "_updates_in_place", lambda self, *a: None)
        model, cache = make_cache()
        logits = decode_logits(model, cache, ids, prompt, chunk=32)
    return logits, cache, sum(made)


SETTINGS = {  # (the cache, the prompt and the stream's length): long enough for most decode reads to read pages
    "preset 25%": (lambda model: ConfKVCache.for_model(model, memory=0.25), 300, 360),
    "preset 12.5%": (lambda model: ConfKVCache.for_model(model, memory=0.125), 500, 560),
    "preset 12.5%, pages of 16": (lambda model: ConfKVCache.for_model(model, memory=0.125, page_size=16,
                                                                      group_size=16), 400, 460),
    "preset 25%, pages of 48": (lambda model: ConfKVCache.for_model(model, memory=0.25, page_size=48,
                                                                    group_size=16), 300, 360),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("batch", [1, 3])
def test_the_read_updates_what_the_python_would(setting, batch, monkeypatch):
    make, prompt, length = SETTINGS[setting]

    def make_cache():
        torch.manual_seed(0)
        model = tiny_model("llama")
        return model, make(model)

    ids = torch.randint(0, 250, (batch, length), generator=torch.Generator().manual_seed(4))
    want, reference, none_made = _stream(monkeypatch, make_cache, ids, prompt, in_place=False)
    got, cache, made = _stream(monkeypatch, make_cache, ids, prompt, in_place=True)
    assert none_made == 0
    assert made >= (length - prompt) * len(cache.layers) // 2  # most decode steps' reads update in place
    assert torch.equal(got, want)
    same_cache_state(cache, reference)


def test_without_torch_sum_order_the_python_updates(monkeypatch):
    """Where kernels.c's sum order is not matched against torch (lanes 0), page heat cannot be made bit for bit in
    C: the reader declines the updates and the Python makes them all (the same stream, the same state as the
    stream whose reads update in place, which do)."""
    make, prompt, length = SETTINGS["preset 25%"]

    def make_cache():
        torch.manual_seed(0)
        model = tiny_model("llama")
        return model, make(model)

    ids = torch.randint(0, 250, (1, length), generator=torch.Generator().manual_seed(5))
    want, reference, made_in_place = _stream(monkeypatch, make_cache, ids, prompt, in_place=True)
    with monkeypatch.context() as patch:
        patch.setattr(native_pages, "_sum_lanes", lambda lib: 0)
        got, cache, made = _stream(monkeypatch, make_cache, ids, prompt, in_place=True)
    assert made_in_place > 0 and made == 0
    assert torch.equal(got, want)
    same_cache_state(cache, reference)


def test_an_update_that_does_not_fit_its_segment_is_refused():
    stat = torch.zeros(1, 2, 5)
    with pytest.raises(ValueError, match="float32 \\[B, Hkv, N\\]"):
        native_pages.InPlaceUpdate.page_heat(stat.double())
    with pytest.raises(ValueError, match="last dimension contiguous"):
        native_pages.InPlaceUpdate.page_heat(torch.zeros(1, 4, 2).transpose(1, 2))
    keys = torch.randn(1, 2, 6, 8)
    segment = read_module.KVSegment(keys, keys, None)
    query = torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match="does not match the segment"):
        native_pages._read(native.library(), query, [segment], 1.0, True, None,
                           [native_pages.InPlaceUpdate.statistic(stat, (0, 0))], 16)
    with pytest.raises(ValueError, match="need_mass"):
        native_pages._read(native.library(), query, [segment], 1.0, False, None, [None], 16)


def test_a_pages_mass_sum_is_torchs_bit_for_bit():
    """The page heat's sum (kernels.c's page_mass_sum: a short row's sum with its vector width fixed) against
    ``torch.sum`` over rows of every length up to 160 and a few beyond, as the cold tier's ``observe`` sums a page."""
    lib = native.library()
    lanes = native._sum_lanes(lib)
    if not lanes:
        pytest.skip("torch's float sum order is not matched on this build")
    gen = torch.Generator().manual_seed(11)
    for n in list(range(1, 161)) + [255, 256, 511, 512, 1000, 1024, 1030]:
        rows = torch.rand(4, n, generator=gen) * torch.rand(4, 1, generator=gen) * 1e-2
        want = rows.sum(-1)
        for row, total in zip(rows, want):
            got = lib.confkv_page_mass_sum(row.data_ptr(), n, lanes)
            assert torch.tensor(got, dtype=torch.float32).view(torch.int32) == total.view(torch.int32), n
