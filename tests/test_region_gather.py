"""``Region.gather`` on INT8 data: every per-slot tensor, scales included, follows its slot.

The expectation is built slot by slot with Python indexing, and the dequantized kept
tokens must equal the dequantized originals at the chosen slots (a scale left behind or
gathered with another slot's index changes them).
"""

import pytest
import torch

from confkv import quant
from confkv.store.region import Region

B, H, L, D = 2, 3, 10, 8


def _int8_region(seed: int) -> tuple[Region, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, L, D, generator=g) * torch.linspace(0.1, 5, L)[:, None]  # scales differ per slot
    values = torch.randn(B, H, L, D, generator=g) * torch.linspace(5, 0.1, L)[:, None]
    channel = quant.key_channel_scale(keys)
    q_keys, key_scale = quant.quantize_keys(keys, channel)
    q_values, value_scale = quant.quantize_values(values)
    positions = torch.arange(L).repeat(B, H, 1) + 100 * torch.arange(B)[:, None, None]
    region = Region(keys=q_keys, values=q_values, positions=positions, valid=torch.ones(B, L, dtype=torch.bool),
                    stats={"ema": torch.rand(B, H, L, generator=g)}, key_scale=key_scale, value_scale=value_scale,
                    all_valid=True)
    return region, channel


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_gather_moves_scales_with_their_slots(seed):
    region, channel = _int8_region(seed)
    g = torch.Generator().manual_seed(100 + seed)
    keep = 4
    # a different, sorted set of slots per (sequence, head), as head-wise eviction gives
    index = torch.stack([torch.stack([torch.randperm(L, generator=g)[:keep].sort().values for _ in range(H)])
                         for _ in range(B)])
    valid = torch.ones(B, keep, dtype=torch.bool)
    kept = region.gather(index, valid, all_valid=True)
    assert kept.is_int8 and kept.length == keep and kept.key_scale is not None and kept.value_scale is not None
    for b in range(B):
        for h in range(H):
            for k in range(keep):
                s = int(index[b, h, k])
                assert torch.equal(kept.keys[b, h, k], region.keys[b, h, s])
                assert torch.equal(kept.values[b, h, k], region.values[b, h, s])
                assert kept.key_scale[b, h, k] == region.key_scale[b, h, s]
                assert kept.value_scale[b, h, k] == region.value_scale[b, h, s]
                assert kept.positions[b, h, k] == region.positions[b, h, s]
                assert kept.stats["ema"][b, h, k] == region.stats["ema"][b, h, s]
    # the dequantized kept tokens are the dequantized originals at those slots
    full_keys = quant.dequantize_keys(region.keys, region.key_scale, channel)
    full_values = quant.dequantize_values(region.values, region.value_scale)
    picked = index[..., None].expand(-1, -1, -1, D)
    torch.testing.assert_close(quant.dequantize_keys(kept.keys, kept.key_scale, channel),
                               full_keys.gather(2, picked), rtol=0, atol=0)
    torch.testing.assert_close(quant.dequantize_values(kept.values, kept.value_scale),
                               full_values.gather(2, picked), rtol=0, atol=0)
    assert torch.equal(kept.valid, valid) and kept.all_valid
