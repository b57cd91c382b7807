"""INT8 KV quantization: error bound, robustness, compaction invariance, byte accounting."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from confkv.quant import (
    channel_scale_bytes,
    dequantize_keys,
    dequantize_values,
    int8_bytes_per_token,
    int8_key_bytes_per_token,
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
