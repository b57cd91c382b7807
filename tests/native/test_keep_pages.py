"""A cold tier's pages dropped in one C call (``confkv.native.pages.keep_pages``, ``c/page_moves.c``): the bytes of the
torch path's gather (``ColdTier._keep_pages``), into new tensors of exactly the kept pages or in place; refusals
change nothing; a cache that drops pages this way decodes as one that gathers."""

from __future__ import annotations

from array import array

import pytest
import torch

from confkv import native
from confkv.attention.segments import gather_pages
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.native import pages as native_pages

from decode_stream import decode_logits, same_cache_state

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")


def _page_tensors(batch: int, heads: int, capacity: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Tensors shaped as a cold tier's pages: codes, scales, validity, heat, positions (capacity pages a row)."""
    return [torch.randint(0, 256, (batch, heads, capacity, 16, 6), dtype=torch.uint8, generator=gen),
            torch.randn(batch, heads, capacity, 2, 8, generator=gen).to(torch.float16),
            torch.rand(batch, heads, capacity, 16, generator=gen) > 0.3,
            torch.rand(batch, heads, capacity, generator=gen),
            torch.randint(0, 10 ** 6, (batch, heads, capacity, 16), generator=gen)]


def _dropped(batch: int, heads: int, live: int, count: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.stack([torch.randperm(live, generator=gen)[:count] for _ in range(heads)])
                        for _ in range(batch)])


def _kept_by_torch(tensor: torch.Tensor, dropped: torch.Tensor, live: int) -> torch.Tensor:
    """What ``ColdTier.drop_pages`` keeps by its torch path: a mask of the dropped pages, its stable argsort, a gather."""
    gone = torch.zeros(dropped.shape[:2] + (live,), dtype=torch.bool).scatter_(2, dropped, True)
    rest = gone.to(torch.int8).argsort(dim=-1, stable=True)[..., :live - dropped.shape[-1]].sort(-1).values
    return gather_pages(tensor.narrow(2, 0, live), rest)


@pytest.mark.parametrize("batch, heads, capacity, live, count", [
    (1, 3, 12, 12, 1), (2, 2, 16, 9, 3), (3, 1, 8, 8, 8), (1, 4, 20, 13, 0), (2, 3, 10, 10, 5)])
@pytest.mark.parametrize("exact", [True, False])
def test_the_kept_pages_are_the_torch_gathers(batch, heads, capacity, live, count, exact):
    gen = torch.Generator().manual_seed(batch * 100 + capacity + count)
    tensors = _page_tensors(batch, heads, capacity, gen)
    before = [t.clone() for t in tensors]
    dropped = _dropped(batch, heads, live, count, gen)
    out = native_pages.keep_pages(tensors, dropped, live, exact)
    assert out is not None
    for got, original in zip(out, before):
        want = _kept_by_torch(original, dropped, live)
        if exact:
            assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
            assert torch.equal(got, want)
        else:
            assert got.shape == original.shape  # the same tensor, its pages moved down
            assert torch.equal(got.narrow(2, 0, live - count), want)
    if exact:
        assert all(torch.equal(t, b) for t, b in zip(tensors, before))  # the sources are left as they were
    else:
        assert all(got is t for got, t in zip(out, tensors))


@pytest.mark.parametrize("case", ["out of range", "negative", "repeated", "strided", "other batch", "more than live"])
def test_a_refused_drop_changes_nothing(case):
    gen = torch.Generator().manual_seed(7)
    tensors = _page_tensors(2, 3, 10, gen)
    before = [t.clone() for t in tensors]
    dropped = _dropped(2, 3, 8, 2, gen)
    live = 8
    if case == "out of range":
        dropped[1, 2, 0] = 8
    elif case == "negative":
        dropped[0, 1, 1] = -1
    elif case == "repeated":
        dropped[1, 0, 1] = dropped[1, 0, 0]
    elif case == "strided":
        tensors[1] = tensors[1].transpose(3, 4)
        before[1] = tensors[1].clone()
    elif case == "other batch":
        dropped = dropped[:1]
    elif case == "more than live":
        live = 11
    assert native_pages.keep_pages(tensors, dropped, live, exact=False) is None
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_a_cache_that_drops_pages_in_one_call_decodes_as_one_that_gathers(monkeypatch):
    """The preset at 12.5% on a tiny model: its ladder steps pages down and drops them many times."""
    calls = []
    real = native_pages.keep_pages

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    def stream(native_drop: bool):
        with monkeypatch.context() as patch:
            patch.setattr(native_pages, "keep_pages", counted if native_drop else lambda *a: None)
            torch.manual_seed(0)
            model = tiny_model("llama")
            cache = ConfKVCache.for_model(model, memory=0.125, page_size=16, group_size=16)
            ids = torch.randint(0, 250, (2, 460), generator=torch.Generator().manual_seed(4))
            return decode_logits(model, cache, ids, 400, chunk=32), cache

    want, reference = stream(native_drop=False)
    got, cache = stream(native_drop=True)
    assert sum(calls) >= 20 and all(calls)
    assert torch.equal(got, want)
    same_cache_state(cache, reference)


