"""Outliers apart ("dense-and-sparse", KVQuant): the few most extreme entries of a page kept in 16 bits.

A low-bit group spends its levels on its range, so one extreme entry coarsens every other
entry of its group. Per page and KV head the ``count`` entries that stand out most from their
quantization group are taken out before the ranges are computed. Each is stored as its flat
index in the page (int16: ``page_size * head_dim`` must stay below 32,768) and its
**correction**: the entry less what its codes decode to (float16), added back to the
dequantized page (an index that repeats adds each of its corrections). A read that never writes
a page out dequantized (the native packed reads) adds ``q_d * correction`` to a token's score
and ``p_t * correction`` to an output channel, with nothing else to look up. A page of ``P``
tokens and ``D`` channels keeps ``round(fraction * P * D)`` of them per tensor: 4 bytes each,
all counted. A decoded outlier is the entry to within float16's rounding of its correction
(``2**-11 |correction|``): no coarser than the entry stored in float16 when the entry lies beyond
its group's range on the side away from 0 (then ``|correction| <= |entry|``).

"Stand out" is the distance from the group's mean in units of the group's spread (its
standard deviation over the valid entries): a wide but even group gains nothing from losing
its largest entry, a tight group with one stray entry gains most.
"""

from __future__ import annotations

import torch
from torch import Tensor

VALUE_DTYPE = torch.float16
INDEX_DTYPE = torch.int16
ENTRY_BYTES = 4  # float16 value + int16 index


def outlier_count(fraction: float, page_size: int, head_dim: int) -> int:
    """Outliers kept per page, KV head and tensor."""
    return int(round(fraction * page_size * head_dim))


def check_indexable(page_size: int, head_dim: int) -> None:
    if page_size * head_dim > torch.iinfo(INDEX_DTYPE).max + 1:
        raise ValueError(f"outliers: pages of {page_size} x {head_dim} entries exceed int16 indices; "
                         "use a smaller page_size")


def pick(grouped: Tensor, valid: Tensor, dim: int, count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` most outlying entries of each page.

    Args:
        grouped: [B, H, N, ...] float32, a page's entries arranged so that ``dim`` is its
            quantization group's axis (every other trailing axis indexes groups).
        valid: bool, broadcastable to ``grouped``: entries that are real tokens.
        count: entries per page (> 0).
    Returns:
        flat index [B, H, N, count] int64 into the page's trailing entries (in ``grouped``'s
        layout), and the mask of the picked entries (``grouped``'s shape).
    """
    mask = valid.expand_as(grouped)
    weight = mask.float()
    total = weight.sum(dim, keepdim=True).clamp_min(1)
    mean = (grouped * weight).sum(dim, keepdim=True) / total
    spread = (((grouped - mean) ** 2) * weight).sum(dim, keepdim=True) / total
    score = (grouped - mean).abs() / (spread.sqrt() + 1e-6)
    score = score.masked_fill(~mask, -1.0)
    lead = grouped.shape[:3]
    flat = score.reshape(*lead, -1)
    index = flat.topk(count, dim=-1).indices
    picked = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, index, True).reshape(grouped.shape)
    return index, picked


def corrections(grouped: Tensor, decoded: Tensor, index: Tensor) -> Tensor:
    """What the decode lacks at flat ``index`` [B, H, N, count] of each page: the entry less what its codes decode
    to there (``decoded``: the page as every read decodes it, float32), float16; ``grouped`` and ``decoded`` in the
    same layout."""
    lead = grouped.shape[:3]
    entries, given = (t.reshape(*lead, -1).gather(-1, index) for t in (grouped, decoded))
    return (entries - given).to(VALUE_DTYPE)


def restore(grouped: Tensor, index: Tensor, corrections: Tensor) -> Tensor:
    """``grouped`` (a dequantized page) with the corrections added at ``index`` (int16 or int64; an index
    that repeats adds each), in place when ``grouped`` is contiguous (a decode's fresh output), else on a
    copy."""
    flat = grouped.reshape(*grouped.shape[:3], -1)
    if flat.data_ptr() != grouped.data_ptr() or not grouped.is_contiguous():
        flat = flat.clone()
    return flat.scatter_add_(-1, index.long(), corrections.to(flat.dtype)).reshape(grouped.shape)
