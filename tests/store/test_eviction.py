"""Eviction in one layer (:mod:`confkv.store.hot_tier`) on hand-made slots and regions, with answers worked
out by hand: the selection rule (protected slots, the kept and the dropped slots), the demotion to the cold
tier, and the moves back (the promoted region's statistics, dtype and validity; the merge into position order).

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md): every expected value below is
spelled out, not computed with the code under test.
"""

import torch

from confkv import profiling
from confkv.config import ColdConfig
from confkv.policies import make_policy
from confkv.store.hot_tier import demote_dropped, dropped_slots, protected_mask, select_kept
from confkv.store.promotion import merge_in_position_order, promoted_region
from confkv.store.hot_tier import Region
from confkv.tiers.cold import ColdTier


def test_protected_mask_marks_the_last_protect_positions_and_the_sinks():
    positions = torch.arange(10).view(1, 1, 10)
    valid = torch.ones(1, 10, dtype=torch.bool)
    mask = protected_mask(positions, valid, torch.tensor([9]), protect=3, sinks=2)
    # recent: 7, 8, 9 (the last 3 positions, 9 included); sinks: 0, 1
    assert mask[0, 0].tolist() == [True, True, False, False, False, False, False, True, True, True]


def test_protected_mask_is_relative_to_each_sequences_current_position():
    positions = torch.arange(6).expand(2, 1, 6)
    valid = torch.ones(2, 6, dtype=torch.bool)
    mask = protected_mask(positions, valid, torch.tensor([5, 3]), protect=2, sinks=0)
    assert mask[0, 0].tolist() == [False, False, False, False, True, True]
    # positions 4 and 5 lie after sequence 1's current token 3: they count as recent too
    assert mask[1, 0].tolist() == [False, False, True, True, True, True]


def test_protected_mask_zero_protect_and_zero_sinks_protect_nothing():
    positions = torch.arange(5).view(1, 1, 5)
    valid = torch.ones(1, 5, dtype=torch.bool)
    assert not protected_mask(positions, valid, torch.tensor([4]), protect=0, sinks=0).any()


def test_protected_mask_never_protects_invalid_slots():
    positions = torch.arange(5).view(1, 1, 5)
    valid = torch.tensor([[False, True, True, True, False]])
    mask = protected_mask(positions, valid, torch.tensor([4]), protect=2, sinks=1)
    assert mask[0, 0].tolist() == [False, False, False, True, False]


