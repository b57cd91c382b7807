"""Triton paged read: attention over selected cold pages, straight from their packed storage.

The cold tier keeps demoted tokens in pages of ``P`` tokens, low-bit in the KIVI layout
(Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"):
keys per channel with one float16 (scale, min) per ``G`` tokens and channel, values per
token with one float16 (scale, min) per ``Gv = min(G, D)`` channels, codes packed
little-endian so that channel ``d``'s code starts at bit ``d * bits`` of the token's row
(:mod:`confkv.tiers.lowbit`). Each decode step reads, per sequence and KV head, the ``K``
pages whose key digest bounds ``q . k`` highest (Tang et al. 2024, "Quest: Query-Aware
Sparsity for Efficient Long-Context LLM Inference"); the selection arrives as a
:class:`~confkv.attention.segments.PagedSegment` (page numbers [B, H, K] plus a per-sequence
count; -1 or ranks >= count are not read).

Instead of gathering and dequantizing the pages on the host, one program per
(sequence * KV head, split of ``pages_per_split`` ranks) loads each selected page's
page number, then its codes, unpacks them in registers (shift and mask; a 3-bit code
may straddle two bytes), applies the key scale/min of the token's group and the value
scale/min of the channel's group, and runs the online softmax (FlashAttention, Dao et
al. 2022) over the page's slots, writing one partial (max, sum, output) per split,
Flash-Decoding style (Dao et al. 2023). 16-bit pages are plain loads. The partials go
into the same buffers as :mod:`confkv.attention.triton_read`'s dense segments, so the
host merges hot segments and cold pages in ONE log-sum-exp merge. When the mass is
requested the kernel also stores each slot's final score, normalised by that merge:
the cold segment's mass is [B, H, K * P], slot ``j * P + t`` = token ``t`` of the
rank-``j`` page, what :meth:`confkv.tiers.cold.ColdTier.observe` and promotion consume.

Shapes of :func:`paged_partials`: query rows [B*H, R, D] float32 (R = G_q * Q, already
scaled), partial buffers part_max / part_sum [B*H, S, R], part_acc [B*H, S, R, D];
the storage as in :mod:`confkv.attention.segments`. Storage and page numbers must be on
the query's device (CUDA, or anything under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv.attention.segments import PagedSegment

try:  # optional dependency
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

    class tl:  # noqa: N801 - stub so the kernel's annotations evaluate without triton
        constexpr = None


def _paged_split_kernel(
    q_ptr, index_ptr, count_ptr, valid_ptr,
    kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr,
    part_max_ptr, part_sum_ptr, part_acc_ptr, scores_ptr,
    kv_heads, width, rows, head_dim, split_offset, total_splits,
    stride_ib, stride_ih, stride_ik,
    stride_ab, stride_ah, stride_an, stride_ap,
    stride_kcb, stride_kch, stride_kcn, stride_kcp, stride_kcc,
    stride_ksb, stride_ksh, stride_ksn, stride_ksg, stride_ksd,
    stride_kmb, stride_kmh, stride_kmn, stride_kmg, stride_kmd,
    stride_vcb, stride_vch, stride_vcn, stride_vcp, stride_vcc,
    stride_vsb, stride_vsh, stride_vsn, stride_vsp, stride_vsg,
    stride_vmb, stride_vmh, stride_vmn, stride_vmp, stride_vmg,
    softcap,
    PAGE: tl.constexpr, KEY_GROUP: tl.constexpr, VALUE_GROUP: tl.constexpr, BITS: tl.constexpr,
    PAGES_PER_SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, STORE_SCORES: tl.constexpr,
):  # pragma: no cover - body runs inside Triton (compiled or interpreted)
    """One (sequence * KV head, split of page ranks): partial online softmax over packed pages."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    t_local = tl.arange(0, BLOCK_T)
    r_ok = r < rows
    d_ok = d < head_dim
    length = width * PAGE

    q = tl.load(q_ptr + bh * rows * head_dim + r[:, None] * head_dim + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_R], -1e30, tl.float32)  # finite start, as in blockwise.py
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    count = tl.load(count_ptr + b)
    if BITS != 16:
        bit = d * BITS  # channel d's code starts at this bit of the token's packed row
        byte = bit // 8
        shift = bit % 8
        straddles = (shift + BITS) > 8  # only 3-bit codes cross a byte
        code_mask = (1 << BITS) - 1
        value_group = d // VALUE_GROUP

    # ranks [first, last) of this split; ranks >= count are not read (their scores stay -inf)
    first = split * PAGES_PER_SPLIT
    last = tl.minimum(tl.minimum(first + PAGES_PER_SPLIT, width), count)
    for j in range(first, last):
        page = tl.load(index_ptr + b * stride_ib + h * stride_ih + j * stride_ik)
        live = page >= 0  # -1: fewer pages than ranks
        page = tl.where(live, page, 0)
        # a scalar slot limit compared with t (a vector & scalar-bool mask breaks the interpreter)
        read_limit = tl.where(live, PAGE, 0)
        for t0 in range(0, PAGE, BLOCK_T):
            t = t0 + t_local
            t_ok = t < read_limit
            tile = t_ok[:, None] & d_ok[None, :]
            slot = tl.load(valid_ptr + b * stride_ab + h * stride_ah + page * stride_an + t * stride_ap,
                           mask=t_ok, other=0)
            t_read = t_ok & (slot != 0)
            # keys [BLOCK_T, BLOCK_D]
            k_row = kc_ptr + b * stride_kcb + h * stride_kch + page * stride_kcn + t[:, None] * stride_kcp
            if BITS == 16:
                k = tl.load(k_row + d[None, :] * stride_kcc, mask=tile, other=0).to(tl.float32)
            else:
                word = tl.load(k_row + byte[None, :] * stride_kcc, mask=tile, other=0).to(tl.int32)
                if BITS == 3:
                    high = tl.load(k_row + (byte[None, :] + 1) * stride_kcc, mask=tile & straddles[None, :],
                                   other=0).to(tl.int32)
                    word = word | (high << 8)
                code = ((word >> shift[None, :]) & code_mask).to(tl.float32)
                group = t // KEY_GROUP
                k_scale = tl.load(ks_ptr + b * stride_ksb + h * stride_ksh + page * stride_ksn
                                  + group[:, None] * stride_ksg + d[None, :] * stride_ksd, mask=tile, other=0.0)
                k_min = tl.load(km_ptr + b * stride_kmb + h * stride_kmh + page * stride_kmn
                                + group[:, None] * stride_kmg + d[None, :] * stride_kmd, mask=tile, other=0.0)
                k = code * k_scale.to(tl.float32) + k_min.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_R, BLOCK_T]
            if USE_SOFTCAP:
                s = (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * softcap  # tanh(s) * softcap
            s = tl.where(r_ok[:, None] & t_read[None, :], s, float("-inf"))
            if STORE_SCORES:
                tl.store(scores_ptr + bh * rows * length + r[:, None] * length + (j * PAGE + t)[None, :], s,
                         mask=r_ok[:, None] & (t < PAGE)[None, :])
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            correction = tl.exp(m_i - m_new)
            l_i = l_i * correction + tl.sum(p, 1)
            # values [BLOCK_T, BLOCK_D]
            v_row = vc_ptr + b * stride_vcb + h * stride_vch + page * stride_vcn + t[:, None] * stride_vcp
            if BITS == 16:
                v = tl.load(v_row + d[None, :] * stride_vcc, mask=tile, other=0).to(tl.float32)
            else:
                word = tl.load(v_row + byte[None, :] * stride_vcc, mask=tile, other=0).to(tl.int32)
                if BITS == 3:
                    high = tl.load(v_row + (byte[None, :] + 1) * stride_vcc, mask=tile & straddles[None, :],
                                   other=0).to(tl.int32)
                    word = word | (high << 8)
                code = ((word >> shift[None, :]) & code_mask).to(tl.float32)
                v_scale = tl.load(vs_ptr + b * stride_vsb + h * stride_vsh + page * stride_vsn
                                  + t[:, None] * stride_vsp + value_group[None, :] * stride_vsg, mask=tile, other=0.0)
                v_min = tl.load(vm_ptr + b * stride_vmb + h * stride_vmh + page * stride_vmn
                                + t[:, None] * stride_vmp + value_group[None, :] * stride_vmg, mask=tile, other=0.0)
                v = code * v_scale.to(tl.float32) + v_min.to(tl.float32)
            acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new

    part = bh * total_splits + split_offset + split
    tl.store(part_max_ptr + part * rows + r, m_i, mask=r_ok)
    tl.store(part_sum_ptr + part * rows + r, l_i, mask=r_ok)
    tl.store(part_acc_ptr + part * rows * head_dim + r[:, None] * head_dim + d[None, :], acc,
             mask=r_ok[:, None] & d_ok[None, :])


_COMPILED: dict[bool, object] = {}


def _kernel(interpret: bool):
    """The jitted kernel; built on first use so TRITON_INTERPRET is honoured then."""
    if interpret not in _COMPILED:
        _COMPILED[interpret] = triton.jit(_paged_split_kernel)
    return _COMPILED[interpret]


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(1, x) - 1).bit_length())


