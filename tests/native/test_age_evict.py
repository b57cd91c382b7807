"""A decode step's ageing and eviction in one C call (``confkv_age_evict_rows``, ``c/evict.c``, through
:func:`confkv.store.hot_tier.age_and_evict_at_once`): the store it leaves is the one the two steps (``_age`` then
``_evict``) leave, byte for byte, and it declines (changing nothing) every step it does not take. Then through a
cache: decoding with it gives the same logits, bytes and slots as without it.
"""

from __future__ import annotations

import copy
import ctypes
import math

import pytest
import torch

from confkv import native
from confkv.config import StoreConfig
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.native import loader
from confkv.policies.registry import make_policy
from confkv.store import LayerStore
from confkv.store import hot_tier
from confkv.store.hot_tier import age_and_evict_at_once
from confkv.store.hot_tier import Region
from confkv.tiers.storage import Storage
from decode_stream import decode_logits

pytestmark = [pytest.mark.usefixtures("nan_filled_empty"),
              pytest.mark.skipif(not native.available(), reason="the call needs the library")]


def _region(batch: int, heads: int, length: int, start: int, gen: torch.Generator, dtype) -> Region:
    keys = torch.randn(batch, heads, length, 8, generator=gen).to(dtype)
    values = torch.randn(batch, heads, length, 8, generator=gen).to(dtype)
    positions = (start + torch.arange(length)).expand(batch, heads, length).clone()
    return Region(keys=keys, values=values, positions=positions, valid=torch.ones(batch, length, dtype=torch.bool),
                  stats={"ema": torch.rand(batch, heads, length, generator=gen)}, all_valid=True)


def _store(batch: int, heads: int, old: int, recent: int, seed: int, dtype=torch.float32, protect: int = 4,
           sinks: int = 2) -> LayerStore:
    """A full-precision store of ``old`` older and ``recent`` window slots (positions 0 .. old + recent - 1)."""
    policy = make_policy("confkv-fixed", protect=protect, sinks=sinks)
    store = LayerStore(policy, StoreConfig())
    gen = torch.Generator().manual_seed(seed)
    store.old = _region(batch, heads, old, 0, gen, dtype)
    store.recent = _region(batch, heads, recent, old, gen, dtype)
    store.seen_real = torch.full((batch,), old + recent, dtype=torch.int64)
    store.seen_tokens = old + recent
    return store


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """The same dtype, shape and values (a NaN where the other has one)."""
    return x.dtype == y.dtype and x.shape == y.shape and bool(((x == y) | (x.isnan() & y.isnan())).all()
                                                              if x.is_floating_point() else torch.equal(x, y))


def _assert_same_region(a: Region, b: Region) -> None:
    for name in ("keys", "values", "positions", "valid"):
        assert _same(getattr(a, name), getattr(b, name)), name
    for name in ("key_scale", "value_scale"):  # INT8 regions: each slot's scales
        assert (getattr(a, name) is None) == (getattr(b, name) is None), name
        assert getattr(a, name) is None or _same(getattr(a, name), getattr(b, name)), name
    assert a.stats.keys() == b.stats.keys() and all(_same(a.stats[k], b.stats[k]) for k in a.stats)
    assert a.all_valid == b.all_valid


def _two_steps(store: LayerStore, budget: torch.Tensor) -> LayerStore:
    twin = copy.deepcopy(store)
    twin._age(force=True)
    twin._evict(budget)
    return twin


