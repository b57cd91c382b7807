"""Block-wise online-softmax attention read over mixed FP / INT8 KV segments.

This is the PyTorch reference of the read (flash-decoding style): the
concatenation of the segments is walked tile by tile with a running max, a
running sum and a running output, rescaled as each tile is merged (the online
softmax of FlashAttention, Dao et al. 2022, and its split-KV use in
Flash-Decoding, Dao et al. 2023).  Within a tile, INT8 keys and values are
dequantized one block of ``block_size`` slots at a time, never as a whole
segment:

* the frozen key channel scale (see :mod:`confkv.quant`) is folded into the
  query once per segment: ``q . (k_int8 * ts * cs) = ((q * cs) . k_int8) * ts``;
* the per-token key scale multiplies the tile's scores;
* the per-token value scale multiplies the probabilities before ``p @ v``.

So the only full-precision data the read creates for an INT8 segment is one
block at a time, converted from int8, plus the tile's scores ([B*Hkv, G*Q,
tile] floats, which the attention mass needs anyway).  On CPU every torch op
costs several microseconds of dispatch, so for decoding (few query rows) a
tile is a whole segment: the softmax bookkeeping is then a handful of ops per
segment and each block costs 4 ops (convert K, ``bmm``, convert V,
``baddbmm``).  ``tile_size`` can force small tiles (the tests do, to exercise
the rescaling); the automatic tile is capped so that its scores stay below
``_TILE_SCORE_BUDGET`` floats for long query blocks (prefill).

GQA: the query [B, Hq, Q, D] with Hq = Hkv * G is viewed as
[B, Hkv, G * Q, D] (query head ``h`` reads KV head ``h // G``, the Hugging
Face ``repeat_kv`` convention), so KV is never repeated.

All arithmetic is float32; the output is cast to ``query.dtype``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from confkv.attention.segments import KVSegment

# Running-max start value.  Masked scores are -inf; starting the running max
# at a finite value keeps exp(-inf - m) = 0 and exp(m_old - m_new) finite even
# while every slot seen so far is masked, without extra `where` ops.
_MAX_START = -1e30
# Default block: an int8 block converted to float32 (Hkv * 1024 * D * 4 bytes,
# 768 KiB at SmolLM2's shape) stays in a 2 MiB L2 while the bmm reads it;
# larger blocks only save a few ops per block (python -m confkv.eval.bench.attention).
DEFAULT_BLOCK_SIZE = 1024
# Automatic tile cap, in score entries (B * Hkv * G*Q * tile floats): 16 MiB.
_TILE_SCORE_BUDGET = 1 << 22


def _visible_4d(visible: Tensor | None) -> Tensor | None:
    """Left-pad a broadcastable mask to 4 dims [B?, Hkv?, Q?, L]."""
    if visible is None:
        return None
    while visible.dim() < 4:
        visible = visible.unsqueeze(0)
    return visible


def _segment_query(query_grouped: Tensor, segment: KVSegment, scale: float, batch: int, kv_heads: int) -> Tensor:
    """The float32 query a segment's raw key bytes are multiplied with.

    Args:
        query_grouped: [B*Hkv, G*Q, D] float32.
        segment: the segment; its key channel scale (int8 keys) is folded in:
            ``q . (k_int8 * ts * cs) = ((q * cs) . k_int8) * ts``.
        scale: scalar folded in (attention scaling, divided by softcap).

    Returns:
        [B*Hkv, G*Q, D] float32.
    """
    if segment.keys_int8:
        channel = segment.key_channel_scale.to(torch.float32).reshape(batch * kv_heads, 1, -1)
        return query_grouped * (channel * scale)
    return query_grouped * scale


def _tile_scores(
    query_seg: Tensor,
    segment: KVSegment,
    start: int,
    stop: int,
    block_size: int,
    hidden: Tensor | None,
    group: int,
    softcap: float | None,
) -> Tensor:
    """Scaled, soft-capped, masked scores of the slots [start, stop) of a segment.

    Keys are converted to float32 one block of ``block_size`` slots at a time
    (float32 keys need no conversion and are read as one view).

    Args:
        query_seg: [B*Hkv, G*Q, D] float32 from :func:`_segment_query`.
        hidden: None or bool [B?, Hkv?, Q?, L or 1], True = masked.

    Returns:
        [B*Hkv, G*Q, stop - start] float32; -inf where the slot is not visible.
    """
    keys = segment.keys
    batch, kv_heads, _, head_dim = keys.shape
    step = stop - start if keys.dtype == torch.float32 else block_size
    blocks = []
    for block_start in range(start, stop, step):
        block_stop = min(block_start + step, stop)
        block = keys[:, :, block_start:block_stop].to(torch.float32)
        block = block.reshape(batch * kv_heads, block_stop - block_start, head_dim)
        blocks.append(torch.bmm(query_seg, block.transpose(1, 2)))
    scores = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)
    if segment.keys_int8:
        token_scale = segment.key_token_scale[:, :, start:stop].to(torch.float32)
        scores.mul_(token_scale.reshape(batch * kv_heads, 1, stop - start))
    if softcap is not None:
        scores.tanh_().mul_(softcap)
    if hidden is not None:
        rows = scores.shape[1]
        view = scores.view(batch, kv_heads, group, rows // group, stop - start)
        tile_hidden = hidden if hidden.shape[-1] == 1 else hidden[..., start:stop]
        view.masked_fill_(tile_hidden.unsqueeze(2), float("-inf"))
    return scores


def _accumulate_values(
    acc: Tensor, probs: Tensor, segment: KVSegment, start: int, stop: int, block_size: int, reuse_probs: bool
) -> None:
    """acc += probs @ values[start:stop], dequantizing int8 values per block.

    Args:
        acc: [B*Hkv, G*Q, D] float32, updated in place.
        probs: [B*Hkv, G*Q, stop - start] float32 (unnormalised probabilities).
        reuse_probs: probs may be overwritten (the mass does not need them).
    """
    values = segment.values
    batch, kv_heads, _, head_dim = values.shape
    if segment.values_int8:
        token_scale = segment.value_token_scale[:, :, start:stop].to(torch.float32)
        token_scale = token_scale.reshape(batch * kv_heads, 1, stop - start)
        probs = probs.mul_(token_scale) if reuse_probs else probs * token_scale
    step = stop - start if values.dtype == torch.float32 else block_size
    for block_start in range(start, stop, step):
        block_stop = min(block_start + step, stop)
        block = values[:, :, block_start:block_stop].to(torch.float32)
        block = block.reshape(batch * kv_heads, block_stop - block_start, head_dim)
        acc.baddbmm_(probs[:, :, block_start - start : block_stop - start], block)


def blockwise_attention(
    query: Tensor,
    segments: Sequence[KVSegment],
    scaling: float,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softcap: float | None = None,
    need_mass: bool = True,
    *,
    tile_size: int | None = None,
) -> tuple[Tensor, list[Tensor] | None]:
    """Attention of ``query`` over the concatenation of ``segments``.

    The slots are walked tile by tile (a tile is a run of whole blocks of one
    segment); each tile's scores are computed block by block (int8 keys
    dequantized per block), then merged into a running max / running sum /
    running output with the online-softmax rescaling
    ``acc = acc * exp(m_old - m_new) + exp(s - m_new) @ v``.  For decoding
    (few query rows) a tile is a whole segment, so the softmax bookkeeping
    costs a handful of ops per segment instead of per block, which is what
    makes this fast on CPU; the tile is capped so that its scores stay below
    ``_TILE_SCORE_BUDGET`` floats for long query blocks.

    Args:
        query: [B, Hq, Q, D], Hq = Hkv * G (GQA).
        segments: KV segments (FP or INT8), read in order; lengths may be 0.
        scaling: score multiplier (usually D ** -0.5).
        block_size: dequantization granularity in slots (>= 1): int8 and
            non-float32 segments are converted to float32 this many slots at
            a time; float32 segments are read as views.
        softcap: Gemma-2 soft cap: ``scores = tanh(scores / softcap) * softcap``.
        need_mass: also return per-slot attention mass.
        tile_size: online-softmax granularity in slots (rounded up to a
            multiple of ``block_size``); None = automatic (see above).

    Returns:
        out: [B, Hq, Q, D] in ``query.dtype``.  Rows that can see no slot at
            all are zero.
        mass: if ``need_mass``, one [B, Hkv, L_s] float32 tensor per segment:
            the softmax probability of each slot, averaged over the query
            heads of its KV group and summed over the Q queries (0 for rows
            that see nothing); else None.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not segments:
        raise ValueError("need at least one segment (an empty one is fine)")
    batch, q_heads, num_queries, head_dim = query.shape
    kv_heads = segments[0].keys.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"Hq={q_heads} is not a multiple of Hkv={kv_heads}")
    group = q_heads // kv_heads
    rows = group * num_queries
    flat = batch * kv_heads
    if tile_size is None:
        tile_size = max(block_size, _TILE_SCORE_BUDGET // max(1, flat * rows))
    tile_size = -(-max(1, tile_size) // block_size) * block_size

    # [B, Hq, Q, D] -> [B*Hkv, G*Q, D]: row g*Q + q of KV head j is query head j*G + g.
    query_grouped = query.to(torch.float32).reshape(flat, rows, head_dim)
    score_scale = scaling / softcap if softcap is not None else scaling

    # Online-softmax state (None until the first non-empty tile).
    running_max: Tensor | None = None  # [B*Hkv, G*Q, 1]
    running_sum: Tensor | None = None  # [B*Hkv, G*Q, 1]
    acc: Tensor | None = None  # [B*Hkv, G*Q, D]
    # per segment: (probabilities relative to the running max after that
    # tile, that running max) of each tile, for the final mass normalisation.
    kept: list[list[tuple[Tensor, Tensor]]] = []

    for segment in segments:
        segment.validate()
        kept.append([])
        length = segment.length
        if length == 0:
            continue
        query_seg = _segment_query(query_grouped, segment, score_scale, batch, kv_heads)
        visible = _visible_4d(segment.visible)
        hidden = None if visible is None else ~visible.to(torch.bool)
        for start in range(0, length, tile_size):
            stop = min(start + tile_size, length)
            scores = _tile_scores(query_seg, segment, start, stop, block_size, hidden, group, softcap)
            tile_max = scores.amax(dim=-1, keepdim=True)
            if running_max is None:
                # first tile: nothing to rescale (the clamp keeps fully masked rows finite)
                new_max = tile_max.clamp_min_(_MAX_START)
                probs = scores.sub_(new_max).exp_()  # in place: raw scores are not needed again
                running_sum = probs.sum(dim=-1, keepdim=True)
                acc = query_grouped.new_zeros((flat, rows, head_dim))
            else:
                new_max = torch.maximum(running_max, tile_max)
                probs = scores.sub_(new_max).exp_()
                correction = (running_max - new_max).exp_()
                running_sum.mul_(correction).add_(probs.sum(dim=-1, keepdim=True))
                acc.mul_(correction)
            _accumulate_values(acc, probs, segment, start, stop, block_size, reuse_probs=not need_mass)
            running_max = new_max
            if need_mass:
                kept[-1].append((probs, new_max))

    if acc is None:  # no slot at all
        out = query.new_zeros(query.shape)
        masses = [query_grouped.new_zeros((batch, kv_heads, s.length)) for s in segments]
        return out, (masses if need_mass else None)

    # Rows that saw nothing have running_sum == 0 and acc == 0: 0 * (1 / tiny) = 0.
    inv_sum = running_sum.clamp_min_(torch.finfo(torch.float32).tiny).reciprocal_()
    out = acc.mul_(inv_sum).reshape(batch, q_heads, num_queries, head_dim).to(query.dtype)
    if not need_mass:
        return out, None

    masses = []
    inv_sum_group = inv_sum.div_(group)
    for segment, tiles in zip(segments, kept):
        if not tiles:
            masses.append(query_grouped.new_zeros((batch, kv_heads, segment.length)))
            continue
        parts = []
        for probs, tile_max in tiles:
            # row weight exp(m_tile - m_final) / l_final / G: normalises and averages the group.
            if tile_max is running_max:
                row_weight = inv_sum_group
            else:
                row_weight = (tile_max - running_max).exp_().mul_(inv_sum_group)
            parts.append(torch.bmm(row_weight.transpose(1, 2), probs).view(batch, kv_heads, -1))
        masses.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))
    return out, masses


