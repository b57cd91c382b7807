"""A :class:`confkv.store.LayerStore` driven by hand: the timing breakdown it reports, what it keeps,
where each token lives, and its byte counts, against expectations worked out by hand.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

from __future__ import annotations
import itertools
import pytest
import torch
from confkv import profiling
from confkv.config import StoreConfig
from confkv.policies import make_policy
from confkv.store import LayerStore
import re
from confkv.store import layer as store_module


def _step(store: LayerStore, gen: torch.Generator, budget: int | None, batch: int = 1, new: int = 1,
          padding: torch.Tensor | None = None) -> torch.Tensor:
    store.append(torch.randn(batch, 2, new, 4, generator=gen), torch.randn(batch, 2, new, 4, generator=gen))
    out = store.attend(torch.randn(batch, 4, new, 4, generator=gen), scaling=0.5, padding=padding)
    store.end_step(None if budget is None else torch.full((batch,), budget, dtype=torch.int64))
    return out


def test_timing_breakdown_names_every_section_and_counts_only_its_own_time(monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr(profiling, "clock", lambda: float(next(ticks)))
    store = LayerStore(make_policy("confkv", n_high=8, n_low=8, protect=2, sinks=1),
                       StoreConfig(kv_int8=True, fp_window=3, move_block=2))
    gen = torch.Generator().manual_seed(0)
    timers = profiling.Timers()
    with profiling.enabled(timers):
        for _ in range(12):
            _step(store, gen, budget=8)
    assert set(timers.calls) == {
        "append (FP window)", "positions and masks", "attention read", "EMA / stats update",
        "eviction bookkeeping", "quantization", "ageing (old-region concat)", "ageing + eviction (one call)"}
    assert timers.calls["append (FP window)"] == 12 and timers.calls["attention read"] == 12
    elapsed = next(ticks)  # every clock reading so far
    # each section is a difference of two readings: a positive whole number of ticks, and the
    # sections never overlap, so together they cannot exceed the ticks that passed
    assert all(s >= 1 and s == int(s) for s in timers.seconds.values()), dict(timers.seconds)
    assert sum(timers.seconds.values()) <= elapsed


def test_store_without_profiling_records_nothing():
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(kv_int8=True, fp_window=2, move_block=1))
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        _step(store, gen, budget=6)
    assert profiling.ACTIVE is None and store.kept_list() == [6]


def test_bookkeeping_bytes_by_hand():
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(kv_int8=True, fp_window=2, move_block=1))
    assert store.bookkeeping_bytes() == 0 and store.kv_bytes() == 0
    gen = torch.Generator().manual_seed(2)
    for _ in range(9):
        _step(store, gen, budget=6, batch=2)
    old, recent = store.old.length, store.recent.length
    assert (old, recent) == (4, 2)
    # per slot and head: an int64 position and one float32 statistic ("acc"); per slot: a bool
    per_slot = 2 * 2 * (8 + 4) + 2 * 1
    assert store.bookkeeping_bytes() == (old + recent) * per_slot
    # int8 old slots: 2 heads * (4 + 4 + 2 * 4) bytes per row; fp32 recent: 2 heads * 2 * 4 * 4; channel scale
    assert store.kv_bytes() == 2 * (old * 2 * (4 + 4 + 8) + recent * 2 * 2 * 4 * 4 + 2 * 4 * 4)


def test_select_batch_keeps_the_chosen_rows_of_every_part():
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(kv_int8=True, fp_window=2, move_block=1))
    LayerStore(make_policy("full"), StoreConfig()).select_batch(torch.tensor([0]))  # nothing stored yet: no-op
    gen = torch.Generator().manual_seed(3)
    padding = torch.tensor([[True], [True], [False]])
    _step(store, gen, budget=6, batch=3, padding=padding)
    for _ in range(8):
        _step(store, gen, budget=6, batch=3)
    before = {"old": store.old, "recent": store.recent, "seen": store.seen_real.clone(),
              "scale": store.channel_scale.clone()}
    store.select_batch(torch.tensor([2, 0]))
    assert store.seen_real.tolist() == [before["seen"][2].item(), before["seen"][0].item()] == [8, 9]
    assert torch.equal(store.channel_scale, before["scale"][[2, 0]])
    for name in ("old", "recent"):
        region, was = getattr(store, name), before[name]
        assert torch.equal(region.keys, was.keys[[2, 0]]) and torch.equal(region.positions, was.positions[[2, 0]])
        assert torch.equal(region.valid, was.valid[[2, 0]])
    assert torch.equal(store.old.key_scale, before["old"].key_scale[[2, 0]])
    fp = LayerStore(make_policy("window", budget=5), StoreConfig())
    for _ in range(3):
        _step(fp, gen, budget=5, batch=2)
    keys = fp.recent.keys.clone()
    fp.select_batch(torch.tensor([1]))
    assert torch.equal(fp.recent.keys, keys[[1]]) and fp.channel_scale is None and fp.old.key_scale is None


# -- the cold tier (tiered policies) -------------------------------------------------------------
def _tiered(bits: int = 16, k: int = 1, promote: float | None = None) -> LayerStore:
    """confkv-r, 4 hot tokens (2 protected, no sinks), cold pages of 2 tokens, ``k`` read per step."""
    return LayerStore(make_policy("confkv-r", budget=4, protect=2, sinks=0, bits=bits, page_size=2, group_size=2,
                                  k=k, promote=promote), StoreConfig(move_block=1))


def _tiered_step(store: LayerStore, gen: torch.Generator, batch: int, cold_read: list[int] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
    store.append(torch.randn(batch, 2, 1, 4, generator=gen).to(dtype), torch.randn(batch, 2, 1, 4, generator=gen).to(dtype))
    store.attend(torch.randn(batch, 4, 1, 4, generator=gen).to(dtype), scaling=0.5)
    store.end_step(torch.full((batch,), 4, dtype=torch.int64),
                   cold_read=None if cold_read is None else torch.tensor(cold_read))


def _tiered_steps(store: LayerStore, steps: int, batch: int, cold_read: list[int]) -> None:
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        _tiered_step(store, gen, batch, cold_read)


def test_select_batch_of_a_tiered_store_keeps_the_rows_of_its_cold_tier_and_read_budgets():
    store, twin = _tiered(), _tiered()
    for s in (store, twin):  # 9 tokens: 4 hot, 5 cold (2 sealed pages of 2, 1 in the open page)
        _tiered_steps(s, 9, batch=3, cold_read=[1, 2, 0])
    assert store.cold.num_pages == 2 and store.cold.token_count().tolist() == [5, 5, 5]
    cold_before = {name: t.clone() for name, t in store.cold.pages.items()}
    open_before = {name: t.clone() for name, t in store.cold.open.items()}
    store.select_batch(torch.tensor([2, 0]))
    for name, t in cold_before.items():
        assert torch.equal(store.cold.pages[name], t[[2, 0]]), name
    for name, t in open_before.items():
        assert torch.equal(store.cold.open[name], t[[2, 0]]), name
    # the next read of the kept rows is the read the original rows make: each row reads its own
    # number of cold pages (row 2 none, row 0 one), not the first step's budget
    gen = torch.Generator().manual_seed(5)
    keys, values, query = (torch.randn(3, h, 1, 4, generator=gen) for h in (2, 2, 4))
    store.append(keys[[2, 0]], values[[2, 0]])
    twin.append(keys, values)
    out, ref = store.attend(query[[2, 0]], scaling=0.5), twin.attend(query, scaling=0.5)
    assert torch.allclose(out, ref[[2, 0]], atol=1e-6, rtol=0)
    assert store.cold_read.tolist() == [0, 1]


def test_bookkeeping_bytes_of_a_tiered_store_count_its_cold_tier():
    store = _tiered()
    _tiered_steps(store, 9, batch=3, cold_read=[1, 1, 1])
    assert (store.old.length, store.recent.length, store.cold.open_length, store.cold.num_pages) == (2, 2, 1, 2)
    # hot slots (old + recent), per row: 2 heads * (int64 position + float32 EMA) + a bool
    hot = 3 * (2 + 2) * (2 * (8 + 4) + 1)
    # open page: 1 slot per row, 2 heads * (int64 position + float32 attention while hot) + a bool
    cold_open = 3 * 1 * (2 * (8 + 4) + 1)
    # 2 sealed pages per row and head: 2 int64 positions, 2 bools, a float32 heat, an int64 sealing time,
    # a float32 confidence at sealing, a float32 attention while hot
    sealed = 3 * 2 * 2 * (2 * 8 + 2 * 1 + 4 + 8 + 4 + 4)
    assert store.bookkeeping_bytes() == hot + cold_open + sealed == 831


def test_a_promoted_page_comes_back_in_the_hot_tier_s_dtype():
    """bfloat16 keys, 2-bit cold pages (dequantized to float32): the page a read promotes is cast
    back to the model's dtype, so the hot tier stays bfloat16."""
    store = _tiered(bits=2, k=2, promote=0.01)
    gen = torch.Generator().manual_seed(0)
    bf, came_back = torch.bfloat16, 0
    for _ in range(12):
        sealed = store.cold.pages["positions"][0, 0, :store.cold.num_pages] if store.cold.num_pages else torch.zeros(0)
        store.append(torch.randn(1, 2, 1, 4, generator=gen).to(bf), torch.randn(1, 2, 1, 4, generator=gen).to(bf))
        store.attend(torch.randn(1, 4, 1, 4, generator=gen).to(bf), scaling=0.5)  # promotes during the read
        came_back += len(set(sealed.flatten().tolist()) & set(store.old.positions[0, 0].tolist()))
        store.end_step(torch.full((1,), 4, dtype=torch.int64))
        assert store.old.keys.dtype == store.old.values.dtype == store.recent.keys.dtype == bf
    assert came_back  # some page was promoted at a 1% attention threshold