@pytest.mark.parametrize("batch, heads, live", [(0, 3, 4), (2, 0, 4), (2, 3, 0)])
def test_an_empty_drop_is_taken(batch, heads, live):
    """Nothing to move (no sequence, no KV head, no live page): the call still answers, with tensors of no kept page,
    rather than declining to the gather."""
    tensors = [torch.zeros(batch, heads, 6, 4), torch.zeros(batch, heads, 6, dtype=torch.int64)]
    out = native_pages.keep_pages(tensors, torch.zeros(batch, heads, 0, dtype=torch.int64), live, exact=True)
    assert out is not None
    assert [tuple(t.shape) for t in out] == [(batch, heads, live, 4), (batch, heads, live)]


def _call_keep_pages(batch: int, heads: int, live: int, drop: int, count: int, capacity: list[int],
                     capacity_out: list[int], page_bytes: list[int], in_place: bool = False) -> tuple[int, list]:
    """``confkv_keep_pages`` called directly (its Python wrapper never passes what these tests pass): ``count``
    uint8 tensors of ``capacity[t]`` pages of ``page_bytes[t]`` bytes (at least 1 allocated) a row, the last
    ``drop`` live pages of each row dropped. Returns (the call's status, (source, destination) pairs)."""
    lib = native_pages._moves_library()
    gen = torch.Generator().manual_seed(11)
    pairs = []
    for t in range(count):
        size = max(page_bytes[t], 1)
        source = torch.randint(0, 256, (max(batch, 1), max(heads, 1), max(capacity[t], 1), size), dtype=torch.uint8,
                               generator=gen)
        target = source if in_place else torch.zeros(max(batch, 1), max(heads, 1), max(capacity_out[t], 1), size,
                                                     dtype=torch.uint8)
        pairs.append((source, target))
    index = torch.arange(max(live - drop, 0), max(live, 0), dtype=torch.int64).expand(
        max(batch, 1), max(heads, 1), -1).contiguous() if drop >= 0 else torch.zeros(1, dtype=torch.int64)
    tables = [array("Q", [pair[k].data_ptr() for pair in pairs] or [0]) for k in (0, 1)]
    sizes = [array("q", values or [0]) for values in (capacity, capacity_out, page_bytes)]
    status = lib.confkv_keep_pages(batch, heads, live, drop, index.data_ptr(), count, tables[0].buffer_info()[0],
                                   sizes[0].buffer_info()[0], tables[1].buffer_info()[0], sizes[1].buffer_info()[0],
                                   sizes[2].buffer_info()[0])
    return status, pairs


@pytest.mark.parametrize("field", ["batch", "heads", "live", "drop", "count"])
def test_the_c_call_refuses_a_negative_size_and_takes_zero(field):
    """Each size on its own: a negative one is refused (1), zero is taken (0); the wrapper never passes either
    (mutation testing found these checks unguarded: ``||`` made ``&&`` and ``<`` made ``<=`` lived)."""
    sizes = {"batch": 2, "heads": 3, "live": 4, "drop": 1, "count": 2}
    for value, want in ((-1, 1), (0, 0)):
        args = {**sizes, field: value}
        if field == "live" and value == 0:
            args["drop"] = 0  # no live page: none to drop
        count = max(args["count"], 0)
        status, _ = _call_keep_pages(args["batch"], args["heads"], args["live"], args["drop"], args["count"],
                                     [6] * count, [6] * count, [5] * count)
        assert status == want, (field, value)


def test_the_c_call_refuses_more_drops_than_live_pages_and_takes_all():
    assert _call_keep_pages(2, 3, 4, 5, 1, [6], [6], [5])[0] == 1
    assert _call_keep_pages(2, 3, 4, 4, 1, [6], [6], [5])[0] == 0


@pytest.mark.parametrize("which", [0, 2])
@pytest.mark.parametrize("problem", ["capacity below live", "destination too small", "negative page bytes",
                                     "in place, other capacity"])
def test_the_c_call_checks_every_tensor_before_a_byte_moves(which, problem):
    """One bad tensor among three (the first or the last): refused, every destination untouched; at its bound
    (capacity == live, a destination of exactly the kept pages, pages of 0 bytes) taken."""
    capacity, capacity_out, page_bytes = [6, 6, 6], [6, 6, 6], [5, 5, 5]
    bound = {"capacity below live": (capacity, 4), "destination too small": (capacity_out, 3),
             "negative page bytes": (page_bytes, 0)}
    if problem == "in place, other capacity":
        capacity_out[which] = 7
        assert _call_keep_pages(2, 3, 4, 1, 3, capacity, capacity_out, page_bytes, in_place=True)[0] == 1
        capacity_out[which] = 6
        assert _call_keep_pages(2, 3, 4, 1, 3, capacity, capacity_out, page_bytes, in_place=True)[0] == 0
        return
    table, at_bound = bound[problem]
    table[which] = at_bound - 1
    status, pairs = _call_keep_pages(2, 3, 4, 1, 3, capacity, capacity_out, page_bytes)
    assert status == 1
    assert not any(target.any() for _, target in pairs)  # the destinations start as zeros: none written
    table[which] = at_bound
    assert _call_keep_pages(2, 3, 4, 1, 3, capacity, capacity_out, page_bytes)[0] == 0
