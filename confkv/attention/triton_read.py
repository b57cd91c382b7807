"""Triton kernel for the mixed FP / INT8 attention read (GPU; optional dependency).

Same contract as :func:`confkv.attention.blockwise.blockwise_attention`
(output [B, Hq, Q, D] in ``query.dtype``, per-segment mass [B, Hkv, L_s]
float32, fully masked rows give zeros), computed Flash-Decoding style
(Dao et al., 2023): every segment is cut into splits of ``split_size`` slots;
one program per (sequence * KV head, split) walks its split in blocks of
``block_n`` slots with an online softmax (FlashAttention, Dao et al. 2022),
dequantizing int8 keys / values in registers (key channel scale folded into
the query, key token scale into the scores, value token scale into the
probabilities), and writes a partial (max, sum, output).  The partials of all
splits of all segments are then merged on the host with the usual
log-sum-exp rescaling (a few small torch ops).  When the mass is requested the
kernel also stores each slot's final (scaled, capped, masked) score, which is
normalised with the merged max / sum afterwards.

Supported shapes: all query rows of one KV group (G * Q) are handled by one
program, padded to a power of two >= 16; if G * Q > ``MAX_ROWS`` (64) - i.e.
a prefill-sized query block - the call falls back to the torch reference
``blockwise_attention`` (documented, not an error).  Head dims up to 256.
Keys / values may be int8, float16, bfloat16 or float32, with any strides.

A segment may also be a :class:`~confkv.attention.segments.PagedSegment` (selected
cold pages, still packed low-bit): :mod:`confkv.attention.triton_pages` reads it
with its own kernel into the same partial buffers, so hot segments and cold pages
meet in one merge.

``triton`` is optional: this module imports without it; calling
:func:`triton_attention` then raises a RuntimeError.  The kernel is compiled
lazily on first use, so setting ``TRITON_INTERPRET=1`` before the first call
runs it in Triton's CPU interpreter (that is how the tests check it on a
machine without a GPU).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from confkv.attention import triton_pages
from confkv.attention.blockwise import _visible_4d, blockwise_attention
from confkv.attention.segments import KVSegment, PagedSegment, densify

try:  # optional dependency
    import triton
    import triton.language as tl

    _IMPORT_ERROR: Exception | None = None
except ImportError as error:  # pragma: no cover - exercised only without triton
    triton = None
    _IMPORT_ERROR = error

    class tl:  # noqa: N801 - stub so the kernel's annotations evaluate without triton
        constexpr = None


MAX_ROWS = 64
DEFAULT_SPLIT_SIZE = 256
DEFAULT_BLOCK_N = 64
_MAX_START = -1e30


def triton_available() -> bool:
    """True if the ``triton`` package imports."""
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _read_split_kernel(
    q_ptr, k_ptr, v_ptr, kts_ptr, vts_ptr, vis_ptr,
    part_max_ptr, part_sum_ptr, part_acc_ptr, scores_ptr,
    kv_heads, length, rows, num_queries, head_dim, num_splits, split_offset, total_splits,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_ksb, stride_ksh, stride_ksl,
    stride_vsb, stride_vsh, stride_vsl,
    stride_mb, stride_mh, stride_mq, stride_ml,
    softcap,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    KEYS_INT8: tl.constexpr, VALUES_INT8: tl.constexpr, HAS_MASK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, STORE_SCORES: tl.constexpr,
):  # pragma: no cover - body runs inside Triton (compiled or interpreted)
    """One (sequence * KV head, split) of one segment: partial online softmax."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < rows
    d_ok = d < head_dim
    query_row = r % num_queries  # row g*Q + q -> query q (for the mask)

    q = tl.load(q_ptr + bh * rows * head_dim + r[:, None] * head_dim + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_R], -1e30, tl.float32)  # finite start, as in blockwise.py
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)

    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    start = split * SPLIT
    for offset in range(0, SPLIT, BLOCK_N):
        n = start + offset + tl.arange(0, BLOCK_N)
        n_ok = n < length
        k = tl.load(k_base + n[:, None] * stride_kl + d[None, :] * stride_kd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_R, BLOCK_N]
        if KEYS_INT8:
            kts = tl.load(kts_ptr + b * stride_ksb + h * stride_ksh + n * stride_ksl, mask=n_ok, other=0.0)
            s = s * kts[None, :]
        if USE_SOFTCAP:
            s = (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * softcap  # tanh(s) * softcap
        valid = r_ok[:, None] & n_ok[None, :]
        if HAS_MASK:
            vis = tl.load(vis_ptr + b * stride_mb + h * stride_mh + query_row[:, None] * stride_mq
                          + n[None, :] * stride_ml, mask=valid, other=0)
            valid = valid & (vis != 0)
        s = tl.where(valid, s, float("-inf"))
        if STORE_SCORES:
            tl.store(scores_ptr + bh * rows * length + r[:, None] * length + n[None, :], s,
                     mask=r_ok[:, None] & n_ok[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        correction = tl.exp(m_i - m_new)
        l_i = l_i * correction + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * stride_vl + d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0).to(tl.float32)
        if VALUES_INT8:
            vts = tl.load(vts_ptr + b * stride_vsb + h * stride_vsh + n * stride_vsl, mask=n_ok, other=0.0)
            p = p * vts[None, :]
        acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    part = bh * total_splits + split_offset + split
    tl.store(part_max_ptr + part * rows + r, m_i, mask=r_ok)
    tl.store(part_sum_ptr + part * rows + r, l_i, mask=r_ok)
    tl.store(part_acc_ptr + part * rows * head_dim + r[:, None] * head_dim + d[None, :], acc,
             mask=r_ok[:, None] & d_ok[None, :])


_COMPILED: dict[bool, object] = {}


def _kernel():
    """The jitted kernel; built on first use so TRITON_INTERPRET is honoured then."""
    interpret = _interpreting()
    if interpret not in _COMPILED:
        _COMPILED[interpret] = triton.jit(_read_split_kernel)
    return _COMPILED[interpret]


def _next_pow2(x: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(1, x) - 1).bit_length())


def triton_attention(
    query: Tensor,
    segments: Sequence[KVSegment | PagedSegment],
    scaling: float,
    softcap: float | None = None,
    need_mass: bool = True,
    *,
    split_size: int = DEFAULT_SPLIT_SIZE,
    block_n: int = DEFAULT_BLOCK_N,
) -> tuple[Tensor, list[Tensor] | None]:
    """Triton version of :func:`confkv.attention.blockwise.blockwise_attention`.

    Args:
        query: [B, Hq, Q, D] CUDA tensor (any device under TRITON_INTERPRET=1).
        segments, scaling, softcap, need_mass: as for ``blockwise_attention``; a
            segment may be a :class:`PagedSegment` (mass [B, Hkv, K * P]).
        split_size: slots per program (flash-decoding split); a multiple of
            ``block_n``.
        block_n: slots per inner block (power of two >= 16).

    Returns:
        (out [B, Hq, Q, D] in query.dtype, per-segment mass [B, Hkv, L_s]
        float32 or None).
    """
    if triton is None:
        raise RuntimeError(f"the triton backend needs the optional 'triton' package ({_IMPORT_ERROR})")
    if not (query.is_cuda or _interpreting()):
        raise RuntimeError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")
    if block_n < 16 or block_n & (block_n - 1) or split_size % block_n:
        raise ValueError(f"block_n must be a power of two >= 16 dividing split_size (got {block_n}, {split_size})")
    batch, q_heads, num_queries, head_dim = query.shape
    # pages of two widths or with outliers: the kernel reads one width of plain codes, so they come decoded
    segments = [s.to_dense() if isinstance(s, PagedSegment) and not s.plain else s for s in segments]
    first = segments[0]
    kv_heads = first.kv_heads if isinstance(first, PagedSegment) else first.keys.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"Hq={q_heads} is not a multiple of Hkv={kv_heads}")
    group = q_heads // kv_heads
    rows = group * num_queries
    if rows > MAX_ROWS or head_dim > 256:
        return blockwise_attention(query, densify(list(segments)), scaling, softcap=softcap, need_mass=need_mass)
    flat = batch * kv_heads
    device = query.device
    score_scale = scaling / softcap if softcap is not None else scaling
    query_grouped = query.to(torch.float32).reshape(flat, rows, head_dim)

    split_counts = [triton_pages.split_count(s, split_size) if isinstance(s, PagedSegment)
                    else triton.cdiv(s.length, split_size) for s in segments]
    total_splits = max(1, sum(split_counts))
    part_max = torch.full((flat, total_splits, rows), _MAX_START, dtype=torch.float32, device=device)
    part_sum = torch.zeros((flat, total_splits, rows), dtype=torch.float32, device=device)
    part_acc = torch.zeros((flat, total_splits, rows, head_dim), dtype=torch.float32, device=device)
    scores: list[Tensor | None] = []
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    kernel = _kernel()
    split_offset = 0
    for segment, num_splits in zip(segments, split_counts):
        if isinstance(segment, PagedSegment):
            scores.append(triton_pages.paged_partials(
                (query_grouped * score_scale).contiguous(), segment, part_max, part_sum, part_acc, split_offset,
                split_size=split_size, softcap=softcap, need_scores=need_mass, interpret=_interpreting()))
            split_offset += num_splits
            continue
        segment.validate()
        length = segment.length
        seg_scores = None
        if need_mass:
            seg_scores = torch.empty((flat, rows, length), dtype=torch.float32, device=device)
        scores.append(seg_scores)
        if length == 0:
            continue
        if segment.keys_int8:
            channel = segment.key_channel_scale.to(torch.float32).reshape(flat, 1, head_dim)
            q_seg = (query_grouped * (channel * score_scale)).contiguous()
        else:
            q_seg = (query_grouped * score_scale).contiguous()
        visible = _visible_4d(segment.visible)
        mask = None if visible is None else visible.to(device=device, dtype=torch.uint8).expand(batch, kv_heads, num_queries, length)
        kts = segment.key_token_scale.to(torch.float32) if segment.keys_int8 else dummy.view(1, 1, 1)
        vts = segment.value_token_scale.to(torch.float32) if segment.values_int8 else dummy.view(1, 1, 1)
        mask_arg = dummy if mask is None else mask
        mask_strides = (0, 0, 0, 0) if mask is None else mask.stride()
        kernel[(flat, num_splits)](
            q_seg, segment.keys, segment.values, kts, vts, mask_arg,
            part_max, part_sum, part_acc, dummy if seg_scores is None else seg_scores,
            kv_heads, length, rows, num_queries, head_dim, num_splits, split_offset, total_splits,
            *segment.keys.stride(), *segment.values.stride(), *kts.stride(), *vts.stride(), *mask_strides,
            float(softcap) if softcap is not None else 1.0,
            SPLIT=split_size, BLOCK_N=block_n, BLOCK_R=_next_pow2(rows), BLOCK_D=_next_pow2(head_dim),
            KEYS_INT8=segment.keys_int8, VALUES_INT8=segment.values_int8, HAS_MASK=mask is not None,
            USE_SOFTCAP=softcap is not None, STORE_SCORES=need_mass,
        )
        split_offset += num_splits

    # Merge the partials of every split of every segment (log-sum-exp rescaling).
    final_max = part_max.amax(dim=1, keepdim=True)  # [BH, 1, R]
    weight = (part_max - final_max).exp()  # [BH, S, R]
    total = (part_sum * weight).sum(dim=1)  # [BH, R]
    inv_total = 1.0 / total.clamp_min(torch.finfo(torch.float32).tiny)
    out = (part_acc * weight.unsqueeze(-1)).sum(dim=1) * inv_total.unsqueeze(-1)
    out = out.reshape(batch, q_heads, num_queries, head_dim).to(query.dtype)
    if not need_mass:
        return out, None
    masses = []
    for seg_scores in scores:
        probs = (seg_scores - final_max.transpose(1, 2)).exp() * inv_total.unsqueeze(-1)  # [BH, R, L]
        mass = probs.view(batch, kv_heads, group, num_queries, -1).sum(dim=3).mean(dim=2)
        masses.append(mass)
    return out, masses