def test_a_page_promoted_into_an_int8_hot_tier_is_quantized_and_keeps_its_keys():
    """kv_int8 hot tier (FP window 2), full-precision cold pages: a promoted page joins the older
    region as INT8 like every other old token, and dequantizes back to the key it was appended with
    (two INT8 roundings: in the hot tier before demotion, again on promotion)."""
    store = LayerStore(make_policy("confkv-r", budget=4, protect=2, sinks=0, bits=16, page_size=2, group_size=2,
                                   k=2, promote=0.01), StoreConfig(kv_int8=True, fp_window=2, move_block=1))
    gen = torch.Generator().manual_seed(0)
    appended, came_back = {}, 0
    for step in range(12):
        sealed = store.cold.pages["positions"][0, 0, :store.cold.num_pages] if store.cold.num_pages else torch.zeros(0)
        keys = torch.randn(1, 2, 1, 4, generator=gen)
        appended[step] = keys[0, :, 0]  # [H, D]
        store.append(keys, torch.randn(1, 2, 1, 4, generator=gen))
        store.attend(torch.randn(1, 4, 1, 4, generator=gen), scaling=0.5)  # promotes during the read
        came_back += len(set(sealed.flatten().tolist()) & set(store.old.positions[0, 0].tolist()))
        old = store.old
        assert old.keys.dtype == old.values.dtype == torch.int8
        assert old.key_scale.shape == old.value_scale.shape == old.positions.shape
        channel = store.channel_scale[0] if old.length else None  # [H, D]; none before the first quantization
        for h in range(2 if old.length else 0):
            for slot in torch.nonzero(old.valid[0]).flatten().tolist():
                original = appended[int(old.positions[0, h, slot])][h]
                key = old.keys[0, h, slot].float() * old.key_scale[0, h, slot] * channel[h]
                bound = channel[h] * (original.abs() / channel[h]).max() / 127 + 1e-5
                assert ((key - original).abs() <= bound).all(), (step, h, slot)
        store.end_step(torch.full((1,), 4, dtype=torch.int64))
    assert came_back  # some page was promoted at a 1% attention threshold


def test_cold_counts_are_zeros_without_a_cold_tier_and_the_demoted_tokens_with_one():
    plain = LayerStore(make_policy("h2o", budget=4, protect=2), StoreConfig(move_block=1))
    before = plain.cold_counts()  # nothing appended yet: no sequences
    assert before.shape == (0,) and before.dtype == torch.int64
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):
        _step(plain, gen, budget=4, batch=2)
    assert plain.kept_list() == [4, 4]  # two tokens of each sequence evicted for good, none held cold
    counts = plain.cold_counts()
    assert counts.dtype == torch.int64 and counts.tolist() == [0, 0]
    tiered = _tiered()
    assert tiered.cold_counts().shape == (0,) and tiered.cold_counts().dtype == torch.int64
    for steps in range(1, 8):
        _tiered_step(tiered, gen, batch=2)
        # 4 tokens stay hot; every token past them has been demoted to the cold tier
        assert tiered.cold_counts().tolist() == [max(0, steps - 4)] * 2, steps
    assert tiered.cold_counts().dtype == torch.int64