def pages_per_split(segment: PagedSegment, split_size: int) -> int:
    """Selected pages one program walks: about ``split_size`` slots, at least one page."""
    return max(1, split_size // segment.page_size)


def split_count(segment: PagedSegment, split_size: int) -> int:
    """Partials the segment writes (0 when it selects no page)."""
    per = pages_per_split(segment, split_size)
    return -(-segment.width // per)


def paged_partials(
    query_rows: Tensor,
    segment: PagedSegment,
    part_max: Tensor,
    part_sum: Tensor,
    part_acc: Tensor,
    split_offset: int,
    *,
    split_size: int,
    softcap: float | None,
    need_scores: bool,
    interpret: bool,
) -> Tensor | None:
    """Write the segment's partials into ``part_*[:, split_offset : split_offset + split_count]``.

    Args:
        query_rows: [B*H, R, D] float32, contiguous, already multiplied by the score scale
            (``scaling``, or ``scaling / softcap``).
        segment: the selected pages (storage on the query's device).
        part_max, part_sum: [B*H, S, R] float32; part_acc: [B*H, S, R, D] float32.
        split_size: slots per program (rounded to whole pages).
        softcap: Gemma-2 soft cap or None.
        need_scores: also return each slot's final score (-inf where not read).
        interpret: the kernel runs under TRITON_INTERPRET=1.
    Returns:
        None, or scores [B*H, R, K * P] float32 (-inf where a slot is not read).
    """
    segment.validate()
    if not segment.plain:
        raise ValueError("the Triton paged read takes pages of one width without outliers; call "
                         "PagedSegment.to_dense() for the others")
    flat, rows, head_dim = query_rows.shape
    device = query_rows.device
    heads, width, page = segment.kv_heads, segment.width, segment.page_size
    if segment.index.device != device or segment.valid.device != device:
        raise ValueError("the paged read needs the page storage and page numbers on the query's device; "
                         "call PagedSegment.to_dense() for storage elsewhere")
    per = pages_per_split(segment, split_size)
    splits = split_count(segment, split_size)
    scores = None
    if need_scores:  # slots of ranks a sequence does not read are never written: -inf, mass 0
        scores = torch.full((flat, rows, width * page), float("-inf"), dtype=torch.float32, device=device)
    if splits == 0:
        return scores
    counts = segment.counts.clamp(0, width).to(device=device, dtype=torch.int32).contiguous()  # int32 loop bound
    valid = segment.valid.view(torch.uint8) if segment.valid.dtype == torch.bool else segment.valid
    if segment.bits == 16:
        tensors = (segment.keys, segment.keys, segment.keys, segment.values, segment.values, segment.values)
        group = value_group = 1
    else:
        tensors = (segment.key_codes, segment.key_scale, segment.key_min,
                   segment.value_codes, segment.value_scale, segment.value_min)
        group, value_group = segment.group_size, min(segment.group_size, head_dim)
    strides = [s for tensor in tensors for s in tensor.stride()]
    _kernel(interpret)[(flat, splits)](
        query_rows, segment.index, counts, valid, *tensors,
        part_max, part_sum, part_acc, part_max if scores is None else scores,
        heads, width, rows, head_dim, split_offset, part_max.shape[1],
        *segment.index.stride(), *valid.stride(), *strides,
        float(softcap) if softcap is not None else 1.0,
        PAGE=page, KEY_GROUP=group, VALUE_GROUP=value_group, BITS=segment.bits,
        PAGES_PER_SPLIT=per, BLOCK_T=min(_pow2(page), 64), BLOCK_R=_pow2(rows), BLOCK_D=_pow2(head_dim),
        USE_SOFTCAP=softcap is not None, STORE_SCORES=need_scores,
    )
    return scores
