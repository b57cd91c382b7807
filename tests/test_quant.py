"""INT8 KV quantization: error bound, robustness, compaction invariance, byte accounting."""

from __future__ import annotations
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
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


FAST = settings(max_examples=25, deadline=None)


def _assert_finite(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert torch.isfinite(t.to(torch.float32)).all()


@FAST
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    length=st.integers(0, 17),
    dim=st.sampled_from([1, 4, 16]),
    outlier=st.sampled_from([1.0, 30.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_bound(batch, heads, length, dim, outlier, seed):
    """|k - k_hat| <= token_scale * channel_scale / 2 and |v - v_hat| <= token_scale / 2, elementwise."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, length, dim, generator=gen)
    keys[..., 0] *= outlier
    values = torch.randn(batch, heads, length, dim, generator=gen)
    calibration = keys[:, :, : max(1, length // 2)]
    channel = key_channel_scale(calibration)
    assert channel.shape == (batch, heads, dim) and channel.dtype == torch.float32
    assert (channel > 0).all()
    key_q, key_ts = quantize_keys(keys, channel)
    value_q, value_ts = quantize_values(values)
    assert key_q.dtype == torch.int8 and value_q.dtype == torch.int8
    assert key_ts.shape == (batch, heads, length) and key_ts.dtype == torch.float32
    key_err = (keys - dequantize_keys(key_q, key_ts, channel)).abs()
    key_bound = (key_ts.unsqueeze(-1) * channel.unsqueeze(-2)) / 2
    assert (key_err <= key_bound * (1 + 1e-5) + 1e-30).all()
    value_err = (values - dequantize_values(value_q, value_ts)).abs()
    assert (value_err <= value_ts.unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-30).all()
    _assert_finite(key_ts, value_ts, channel)


def test_channel_smoothing_beats_per_token_on_outlier_channel():
    """An outlier channel must not wipe out the precision of the others."""
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 64, 32)
    keys[..., 3] *= 100.0
    channel = key_channel_scale(keys)
    key_q, key_ts = quantize_keys(keys, channel)
    smoothed_err = (keys - dequantize_keys(key_q, key_ts, channel))[..., 4:].abs().mean()
    per_token_q, per_token_ts = quantize_values(keys)  # per-token-only scheme
    per_token_err = (keys - dequantize_values(per_token_q, per_token_ts))[..., 4:].abs().mean()
    assert smoothed_err < per_token_err / 10


def test_degenerate_inputs_stay_finite():
    zeros = torch.zeros(2, 3, 5, 8)
    constant = torch.full((2, 3, 5, 8), 3.5)
    mixed = torch.randn(2, 3, 5, 8)
    mixed[..., 2] = 0.0  # an all-zero channel
    mixed[:, :, 1] = 0.0  # an all-zero token
    mixed[0, 0, 3, 4] = 1e4  # a huge outlier
    empty = torch.zeros(2, 3, 0, 8)
    for keys in (zeros, constant, mixed, empty):
        channel = key_channel_scale(keys)
        key_q, key_ts = quantize_keys(keys, channel)
        value_q, value_ts = quantize_values(keys)
        _assert_finite(channel, key_ts, value_ts)
        recon_k = dequantize_keys(key_q, key_ts, channel)
        recon_v = dequantize_values(value_q, value_ts)
        _assert_finite(recon_k, recon_v)
        assert (channel > 0).all()
    # zeros round-trip exactly, constants within the bound
    assert torch.equal(dequantize_values(*quantize_values(zeros)), zeros)
    channel = key_channel_scale(zeros)
    assert torch.equal(dequantize_keys(*quantize_keys(zeros, channel), channel), zeros)
    assert torch.allclose(dequantize_values(*quantize_values(constant)), constant, rtol=1e-6)
    # a channel that was zero at calibration and is large later: frozen scale still finite
    later = torch.randn(2, 3, 4, 8) * 50
    key_q, key_ts = quantize_keys(later, key_channel_scale(mixed))
    _assert_finite(key_ts, dequantize_keys(key_q, key_ts, key_channel_scale(mixed)))


def test_half_precision_inputs():
    keys = (torch.randn(1, 2, 6, 16) * 4).to(torch.float16)
    channel = key_channel_scale(keys)
    key_q, key_ts = quantize_keys(keys, channel)
    recon = dequantize_keys(key_q, key_ts, channel, torch.float16)
    assert recon.dtype == torch.float16
    bound = key_ts.unsqueeze(-1) * channel.unsqueeze(-2) / 2
    assert ((keys.float() - recon.float()).abs() <= bound + 4e-3 * keys.float().abs()).all()


@FAST
@given(length=st.integers(1, 20), seed=st.integers(0, 2**16), data=st.data())
def test_compaction_keeps_bytes_and_scales_bit_identical(length, seed, data):
    """Quantize then gather == gather of each kept token's stored bytes and scales:
    eviction never re-quantizes or shares a scale."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, length, 8, generator=gen) * torch.rand(1, 1, length, 1, generator=gen) * 10
    values = torch.randn(2, 3, length, 8, generator=gen)
    channel = key_channel_scale(keys)
    key_q, key_ts = quantize_keys(keys, channel)
    value_q, value_ts = quantize_values(values)
    keep = sorted(data.draw(st.sets(st.integers(0, length - 1), min_size=0, max_size=length)))
    index = torch.tensor(keep, dtype=torch.long)
    # per-(batch, head) gather too, as head-wise eviction would do
    head_index = index.view(1, 1, -1).expand(2, 3, -1)
    for q, ts, x in ((key_q, key_ts, keys), (value_q, value_ts, values)):
        q_kept = torch.gather(q, 2, head_index.unsqueeze(-1).expand(-1, -1, -1, 8))
        ts_kept = torch.gather(ts, 2, head_index)
        assert torch.equal(q_kept, q.index_select(2, index))
        assert torch.equal(ts_kept, ts.index_select(2, index))
        # the kept tokens quantized on their own (same frozen channel scale) give the same bytes
        kept_x = x.index_select(2, index)
        requant = quantize_keys(kept_x, channel) if x is keys else quantize_values(kept_x)
        assert torch.equal(requant[0], q_kept)
        assert torch.equal(requant[1], ts_kept)


def test_byte_accounting():
    # SmolLM2: Hkv=3, D=64 -> keys 192 int8 + 3 fp32 scales = 204 bytes; K+V 408.
    assert int8_key_bytes_per_token(3, 64) == 204
    assert int8_bytes_per_token(3, 64) == 408
    assert channel_scale_bytes(3, 64) == 768
    key_q, key_ts = quantize_keys(torch.randn(1, 3, 10, 64), torch.ones(1, 3, 64))
    stored = key_q.numel() * key_q.element_size() + key_ts.numel() * key_ts.element_size()
    assert stored == 10 * int8_key_bytes_per_token(3, 64)


# ---------------------------------------------------------------------------------------------------
# INT8 quantization of :mod:`confkv.quant` on tiny inputs whose codes and scales are worked out by hand.
#
# Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).


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
