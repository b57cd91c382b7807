"""4-bit weight blocks (W4A8's weights): :func:`pack_int4_blocks` and :func:`unpack_int4_blocks`.

A decode step on a CPU reads every weight once, so its time follows the weights' bytes: Qwen2.5-1.5B's projections
are about 1.5 GB in INT8 and about 0.8 GB here. Each weight row ``W[n]`` is cut into blocks of 32 columns, each
stored as 4-bit codes ``c`` with a float16 scale ``d`` and minimum ``m``, the weight being ``m + c * d`` (the
min / max of the block, round to nearest: the form of llama.cpp's Q4_1, 5 bits a weight with the side bytes).
The projection's input is quantised to int8 in blocks of 32 as for W8A8
(:func:`confkv.native.quantize_activation_blocks`, llama.cpp's Q8 activations), and the decode GEMV sums each
block's products in integers (:class:`confkv.native.int4.Int4Projection`, AVX-512 VNNI); the layer is
:class:`confkv.hf.weights.Int4Linear`. Prefill chunks multiply the same quantised activations by the dequantized
weight in float32, so perplexity measures what decoding computes.

The optional models come as 4-bit GGUF files (SmolLM2's Q4_1, Qwen's Q4_K_M) dequantized to bfloat16: a block whose
codes span 0 to 15 is found again here up to the bfloat16 rounding, while Q4_K_M's 6-bit tensors lose bits.
Quality is measured, never assumed (``confkv bench --dtype bfloat16-w4a8 --quality-tokens N``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv import native
from confkv.native.int4 import PACK_STEP, padded_columns

BLOCK = native.ACTIVATION_BLOCK
LEVELS = 15  #: the largest 4-bit code


def pack_int4_blocks(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``weight`` [N, K] -> (codes [N, Kq / 2] uint8, scale [N, Kq / 32] float16, minimum [N, Kq / 32] float16).

    ``Kq`` is K rounded up to 128; the padding columns are zeros. Per block of 32 columns: ``minimum`` its smallest
    value rounded down to float16, ``scale`` (largest - minimum) / 15 rounded up to float16 (so that no code passes
    15), the codes ``round((w - minimum) / scale)`` in 0..15 (0 where the scale is 0). Each 128 columns go in 64
    bytes (one cache line): column i in the low nibble of byte i, column 64 + i in its high nibble (kernels.c's
    c/gemv_w4.c).

    Raises:
        ValueError: a weight that is not finite or a block beyond float16's range.
    """
    rows, columns = weight.shape
    padded = torch.zeros(rows, padded_columns(columns), dtype=torch.float32)
    padded[:, :columns] = weight.float()
    if not torch.isfinite(padded).all():
        raise ValueError("pack_int4_blocks: the weight has NaN or infinite values; 4-bit blocks need finite weights")
    blocks = padded.view(rows, -1, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    minimum = _rounded(low, down=True)
    scale = _rounded((high - minimum.float()) / LEVELS, down=False)
    if not (torch.isfinite(minimum).all() and torch.isfinite(scale).all()):
        raise ValueError("pack_int4_blocks: a block's values pass float16's range (65504); "
                         "keep that layer in INT8 (confkv.hf.weights.Int8Linear)")
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = torch.where(scale[..., None] > 0, torch.round((blocks - minimum.float()[..., None]) / safe[..., None]),
                        torch.zeros_like(blocks)).clamp(0, LEVELS).to(torch.uint8)
    steps = codes.view(rows, -1, PACK_STEP)
    packed = steps[..., :PACK_STEP // 2] | (steps[..., PACK_STEP // 2:] << 4)
    return packed.reshape(rows, -1).contiguous(), scale.contiguous(), minimum.contiguous()


def _rounded(x: Tensor, *, down: bool) -> Tensor:
    """``x`` (float32) in float16, rounded down (``down``) or up instead of to nearest."""
    half = x.to(torch.float16)
    off = half.float() > x if down else half.float() < x
    towards = torch.full_like(half, -torch.inf if down else torch.inf)
    return torch.where(off, torch.nextafter(half, towards), half)


def unpack_int4_blocks(codes: Tensor, scale: Tensor, minimum: Tensor, columns: int) -> Tensor:
    """The float32 weight [N, columns] that :func:`pack_int4_blocks`' output stands for: ``minimum + code * scale``."""
    rows = codes.shape[0]
    steps = codes.view(rows, -1, PACK_STEP // 2)
    unpacked = torch.cat([steps & 15, steps >> 4], dim=-1).reshape(rows, -1, BLOCK).float()
    weight = minimum.float()[..., None] + unpacked * scale.float()[..., None]
    return weight.reshape(rows, -1)[:, :columns]
