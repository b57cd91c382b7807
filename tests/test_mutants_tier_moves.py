"""Moves from the cold tier back to the hot tier (:mod:`confkv.tier_moves`) on hand-made regions:
the promoted region's statistics, dtype and validity, and the merge into position order, against
values worked out by hand.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

import torch

from confkv.policies import make_policy
from confkv.region import Region
from confkv.tier_moves import merge_in_position_order, promoted_region


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
    assert back.positions.tolist() == [[[4, 5], [6, 7]]] and back.dense and back.key_scale is None
    partly = promoted_region(_taken([False, True]), policy, policy.stat_names, torch.float32)
    assert not partly.dense and partly.valid.tolist() == [[False, True]]


def _region(positions: list, valid: list) -> Region:
    """Keys ``10 * position + head``, values ``-key``, one statistic ``position + 0.5``: every
    slot's contents name it, so a merge that moves a slot can be followed."""
    pos = torch.tensor(positions)
    keys = (10 * pos + torch.arange(pos.shape[1])[None, :, None]).float()[..., None]
    return Region(keys=keys, values=-keys, positions=pos, valid=torch.tensor(valid),
                  stats={"ema": pos.float() + 0.5}, dense=all(all(v) for v in valid))


def test_merge_puts_every_head_in_position_order_with_the_invalid_slots_first():
    # row 0: all valid; row 1: slot 0 is padding (position 9 is garbage), and a valid token at position 0
    old = _region([[[0, 5, 8], [1, 6, 8]], [[9, 0, 4], [9, 1, 3]]], [[True] * 3, [False, True, True]])
    back = _region([[[2, 3], [2, 4]], [[2, 3], [0, 2]]], [[True, True], [True, True]])
    merged = merge_in_position_order(old, back)
    expected = [[[0, 2, 3, 5, 8], [1, 2, 4, 6, 8]], [[9, 0, 2, 3, 4], [9, 0, 1, 2, 3]]]
    assert merged.positions.tolist() == expected
    assert merged.valid.tolist() == [[True] * 5, [False, True, True, True, True]] and not merged.dense
    heads = torch.arange(2)[None, :, None]
    assert torch.equal(merged.keys[..., 0], (10 * torch.tensor(expected) + heads).float())
    assert torch.equal(merged.values, -merged.keys)
    assert torch.equal(merged.stats["ema"], torch.tensor(expected).float() + 0.5)
    dense = merge_in_position_order(_region([[[3, 7]]], [[True, True]]), _region([[[5, 1]]], [[True, True]]))
    assert dense.positions.tolist() == [[[1, 3, 5, 7]]] and dense.dense
    assert dense.valid.tolist() == [[True] * 4]