def dense_attention_reference(
    query: Tensor,
    segments: Sequence[KVSegment],
    scaling: float,
    softcap: float | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """Plain softmax attention over the dequantized concatenation (tests only).

    Same arguments and return convention as :func:`blockwise_attention`
    (mass always returned).  Materializes everything in float64.
    """
    batch, q_heads, num_queries, head_dim = query.shape
    kv_heads = segments[0].keys.shape[1]
    group = q_heads // kv_heads
    keys, values, masks, lengths = [], [], [], []
    for segment in segments:
        dense = segment.to_float()
        k, v = dense.keys, dense.values
        keys.append(k.to(torch.float64))
        values.append(v.to(torch.float64))
        shape = (batch, kv_heads, num_queries, segment.length)
        vis = torch.ones(shape, dtype=torch.bool) if segment.visible is None else _visible_4d(segment.visible).to(torch.bool).expand(shape)
        masks.append(vis.to(query.device))
        lengths.append(segment.length)
    k = torch.cat(keys, dim=2).repeat_interleave(group, dim=1)  # [B, Hq, L, D]
    v = torch.cat(values, dim=2).repeat_interleave(group, dim=1)
    vis = torch.cat(masks, dim=-1).repeat_interleave(group, dim=1)  # [B, Hq, Q, L]
    scores = torch.matmul(query.to(torch.float64), k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~vis, float("-inf"))
    any_visible = vis.any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~any_visible, 0.0), dim=-1) * any_visible
    out = torch.matmul(probs, v).to(query.dtype)
    mass = probs.view(batch, kv_heads, group, num_queries, -1).sum(dim=3).mean(dim=2).to(torch.float32)
    return out, list(torch.split(mass, lengths, dim=-1))