def test_select_kept_keeps_the_best_scores_in_slot_order():
    scores = torch.tensor([[[0.5, 0.1, 0.9, 0.3, 0.7]]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    protected = torch.zeros(1, 1, 5, dtype=torch.bool)
    index, kept_valid = select_kept(scores, valid, protected, torch.tensor([3]))
    assert index[0, 0].tolist() == [0, 2, 4]  # 0.5, 0.9, 0.7, in slot order
    assert kept_valid.tolist() == [[True, True, True]]


def test_select_kept_puts_protected_slots_before_higher_scores():
    scores = torch.tensor([[[0.5, 0.1, 0.9, 0.3, 0.7]]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    protected = torch.tensor([[[False, True, False, True, False]]])
    index, _ = select_kept(scores, valid, protected, torch.tensor([3]))
    assert index[0, 0].tolist() == [1, 2, 3]  # both protected slots, then the best score 0.9


def test_select_kept_never_keeps_invalid_slots_and_clips_to_the_valid_count():
    scores = torch.tensor([[[9.0, 1.0, 8.0, 2.0]]])
    valid = torch.tensor([[False, True, False, True]])
    protected = torch.zeros(1, 1, 4, dtype=torch.bool)
    index, kept_valid = select_kept(scores, valid, protected, torch.tensor([3]))
    assert kept_valid.tolist() == [[True, True]]  # only two valid slots
    assert index[0, 0].tolist() == [1, 3]


def test_select_kept_per_sequence_counts_and_per_head_choices():
    scores = torch.tensor([
        [[1.0, 4.0, 3.0, 2.0], [4.0, 1.0, 2.0, 3.0]],   # sequence 0, heads 0 and 1
        [[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]],   # sequence 1
    ])
    valid = torch.ones(2, 4, dtype=torch.bool)
    protected = torch.zeros(2, 2, 4, dtype=torch.bool)
    index, kept_valid = select_kept(scores, valid, protected, torch.tensor([2, 1]))
    assert kept_valid.tolist() == [[True, True], [True, False]]
    assert index[0, 0].tolist() == [1, 2]
    assert index[0, 1].tolist() == [0, 3]
    assert index[1, 0, :1].tolist() == [3]
    assert index[1, 1, :1].tolist() == [0]
    assert ((index >= 0) & (index < 4)).all()  # the unused entries still point at real slots


def test_select_kept_of_nothing():
    scores = torch.zeros(1, 1, 0)
    index, kept_valid = select_kept(scores, torch.zeros(1, 0, dtype=torch.bool), torch.zeros(1, 1, 0, dtype=torch.bool),
                                    torch.tensor([4]))
    assert index.shape == (1, 1, 0) and kept_valid.shape == (1, 0)


def test_select_kept_clips_each_sequence_to_its_own_valid_count():
    scores = torch.tensor([[[5.0, 1.0, 2.0, 3.0]], [[1.0, 2.0, 3.0, 4.0]]])
    valid = torch.tensor([[False, True, False, False], [True, True, True, True]])
    protected = torch.zeros(2, 1, 4, dtype=torch.bool)
    index, kept_valid = select_kept(scores, valid, protected, torch.tensor([3, 3]))
    assert kept_valid.tolist() == [[True, False, False], [True, True, True]]  # sequence 0 has one valid slot
    assert index[0, 0, 0].item() == 1 and index[1, 0].tolist() == [1, 2, 3]


def test_select_kept_of_an_empty_batch():
    index, kept_valid = select_kept(torch.zeros(0, 2, 3), torch.zeros(0, 3, dtype=torch.bool),
                                    torch.zeros(0, 2, 3, dtype=torch.bool), torch.zeros(0, dtype=torch.int64))
    assert index.shape == (0, 2, 0) and kept_valid.shape == (0, 0)


def test_select_kept_shorter_sequences_get_their_best_slots_not_any_of_the_widest():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(2, 1, 1000, generator=gen)
    valid = torch.ones(2, 1000, dtype=torch.bool)
    protected = torch.zeros(2, 1, 1000, dtype=torch.bool)
    index, kept_valid = select_kept(scores, valid, protected, torch.tensor([600, 5]))
    best5 = sorted(sorted(range(1000), key=lambda j: -scores[1, 0, j].item())[:5])
    assert kept_valid[1].sum().item() == 5 and index[1, 0, :5].tolist() == best5
    best600 = sorted(sorted(range(1000), key=lambda j: -scores[0, 0, j].item())[:600])
    assert index[0, 0].tolist() == best600


def test_dropped_slots_lists_each_heads_unkept_valid_slots_in_slot_order():
    # 18 slots (long enough for an unstable sort to reorder ties); per head a different kept set of equal size
    valid = torch.ones(2, 18, dtype=torch.bool)
    valid[1, :2] = False  # sequence 1: two padding slots, 16 valid
    kept_index = torch.tensor([[[0, 5, 17], [2, 3, 4]], [[6, 9, 12], [7, 8, 12]]])
    kept_valid = torch.tensor([[True, True, True], [True, True, False]])  # slot 12 of sequence 1 is not kept
    index, dropped_valid = dropped_slots(kept_index, kept_valid, valid)
    expected = [[[s for s in range(18) if s not in (0, 5, 17)], [s for s in range(18) if s not in (2, 3, 4)]],
                [[s for s in range(2, 18) if s not in (6, 9)], [s for s in range(2, 18) if s not in (7, 8)]]]
    assert [len(e) for e in expected[0] + expected[1]] == [15, 15, 14, 14]
    assert index.shape == (2, 2, 15) and index.dtype == torch.int64
    assert index[0].tolist() == expected[0]
    assert index[1, :, :14].tolist() == expected[1]  # the 15th entry of sequence 1 is filler
    assert dropped_valid.tolist() == [[True] * 15, [True] * 14 + [False]]


def test_dropped_slots_with_one_kv_head():
    index, dropped_valid = dropped_slots(torch.tensor([[[1, 2]]]), torch.tensor([[True, True]]),
                                         torch.ones(1, 4, dtype=torch.bool))
    assert index.tolist() == [[[0, 3]]] and dropped_valid.tolist() == [[True, True]]


def test_dropped_slots_of_an_empty_batch():
    index, dropped_valid = dropped_slots(torch.zeros(0, 2, 3, dtype=torch.int64), torch.zeros(0, 3, dtype=torch.bool),
                                         torch.zeros(0, 5, dtype=torch.bool))
    assert index.shape == (0, 2, 0) and dropped_valid.shape == (0, 0)


def _taken(valid: list[bool]) -> dict[str, torch.Tensor]:
    """A page of 2 slots in 2 heads as ColdTier.take_best_read_page returns it (float32 keys)."""
    positions = torch.tensor([[[4, 5], [6, 7]]])
    return {"keys": positions[..., None].float().expand(1, 2, 2, 3) + 0.5, "values": -positions[..., None].float(),
            "positions": positions, "valid": torch.tensor([valid]),
            "mass": torch.tensor([[[0.25, 0.5], [0.75, 0.0]]])}


def test_promoted_region_starts_its_statistics_from_one_decode_step_of_attention():
    policy = make_policy("confkv-r", ema_decay=0.5)
    back = promoted_region(_taken([True, True]), policy, policy.stat_names, torch.bfloat16)
    # one observation of one query from a zero EMA: (1 - 0.5) * mass
    assert back.stats["ema"].dtype == torch.float32
    assert back.stats["ema"].tolist() == [[[0.125, 0.25], [0.375, 0.0]]]
    assert back.keys.dtype == back.values.dtype == torch.bfloat16  # the hot tier's dtype
    assert back.keys[0, 1, 0].tolist() == [6.5] * 3 and back.values[0, 0, 1].tolist() == [-5.0]
    assert back.positions.tolist() == [[[4, 5], [6, 7]]] and back.all_valid and back.key_scale is None
    partly = promoted_region(_taken([False, True]), policy, policy.stat_names, torch.float32)
    assert not partly.all_valid and partly.valid.tolist() == [[False, True]]


def _region(positions: list, valid: list) -> Region:
    """Keys ``10 * position + head``, values ``-key``, one statistic ``position + 0.5``: every
    slot's contents name it, so a merge that moves a slot can be followed."""
    pos = torch.tensor(positions)
    keys = (10 * pos + torch.arange(pos.shape[1])[None, :, None]).float()[..., None]
    return Region(keys=keys, values=-keys, positions=pos, valid=torch.tensor(valid),
                  stats={"ema": pos.float() + 0.5}, all_valid=all(all(v) for v in valid))


def test_merge_puts_every_head_in_position_order_with_the_invalid_slots_first():
    # row 0: all valid; row 1: slot 0 is padding (position 9 is garbage), and a valid token at position 0
    old = _region([[[0, 5, 8], [1, 6, 8]], [[9, 0, 4], [9, 1, 3]]], [[True] * 3, [False, True, True]])
    back = _region([[[2, 3], [2, 4]], [[2, 3], [0, 2]]], [[True, True], [True, True]])
    merged = merge_in_position_order(old, back)
    expected = [[[0, 2, 3, 5, 8], [1, 2, 4, 6, 8]], [[9, 0, 2, 3, 4], [9, 0, 1, 2, 3]]]
    assert merged.positions.tolist() == expected
    assert merged.valid.tolist() == [[True] * 5, [False, True, True, True, True]] and not merged.all_valid
    heads = torch.arange(2)[None, :, None]
    assert torch.equal(merged.keys[..., 0], (10 * torch.tensor(expected) + heads).float())
    assert torch.equal(merged.values, -merged.keys)
    assert torch.equal(merged.stats["ema"], torch.tensor(expected).float() + 0.5)
    dense = merge_in_position_order(_region([[[3, 7]]], [[True, True]]), _region([[[5, 1]]], [[True, True]]))
    assert dense.positions.tolist() == [[[1, 3, 5, 7]]] and dense.all_valid
    assert dense.valid.tolist() == [[True] * 4]


def test_demote_dropped_dequantizes_int8_slots_to_the_hot_dtype_and_times_the_demotion():
    """An INT8 older region of 3 slots in 2 heads keeps slot 1: slots 0 and 2 go to a 16-bit cold
    tier (pages of 4, so both wait in its open page), dequantized to bfloat16 by hand below."""
    q = torch.tensor([[[[1, 2], [3, 4], [5, 6]], [[-1, -2], [-3, -4], [-5, -6]]]], dtype=torch.int8)
    old = Region(keys=q, values=-q, positions=torch.tensor([[[10, 11, 12], [10, 11, 12]]]),
                 valid=torch.ones(1, 3, dtype=torch.bool), key_scale=torch.full((1, 2, 3), 0.5),
                 value_scale=torch.full((1, 2, 3), 0.25), all_valid=True)
    channel_scale = torch.tensor([[[2.0, 4.0], [1.0, 3.0]]])  # [B, Hkv, D]
    cold = ColdTier(ColdConfig(bits=16, page_size=4, group_size=4, k_high=1, k_low=1))
    timers = profiling.Timers()
    with profiling.enabled(timers):
        demote_dropped(cold, old, torch.tensor([[[1], [1]]]), torch.tensor([[True]]), channel_scale, torch.bfloat16)
    assert dict(timers.calls) == {"cold demotion (quantize + seal)": 1}
    # key = q * 0.5 * channel scale; value = -q * 0.25
    assert cold.open["keys"].dtype == cold.open["values"].dtype == torch.bfloat16
    assert cold.open["keys"].tolist() == [[[[1.0, 4.0], [5.0, 12.0]], [[-0.5, -3.0], [-2.5, -9.0]]]]
    assert cold.open["values"].tolist() == [[[[-0.25, -0.5], [-1.25, -1.5]], [[0.25, 0.5], [1.25, 1.5]]]]
    assert cold.open["positions"].tolist() == [[[10, 12], [10, 12]]] and cold.open["valid"].tolist() == [[True, True]]
    assert cold.kv_bytes() == 2 * 2 * 2 * 2 * 2  # keys + values, 2 heads, 2 tokens, 2 channels, 2-byte bfloat16
    with profiling.enabled(timers):  # everything kept: nothing to demote, no demotion timed
        demote_dropped(cold, old, torch.tensor([[[0, 1, 2], [0, 1, 2]]]), torch.ones(1, 3, dtype=torch.bool),
                       channel_scale, torch.bfloat16)
    assert dict(timers.calls) == {"cold demotion (quantize + seal)": 1} and cold.open_length == 2


def _stats_region(name: str) -> Region:
    """3 slots in 2 heads, statistic ``name`` = 0.1 * (slot + 1) + head."""
    keys = torch.arange(12.0).reshape(1, 2, 3, 2)
    stat = torch.tensor([[[0.1, 0.2, 0.3], [1.1, 1.2, 1.3]]])
    return Region(keys=keys, values=-keys, positions=torch.tensor([[[10, 11, 12], [10, 11, 12]]]),
                  valid=torch.ones(1, 3, dtype=torch.bool), stats={name: stat}, all_valid=True)


def test_demoted_slots_carry_the_attention_the_policy_estimates_they_received():
    """Slot 1 kept: slots 0 and 2 wait in the open page with their statistic as the policy reads it (the EMA
    of confkv, TOVA's last attention); a policy with no estimate (H2O's running sum) and no policy give 0."""
    for policy_name, stat in (("confkv", "ema"), ("tova", "attn"), ("h2o", "acc"), (None, "ema")):
        cold = ColdTier(ColdConfig(bits=16, page_size=4, group_size=4, k_high=1, k_low=1))
        policy = make_policy(policy_name) if policy_name else None
        demote_dropped(cold, _stats_region(stat), torch.tensor([[[1], [1]]]), torch.tensor([[True]]), None,
                       torch.float32, policy)
        expected = [[[0.1, 0.3], [1.1, 1.3]]] if policy_name in ("confkv", "tova") else [[[0.0, 0.0], [0.0, 0.0]]]
        torch.testing.assert_close(cold.open["attention"], torch.tensor(expected), msg=str(policy_name))


def test_a_chunk_s_tokens_are_scaled_to_the_queries_that_could_see_them():
    """A pass of 3 queries at positions 10-12 (``current`` 12): the policy divided each token's mass by 3, but
    position 11 was seen by 2 queries and position 12 by 1, so their estimates grow by 3/2 and 3; an older token
    (position 4) was seen by all 3 and keeps its estimate. Position 10 is kept hot."""
    keys = torch.arange(16.0).reshape(1, 2, 4, 2)
    region = Region(keys=keys, values=-keys, positions=torch.tensor([[[4, 10, 11, 12], [4, 10, 11, 12]]]),
                    valid=torch.ones(1, 4, dtype=torch.bool), all_valid=True,
                    stats={"ema": torch.tensor([[[0.3, 0.3, 0.3, 0.3], [0.6, 0.6, 0.6, 0.6]]])})
    cold = ColdTier(ColdConfig(bits=16, page_size=8, group_size=8, k_high=1, k_low=1))
    demote_dropped(cold, region, torch.tensor([[[1], [1]]]), torch.tensor([[True]]), None, torch.float32,
                   make_policy("confkv"), torch.tensor([12]), 3)
    assert cold.open["positions"].tolist() == [[[4, 11, 12], [4, 11, 12]]]
    torch.testing.assert_close(cold.open["attention"], torch.tensor([[[0.3, 0.45, 0.9], [0.6, 0.9, 1.8]]]))
