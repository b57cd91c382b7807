"""Symmetric INT8 quantization of KV-cache tokens (no zero points).

Scheme
------
Keys (SmoothQuant-style smoothing + per-token scales):

    k[b, h, t, d] ~= q[b, h, t, d] * token_scale[b, h, t] * channel_scale[b, h, d]

* ``channel_scale`` [B, Hkv, D] float32 is computed ONCE per layer, from the
  first tokens that get quantized (per-channel absmax, floored, see
  :func:`key_channel_scale`), and then frozen.  Keys have a few outlier
  channels whose magnitude is 10-100x the rest (KIVI, Liu et al. 2024;
  SmoothQuant, Xiao et al. 2023): with a per-token scale alone, the outlier
  channel sets the scale and the ordinary channels get only a handful of
  levels.  Dividing by the channel scale first ("smoothing") equalises the
  channels.
* ``token_scale`` [B, Hkv, L] float32 is the absmax of the *smoothed* key of
  that token and head, divided by 127.

Why this split: every token carries its own token scale, so eviction (a dense
gather along the token axis) moves a token's int8 bytes together with its
scale and never leaves it with a stale or shared scale.  The channel scale is
frozen, so tokens quantized long ago stay valid forever; it is never
re-estimated (re-estimating would require re-quantizing the stored tokens).
KIVI's per-channel key grouping needs a group of tokens to share a scale,
which breaks under per-token eviction; this scheme keeps the per-channel
benefit without that coupling.

Values: per-token, per-head absmax (values have no channel outliers, KIVI):

    v[b, h, t, d] ~= q[b, h, t, d] * token_scale[b, h, t]

Error bound (elementwise, round-to-nearest, no clipping since the scale is
the absmax): ``|k - k_hat| <= token_scale * channel_scale / 2`` and
``|v - v_hat| <= token_scale / 2``.

Robustness: all-zero tokens get ``token_scale = 0`` and int8 zeros (they
dequantize exactly to 0); all-zero channels or heads get a floored channel
scale; nothing ever divides by zero, so no NaN/inf appears for zeros,
constants, huge outliers or empty (L = 0) inputs.

Byte accounting (per sequence): :func:`int8_key_bytes_per_token`,
:func:`int8_value_bytes_per_token`, :func:`int8_bytes_per_token` and
:func:`channel_scale_bytes`, all from the one byte model (:mod:`confkv.tiers.byte_model`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv.native.pages import decode_int8_rows, quantize_int8_rows
from confkv.tiers import byte_model
from confkv.tiers.byte_model import SCALE_BYTES

INT8_MAX = 127
# A channel's scale is at least this fraction of the largest channel scale
# of its head: it bounds how much a channel that was quiet during calibration
# can be amplified (and so how much it can dominate a later token's scale).
CHANNEL_SCALE_FLOOR_RATIO = 1e-2


def key_channel_scale(keys: Tensor) -> Tensor:
    """Per-(sequence, KV head, channel) smoothing scale for keys.

    Args:
        keys: [B, Hkv, L, D] float, the first keys of a layer to be quantized.

    Returns:
        [B, Hkv, D] float32, strictly positive and finite:
        ``max(absmax_over_L(|k|), 1e-2 * max_over_channels(absmax))``; a head
        whose keys are all zero (or L = 0) gets scale 1.
    """
    batch, heads, _, head_dim = keys.shape
    if keys.shape[2] == 0:
        return torch.ones(batch, heads, head_dim, dtype=torch.float32, device=keys.device)
    absmax = keys.detach().abs().amax(dim=2).to(torch.float32)  # [B, Hkv, D]
    head_max = absmax.amax(dim=-1, keepdim=True)  # [B, Hkv, 1]
    floor = torch.where(head_max > 0, head_max * CHANNEL_SCALE_FLOOR_RATIO, torch.ones_like(head_max))
    return torch.maximum(absmax, floor)


def _quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric absmax quantization along the last axis.

    Args:
        x: [..., L, D] float32.

    Returns:
        (q int8 [..., L, D], token_scale float32 [..., L]); token_scale is 0
        for all-zero rows (and q is 0 there).
    """
    token_scale = x.abs().amax(dim=-1) / INT8_MAX if x.shape[-1] > 0 else x.new_zeros(x.shape[:-1])
    safe = torch.where(token_scale > 0, token_scale, torch.ones_like(token_scale))
    q = torch.round(x / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, token_scale


def quantize_keys(keys: Tensor, channel_scale: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize keys with a frozen channel scale and per-token scales.

    Args:
        keys: [B, Hkv, L, D] float (any float dtype).
        channel_scale: [B, Hkv, D] float32 from :func:`key_channel_scale`.

    Returns:
        (q int8 [B, Hkv, L, D], token_scale float32 [B, Hkv, L]) with
        ``keys ~= q * token_scale[..., None] * channel_scale[..., None, :]``.
    """
    channel_scale = channel_scale.to(torch.float32)
    native = quantize_int8_rows(keys.detach(), channel_scale)  # the same codes and scales in one C call
    if native is not None:
        return native
    smoothed = keys.detach().to(torch.float32) / channel_scale.unsqueeze(-2)
    return _quantize_per_token(smoothed)


def quantize_values(values: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize values with a per-token, per-head absmax scale.

    Args:
        values: [B, Hkv, L, D] float.

    Returns:
        (q int8 [B, Hkv, L, D], token_scale float32 [B, Hkv, L]) with
        ``values ~= q * token_scale[..., None]``.
    """
    native = quantize_int8_rows(values.detach())  # the same codes and scales in one C call
    return native if native is not None else _quantize_per_token(values.detach().to(torch.float32))


def dequantize_keys(q: Tensor, token_scale: Tensor, channel_scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantization of keys (one C call where the library takes it: the same values).

    Args:
        q: [B, Hkv, L, D] int8; token_scale: [B, Hkv, L] float32;
        channel_scale: [B, Hkv, D] float32.

    Returns:
        [B, Hkv, L, D] in ``dtype``.
    """
    native = decode_int8_rows(q, token_scale, dtype, channel_scale)
    if native is not None:
        return native
    k = q.to(torch.float32) * token_scale.unsqueeze(-1) * channel_scale.unsqueeze(-2)
    return k.to(dtype)


def dequantize_values(q: Tensor, token_scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantization of values (one C call where the library takes it: the same values).

    Args:
        q: [B, Hkv, L, D] int8; token_scale: [B, Hkv, L] float32.

    Returns:
        [B, Hkv, L, D] in ``dtype``.
    """
    native = decode_int8_rows(q, token_scale, dtype)
    return native if native is not None else (q.to(torch.float32) * token_scale.unsqueeze(-1)).to(dtype)


def int8_key_bytes_per_token(num_kv_heads: int, head_dim: int) -> int:
    """Bytes one token's INT8 keys occupy in one layer of one sequence (:mod:`confkv.tiers.byte_model`)."""
    return byte_model.int8_half_token_bytes(num_kv_heads, head_dim)


def int8_value_bytes_per_token(num_kv_heads: int, head_dim: int) -> int:
    """Bytes one token's INT8 values occupy in one layer of one sequence (same layout as keys)."""
    return byte_model.int8_half_token_bytes(num_kv_heads, head_dim)


def int8_bytes_per_token(num_kv_heads: int, head_dim: int) -> int:
    """Keys + values bytes of one INT8 token in one layer of one sequence.
    Excludes the per-layer channel scales (:func:`channel_scale_bytes`)."""
    return byte_model.int8_token_bytes(num_kv_heads, head_dim)


def fp_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys + values bytes of one full-precision token in one layer of one sequence."""
    return byte_model.fp_token_bytes(num_kv_heads, head_dim, torch.empty((), dtype=dtype).element_size())


def channel_scale_bytes(num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one layer's frozen key channel scale, per sequence ([Hkv, D] float32)."""
    return byte_model.channel_scale_bytes(num_kv_heads, head_dim)
