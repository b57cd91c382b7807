"""Clipped ranges: each quantization group's range chosen by least squared error, not by its minimum and maximum.

KIVI (and :mod:`confkv.tiers.lowbit`) spreads a group's ``L = 2**bits`` levels evenly from its smallest to its
largest entry. At 2 and 3 bits a few extreme entries then cost every other entry of the group its precision: with
four levels over 64 near-Gaussian entries, most entries fall between two levels that are a third of the group's
whole span apart. Clipping the range (AWQ, Lin et al. 2024, searches a clipping ratio per group on a grid;
OmniQuant, Shao et al. 2024, learns it) trades a larger error on the few extremes for a smaller one on the rest.

Here each group's ends are moved towards each other, independently, on a small grid of shrink ratios, and the pair
with the least squared reconstruction error over the group's valid entries is kept. The stored form does not
change (codes in ``[0, L - 1]``, a float16 minimum and scale per group; entries outside the range take the end
codes), so every read that takes KIVI pages takes clipped pages as they are; only encoding (at demotion) costs
more: one quantize-dequantize of the group per pair of ratios. Only codes of at most :data:`MAX_BITS` bits are
clipped.

What it costs, measured: a needle's digits. On the memory preset's 8/4/3 ladder (25%, 4K, pydoc-topics) clipped
pages found 10 of 20 needles where the same pages unclipped found 16 of the same 20, while lowering perplexity
(results/memory/README.md, "Points 2 and 3 (stop 38)"). The likely reason, not tested: the entries a clipped
range gives up are its group's extremes, where a needle's distinctive key entries would sit. It is an option,
not a default.

Shapes: ``x`` is any float tensor, grouped along ``axis``; ``mask`` (bool, broadcastable to ``x``) marks the
entries that count. Returns ``bottom`` and ``top`` with ``axis`` kept as size 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv.tiers import lowbit

#: the shrink ratios each end of a group's range is tried at (1.0: the end stays at the group's extreme), chosen
#: on pydoc-topics' replay at 2 bits among ten grids (results/lowbit/README.md, "Clipped ranges")
RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)
#: the widest codes clipped: at 4 bits the replay gained nothing, so 4- and 8-bit pages keep min / max (and
#: their encoding its cost: the search quantizes every group once per pair of ratios)
MAX_BITS = 3


def _squared_error(x: Tensor, mask: Tensor, axis: int, bottom: Tensor, top: Tensor, bits: int) -> Tensor:
    """Summed squared error over ``axis`` of quantizing ``x`` to ``[bottom, top]`` as it is stored (float16 ends).

    The float32 operations of ``lowbit.levels_in_range`` then ``(minimum + code * scale - x)**2``, in that order,
    done in place on one buffer: the same bits, and the search (these passes over ``len(RATIOS)**2`` copies of a
    page) is most of a clipped page's encode (results/lowbit/README.md, "What a seal costs", stop 73)."""
    scale, minimum = lowbit.scale_and_minimum(bottom, top, bits)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    error = x - minimum.float()
    error.div_(safe).clamp_(0, (1 << bits) - 1).round_()  # the codes
    error.mul_(scale.float()).add_(minimum.float()).sub_(x).square_()  # code * scale + minimum: IEEE addition commutes
    if not bool(mask.all()):
        error.masked_fill_(~mask.expand_as(error), 0.0)
    return error.sum(dim=axis, keepdim=True)


def clipped_range(x: Tensor, mask: Tensor, axis: int, bottom: Tensor, top: Tensor, bits: int,
                  ratios: tuple[float, ...] = RATIOS) -> tuple[Tensor, Tensor]:
    """The range ``[bottom', top']`` inside ``[bottom, top]`` (a group's extremes, ``axis`` kept as size 1) with the
    least squared error of ``x``'s ``mask`` entries quantized to ``2**bits`` even levels, each end moved towards the
    group's middle by one of ``ratios``. Ties go to the pair tried first (the extremes themselves, ``ratios[0]`` =
    1.0 at both ends, then the low end's ratios outermost).

    Every pair is tried at once along a new leading dimension (``len(ratios)**2`` copies of ``x``'s groups).
    """
    middle = (bottom + top) / 2
    shrink = torch.tensor(ratios, dtype=bottom.dtype, device=bottom.device)
    shrink = shrink.reshape(-1, *([1] * bottom.dim()))
    lows = torch.where(shrink == 1.0, bottom, middle + shrink * (bottom - middle))  # [R, ...]: an end at 1.0 stays exact
    highs = torch.where(shrink == 1.0, top, middle + shrink * (top - middle))
    count = len(ratios)
    low = lows.repeat_interleave(count, dim=0)  # pair (a, b) at a * count + b
    high = highs.repeat(count, *([1] * bottom.dim()))
    error = _squared_error(x.float().unsqueeze(0), mask.expand_as(x).unsqueeze(0), axis if axis < 0 else axis + 1,
                           low, high, bits)
    best = error.argmin(dim=0, keepdim=True)  # the first of equal errors
    return low.gather(0, best).squeeze(0), high.gather(0, best).squeeze(0)
