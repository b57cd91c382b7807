"""INT8 quantization of :mod:`confkv.quant` on tiny inputs whose codes and scales are worked out by hand.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

import pytest
import torch

from confkv.quant import (
    channel_scale_bytes,
    dequantize_keys,
    dequantize_values,
    fp_bytes_per_token,
    int8_bytes_per_token,
    int8_key_bytes_per_token,
    int8_value_bytes_per_token,
    key_channel_scale,
    quantize_keys,
    quantize_values,
)


def test_channel_scale_is_the_channel_absmax_floored_at_one_percent_of_the_head_max():
    keys = torch.tensor([[[[200.0, -1.0, 0.0, 3.0],
                           [-50.0, 0.5, 0.0, -4.0]]]])  # [1, 1, L=2, D=4]
    # absmax per channel: 200, 1, 0, 4; floor = 200 * 1e-2 = 2
    assert key_channel_scale(keys)[0, 0].tolist() == [200.0, 2.0, 2.0, 4.0]


def test_channel_scale_of_an_all_zero_head_or_of_no_token_is_one():
    keys = torch.zeros(1, 2, 3, 2)
    keys[0, 1] = torch.tensor([[1.0, -8.0], [0.0, 0.0], [2.0, 0.0]])
    scale = key_channel_scale(keys)
    assert scale[0, 0].tolist() == [1.0, 1.0]  # head 0 is all zero
    assert scale[0, 1].tolist() == [2.0, 8.0]
    empty = key_channel_scale(torch.zeros(2, 3, 0, 5))
    assert empty.shape == (2, 3, 5) and empty.dtype == torch.float32 and (empty == 1).all()


def test_values_quantize_to_known_codes():
    values = torch.tensor([[[[127.0, -63.0, 0.0, 31.6],
                             [0.0, 0.0, 0.0, 0.0],
                             [-2.54, 1.27, 0.0, 0.0]]]])  # [1, 1, 3, 4]
    q, scale = quantize_values(values)
    # row 0: absmax 127 -> scale 1; row 1: all zero -> scale 0, codes 0; row 2: absmax 2.54 -> scale 0.02
    assert scale[0, 0].tolist() == [1.0, 0.0, torch.tensor(2.54 / 127).item()]
    assert q[0, 0].tolist() == [[127, -63, 0, 32], [0, 0, 0, 0], [-127, 64, 0, 0]]
    assert q.dtype == torch.int8 and scale.dtype == torch.float32


def test_keys_are_divided_by_the_channel_scale_before_the_token_scale():
    keys = torch.tensor([[[[100.0, 1.0], [-50.0, -2.0]]]])  # [1, 1, 2, 2]
    channel = torch.tensor([[[100.0, 2.0]]])
    q, scale = quantize_keys(keys, channel)
    # smoothed: [1, 0.5] and [-0.5, -1]: both rows have absmax 1 -> scale 1/127
    assert torch.allclose(scale, torch.full((1, 1, 2), 1 / 127))
    assert q[0, 0].tolist() == [[127, 64], [-64, -127]]
    restored = dequantize_keys(q, scale, channel, dtype=torch.float64)
    assert restored.dtype == torch.float64
    assert torch.allclose(restored, keys.double(), rtol=0, atol=0.5 * 100 / 127 + 1e-6)
    assert restored[0, 0, 0, 0].item() == torch.tensor(127 * (1 / 127) * 100.0).item()


def test_dequantize_multiplies_codes_by_their_scales():
    q = torch.tensor([[[[1, -2], [3, 4]]]], dtype=torch.int8)
    token = torch.tensor([[[0.5, 2.0]]])
    channel = torch.tensor([[[10.0, 100.0]]])
    assert dequantize_values(q, token).tolist() == [[[[0.5, -1.0], [6.0, 8.0]]]]
    assert dequantize_values(q, token, dtype=torch.float16).dtype == torch.float16
    assert dequantize_keys(q, token, channel).tolist() == [[[[5.0, -100.0], [60.0, 800.0]]]]


def test_quantization_clamps_and_never_returns_nan_for_empty_channels():
    q, scale = quantize_values(torch.zeros(1, 1, 2, 0))
    assert q.shape == (1, 1, 2, 0) and scale.tolist() == [[[0.0, 0.0]]]
    huge = torch.tensor([[[[3e38, -3e38]]]])
    q, scale = quantize_values(huge)
    assert q[0, 0, 0].tolist() == [127, -127] and torch.isfinite(scale).all()


def test_byte_counts_per_token():
    # Hkv=2, D=8: int8 data 16 bytes + 2 float32 scales = 24, for keys and for values
    assert int8_key_bytes_per_token(2, 8) == 24
    assert int8_value_bytes_per_token(2, 8) == 24
    assert int8_value_bytes_per_token(3, 5) == 15 + 12
    assert int8_bytes_per_token(2, 8) == 48
    assert fp_bytes_per_token(2, 8, torch.float16) == 2 * 16 * 2
    assert fp_bytes_per_token(3, 4, torch.float32) == 2 * 12 * 4
    assert channel_scale_bytes(2, 8) == 64


def test_channel_scale_floor_for_small_keys_and_half_precision_input():
    keys = torch.tensor([[[[0.5, 0.001, -0.25]]]], dtype=torch.float16)  # head max 0.5 -> floor 0.005
    scale = key_channel_scale(keys)
    assert scale.dtype == torch.float32
    assert scale[0, 0].tolist() == pytest.approx([0.5, 0.005, 0.25], rel=1e-3)


def test_half_precision_values_get_float32_scales():
    q, scale = quantize_values(torch.tensor([[[[1.0, -2.0, 0.5]]]], dtype=torch.float16))
    assert scale.dtype == torch.float32 and q.tolist() == [[[[64, -127, 32]]]]


def test_a_row_whose_scale_underflows_to_zero_stores_zero_codes():
    tiny = torch.tensor([[[[1e-44, -1e-44, 0.0]]]])  # subnormal: absmax / 127 rounds to 0
    q, scale = quantize_values(tiny)
    assert scale.tolist() == [[[0.0]]] and q.tolist() == [[[[0, 0, 0]]]]


def test_channel_scale_of_no_token_lives_on_the_keys_device():
    meta = torch.device("meta")  # a device other than the default CPU, available everywhere
    assert key_channel_scale(torch.zeros(2, 3, 0, 4, device=meta)).device == meta
