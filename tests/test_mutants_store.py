"""A :class:`confkv.store.LayerStore` driven by hand: the timing breakdown it reports, what it keeps,
where each token lives, and its byte counts, against expectations worked out by hand.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

import itertools

import pytest
import torch

from confkv import profiling
from confkv.config import StoreConfig
from confkv.policies import make_policy
from confkv.store import LayerStore


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
        "eviction bookkeeping", "quantization", "ageing (old-region concat)", "ranking and top-k",
        "compaction gather"}
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
    # open page: 1 slot per row, 2 heads * int64 position + a bool
    cold_open = 3 * 1 * (2 * 8 + 1)
    # 2 sealed pages per row and head: 2 int64 positions, 2 bools, a float32 heat, an int64 sealing time,
    # a float32 confidence at sealing
    sealed = 3 * 2 * 2 * (2 * 8 + 2 * 1 + 4 + 8 + 4)
    assert store.bookkeeping_bytes() == hot + cold_open + sealed == 759


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
    from confkv.attention.paged import PagedSegment

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