def test_check_store_fits_refuses_exactly_when_the_fp_window_and_sinks_fill_the_budget():
    """``kv_int8`` keeps ``fp_window`` recent tokens and the sinks in full precision, never evicted:
    with a budget of 20 and 4 sinks, a window of 16 (16 + 4 = 20, nothing left to evict) is refused and
    15 is accepted; an unlimited policy is never refused, however wide the window."""
    from confkv.errors import ConfigError
    from confkv.policies.base import UNLIMITED
    from confkv.store import check_store_fits

    policy = make_policy("streaming", budget=20, sinks=4)
    with pytest.raises(ConfigError) as refused:
        check_store_fits(policy, StoreConfig(kv_int8=True, fp_window=16))
    assert str(refused.value) == ("fp_window: the FP window of 16 tokens (never evicted) plus 4 sinks does not fit "
                                  "the smallest budget 20; lower fp_window or raise the budget")
    check_store_fits(policy, StoreConfig(kv_int8=True, fp_window=15))  # 15 + 4 < 20: fits
    check_store_fits(policy, StoreConfig(kv_int8=False, fp_window=16))  # no INT8 tier: no FP window to fit
    check_store_fits(make_policy("full"), StoreConfig(kv_int8=True, fp_window=UNLIMITED))  # nothing evicted


def test_kv_bytes_of_a_full_precision_store_and_of_a_tiered_one_by_hand():
    """Without INT8 there is no channel scale to count, and without a cold tier nothing is offloaded:
    an h2o store of 2 rows holding 6 float32 tokens of 2 heads x 4 dims has 2 (keys, values) x 2 rows x
    6 x 2 x 4 x 4 bytes. A tiered store adds its 16-bit cold tier (5 tokens: two sealed pages of 2 and
    one open slot) to its hot bytes."""
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(5)
    for _ in range(9):
        _step(store, gen, budget=6, batch=2)
    assert store.old.length + store.recent.length == 6
    assert store.kv_bytes() == 2 * 2 * 6 * 2 * 4 * 4 == 768
    assert store.offloaded_bytes() == 0
    tiered = _tiered()
    _tiered_steps(tiered, 9, batch=1, cold_read=[1])
    hot = (tiered.old.length + tiered.recent.length) * 2 * 2 * 4 * 4  # float32 keys and values, 1 row
    assert tiered.old.length + tiered.recent.length == 4 and tiered.cold.kv_bytes() > 0
    assert tiered.kv_bytes() == hot + tiered.cold.kv_bytes()
    assert tiered.offloaded_bytes() == 0  # cold pages in RAM (no offload)


