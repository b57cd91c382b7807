"""A :class:`confkv.store.LayerStore` driven by hand through ``end_step``: when the FP window ages (in
``move_block`` groups, at once when over budget), what eviction keeps (protected tokens, sliding
windows, slack, hole compaction), when it ranks at all, and the memory the window holds afterwards,
against expectations worked out by hand.

Written to kill the mutants of ``end_step``, ``_age`` and ``_evict`` that survived ``make mutate``
(docs/MUTATION.md).
"""

import torch

from confkv import profiling
from confkv.config import StoreConfig
from confkv.policies import make_policy
from confkv.store import LayerStore


def _step(store: LayerStore, gen: torch.Generator, budget: list[int] | None, new: int = 1,
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
        _step(store, gen, budget=None)
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
        _step(store, gen, budget=[4])
        seen.append(_lengths(store))
    assert seen == [(0, 1), (0, 2), (0, 3), (0, 4), (2, 2), (2, 2)]


def test_a_padded_store_counts_real_tokens_against_its_budget_not_slots():
    """One leading padding column: real tokens = slots - 1. Budget 4, protect 2, move_block 5 (the window
    would age only at 7 slots). At 4 real tokens (5 slots) the layer is at budget, not over: nothing
    ages; at 5 real tokens it is over: the window ages at once (4 slots: the padding and 3 tokens) and
    eviction keeps the 2 best real old tokens; the padding slot is compacted away."""
    store = LayerStore(make_policy("h2o", budget=4, protect=2), StoreConfig(move_block=5))
    gen = torch.Generator().manual_seed(3)
    _step(store, gen, budget=[4], new=2, padding=torch.tensor([[False, True]]))
    seen = [_lengths(store)]
    for _ in range(4):
        _step(store, gen, budget=[4])
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
        _step(store, gen, budget=[100, 3], new=2, padding=padding)
        for _ in range(2):
            _step(store, gen, budget=[100, 3])
    assert store.kept_list() == [4, 3]
    assert "ranking and top-k" not in timers.calls and "compaction gather" not in timers.calls
    with profiling.enabled(timers):
        _step(store, gen, budget=[100, 3])
    assert store.kept_list() == [5, 3] and timers.calls["ranking and top-k"] == 1


def test_slack_evicts_only_the_sequences_over_their_own_budget():
    """evict_slack 2, two rows (the second padded by 2 columns), budget 5 each, one FP slot (protect 1).
    Real tokens per row go [4, 2], [5, 3], then the first row is over (6): it alone is evicted to
    5 - 2 = 3; the second (4, under its budget) keeps everything, and still does at 5 (at budget): the old
    region's counts are per sequence, never summed over the batch."""
    store = LayerStore(make_policy("h2o", budget=5, protect=1), StoreConfig(move_block=1, evict_slack=2))
    gen = torch.Generator().manual_seed(5)
    padding = torch.tensor([[True, True, True], [False, False, True]])
    _step(store, gen, budget=[5, 5], new=3, padding=padding)
    seen = [store.kept_list()]
    for _ in range(4):
        _step(store, gen, budget=[5, 5])
        seen.append(store.kept_list())
    assert seen == [[3, 1], [4, 2], [5, 3], [3, 4], [4, 5]]


def test_padding_columns_no_sequence_uses_are_compacted_even_without_a_budget():
    """Both rows start with a padding column (left padding of a batch whose longest prompt is 2 of 3
    columns): once it ages into the old region it is a hole in every row, and the store drops it, so it
    holds 2 slots per row for row 1's 2 tokens, not 3 (no budget: nothing real is evicted)."""
    store = LayerStore(make_policy("h2o", budget=4, protect=1), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(6)
    padding = torch.tensor([[False, True, True], [False, False, True]])
    _step(store, gen, budget=None, new=3, padding=padding)
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
        _step(store, gen, budget=[6])
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
            _step(store, gen, budget=None)
            assert store.physical_length == min(step, window - 1), (window, step)
        kept = sorted(store.old.positions[0, 0].tolist() + store.recent.positions[0, 0].tolist())
        assert kept == [6 - window + 1 + i for i in expected], (window, kept)


def test_the_aged_window_owns_its_memory():
    """After ageing, the FP window is a copy of its remaining slots, not a view that keeps the moved
    slots' storage alive (``kv_bytes`` counts only the slots held, so it must be all the memory held)."""
    store = LayerStore(make_policy("h2o", budget=8, protect=2), StoreConfig(move_block=2))
    gen = torch.Generator().manual_seed(9)
    for _ in range(4):  # 4 slots: the 2 oldest age
        _step(store, gen, budget=None)
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
        _step(store, gen, budget=[6, 3])
    assert store.kept_list() == [6, 3] and _lengths(store) == (5, 1)
    store.select_batch(torch.tensor([1]))
    _step(store, gen, budget=None)
    assert store.kept_list() == [4] and _lengths(store) == (3, 1)


def test_a_store_whose_sequences_were_all_removed_still_steps():
    """A padded prompt (so the store tracks validity) that has not yet aged into the old region, then
    every sequence removed: ``end_step`` over an empty batch does nothing and holds nothing."""
    store = LayerStore(make_policy("h2o", budget=6, protect=4), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(12)
    _step(store, gen, budget=[6], new=2, padding=torch.tensor([[False, True]]))
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
        _step(store, gen, budget=[6], new=2, padding=torch.tensor([[False, True]]))
        _step(store, gen, budget=[6])
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
        _step(store, gen, budget=None)
        seen.append(store.physical_length)
    assert seen == [1, 2, 3, 3, 3, 3, 3]
    assert sorted(store.old.positions[0, 0].tolist() + store.recent.positions[0, 0].tolist()) == [4, 5, 6]


def test_slack_spares_a_sequence_exactly_at_its_budget():
    """evict_slack 2, budgets [5, 5], protect 1; the second row has one padding column so it holds one real
    token fewer. Real tokens go [2, 1] ... [5, 4]; at [6, 5] the first row is over and is evicted to
    5 - 2 = 3; the second is exactly at its budget (not over) and keeps all 5."""
    store = LayerStore(make_policy("h2o", budget=5, protect=1, sinks=0), StoreConfig(move_block=1, evict_slack=2))
    gen = torch.Generator().manual_seed(15)
    _step(store, gen, budget=[5, 5], new=2, padding=torch.tensor([[True, True], [False, True]]))
    seen = [store.kept_list()]
    for _ in range(4):
        _step(store, gen, budget=[5, 5])
        seen.append(store.kept_list())
    assert seen == [[2, 1], [3, 2], [4, 3], [5, 4], [3, 5]]


def test_slack_may_empty_the_old_region():
    """Budget 2, evict_slack 2, protect 1 (sinks 0): over budget at 3 tokens, the old region's keep is
    2 - 1 (the FP slot) - 2 (slack) < 0, so 0: only the protected FP token stays; kept 1 2 1 2 1."""
    store = LayerStore(make_policy("h2o", budget=2, protect=1, sinks=0), StoreConfig(move_block=1, evict_slack=2))
    gen = torch.Generator().manual_seed(16)
    seen = []
    for _ in range(5):
        _step(store, gen, budget=[2])
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
    _step(store, gen, budget=[2, 100], new=3)
    assert store.kept_list() == [2, 3]
    _step(store, gen, budget=[2, 100], padding=torch.tensor([[True], [False]]))
    assert store.kept_list() == [2, 3]
    assert store.recent.positions[0, 0].tolist() == [2, 3]
    assert not bool(store.old.valid[0].any())


def test_protected_tokens_are_counted_per_head_not_summed_over_heads():
    """protect 2, sinks 0, Hkv 2, a 3-token prompt without a budget, then a padding column: old [0, 1], FP
    window [2, pad]. Budget 2 leaves the old region 2 - 1 = 1 slot; exactly one old token (position 1) is
    protected in each head, so the old region keeps 1 (not 2, the heads' sum): 2 tokens in all."""
    store = LayerStore(make_policy("h2o", budget=3, protect=2, sinks=0), StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(18)
    _step(store, gen, budget=None, new=3)
    assert _lengths(store) == (1, 2)
    _step(store, gen, budget=[2], padding=torch.tensor([[False]]))
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
        _step(store, gen, budget=[6, 6], new=4, padding=mask)
        _step(store, gen, budget=[6, 6], padding=torch.cat([mask, torch.ones(2, 1, dtype=dtype)], dim=1))
        assert store.seen_real.dtype == torch.int64 and store.seen_real.tolist() == [4, 2], dtype
        assert store.kept_list() == [4, 2]
        assert _lengths(store) == (0, 4)  # the all-padding first column was dropped when it aged
        assert store.recent.valid.tolist() == [[True, True, True, True], [False, False, True, True]]
        assert store.recent.positions[0, 0].tolist() == [0, 1, 2, 3]
        assert store.recent.positions[1, 0, 2:].tolist() == [0, 1]