@pytest.mark.parametrize("batch,heads,old,recent,budget", [(1, 1, 9, 5, 12), (1, 3, 40, 5, 43), (3, 2, 40, 6, 44),
                                                             (2, 3, 60, 9, 40), (1, 2, 30, 5, 31), (2, 1, 0, 9, 6),
                                                             (1, 3, 40, 5, 44), (2, 3, 40, 5, 44)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_call_leaves_the_store_the_two_steps_leave(batch, heads, old, recent, budget, dtype):
    # the window keeps its 4 newest slots (protect 4): recent - 4 slots age, and the older region drops to the budget
    store = _store(batch, heads, old, recent, seed=old + recent + budget, dtype=dtype)
    want = _two_steps(store, torch.full((batch,), budget))
    before = store.old
    pointers = [t.data_ptr() for t in (before.keys, before.values, before.positions, before.stats["ema"])]
    assert age_and_evict_at_once(store, torch.full((batch,), budget))
    _assert_same_region(store.old, want.old)
    _assert_same_region(store.recent, want.recent)
    assert store.recent.length == 4 and store.physical_length == budget
    in_place = recent - 4 == old + recent - budget  # as many aged as dropped: the older region rewritten in place
    assert (store.old is before) == in_place
    if in_place:
        assert [t.data_ptr() for t in (store.old.keys, store.old.values, store.old.positions,
                                       store.old.stats["ema"])] == pointers


def _int8_store(batch: int, heads: int, old: int, recent: int, seed: int) -> LayerStore:
    """:func:`_store` with its older region in INT8 (codes, per-slot scales, a channel scale from its keys)."""
    store = _store(batch, heads, old, recent, seed, dtype=torch.bfloat16)
    store.config = StoreConfig(kv_int8=True)
    store.int8 = True
    store.old = store._quantize(store.old)
    return store


@pytest.mark.parametrize("batch,heads,old,recent,budget", [(1, 1, 9, 5, 12), (3, 2, 40, 6, 44), (2, 3, 60, 9, 40),
                                                             (1, 3, 40, 5, 44)])
def test_an_int8_older_region_is_split_as_the_two_steps_split_it(batch, heads, old, recent, budget):
    """The aged slots quantized on the way in, every slot's scales moving with its codes: the store the two steps
    leave (INT8 codes and scales, window, statistics), and the dropped slots demoted as they demote them."""
    seen = []

    class Cold:
        def demote(self, keys, values, positions, valid, attention):
            seen.append((keys.clone(), values.clone(), positions.clone(), valid.clone()))

        def kv_bytes(self):
            return 0

    store = _int8_store(batch, heads, old, recent, seed=old + budget)
    store.cold = Cold()
    want = _two_steps(store, torch.full((batch,), budget))
    assert age_and_evict_at_once(store, torch.full((batch,), budget))
    assert store.old.is_int8 and store.old.key_scale.shape == store.old.positions.shape
    _assert_same_region(store.old, want.old)
    _assert_same_region(store.recent, want.recent)
    assert len(seen) == 2 and all(_same(a, b) for a, b in zip(seen[0], seen[1]))  # [0]: the two steps' demotion


def test_it_declines_an_int8_store_whose_older_region_is_not_int8_yet():
    store = _int8_store(2, 1, 10, 5, seed=3)
    store.old = _store(2, 1, 10, 5, seed=3, dtype=torch.bfloat16).old
    _unchanged(store, torch.tensor([12, 12]))


def test_the_dropped_slots_go_to_the_cold_tier_as_the_two_steps_send_them():
    seen = []

    class Cold:
        def demote(self, keys, values, positions, valid, attention):
            seen.append((keys.clone(), values.clone(), positions.clone(), valid.clone(), attention))

        def kv_bytes(self):
            return 0

    store = _store(2, 3, 30, 6, seed=5)
    store.cold = Cold()
    store.storage = Storage(unread_by="attention")  # the policy's attention goes with each slot
    twin = copy.deepcopy(store)
    twin._age(force=True)
    twin._evict(torch.tensor([28, 28]))
    assert age_and_evict_at_once(store, torch.tensor([28, 28]))
    assert len(seen) == 2
    assert seen[0][4] is not None and seen[1][4] is not None
    for a, b in zip(seen[0], seen[1]):
        assert torch.equal(a, b)
    assert seen[0][2].shape == (2, 3, 8)  # 30 older and 2 aged slots, 24 kept beside the window's 4


def _unchanged(store: LayerStore, budget: torch.Tensor) -> None:
    before = copy.deepcopy(store)
    assert not age_and_evict_at_once(store, budget)
    _assert_same_region(store.old, before.old)
    _assert_same_region(store.recent, before.recent)


def test_it_declines_a_tie_at_the_boundary_a_nan_and_a_protected_slot_among_the_lowest():
    store = _store(1, 1, 10, 5, seed=1, protect=4, sinks=0)
    store.policy = make_policy("confkv-fixed", protect=4, sinks=0, recency_weight=0.0)
    # 10 older slots and 1 aged, the window's 4 newest kept: a budget of 14 drops one of the 11
    store.old.stats["ema"][..., 3] = store.old.stats["ema"][..., 6] = -1.0  # the two lowest, equal
    _unchanged(store, torch.tensor([14]))
    store.old.stats["ema"][..., 3] = math.nan
    _unchanged(store, torch.tensor([14]))
    # sinks 8: positions 0-7 protected, so of the 11 only 8, 9, 10 may go: a budget of 11 would drop 4
    store = _store(1, 1, 10, 5, seed=2, protect=4, sinks=8)
    _unchanged(store, torch.tensor([11]))
    assert age_and_evict_at_once(store, torch.tensor([12]))  # 3 to drop: the three unprotected
    assert store.old.positions.flatten().tolist() == list(range(8))


def test_it_declines_what_it_does_not_take():
    store = _store(2, 1, 10, 5, seed=3)
    _unchanged(store, torch.tensor([12, 11]))  # a budget per sequence
    _unchanged(store, torch.tensor([20, 20]))  # nothing to drop
    _unchanged(store, None)
    _unchanged(_store(2, 1, 10, 4, seed=3), torch.tensor([12, 12]))  # nothing to age
    holes = _store(2, 1, 10, 5, seed=3)
    holes.old.all_valid = False
    _unchanged(holes, torch.tensor([12, 12]))
    slack = _store(2, 1, 10, 5, seed=3)
    slack.config = StoreConfig(evict_slack=2)
    _unchanged(slack, torch.tensor([12, 12]))
    strided = _store(2, 1, 10, 5, seed=3)
    strided.old.keys = torch.randn(2, 1, 8, 10).transpose(-1, -2)
    _unchanged(strided, torch.tensor([12, 12]))
    with loader.disabled():
        _unchanged(store, torch.tensor([12, 12]))
    assert age_and_evict_at_once(store, torch.tensor([12, 12]))  # back on after it


def _decode(policy, memory, batch, one_call: bool, monkeypatch, steps: int = 120):
    taken = []

    def counted(store, budget):
        done = age_and_evict_at_once(store, budget) if one_call else False
        taken.append(done)
        return done

    monkeypatch.setattr(hot_tier, "age_and_evict_at_once", counted)
    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, policy, memory=memory)
    ids = torch.randint(0, 250, (batch, 80 + steps), generator=torch.Generator().manual_seed(3))
    logits = decode_logits(model, cache, ids, 80, 32)
    monkeypatch.undo()
    regions = [(s.old, s.recent) for s in (layer.store for layer in cache.layers)]
    return logits, cache.kv_bytes(), regions, sum(taken)


@pytest.mark.parametrize("policy,memory,batch", [(None, 0.25, 1), (None, 0.125, 3), ("h2o", 0.25, 2),
                                                 ("tova", 0.25, 1), ("tiered-int8", 0.25, 2)])
def test_a_cache_decodes_the_same_with_the_one_call_as_without_it(policy, memory, batch, monkeypatch):
    logits, nbytes, regions, one_call_steps = _decode(policy, memory, batch, True, monkeypatch)
    want_logits, want_bytes, want_regions, none = _decode(policy, memory, batch, False, monkeypatch)
    assert one_call_steps > 100 and none == 0
    assert torch.equal(logits, want_logits) and nbytes == want_bytes
    for (old, recent), (want_old, want_recent) in zip(regions, want_regions):
        _assert_same_region(old, want_old)
        _assert_same_region(recent, want_recent)


@pytest.mark.parametrize("aged,old_length,drop", [(0, 6, 1), (-1, 6, 1), (4, 6, 1), (5, 6, 1), (3, -1, 1),
                                                   (2, 6, 0), (2, 6, 8), (2, 6, 9)])
def test_the_c_call_refuses_what_it_cannot_split_and_writes_nothing(aged, old_length, drop):
    """Ageing past the window (aged > its 3 slots), none or fewer than none, a negative older region, a drop outside
    1 .. L - 1: refused (1), every output as it was. The wrapper never asks these; a caller of the C function might."""
    evict = hot_tier._native("confkv_age_evict_rows")
    length = max(old_length, 0) + max(aged, 0)
    scores, positions = torch.rand(1, 1, max(length, 1)), torch.arange(max(length, 1)).view(1, 1, -1)
    old, recent = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1), torch.full((1, 1, 3, 1), 7.0)
    outputs = [torch.full((1, 1, 12, 1), -1.0) for _ in range(3)]
    pointers, current = ctypes.c_void_p * 1, torch.tensor([length])  # held: the call reads its memory
    status = evict(1, 1, old_length, 3, aged, drop, scores.data_ptr(), positions.data_ptr(),
                   current.data_ptr(), 0, 0, 1, pointers(old.data_ptr()), pointers(recent.data_ptr()),
                   *(pointers(t.data_ptr()) for t in outputs), (ctypes.c_int64 * 1)(4))
    assert status == 1 and all(bool((t == -1).all()) for t in outputs)
    assert torch.equal(old.flatten(), torch.arange(6.0)) and bool((recent == 7).all())