def _reference_read(query, keys, values, scaling, causal_from=None, softcap=None):
    """softmax(q k^T * scaling) v over KV heads repeated for their query groups, by hand.
    causal_from: the position of the first query among the keys (None: every key visible)."""
    group = query.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = query @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal_from is not None:
        q_pos = causal_from + torch.arange(query.shape[2])[:, None]
        scores = scores.masked_fill(torch.arange(keys.shape[2])[None, :] > q_pos, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_a_two_token_prefill_is_causal_the_first_query_never_sees_the_second_key():
    gen = torch.Generator().manual_seed(0)
    store = LayerStore(make_policy("h2o", budget=64, protect=2), StoreConfig(move_block=1))
    keys, values, query = (torch.randn(1, 2, 2, 4, generator=gen), torch.randn(1, 2, 2, 4, generator=gen),
                           torch.randn(1, 4, 2, 4, generator=gen))
    store.append(keys, values)
    out = store.attend(query, scaling=0.5)
    torch.testing.assert_close(out, _reference_read(query, keys, values, 0.5, causal_from=0), rtol=1e-6, atol=1e-6)
    # the first query's output is its own value: the only key it may see
    torch.testing.assert_close(out[0, :2, 0], values[0, 0, 0].expand(2, 4), rtol=1e-6, atol=1e-6)


def test_the_read_applies_the_softcap_it_is_given():
    # scores of up to ~±10 capped at 2: a visible change against the uncapped read
    gen = torch.Generator().manual_seed(1)
    store = LayerStore(make_policy("h2o", budget=64, protect=2), StoreConfig(move_block=1))
    keys, values = 3 * torch.randn(1, 2, 5, 4, generator=gen), torch.randn(1, 2, 5, 4, generator=gen)
    store.append(keys, values)
    store.attend(torch.randn(1, 4, 5, 4, generator=gen), scaling=0.5)
    store.end_step(None)
    k1, v1, q1 = 3 * torch.randn(1, 2, 1, 4, generator=gen), torch.randn(1, 2, 1, 4, generator=gen), \
        3 * torch.randn(1, 4, 1, 4, generator=gen)
    store.append(k1, v1)
    out = store.attend(q1, scaling=0.5, softcap=2.0)
    all_k, all_v = torch.cat([keys, k1], dim=2), torch.cat([values, v1], dim=2)
    capped = _reference_read(q1, all_k, all_v, 0.5, softcap=2.0)
    torch.testing.assert_close(out, capped, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(capped, _reference_read(q1, all_k, all_v, 0.5), atol=1e-3)


def test_a_read_out_of_step_with_the_appends_is_refused_with_its_message_and_pending_is_a_count():
    store = LayerStore(make_policy("h2o", budget=64, protect=2), StoreConfig(move_block=1))
    store.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert store.pending == 1
    with pytest.raises(RuntimeError) as refused:
        store.attend(torch.zeros(1, 4, 2, 4), scaling=0.5)
    assert str(refused.value) == ("confkv: 2 queries but 1 new keys in this layer; "
                                  "the cache and the attention read are out of step")
    store.attend(torch.zeros(1, 4, 1, 4), scaling=0.5)
    assert store.pending == 0  # read: nothing pending (an int count, with or without padding)
    store.end_step(None)
    store.append(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    store.attend(torch.zeros(1, 4, 2, 4), scaling=0.5, padding=torch.tensor([[True, True, False, True]]))
    assert store.pending == 0


def test_a_triton_backend_store_hands_its_cold_pages_over_packed(monkeypatch):
    # the Triton read takes the cold tier's pages still packed (a PagedSegment); the read itself is
    # replaced here by the torch read of the same pages unpacked, so no Triton kernel runs
    from confkv.store import read as store_module
    from confkv.attention.segments import PagedSegment

    seen = []
    real = store_module.attention_read

    def spy(query, segments, scaling, **kwargs):
        seen.append([type(s).__name__ for s in segments])
        kwargs["backend"] = "torch"
        return real(query, [s.to_dense() if isinstance(s, PagedSegment) else s for s in segments], scaling, **kwargs)

    monkeypatch.setattr(store_module, "attention_read", spy)
    policy = make_policy("confkv-r", budget=4, protect=2, sinks=0, bits=2, page_size=2, group_size=2, k=1)
    store = LayerStore(policy, StoreConfig(move_block=1, read_backend="triton"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(9):
        _step(store, gen, budget=4)
    assert int(store.cold_counts().min()) > 0  # pages were demoted, and read since
    assert seen[-1][-1] == "PagedSegment" and "PagedSegment" not in seen[-1][:-1]


def test_the_read_gets_the_store_s_block_size(monkeypatch):
    # `block_size` bounds the read's temporary memory: the store's setting, not the read's default
    from confkv.store import read as store_module

    sizes = []
    real = store_module.attention_read
    monkeypatch.setattr(store_module, "attention_read",
                        lambda *args, **kwargs: sizes.append(kwargs["block_size"]) or real(*args, **kwargs))
    store = LayerStore(make_policy("h2o", budget=8, protect=2), StoreConfig(move_block=1, block_size=3))
    _step(store, torch.Generator().manual_seed(0), budget=8, new=5)
    assert sizes == [3]


def test_a_fresh_store_has_nothing_pending_and_its_statistics_stay_float32_for_bfloat16_keys():
    store = LayerStore(make_policy("h2o", budget=8, protect=2), StoreConfig(move_block=1))
    assert store.pending == 0 and store.old is None and not store.is_initialized
    gen = torch.Generator().manual_seed(0)
    store.append(torch.randn(1, 2, 3, 4, generator=gen).bfloat16(), torch.randn(1, 2, 3, 4, generator=gen).bfloat16())
    assert [t.dtype for t in store.recent.stats.values()] == [torch.float32]  # accumulated attention mass: fp32 in any model dtype
    assert store.old.keys.dtype == torch.bfloat16 and store.old.length == 0


def test_a_second_append_without_a_read_is_refused_with_its_message():
    store = LayerStore(make_policy("h2o", budget=8, protect=2), StoreConfig(move_block=1))
    store.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    with pytest.raises(RuntimeError) as refused:
        store.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert str(refused.value) == ("confkv: a layer received new keys twice without an attention read in between; "
                                  "the model must run with attn_implementation='confkv' (use confkv.hf.enable(model))")


def test_promotion_without_attention_is_refused_and_the_page_file_opens_in_offload_dir(tmp_path, monkeypatch):
    from confkv.errors import ConfigError

    blind = make_policy("quest", budget=8, protect=2, bits=4, page_size=2, group_size=2, k=1, promote=0.1)
    with pytest.raises(ConfigError) as refused:
        LayerStore(blind, StoreConfig(move_block=1))
    assert str(refused.value) == ("promote: policy 'quest' reads no attention mass, so no page can earn "
                                  "promotion; use confkv-r or leave promote unset")
    from confkv.store import layer as store_module

    opened = []
    real = store_module.PageFile
    monkeypatch.setattr(store_module, "PageFile", lambda directory: opened.append(directory) or real(directory))
    offloaded = make_policy("confkv-r", budget=8, protect=2, bits=4, page_size=2, group_size=2, k=1, offload=True,
                            offload_dir=str(tmp_path))
    store = LayerStore(offloaded, StoreConfig(move_block=1))
    assert opened == [str(tmp_path)] and store.cold.page_file is not None  # the page file where the user asked
    store.cold.page_file.close()


# ---------------------------------------------------------------------------------------------------
# What a :class:`confkv.store.LayerStore` reports it keeps (:meth:`kept_counts`), and that INT8
# ageing keeps an unpadded store on its mask-free path; expectations worked out by hand.
#
# Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).


def _step_unbudgeted(store: LayerStore, gen: torch.Generator, batch: int, new: int,
          padding: torch.Tensor | None = None) -> None:
    store.append(torch.randn(batch, 2, new, 4, generator=gen), torch.randn(batch, 2, new, 4, generator=gen))
    store.attend(torch.randn(batch, 4, new, 4, generator=gen), scaling=0.5, padding=padding)
    store.end_step(None)


def test_an_empty_store_keeps_an_empty_int64_count():
    counts = LayerStore(make_policy("full"), StoreConfig()).kept_counts()
    assert counts.shape == (0,) and counts.dtype == torch.int64


def test_counts_live_on_the_device_of_the_cache():
    """On the ``meta`` device (no data): the counts are made where the keys are, as int64 per sequence."""
    store = LayerStore(make_policy("full"), StoreConfig())
    store.append(torch.zeros(2, 2, 3, 4, device="meta"), torch.zeros(2, 2, 3, 4, device="meta"))
    counts = store.kept_counts()
    assert counts.device.type == "meta" and counts.shape == (2,) and counts.dtype == torch.int64


def test_padded_tokens_are_not_counted_when_only_the_window_has_padding():
    """A left-padded prompt of 3 (sequence 0: one pad token) then one step: the older region is
    still empty (all valid) while the FP window holds the pad, so the count must look at validity."""
    store = LayerStore(make_policy("full"), StoreConfig(fp_window=8))
    gen = torch.Generator().manual_seed(0)
    _step_unbudgeted(store, gen, batch=2, new=3, padding=torch.tensor([[False, True, True], [True, True, True]]))
    assert store.old.length == 0 and store.old.all_valid and not store.recent.all_valid
    assert store.kept_counts().tolist() == [2, 3]
    assert store.kept_list() == [2, 3]


def test_int8_ageing_of_an_unpadded_store_keeps_it_dense():
    """Ten single-token steps through a 2-slot FP window, moved in blocks of 2: 8 slots become INT8,
    every one of them valid, so the store keeps reading without masks and counting by lengths."""
    store = LayerStore(make_policy("full"), StoreConfig(kv_int8=True, fp_window=2, move_block=2))
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        _step_unbudgeted(store, gen, batch=2, new=1)
    assert store.old.keys.dtype == torch.int8 and (store.old.length, store.recent.length) == (8, 2)
    assert store.old.all_valid and store.recent.all_valid
    assert store.kept_counts().tolist() == [10, 10]


# ---------------------------------------------------------------------------------------------------
# A :class:`confkv.store.LayerStore` driven by hand through ``end_step``: when the FP window ages (in
# ``move_block`` groups, at once when over budget), what eviction keeps (protected tokens, sliding
# windows, slack, hole compaction), when it ranks at all, and the memory the window holds afterwards,
# against expectations worked out by hand.
#
# Written to kill the mutants of ``end_step``, ``_age`` and ``_evict`` that survived ``make mutate``
# (docs/MUTATION.md).


def _step_with_budgets(store: LayerStore, gen: torch.Generator, budget: list[int] | None, new: int = 1,
          padding: torch.Tensor | None = None) -> None:
    batch = 1 if budget is None else len(budget)
    batch = batch if padding is None else padding.shape[0]
    store.append(torch.randn(batch, 2, new, 4, generator=gen), torch.randn(batch, 2, new, 4, generator=gen))
    store.attend(torch.randn(batch, 4, new, 4, generator=gen), scaling=0.5, padding=padding)
    store.end_step(None if budget is None else torch.tensor(budget, dtype=torch.int64))


def _lengths(store: LayerStore) -> tuple[int, int]:
    return store.old.length, store.recent.length


def test_end_step_before_any_token_or_between_append_and_read_does_nothing():
    """A fresh store has nothing to age or evict; keys appended but not yet read keep their FP slots
    (their positions are not even known yet) until the read, whatever the budget."""
    store = LayerStore(make_policy("h2o", budget=4, protect=1), StoreConfig(move_block=1))
    store.end_step(torch.tensor([1]))
    store.end_step(None)
    assert store.physical_length == 0 and store.kv_bytes() == 0
    gen = torch.Generator().manual_seed(0)
    store.append(torch.randn(1, 2, 3, 4, generator=gen), torch.randn(1, 2, 3, 4, generator=gen))
    store.end_step(torch.tensor([2]))  # over budget, but the 3 keys are pending
    assert _lengths(store) == (0, 3) and store.pending == 3
    store.attend(torch.randn(1, 4, 3, 4, generator=gen), scaling=0.5)
    store.end_step(torch.tensor([2]))  # now it ages and evicts: 1 FP slot + 1 old slot
    assert _lengths(store) == (1, 1)


def test_the_fp_window_ages_in_move_block_groups_without_a_budget():
    """protect 2, move_block 3, no budget: the window grows to 2 + 3 = 5 slots, then its oldest 3 move
    to the old region at once: recent lengths 1 2 3 4 | 2 3 4 | 2 ..., old 0 0 0 0 | 3 3 3 | 6."""
    store = LayerStore(make_policy("h2o", budget=8, protect=2), StoreConfig(move_block=3))
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(8):
        _step_with_budgets(store, gen, budget=None)
        seen.append(_lengths(store))
    assert seen == [(0, 1), (0, 2), (0, 3), (0, 4), (3, 2), (3, 3), (3, 4), (6, 2)]


def test_a_store_exactly_at_budget_keeps_its_window_and_ages_at_once_only_when_over():
    """Budget 4, protect 2, move_block 3: at 4 tokens (at budget, not over) the window keeps all 4, its
    group of 3 not yet complete; the 5th token puts the layer over budget: the window ages and eviction
    takes old down to 2; from then on each token over budget ages its single surplus slot at once,
    without waiting for a group of 3."""
    store = LayerStore(make_policy("h2o", budget=4, protect=2), StoreConfig(move_block=3))
    gen = torch.Generator().manual_seed(2)
    seen = []
    for _ in range(6):
        _step_with_budgets(store, gen, budget=[4])
        seen.append(_lengths(store))
    assert seen == [(0, 1), (0, 2), (0, 3), (0, 4), (2, 2), (2, 2)]


def test_a_padded_store_counts_real_tokens_against_its_budget_not_slots():
    """One leading padding column: real tokens = slots - 1. Budget 4, protect 2, move_block 5 (the window
    would age only at 7 slots). At 4 real tokens (5 slots) the layer is at budget, not over: nothing
    ages; at 5 real tokens it is over: the window ages at once (4 slots: the padding and 3 tokens) and
    eviction keeps the 2 best real old tokens; the padding slot is compacted away."""
    store = LayerStore(make_policy("h2o", budget=4, protect=2), StoreConfig(move_block=5))
    gen = torch.Generator().manual_seed(3)
    _step_with_budgets(store, gen, budget=[4], new=2, padding=torch.tensor([[False, True]]))
    seen = [_lengths(store)]
    for _ in range(4):
        _step_with_budgets(store, gen, budget=[4])
        seen.append(_lengths(store))
    assert store.kept_list() == [4]
    assert seen == [(0, 2), (0, 3), (0, 4), (0, 5), (2, 2)]


def test_ranking_runs_only_when_a_sequence_is_over_its_budget():
    """Two rows, the second with a leading padding column, budgets [100, 3]: the second row reaches
    exactly 3 tokens after two decode steps (at budget: no ranking, nothing compacted), then goes over
    at the third and is ranked and evicted back to 3 (``kept_list`` [5, 3])."""
    store = LayerStore(make_policy("h2o", budget=3, protect=1), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(4)
    padding = torch.tensor([[True, True], [False, True]])
    timers = profiling.Timers()
    with profiling.enabled(timers):
        _step_with_budgets(store, gen, budget=[100, 3], new=2, padding=padding)
        for _ in range(2):
            _step_with_budgets(store, gen, budget=[100, 3])
    assert store.kept_list() == [4, 3]
    assert "ranking and top-k" not in timers.calls and "compaction gather" not in timers.calls
    with profiling.enabled(timers):
        _step_with_budgets(store, gen, budget=[100, 3])
    assert store.kept_list() == [5, 3] and timers.calls["ranking and top-k"] == 1


def test_slack_evicts_only_the_sequences_over_their_own_budget():
    """evict_slack 2, two rows (the second padded by 2 columns), budget 5 each, one FP slot (protect 1).
    Real tokens per row go [4, 2], [5, 3], then the first row is over (6): it alone is evicted to
    5 - 2 = 3; the second (4, under its budget) keeps everything, and still does at 5 (at budget): the old
    region's counts are per sequence, never summed over the batch."""
    store = LayerStore(make_policy("h2o", budget=5, protect=1), StoreConfig(move_block=1, evict_slack=2))
    gen = torch.Generator().manual_seed(5)
    padding = torch.tensor([[True, True, True], [False, False, True]])
    _step_with_budgets(store, gen, budget=[5, 5], new=3, padding=padding)
    seen = [store.kept_list()]
    for _ in range(4):
        _step_with_budgets(store, gen, budget=[5, 5])
        seen.append(store.kept_list())
    assert seen == [[3, 1], [4, 2], [5, 3], [3, 4], [4, 5]]


def test_padding_columns_no_sequence_uses_are_compacted_even_without_a_budget():
    """Both rows start with a padding column (left padding of a batch whose longest prompt is 2 of 3
    columns): once it ages into the old region it is a hole in every row, and the store drops it, so it
    holds 2 slots per row for row 1's 2 tokens, not 3 (no budget: nothing real is evicted)."""
    store = LayerStore(make_policy("h2o", budget=4, protect=1), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(6)
    padding = torch.tensor([[False, True, True], [False, False, True]])
    _step_with_budgets(store, gen, budget=None, new=3, padding=padding)
    assert store.kept_list() == [2, 1]
    assert _lengths(store) == (1, 1) and store.physical_length == 2
    assert store.old.positions[0, :, 0].tolist() == [0, 0]  # row 0's first real token kept
    assert store.old.valid.tolist() == [[True], [False]]


def test_an_int8_store_protects_the_last_protect_tokens_beyond_its_fp_window():
    """kv_int8 with an FP window of 1 and protect 4: the 3 tokens before the window live in the INT8 old
    region but stay protected (effective protection max(protect, W)), so after every step the last 4
    positions are all kept, however little attention they got (TOVA ranks by the last attention only)."""
    store = LayerStore(make_policy("tova", budget=6, protect=4, sinks=0), StoreConfig(kv_int8=True, fp_window=1,
                                                                                     move_block=1))
    gen = torch.Generator().manual_seed(7)
    for step in range(1, 16):
        _step_with_budgets(store, gen, budget=[6])
        kept = set(store.old.positions[0, 0].tolist()) | set(store.recent.positions[0, 0].tolist())
        assert set(range(max(0, step - 4), step)) <= kept, (step, sorted(kept))
        assert len(kept) == min(step, 6)


def test_a_sliding_window_layer_keeps_w_minus_1_tokens_whatever_the_policy_protects():
    """A sliding-window layer of window W keeps exactly its last W - 1 tokens; the policy's protection
    window (4 here) does not apply to it. W = 1 keeps nothing between steps."""
    for window, expected in ((3, [0, 1]), (1, [])):
        store = LayerStore(make_policy("h2o", budget=6, protect=4, sinks=0), StoreConfig(move_block=1),
                           sliding_window=window)
        gen = torch.Generator().manual_seed(8)
        for step in range(1, 7):
            _step_with_budgets(store, gen, budget=None)
            assert store.physical_length == min(step, window - 1), (window, step)
        kept = sorted(store.old.positions[0, 0].tolist() + store.recent.positions[0, 0].tolist())
        assert kept == [6 - window + 1 + i for i in expected], (window, kept)


def test_the_aged_window_owns_its_memory():
    """After ageing, the FP window is a copy of its remaining slots, not a view that keeps the moved
    slots' storage alive (``kv_bytes`` counts only the slots held, so it must be all the memory held)."""
    store = LayerStore(make_policy("h2o", budget=8, protect=2), StoreConfig(move_block=2))
    gen = torch.Generator().manual_seed(9)
    for _ in range(4):  # 4 slots: the 2 oldest age
        _step_with_budgets(store, gen, budget=None)
    assert _lengths(store) == (2, 2)
    recent = store.recent
    for tensor in (recent.keys, recent.values, recent.positions, recent.valid, *recent.stats.values()):
        assert tensor.untyped_storage().nbytes() == tensor.nbytes


def test_the_cold_read_gets_int64_page_counts(monkeypatch):
    """``ColdTier.segments`` takes [B] int64 page counts; the store converts the ``cold_read`` it is
    given (here int32) before handing it on."""
    store = LayerStore(make_policy("confkv-r", budget=4, protect=2, sinks=0, bits=16, page_size=2, group_size=2,
                                   k=1), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(10)
    handed = []
    original = store.cold.segments

    def spy(query, read_pages, paged=False, **kwargs):
        handed.append(read_pages)
        return original(query, read_pages, paged=paged, **kwargs)

    monkeypatch.setattr(store.cold, "segments", spy)
    for _ in range(8):
        store.append(torch.randn(1, 2, 1, 4, generator=gen), torch.randn(1, 2, 1, 4, generator=gen))
        store.attend(torch.randn(1, 4, 1, 4, generator=gen), scaling=0.5)
        store.end_step(torch.tensor([4]), cold_read=torch.tensor([1], dtype=torch.int32))
    assert len(handed) == 8 and all(pages.dtype == torch.int64 for pages in handed)
    assert [pages.tolist() for pages in handed[1:]] == [[1]] * 7


def test_slots_no_remaining_sequence_uses_are_dropped_after_a_batch_selection():
    """Budgets [6, 3] (no padding): after 6 steps row 0 holds 6 tokens, row 1 only 3, so the old region
    is 5 slots wide and row 1 uses 2 of them. Keeping row 1 alone (a finished sequence removed) leaves
    3 old slots nobody uses: the next step (no budget) drops them, so the store holds 4 slots for row 1's
    4 tokens, not 5 + 2."""
    store = LayerStore(make_policy("h2o", budget=3, protect=1), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(11)
    for _ in range(6):
        _step_with_budgets(store, gen, budget=[6, 3])
    assert store.kept_list() == [6, 3] and _lengths(store) == (5, 1)
    store.select_batch(torch.tensor([1]))
    _step_with_budgets(store, gen, budget=None)
    assert store.kept_list() == [4] and _lengths(store) == (3, 1)


def test_a_store_whose_sequences_were_all_removed_still_steps():
    """A padded prompt (so the store tracks validity) that has not yet aged into the old region, then
    every sequence removed: ``end_step`` over an empty batch does nothing and holds nothing."""
    store = LayerStore(make_policy("h2o", budget=6, protect=4), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(12)
    _step_with_budgets(store, gen, budget=[6], new=2, padding=torch.tensor([[False, True]]))
    assert _lengths(store) == (0, 2)
    store.select_batch(torch.tensor([], dtype=torch.int64))
    store.end_step(torch.zeros(0, dtype=torch.int64))
    store.end_step(None)
    assert store.kept_list() == [] and store.kv_bytes() == 0


def test_nothing_is_ranked_while_the_old_region_is_empty():
    """A padded prompt (validity tracked, so no dense shortcut) still inside the FP window (protect 4):
    the old region is empty, there is nothing to rank or compact, whatever the budget."""
    store = LayerStore(make_policy("h2o", budget=6, protect=4), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(13)
    timers = profiling.Timers()
    with profiling.enabled(timers):
        _step_with_budgets(store, gen, budget=[6], new=2, padding=torch.tensor([[False, True]]))
        _step_with_budgets(store, gen, budget=[6])
    assert _lengths(store) == (0, 3) and store.kept_list() == [2]
    assert "ranking and top-k" not in timers.calls and "compaction gather" not in timers.calls


def test_a_sliding_window_layer_takes_no_eviction_slack():
    """evict_slack 2 does not apply to a sliding-window layer (W = 4): it holds exactly its last 3 tokens
    at every step once full, never 3 - 2 = 1."""
    store = LayerStore(make_policy("h2o", budget=6, protect=4, sinks=0), StoreConfig(move_block=1, evict_slack=2),
                       sliding_window=4)
    gen = torch.Generator().manual_seed(14)
    seen = []
    for _ in range(7):
        _step_with_budgets(store, gen, budget=None)
        seen.append(store.physical_length)
    assert seen == [1, 2, 3, 3, 3, 3, 3]
    assert sorted(store.old.positions[0, 0].tolist() + store.recent.positions[0, 0].tolist()) == [4, 5, 6]


def test_slack_spares_a_sequence_exactly_at_its_budget():
    """evict_slack 2, budgets [5, 5], protect 1; the second row has one padding column so it holds one real
    token fewer. Real tokens go [2, 1] ... [5, 4]; at [6, 5] the first row is over and is evicted to
    5 - 2 = 3; the second is exactly at its budget (not over) and keeps all 5."""
    store = LayerStore(make_policy("h2o", budget=5, protect=1, sinks=0), StoreConfig(move_block=1, evict_slack=2))
    gen = torch.Generator().manual_seed(15)
    _step_with_budgets(store, gen, budget=[5, 5], new=2, padding=torch.tensor([[True, True], [False, True]]))
    seen = [store.kept_list()]
    for _ in range(4):
        _step_with_budgets(store, gen, budget=[5, 5])
        seen.append(store.kept_list())
    assert seen == [[2, 1], [3, 2], [4, 3], [5, 4], [3, 5]]


def _kept_under(slack, budget: int, steps: int = 12) -> list[int]:
    """kept counts of one sequence after each step: h2o, protect 1 (the FP slot), sinks 2, a fixed budget."""
    store = LayerStore(make_policy("h2o", budget=budget, protect=1, sinks=2),
                       StoreConfig(move_block=1, evict_slack=slack))
    gen = torch.Generator().manual_seed(18)
    seen = []
    for _ in range(steps):
        _step_with_budgets(store, gen, budget=[budget])
        seen.append(store.kept_list()[0])
    return seen


def test_a_share_of_slack_is_a_share_of_the_tokens_kept_by_rank():
    """Budget 11: the FP slot and the 2 sinks are kept whatever happens, 8 tokens by rank. A share of 0.25 is 2 of
    those 8 (whole tokens): over budget at 12 the store goes down to 9, as with evict_slack=2, step for step; 0.3
    is 2 as well (2.4, rounded down), 0.4 is 3."""
    assert _kept_under(2, 11) == _kept_under(0.25, 11) == _kept_under(0.3, 11) == [
        1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 9]
    assert _kept_under(0.4, 11, 14)[-3:] == [8, 9, 10]  # 12 -> 8 at the 12th step, then one more a step


def test_a_share_of_slack_takes_nothing_from_a_budget_at_its_floor():
    """Budget 4: one token by rank above the floor of 3 (the FP slot, 2 sinks). A fixed slack of 2 takes that one
    (and the newest old token) at times, so the store holds fewer than 4 at some steps; a share of it is 0.5 x 1
    -> 0 tokens: the store holds 4 at every step, as with no slack."""
    assert min(_kept_under(2, 4)[4:]) < 4
    assert _kept_under(0.5, 4) == _kept_under(0, 4) == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4]


def test_slack_may_empty_the_old_region():
    """Budget 2, evict_slack 2, protect 1 (sinks 0): over budget at 3 tokens, the old region's keep is
    2 - 1 (the FP slot) - 2 (slack) < 0, so 0: only the protected FP token stays; kept 1 2 1 2 1."""
    store = LayerStore(make_policy("h2o", budget=2, protect=1, sinks=0), StoreConfig(move_block=1, evict_slack=2))
    gen = torch.Generator().manual_seed(16)
    seen = []
    for _ in range(5):
        _step_with_budgets(store, gen, budget=[2])
        seen.append(store.kept_list())
    assert seen == [[1], [2], [1], [2], [1]]
    assert store.old.length == 0 or not bool(store.old.valid.any())


def test_protection_raises_each_sequences_keep_by_its_own_protected_count():
    """protect 2, sinks 0, budgets [2, 100], a 3-token prompt: row 0 is cut to its 2 protected FP tokens.
    The next token is padding for row 1, so its FP window holds [2, pad] and its protected position 1 lives
    in the old region. Row 0 (positions 2, 3 in its FP window, nothing protected in old) is over its budget
    and keeps no old token: row 1's protected old token does not raise row 0's keep."""
    store = LayerStore(make_policy("h2o", budget=3, protect=2, sinks=0), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(17)
    _step_with_budgets(store, gen, budget=[2, 100], new=3)
    assert store.kept_list() == [2, 3]
    _step_with_budgets(store, gen, budget=[2, 100], padding=torch.tensor([[True], [False]]))
    assert store.kept_list() == [2, 3]
    assert store.recent.positions[0, 0].tolist() == [2, 3]
    assert not bool(store.old.valid[0].any())


def test_protected_tokens_are_counted_per_head_not_summed_over_heads():
    """protect 2, sinks 0, Hkv 2, a 3-token prompt without a budget, then a padding column: old [0, 1], FP
    window [2, pad]. Budget 2 leaves the old region 2 - 1 = 1 slot; exactly one old token (position 1) is
    protected in each head, so the old region keeps 1 (not 2, the heads' sum): 2 tokens in all."""
    store = LayerStore(make_policy("h2o", budget=3, protect=2, sinks=0), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(18)
    _step_with_budgets(store, gen, budget=None, new=3)
    assert _lengths(store) == (1, 2)
    _step_with_budgets(store, gen, budget=[2], padding=torch.tensor([[False]]))
    assert store.kept_list() == [2]
    valid_old = store.old.valid[0]
    assert store.old.positions[0, :, valid_old].tolist() == [[1], [1]]


def test_an_int8_store_demotes_tokens_to_the_cold_tier_in_the_model_dtype():
    """kv_int8 store of bfloat16 keys with a 16-bit cold tier (confkv-r): the INT8 tokens evicted to the
    cold tier are dequantized to bfloat16 (the FP window's dtype), so the tier stores bfloat16, not the
    float32 that dequantization computes in (which would double its memory)."""
    store = LayerStore(make_policy("confkv-r", budget=4, protect=2, sinks=0, bits=16, page_size=2, group_size=2,
                                   k=1), StoreConfig(move_block=1, kv_int8=True, fp_window=1))
    gen = torch.Generator().manual_seed(19)
    for _ in range(8):
        store.append(torch.randn(1, 2, 1, 4, generator=gen).bfloat16(), torch.randn(1, 2, 1, 4, generator=gen).bfloat16())
        store.attend(torch.randn(1, 4, 1, 4, generator=gen).bfloat16(), scaling=0.5)
        store.end_step(torch.tensor([4]))
    assert store.int8 and store.kept_list() == [4]
    assert store.cold.token_count().tolist() == [4]
    assert store.cold.dtype == torch.bfloat16


def test_hf_style_int_and_float_attention_masks_count_real_tokens_as_int64():
    """``padding`` may come as HF's 2D attention mask (``model(...)`` takes int64 or float 0/1 masks):
    the store reads it as bool, so the real-token counts stay int64 [B] and positions are integers:
    rows with 1 and 3 leading padding columns of 4 hold 3 and 1 real tokens at positions 0.."""
    for dtype in (torch.int64, torch.float32):
        store = LayerStore(make_policy("h2o", budget=6, protect=4), StoreConfig(move_block=1))
        gen = torch.Generator().manual_seed(20)
        mask = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1]], dtype=dtype)
        _step_with_budgets(store, gen, budget=[6, 6], new=4, padding=mask)
        _step_with_budgets(store, gen, budget=[6, 6], padding=torch.cat([mask, torch.ones(2, 1, dtype=dtype)], dim=1))
        assert store.seen_real.dtype == torch.int64 and store.seen_real.tolist() == [4, 2], dtype
        assert store.kept_list() == [4, 2]
        assert _lengths(store) == (0, 4)  # the all-padding first column was dropped when it aged
        assert store.recent.valid.tolist() == [[True, True, True, True], [False, False, True, True]]
        assert store.recent.positions[0, 0].tolist() == [0, 1, 2, 3]
        assert store.recent.positions[1, 0, 2:].tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------------
# Forking a layer store (:meth:`confkv.store.LayerStore.fork`): a sliding-window layer stays a
# sliding-window layer whatever the policy, and an offloaded cold tier's copy shares the page file
# instead of opening one more.
#
# Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).


def _step_one_token(store: LayerStore, gen: torch.Generator, budget: int) -> torch.Tensor:
    store.append(torch.randn(1, 2, 1, 4, generator=gen), torch.randn(1, 2, 1, 4, generator=gen))
    out = store.attend(torch.randn(1, 4, 1, 4, generator=gen), scaling=0.5)
    store.end_step(torch.full((1,), budget, dtype=torch.int64))
    return out


def test_a_forked_sliding_window_layer_keeps_its_window_and_ignores_the_new_policy():
    # W = 4: the layer keeps the last W - 1 = 3 tokens, whatever the policy's budget (6)
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(move_block=1), sliding_window=4)
    for seed in range(7):
        _step_one_token(store, torch.Generator().manual_seed(seed), budget=6)
    twin = store.fork(make_policy("tova", budget=6))
    assert twin.sliding_window == 4
    for seed in range(7, 10):
        out, ref = _step_one_token(twin, torch.Generator().manual_seed(seed), 6), _step_one_token(store, torch.Generator().manual_seed(seed), 6)
        assert torch.equal(out, ref)
    # tokens 0..9 seen: the last 3 kept, in both
    kept = sorted(twin.old.positions[0, 0].tolist() + twin.recent.positions[0, 0].tolist())
    assert kept == [7, 8, 9] and twin.kept_list() == [3] and twin.stat_names == ()


def test_forking_an_offloaded_tiered_store_shares_its_page_file(tmp_path, monkeypatch):
    policy = make_policy("confkv-r", budget=4, protect=2, sinks=0, bits=2, page_size=2, group_size=2, k=1,
                         offload=True, offload_dir=str(tmp_path))
    store = LayerStore(policy, StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(0)
    for _ in range(9):
        _step_one_token(store, gen, budget=4)
    assert store.offloaded_bytes() > 0
    opened = []
    real = store_module.PageFile
    monkeypatch.setattr(store_module, "PageFile", lambda directory: opened.append(directory) or real(directory))
    twin = store.fork(policy)
    assert opened == []  # no second file for the copy
    assert twin.cold.page_file is store.cold.page_file
    assert twin.offloaded_bytes() == store.offloaded_bytes() and twin.kv_bytes() == store.kv_bytes()
    store.cold.page_file.close()


def test_forking_an_int8_store_copies_its_scales_so_the_copy_reads_what_the_original_reads():
    # kv_int8 with a 2-token FP window: after 8 steps the older region holds INT8 keys/values with
    # per-token scales, and the layer's key channel scale is frozen
    config = StoreConfig(kv_int8=True, fp_window=2, move_block=1)
    store = LayerStore(make_policy("h2o", budget=6, protect=2), config)
    for seed in range(8):
        _step_one_token(store, torch.Generator().manual_seed(seed), budget=6)
    assert store.old.is_int8 and store.old.length > 0 and store.channel_scale is not None
    twin = store.fork(make_policy("h2o", budget=6, protect=2))
    for name in ("key_scale", "value_scale"):
        mine, theirs = getattr(twin.old, name), getattr(store.old, name)
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr(), name  # equal copies
    assert torch.equal(twin.channel_scale, store.channel_scale)
    assert twin.channel_scale.data_ptr() != store.channel_scale.data_ptr()
    for seed in range(8, 12):
        out, ref = _step_one_token(twin, torch.Generator().manual_seed(seed), 6), _step_one_token(store, torch.Generator().manual_seed(seed), 6)
        assert torch.equal(out, ref), seed


def test_forking_in_the_middle_of_a_forward_pass_is_refused():
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(move_block=1))
    _step_one_token(store, torch.Generator().manual_seed(0), budget=6)
    store.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))  # keys appended, attention not read yet
    with pytest.raises(ValueError, match="^" + re.escape("confkv: cannot fork a store in the middle of a forward pass") + "$"):
        store.fork(make_policy("h2o", budget=6, protect=2))


def test_forking_for_a_policy_whose_statistic_was_never_collected_names_it():
    # H2O collects "acc"; TOVA needs "attn", which no step of this store recorded
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(move_block=1))
    for seed in range(3):
        _step_one_token(store, torch.Generator().manual_seed(seed), budget=6)
    message = ("confkv: cannot fork for policy 'tova': statistics ['attn'] were never collected "
               "(prefill with a TeePolicy that includes it)")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        store.fork(make_policy("tova", budget=6))


def test_a_fork_keeps_the_regions_dense_flag():
    # `dense` (every slot valid, known without reading `valid`) lets the read skip the mask; a copy
    # of a dense region is dense too, not demoted to the masked path
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(move_block=1))
    for seed in range(8):
        _step_one_token(store, torch.Generator().manual_seed(seed), budget=6)
    assert store.old.all_valid is True and store.recent.all_valid is True
    twin = store.fork(make_policy("h2o", budget=6, protect=2))
    assert twin.old.all_valid is True and twin.recent.all_valid is True
