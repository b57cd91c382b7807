"""The open page's 4-bit slots (``ColdConfig.open_bits=4``; the open page's storage is
:mod:`confkv.tiers.cold_read`'s, which calls these only at 4 bits, so that a step at other widths never enters here).

Each token's channels are first turned by the randomized Hadamard rotation of its head size
(:func:`confkv.tiers.hadamard.shared_rotation`, which spreads an outlier channel over all of them: QuaRot, Ashkboos
et al. 2024; llama.cpp rotates its quantized KV cache so, PR #21038), then quantized per token and KV head,
symmetric, with 15 levels: scale = max_d |y_d| / 7 in float16, code = round(y / scale) in [-7, 7], stored + 8 as a
4-bit code (channel 2i in the low half of byte i, 2i + 1 in the high half), and turned back on decode. A slot costs
2 * (D / 2 + 2) bytes a head: 26.6% of a 16-bit one at D = 64, where INT8 costs 52%.

Shapes: keys / values [B, H, M, D] float -> codes [B, H, M, D / 2] uint8 and scales [B, H, M] float16.
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv.tiers.hadamard import shared_rotation

#: the largest code magnitude (15 levels, symmetric), and what is added to store a code in [1, 15]
_NIBBLE_MAX, _NIBBLE_ZERO = 7, 8


def encode(keys: Tensor, values: Tensor) -> dict[str, Tensor]:
    """4-bit codes of the rotated keys / values [B, H, M, D] (D even), two a byte, and their float16 scales."""
    head_dim = keys.shape[-1]
    if head_dim % 2:
        raise ValueError(f"open_bits: 4-bit open slots pack two channels a byte; head_dim {head_dim} is odd "
                         "(use open_bits=8)")
    turned = shared_rotation(head_dim).forward(torch.stack([keys, values]).float())  # [2, B, H, M, D]
    scale = turned.abs().amax(-1).div_(float(_NIBBLE_MAX)).to(torch.float16)
    codes = turned.div_(scale.float().clamp_min_(1e-30)[..., None]).round_().clamp_(-_NIBBLE_MAX, _NIBBLE_MAX)
    codes = (codes + _NIBBLE_ZERO).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return {"keys": packed[0], "values": packed[1], "key_scale": scale[0], "value_scale": scale[1]}


def decode(stored: dict[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(keys, values) [B, H, S, D] in ``dtype``, turned back, of :func:`encode`'s storage (or slots cut from it)."""
    packed = torch.stack([stored["keys"], stored["values"]])  # [2, B, H, S, D / 2]
    scale = torch.stack([stored["key_scale"], stored["value_scale"]])
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).float() - _NIBBLE_ZERO
    turned = shared_rotation(codes.shape[-1]).inverse(codes.mul_(scale.float()[..., None])).to(dtype)
    return turned[0], turned[1]
