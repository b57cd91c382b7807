"""A hot region's eviction in one C call (``c/evict.c`` through :func:`confkv.store.hot_tier.split_by_rank`): its
split equals the torch path's (:func:`select_kept`, :func:`dropped_slots` and two gathers) row for row, and it
declines every case where the two could differ (then the torch path runs, as before). Then through a store:
a cache decoding with the C call gives the same logits, bytes and slots as with the torch path alone.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from confkv import native
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.native import loader
from confkv.store import hot_tier
from confkv.store.hot_tier import dropped_slots, protected_mask, select_kept, split_by_rank
from confkv.store.hot_tier import Region
from decode_stream import decode_logits

pytestmark = [pytest.mark.usefixtures("nan_filled_empty"),
              pytest.mark.skipif(not native.available(), reason="the eviction's C call needs the library")]


def _region(batch: int, heads: int, length: int, seed: int = 0, dtype=torch.float32, int8: bool = False,
            start: int = 0) -> Region:
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(batch, heads, length, 8, generator=gen), torch.randn(batch, heads, length, 8, generator=gen)
    positions = (start + torch.arange(length)).expand(batch, heads, length).clone()
    stats = {"ema": torch.rand(batch, heads, length, generator=gen), "hits": torch.rand(batch, heads, length, generator=gen)}
    if int8:
        return Region(keys=(keys * 40).to(torch.int8), values=(values * 40).to(torch.int8), positions=positions,
                      valid=torch.ones(batch, length, dtype=torch.bool), stats=stats,
                      key_scale=torch.rand(batch, heads, length, generator=gen),
                      value_scale=torch.rand(batch, heads, length, generator=gen), all_valid=True)
    return Region(keys=keys.to(dtype), values=values.to(dtype), positions=positions,
                  valid=torch.ones(batch, length, dtype=torch.bool), stats=stats, all_valid=True)


def _torch_split(old: Region, scores, current, protect, sinks, keep) -> tuple[Region, Region]:
    protected = protected_mask(old.positions, old.valid, current, protect, sinks)
    keep = torch.maximum(keep, protected.sum(-1).amax(-1))
    index, valid = select_kept(scores, old.valid, protected, keep)
    dropped_index, dropped_valid = dropped_slots(index, valid, old.valid)
    return old.gather(index, valid), old.gather(dropped_index, dropped_valid)


def _assert_same(a: Region, b: Region) -> None:
    for name in ("keys", "values", "positions", "key_scale", "value_scale"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.stats.keys() == b.stats.keys()
    for name in a.stats:
        assert torch.equal(a.stats[name], b.stats[name]), name
    assert torch.equal(a.valid, b.valid) and a.all_valid and bool(b.valid.all())


@pytest.mark.parametrize("batch,heads,length,drop", [(1, 1, 7, 1), (1, 3, 40, 1), (3, 3, 40, 1), (2, 1, 40, 5),
                                                      (3, 3, 33, 20), (1, 3, 9, 8), (2, 2, 300, 120)])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_the_split_equals_the_torch_path_row_for_row(batch, heads, length, drop, kind):
    old = _region(batch, heads, length, seed=length + drop, dtype=getattr(torch, kind, torch.float32),
                  int8=kind == "int8", start=10)
    scores = torch.rand(batch, heads, length, generator=torch.Generator().manual_seed(drop))
    current = torch.full((batch,), 10 + length - 1)
    keep = torch.full((batch,), length - drop)
    protect, sinks = (2, 12) if length - drop >= 4 else (0, 0)  # the last 2 positions and positions 10, 11
    split = split_by_rank(old, scores, current, protect, sinks, keep)
    assert split is not None
    kept, dropped = split
    want_kept, want_dropped = _torch_split(old, scores, current, protect, sinks, keep)
    assert kept.length == length - drop and dropped.length == drop
    _assert_same(kept, want_kept)
    _assert_same(dropped, want_dropped)


def test_each_sequence_protects_its_own_newest_positions():
    # two sequences 100 positions apart (a left-padded batch after its padding left): each protects its own last 2
    old = _region(2, 3, 6)
    old.positions[1] += 100
    scores = torch.tensor([0.0, 1.0, 2.0, 3.0, 0.1, 0.2]).expand(2, 3, 6).contiguous()
    kept, dropped = split_by_rank(old, scores, torch.tensor([5, 105]), 2, 0, torch.tensor([4, 4]))
    assert dropped.positions[:, 0].tolist() == [[0, 1], [100, 101]]
    want_kept, want_dropped = _torch_split(old, scores, torch.tensor([5, 105]), 2, 0, torch.tensor([4, 4]))
    _assert_same(kept, want_kept)
    _assert_same(dropped, want_dropped)


def test_protected_slots_stay_whatever_their_scores():
    old = _region(1, 2, 6, start=0)
    scores = torch.tensor([[[0.0, 9.0, 8.0, 7.0, 6.0, 1.0], [5.0, 0.5, 4.0, 3.0, 2.0, 0.1]]])
    kept, dropped = split_by_rank(old, scores, torch.tensor([5]), 1, 1, torch.tensor([4]))
    # position 0 is a sink and 5 the newest: both kept; the two lowest of the rest go
    assert kept.positions.tolist() == [[[0, 1, 2, 5], [0, 2, 3, 5]]]
    assert dropped.positions.tolist() == [[[3, 4], [1, 4]]]


@pytest.mark.parametrize("drop", [1, 2])
def test_a_tie_across_the_boundary_is_left_to_the_torch_path(drop):
    old = _region(1, 1, 6)
    scores = torch.tensor([[[0.5, 0.2, 0.9, 0.2, 0.7, 0.2]]])  # three slots tie at the lowest score
    if drop == 2:
        assert split_by_rank(old, scores, torch.tensor([5]), 0, 0, torch.tensor([4])) is None
        scores = torch.tensor([[[0.5, 0.1, 0.9, 0.2, 0.7, 0.2]]])  # the 2nd and 3rd lowest tie
    assert split_by_rank(old, scores, torch.tensor([5]), 0, 0, torch.tensor([6 - drop])) is None


def test_ties_away_from_the_boundary_are_split_as_the_torch_path_splits_them():
    old = _region(1, 1, 6)
    scores = torch.tensor([[[0.7, 0.1, 0.9, 0.1, 0.7, 0.3]]])  # ties among the dropped (0.1) and the kept (0.7)
    kept, dropped = split_by_rank(old, scores, torch.tensor([5]), 0, 0, torch.tensor([4]))
    assert dropped.positions.tolist() == [[[1, 3]]] and kept.positions.tolist() == [[[0, 2, 4, 5]]]


def test_a_nan_score_is_left_to_the_torch_path():
    old = _region(1, 2, 6)
    scores = torch.rand(1, 2, 6)
    scores[0, 1, 4] = math.nan
    assert split_by_rank(old, scores, torch.tensor([5]), 0, 0, torch.tensor([5])) is None


def test_a_budget_below_the_protected_slots_is_left_to_the_torch_path():
    # 3 protected slots (sinks 0, 1 and the newest) and a keep of 2: the torch path keeps 3
    old = _region(1, 1, 6)
    scores = torch.rand(1, 1, 6)
    assert split_by_rank(old, scores, torch.tensor([5]), 1, 2, torch.tensor([2])) is None
    assert split_by_rank(old, scores, torch.tensor([5]), 1, 2, torch.tensor([3])) is not None


def test_it_declines_what_it_does_not_take():
    old = _region(2, 1, 6)
    scores = torch.rand(2, 1, 6)
    current = torch.tensor([5, 5])
    assert split_by_rank(old, scores, current, 0, 0, torch.tensor([4, 3])) is None  # unequal keeps
    assert split_by_rank(old, scores, current, 0, 0, torch.tensor([6, 6])) is None  # nothing to drop
    assert split_by_rank(old, scores, current, 0, 0, torch.tensor([0, 0])) is None  # all of it: the torch path
    holes = _region(2, 1, 6)
    holes.all_valid = False
    assert split_by_rank(holes, scores, current, 0, 0, torch.tensor([4, 4])) is None
    strided = _region(2, 1, 6)
    strided.keys = torch.randn(2, 1, 8, 6).transpose(-1, -2)
    assert split_by_rank(strided, scores, current, 0, 0, torch.tensor([4, 4])) is None
    with loader.disabled():
        assert split_by_rank(old, scores, current, 0, 0, torch.tensor([4, 4])) is None
    assert split_by_rank(old, scores, current, 0, 0, torch.tensor([4, 4])) is not None  # back on after it


@pytest.mark.parametrize("drop", [0, -1, 6, 7])
def test_the_c_call_refuses_a_drop_outside_one_to_l_minus_one_and_writes_nothing(drop):
    # split_by_rank never asks it (its own check comes first); a caller of the C function directly might
    evict_rows = hot_tier._native_evict_rows()
    scores, positions = torch.rand(1, 1, 6), torch.arange(6).view(1, 1, 6)
    source = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1)
    kept, dropped = torch.full((1, 1, 12, 1), -1.0), torch.full((1, 1, 12, 1), -1.0)
    pointers, current = ctypes.c_void_p * 1, torch.tensor([5])  # held while the call may read it
    status = evict_rows(1, 1, 6, drop, scores.data_ptr(), positions.data_ptr(), current.data_ptr(), 0, 0, 1,
                        pointers(source.data_ptr()), pointers(kept.data_ptr()), pointers(dropped.data_ptr()),
                        (ctypes.c_int64 * 1)(4))
    assert status == 1 and bool((kept == -1).all()) and bool((dropped == -1).all())


def _decode(policy, memory, batch, native_split: bool, monkeypatch, steps: int = 120):
    taken = []
    real = hot_tier.split_by_rank

    def counted(*args, **kwargs):
        split = real(*args, **kwargs) if native_split else None
        taken.append(split is not None)
        return split

    monkeypatch.setattr(hot_tier, "split_by_rank", counted)
    # the steady state's ageing and eviction in one call (tests/native/test_age_evict.py) off: every eviction here
    # goes through split_by_rank
    monkeypatch.setattr(hot_tier, "age_and_evict_at_once", lambda store, budget: False)
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, policy, memory=memory)
    ids = torch.randint(0, 250, (batch, 80 + steps), generator=torch.Generator().manual_seed(3))
    logits = decode_logits(model, cache, ids, 80, 32)
    monkeypatch.undo()
    stores = [layer.store for layer in cache.layers]
    state = [(s.old.positions.clone(), s.old.keys.clone(), dict(s.old.stats)) for s in stores]
    return logits, cache.kv_bytes(), state, sum(taken)


@pytest.mark.parametrize("policy,memory,batch", [(None, 0.25, 1), (None, 0.125, 3), ("h2o", 0.25, 2),
                                                 ("streaming", 0.25, 1)])
def test_a_cache_decodes_the_same_with_the_c_call_as_with_the_torch_path(policy, memory, batch, monkeypatch):
    logits, nbytes, state, native_steps = _decode(policy, memory, batch, True, monkeypatch)
    want_logits, want_bytes, want_state, torch_steps = _decode(policy, memory, batch, False, monkeypatch)
    assert native_steps > 100 and torch_steps == 0  # the C call did the evictions of the first run
    assert torch.equal(logits, want_logits) and nbytes == want_bytes
    for (positions, keys, stats), (want_positions, want_keys, want_stats) in zip(state, want_state):
        assert torch.equal(positions, want_positions) and torch.equal(keys, want_keys)
        assert stats.keys() == want_stats.keys() and all(torch.equal(stats[k], want_stats[k]) for k in stats)
