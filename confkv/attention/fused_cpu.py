"""Fused attention read for the common CPU decode case: full-precision segments, no mask, no mass.

When the policy needs no attention mass (``full``, ``window``, ``streaming``, ...), every
segment is in the model's precision and every slot is visible, the read is plain softmax
attention over the concatenation of the segments.  PyTorch's fused CPU kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu``, the kernel behind
``F.scaled_dot_product_attention`` on CPU) computes it in one op per segment and also
returns each row's log-sum-exp, so the segments are never concatenated: their outputs
are merged with the log-sum-exp weights of the split-KV softmax (Flash-Decoding, Dao et
al. 2023)::

    out = sum_s exp(lse_s - logsumexp_s'(lse_s')) * out_s

The block-wise read (:mod:`confkv.attention.blockwise`) costs about a dozen torch ops per
segment; on CPU each op is several microseconds of dispatch and the small-M ``bmm`` of a
decode step is slower than the fused kernel, which is what kept confkv with an unlimited
budget behind ``DynamicCache`` at short contexts (results/bench/README.md).

GQA: the query [B, Hq, Q, D] is viewed as [B, Hkv, G*Q, D] (query head ``h`` reads KV
head ``h // G``), valid because no row is masked.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from confkv.attention.segments import KVSegment

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_read_available() -> bool:
    """True when this torch build has the fused CPU attention kernel."""
    return _FLASH_CPU is not None


def fused_read_eligible(query: Tensor, segments: Sequence[KVSegment], softcap: float | None,
                        need_mass: bool) -> bool:
    """Whether :func:`fused_attention` computes this read exactly (up to float rounding).

    Requires: a CPU query in float32/bfloat16/float16, keys and values of that same dtype
    in every segment (no INT8), every slot visible (``visible is None``), no soft-capping,
    no attention mass, and at least one non-empty segment.
    """
    if _FLASH_CPU is None or need_mass or softcap is not None or query.device.type != "cpu":
        return False
    if query.dtype not in _FLOAT_DTYPES:
        return False
    return any(s.length for s in segments) and all(
        s.visible is None and s.keys.dtype == query.dtype and s.values.dtype == query.dtype for s in segments)


def fused_attention(query: Tensor, segments: Sequence[KVSegment], scaling: float) -> Tensor:
    """Softmax attention of ``query`` over the concatenation of ``segments`` (all visible).

    Args:
        query: [B, Hq, Q, D] on CPU, Hq = Hkv * G.
        segments: FP segments [B, Hkv, L_s, D] of the query's dtype, ``visible`` None;
            empty ones are skipped (see :func:`fused_read_eligible`).
        scaling: score multiplier (usually D ** -0.5).

    Returns:
        [B, Hq, Q, D] in ``query.dtype``.
    """
    batch, q_heads, num_queries, head_dim = query.shape
    filled = [s for s in segments if s.length]
    kv_heads = filled[0].keys.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"Hq={q_heads} is not a multiple of Hkv={kv_heads}")
    grouped = query.reshape(batch, kv_heads, (q_heads // kv_heads) * num_queries, head_dim)
    outs, lses = [], []
    for segment in filled:
        out, lse = _FLASH_CPU(grouped, segment.keys, segment.values, 0.0, False, scale=scaling)
        outs.append(out)  # [B, Hkv, G*Q, D]
        lses.append(lse)  # [B, Hkv, G*Q] float32
    if len(outs) == 1:
        merged = outs[0]
    else:
        weights = torch.softmax(torch.stack(lses), dim=0).unsqueeze(-1)  # [S, B, Hkv, G*Q, 1]
        merged = (torch.stack(outs).to(torch.float32) * weights).sum(0).to(query.dtype)
    return merged.reshape(batch, q_heads, num_queries, head_dim)