def test_every_window_slot_may_age():
    """aged == the window's length: the whole window joins the older region and nothing of it stays."""
    evict = hot_tier._native("confkv_age_evict_rows")
    scores = torch.tensor([[[0.0, 5, 5, 5, 5, 5, 5, 5, 5]]])  # slot 0 (the oldest) is the lowest
    positions = torch.arange(9).view(1, 1, 9)
    old, recent = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1), torch.full((1, 1, 3, 1), 7.0)
    kept, dropped, left = torch.full((1, 1, 8, 1), -1.0), torch.full((1, 1, 1, 1), -1.0), torch.full((1, 1, 1, 1), -1.0)
    pointers, current = ctypes.c_void_p * 1, torch.tensor([8])  # held: the call reads its memory
    status = evict(1, 1, 6, 3, 3, 1, scores.data_ptr(), positions.data_ptr(), current.data_ptr(), 0, 0, 1,
                   pointers(old.data_ptr()), pointers(recent.data_ptr()), pointers(kept.data_ptr()),
                   pointers(dropped.data_ptr()), pointers(left.data_ptr()), (ctypes.c_int64 * 1)(4))
    assert status == 0
    assert kept.flatten().tolist() == [1, 2, 3, 4, 5, 7, 7, 7] and dropped.item() == 0 and left.item() == -1


