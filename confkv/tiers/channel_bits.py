"""Per-channel key widths: each page's key bits shared out among its channels by the error each bit removes.

KIVI quantizes keys per channel (each channel's group of tokens has its own float16 minimum and scale) but
gives every channel the same width. A head's key channels differ in spread by orders of magnitude (a few
large rotary channels, many nearly constant), so at the same bytes the page's squared error is lower when
the wide channels get more bits and the narrow ones fewer, down to none: the bit allocation of transform
coding (reverse water-filling; for KV caches: SVDq, 2025, on SVD channels, and KVQuant's per-channel
sensitivity, Hooper et al. 2024). Here it is done on the channels as they are, with no change of basis.

Per page and KV head, :func:`page_width_errors` measures each channel's squared error at every width 0-8 with
the quantizer below; :func:`allocate` gives the channels the widths of least total error within the page's
bits (the Lagrangian solution: each channel at the width minimising ``error + lambda * width``, ``lambda``
the least that fits, then the bits left given one step at a time to the step that removes the most error per
bit). The widths are stored with the page, one byte a channel, paid for by the codes: each token's row is
``ceil(D / P)`` bytes shorter than KIVI's (``bits * D / 8``), so a page costs at most KIVI's bytes at ``bits``.

The quantizer of a channel's group (``x ~= min + code * scale``, the stored form of KIVI, so the decode is
KIVI's):

- width 0: the group's mean (``scale`` 0, no code bits);
- width 1: the mean minus / plus the mean absolute deviation (two levels placed by the data: a min-max
  range would put them at the extremes, worse than the mean alone);
- widths 2-8: KIVI's even levels from the group's minimum to its maximum.

Codes are packed per page, channel after channel, each channel's P codes token after token in its width's bits
(least significant first): code (t, d) sits at bit ``P * (w_0 + ... + w_{d-1}) + w_d * t`` of the page's
``P * width_bytes`` bytes. With pages of a multiple of 8 tokens, 8 tokens of a channel are ``w_d`` whole bytes, so
the native read unpacks them with one load and scores 8 tokens at a time (``confkv/native/c/page_widths.c``), and a
channel of width 0 is skipped. Shapes: key pages [B, H, N, P, D]; packed [B, H, N, P, width_bytes] (the page's
bytes as P rows); widths [B, H, N, D] (uint8 as stored).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from confkv.tiers.lowbit import SCALE_DTYPE, masked_extremes

#: the widest channel
MAX_WIDTH = 8


def row_bytes(bits: int, head_dim: int, page_size: int) -> int:
    """Bytes of one token's key codes: KIVI's ``bits * D / 8`` less the share of the page's widths.

    Raises:
        ValueError: no byte is left for the codes (pages too short for the head's widths).
    """
    left = bits * head_dim // 8 - math.ceil(head_dim / page_size)
    if left <= 0:
        raise ValueError(f"format: 'channel_bits' at {bits} bits needs pages of more than {page_size} tokens for "
                         f"head_dim {head_dim} (the widths take every code byte); use longer pages or drop it")
    return left


def quantize_groups(x: Tensor, valid: Tensor, widths: Tensor, axis: int) -> tuple[Tensor, Tensor, Tensor]:
    """Codes, scale and minimum of each group of ``x`` over ``axis``, each channel (last dim) at its width.

    Args:
        x: float32 [..., D] grouped so that ``axis`` (not the last) runs over a group's tokens.
        valid: bool, ``x``'s shape: the entries that set a group's range (others are coded but not measured).
        widths: integer, broadcastable to ``x`` with ``axis`` of size 1.
    Returns:
        codes uint8 (``x``'s shape), scale and minimum float16 (``axis`` kept as size 1).
    """
    count = valid.sum(axis, keepdim=True).clamp_min(1)
    mean = torch.where(valid, x, 0).sum(axis, keepdim=True) / count
    spread = torch.where(valid, (x - mean).abs(), 0).sum(axis, keepdim=True) / count
    bottom, top = masked_extremes(x, valid, axis)
    top, bottom, mean, spread = torch.broadcast_tensors(top, bottom, mean, spread, widths)[:4]
    w = widths.to(torch.int64).expand_as(top)
    low = torch.where(w == 0, mean, torch.where(w == 1, mean - spread, bottom)).to(SCALE_DTYPE)
    levels = (2 ** w - 1).clamp_min(1).float()
    span = torch.where(w == 1, 2 * spread, top - low.float())
    scale = torch.where(w == 0, 0, span / levels).to(SCALE_DTYPE)
    safe = torch.where(scale > 0, scale.float(), 1)
    codes = torch.round(((x - low.float()) / safe).clamp(min=0).minimum(levels))
    return torch.where(w == 0, 0, codes).to(torch.uint8), scale, low


def dequantize_groups(codes: Tensor, scale: Tensor, minimum: Tensor) -> Tensor:
    """``min + code * scale`` in float32 (codes float or integer, shapes broadcast)."""
    return torch.addcmul(minimum.float(), codes.float(), scale.float())


def page_width_errors(grouped: Tensor, kept: Tensor) -> Tensor:
    """[B, H, N, D, MAX_WIDTH + 1] float32: each page's and channel's summed squared error at widths 0..MAX_WIDTH.

    Args:
        grouped: [B, H, N, G, group, D] float32 keys, groups of tokens on dim -2; kept: bool, the same shape
            (the entries that count: valid, not kept apart as outliers).
    """
    widths = torch.arange(MAX_WIDTH + 1, device=grouped.device).reshape(-1, *[1] * grouped.dim())
    codes, scale, low = quantize_groups(grouped[None], kept[None], widths, -2)  # every width at once, dim 0
    squared = torch.where(kept, (dequantize_groups(codes, scale, low) - grouped) ** 2, 0)
    return squared.sum((4, 5)).movedim(0, -1)


def allocate(errors: Tensor, budget: int) -> Tensor:
    """[..., D] int64 widths of least total error with at most ``budget`` bits a token (widths summed).

    First each channel takes the width minimising ``error + lambda * width`` for the least ``lambda`` whose
    widths fit (worked out from the widths' slopes: :func:`lagrangian_widths`); then, while a step fits, the one
    step (a channel to a wider width) that removes the most error per bit is taken. For errors that fall by less
    with every bit this is the least total error of all allocations (marginal analysis); otherwise a near one (steps
    that do not lower the error are jumped over).

    Args:
        errors: [..., D, MAX_WIDTH + 1], each channel's error at each width (:func:`page_width_errors`).
        budget: bits a token for the D channels (at most ``MAX_WIDTH * D`` are used).
    """
    errors = errors.double()
    dim, options = errors.shape[-2:]
    cost = torch.arange(options, dtype=torch.float64, device=errors.device)
    widths = lagrangian_widths(errors, budget)
    left = budget - widths.sum(-1)  # [...]
    taken = errors.gather(-1, widths[..., None])[..., 0]  # [..., D]
    for _ in range(options * dim):  # each round widens at least one channel of a page, or stops
        extra = cost - widths[..., None]  # [..., D, options]: bits of a step to each width
        gain = (taken[..., None] - errors) / extra.clamp_min(1)
        gain = gain.masked_fill((extra <= 0) | (extra > left[..., None, None]) | (gain <= 0), -1.0)
        best, at = gain.flatten(-2).max(-1)
        go = best > 0
        if not bool(go.any()):
            break
        channel, width = at // options, at % options
        new = torch.where(go, width, widths.gather(-1, channel[..., None])[..., 0])
        left = left - torch.where(go, new - widths.gather(-1, channel[..., None])[..., 0], 0)
        widths = widths.scatter(-1, channel[..., None], new[..., None])
        taken = errors.gather(-1, widths[..., None])[..., 0]
    return widths


def lagrangian_widths(errors: Tensor, budget: int) -> Tensor:
    """[..., D] int64: each channel at the width minimising ``error + lambda * width``, for the least ``lambda >= 0``
    whose widths fit ``budget`` bits; the first stage of :func:`allocate`.

    Worked out, not searched: width ``w`` is a channel's choice (the first on ties) for ``lambda`` in
    ``[L_w, U_w)``, ``U_w`` the least slope ``(e_v - e_w) / (w - v)`` to a narrower width, ``L_w`` the largest to a
    wider one; as ``lambda`` falls past a chosen width's ``U``, the channel widens to it. So the page's total width
    at ``lambda`` is the sum of those steps whose ``U`` is above ``lambda``, the least ``lambda`` that fits is one of
    the ``U`` (or 0), and the widths are read where that ``lambda`` holds: halfway to the next ``U`` above it, by the
    argmin itself (so ties break as ever).
    """
    errors = errors.double()
    options = errors.shape[-1]
    cost = torch.arange(options, dtype=torch.float64, device=errors.device)
    gap = cost[None, :] - cost[:, None]  # [v, w]: w - v
    slope = (errors[..., :, None] - errors[..., None, :]) / gap.where(gap != 0, 1)  # [..., D, v, w]
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=errors.device)
    upper = slope.where(gap > 0, inf).amin(-2)  # [..., D, w]: U_w (over narrower v); width 0: +inf
    lower = slope.where(gap < 0, -inf).amax(-2)  # L_w (over wider v); the widest: -inf
    chosen = (lower < upper) & (cost > 0)  # widths some lambda picks, past the first (width 0 is always one)
    index = torch.where(lower < upper, cost, -1.0)  # the chosen widths' own, then the nearest narrower chosen one
    before = torch.cat([torch.zeros_like(index[..., :1]), index[..., :-1]], -1).cummax(-1).values
    step = torch.where(chosen, cost - before, 0.0).flatten(-2)  # [..., D * options]: bits each widening adds
    at = torch.where(chosen, upper, -inf).flatten(-2)  # the lambda below which it is taken
    at, order = torch.sort(at, dim=-1, descending=True, stable=True)
    taken = torch.cat([torch.zeros_like(step[..., :1]), step.gather(-1, order).cumsum(-1)], -1)
    above = torch.searchsorted(-at.contiguous(), -at.contiguous(), side="left")  # how many U lie above each
    fits = (taken.gather(-1, above) <= budget) & (at >= 0)
    least = torch.where(fits, at, inf).amin(-1)  # the least U that fits, or +inf
    zero_fits = taken.gather(-1, torch.searchsorted(-at.contiguous(), torch.zeros_like(at[..., :1]))) <= budget
    least = torch.where(zero_fits[..., 0], torch.zeros_like(least), least)
    following = torch.where(at > least[..., None], at, inf).amin(-1)  # the next U above it
    multiplier = torch.where(torch.isinf(following), least + 1.0, (least + following) / 2)
    return (errors + multiplier[..., None, None] * cost).argmin(-1)


def _bit_positions(widths: Tensor, page_size: int) -> tuple[Tensor, Tensor]:
    """(bit position [B, H, N, P, D] of each code in its page, widths [B, H, N, 1, D] int64), widths above
    :data:`MAX_WIDTH` read as :data:`MAX_WIDTH` (as the native read reads them)."""
    wide = widths.to(torch.int64).clamp(0, MAX_WIDTH)[:, :, :, None, :]  # [B, H, N, 1, D]
    first = wide.cumsum(-1) - wide
    tokens = torch.arange(page_size, device=widths.device)[:, None]  # [P, 1]
    return page_size * first + wide * tokens, wide


def pack(codes: Tensor, widths: Tensor, width_bytes: int) -> Tensor:
    """[B, H, N, P, D] integer codes (each below 2**width), widths [B, H, N, D] -> [B, H, N, P, width_bytes] uint8
    (the page's bytes: channel after channel, see the module docstring)."""
    batch, heads, count, page, dim = codes.shape
    size = page * width_bytes
    position, _ = _bit_positions(widths, page)
    shifted = (codes.to(torch.int64) << (position % 8)).reshape(batch, heads, count, page * dim)  # at most 15 bits
    byte = (position // 8).reshape(shifted.shape)  # width-0 channels past the last code add 0 to the spare byte
    flat = torch.zeros(batch, heads, count, size + 1, dtype=torch.int64, device=codes.device)
    flat.scatter_add_(-1, byte.clamp_max(size), shifted & 0xFF)  # no bit is set twice
    flat.scatter_add_(-1, (byte + 1).clamp_max(size), shifted >> 8)
    return flat[..., :size].to(torch.uint8).reshape(batch, heads, count, page, width_bytes)


def unpack(packed: Tensor, widths: Tensor) -> Tensor:
    """Inverse of :func:`pack`: [B, H, N, P, width_bytes] uint8, widths [B, H, N, D] -> [B, H, N, P, D] float32.

    Byte indices past the page are clamped to its last byte (the native read reads widths that claim more bits
    than a page holds the same way)."""
    batch, heads, count, page, width_bytes = packed.shape
    position, wide = _bit_positions(widths, page)
    flat = packed.reshape(batch, heads, count, page * width_bytes).to(torch.int64)
    last = page * width_bytes - 1
    byte = (position // 8).reshape(batch, heads, count, -1)
    low = flat.gather(-1, byte.clamp_max(last)).reshape(position.shape)
    high = flat.gather(-1, (byte + 1).clamp_max(last)).reshape(position.shape)  # only read where a code spans it
    return (((low | (high << 8)) >> (position % 8)) & ((1 << wide) - 1)).float()