def _scored_in_c(monkeypatch) -> list:
    """Record what ``_age_split_scored`` answers (False: the C call that scores was not taken)."""
    answers, scored = [], hot_tier._age_split_scored

    def recorded(*args):
        answer = scored(*args)
        answers.append(answer is not False)
        return answer
    monkeypatch.setattr(hot_tier, "_age_split_scored", recorded)
    return answers


@pytest.mark.parametrize("batch,heads,old,recent,budget", [(1, 3, 40, 5, 43), (3, 2, 40, 6, 44), (2, 3, 60, 9, 40),
                                                             (2, 1, 0, 9, 6), (1, 2, 300, 5, 250)])
@pytest.mark.parametrize("seed", range(4))
def test_the_c_call_scores_the_slots_as_the_policy_does(batch, heads, old, recent, budget, seed, monkeypatch):
    """``confkv_age_evict_rows_ema`` works out the EMA + recency scores itself: EMAs as small as the recency bonus's
    differences between ages (so that an age one off, or a bonus read from the wrong slot, changes which slots
    leave), one and many slots dropped, positions that start late (ages past the recency table's end: bonus 0)."""
    store = _store(batch, heads, old, recent, seed=seed, protect=4, sinks=2)
    for region in (store.old, store.recent):
        region.stats["ema"].mul_(2e-5)
    if seed % 2:  # later in the stream: the older half's ages past the recency table's 9,601 entries (half-life 64)
        store.seen_real.add_(9601 - (old + recent) // 2)
    answers = _scored_in_c(monkeypatch)
    want = _two_steps(store, torch.full((batch,), budget))
    assert age_and_evict_at_once(store, torch.full((batch,), budget))
    assert answers == [True]
    _assert_same_region(store.old, want.old)
    _assert_same_region(store.recent, want.recent)


def test_without_the_scoring_call_the_policy_scores_and_the_split_is_the_same(monkeypatch):
    """A policy whose scores are not an EMA and a table's (or no such C function): the torch scores, the same split."""
    store = _store(2, 3, 40, 5, seed=9)
    want = _two_steps(store, torch.full((2,), 43))
    monkeypatch.setattr(type(store.policy), "recency_scores", lambda self, device: None)
    answers = _scored_in_c(monkeypatch)
    assert age_and_evict_at_once(store, torch.full((2,), 43))
    assert answers == [False]
    _assert_same_region(store.old, want.old)
    _assert_same_region(store.recent, want.recent)


def test_scores_replaced_on_the_class_are_the_ones_ranked(monkeypatch):
    """``ConfKVPolicy.scores`` replaced (a user's patch, the quality guard's backwards ranking): the C call that
    scores the table's way is not taken, and the slots leave by the replacement's scores."""
    from confkv.policies.confkv import ConfKVPolicy

    original = ConfKVPolicy.scores
    monkeypatch.setattr(ConfKVPolicy, "scores", lambda self, *args: -original(self, *args))
    store = _store(2, 3, 40, 5, seed=11)
    want = _two_steps(store, torch.full((2,), 43))
    answers = _scored_in_c(monkeypatch)
    assert age_and_evict_at_once(store, torch.full((2,), 43))
    assert answers == [False]
    _assert_same_region(store.old, want.old)
    _assert_same_region(store.recent, want.recent)


def _ema_call(aged: int, old_length: int, drop: int, table_len: int = 4, batch: int = 1, heads: int = 1,
              old_ema=None, recent_ema=None):
    """``confkv_age_evict_rows_ema`` over an older region of ``old_length`` (rows 0..5) and a window of 3 (rows 7):
    (status, kept, dropped, left) with the outputs filled with -1 before the call."""
    evict = hot_tier._native("confkv_age_evict_rows_ema")
    rows = max(batch * heads, 1)
    old = torch.arange(6, dtype=torch.float32).repeat(rows).view(rows, 1, 6, 1)
    recent = torch.full((rows, 1, 3, 1), 7.0)
    # distinct scores by default: a split these arguments allowed would be unique, so only the checks refuse
    old_ema = (1 + 0.1 * torch.arange(6.0)).repeat(rows, 1) if old_ema is None else old_ema
    recent_ema = torch.full((rows, 3), 5.0) if recent_ema is None else recent_ema
    old_positions = torch.arange(6).repeat(rows, 1)
    recent_positions = (6 + torch.arange(3)).repeat(rows, 1)
    seen, table = torch.full((max(batch, 1),), 9), torch.tensor([1.0, 0.5, 0.25, 0.0])
    kept, dropped, left = (torch.full((rows, 1, 12, 1), -1.0) for _ in range(3))
    pointers = ctypes.c_void_p * 1  # every tensor held here: the call reads and writes their memory
    status = evict(batch, heads, old_length, 3, aged, drop, old_ema.data_ptr(), recent_ema.data_ptr(),
                   old_positions.data_ptr(), recent_positions.data_ptr(), seen.data_ptr(), 0.01, table.data_ptr(),
                   table_len, 0, 0, 1, pointers(old.data_ptr()), pointers(recent.data_ptr()),
                   pointers(kept.data_ptr()), pointers(dropped.data_ptr()), pointers(left.data_ptr()),
                   (ctypes.c_int64 * 1)(4))
    return status, kept, dropped, left


@pytest.mark.parametrize("aged,old_length,drop,table_len,batch,heads", [
    (0, 6, 1, 4, 1, 1), (-1, 6, 1, 4, 1, 1), (4, 6, 1, 4, 1, 1), (2, -1, 1, 4, 1, 1), (2, 6, 0, 4, 1, 1),
    (2, 6, 8, 4, 1, 1), (2, 6, 1, 0, 1, 1), (2, 6, 1, 4, 0, 1), (2, 6, 1, 4, 1, 0)])
def test_the_scoring_call_refuses_what_it_cannot_split_and_writes_nothing(aged, old_length, drop, table_len, batch,
                                                                         heads):
    """No window slot to age or more than the window holds, a negative older region, a drop outside 1 .. L - 1, an
    empty recency table, no sequence or no head: refused (1), every output as it was."""
    status, *outputs = _ema_call(aged, old_length, drop, table_len, batch, heads)
    assert status == 1 and all(bool((t == -1).all()) for t in outputs)


def test_the_scoring_call_may_age_every_window_slot():
    """aged == the window's length: the whole window joins the older region; the lowest score leaves (the oldest
    slot: its EMA is the lowest and its recency bonus 0, past the table)."""
    status, kept, dropped, left = _ema_call(3, 6, 1, old_ema=torch.tensor([[0.0, 5, 5, 5, 5, 5]]),
                                            recent_ema=torch.full((1, 3), 5.0))
    assert status == 0
    assert kept.flatten()[:8].tolist() == [1, 2, 3, 4, 5, 7, 7, 7] and dropped.flatten()[0].item() == 0
    assert bool((left == -1).all())
