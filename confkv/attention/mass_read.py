"""Attention read with attention mass in a few ops, for unmasked full-precision decode steps on CPU.

The policies that rank tokens by the attention they receive (H2O, TOVA, CONF-KV's EMA;
Zhang et al. 2023, Oren et al. 2024, this project's paper) need each slot's softmax
probability at every step. The block-wise read (:mod:`confkv.attention.blockwise`) computes
it with an online softmax over tiles, about three dozen torch ops per segment; on CPU each op
costs microseconds of dispatch, which at 30 layers is most of a decode step's attention time.

When no slot is masked, no segment is INT8 and there is no soft-cap (a decode step of a
full-precision store without padding), the whole score row fits in memory and the read is
one plain softmax over the concatenated scores, in float32 as in the block-wise read::

    s = [q K_1^T, q K_2^T, ...] * scaling          (float32)
    p = softmax(s)                                 (over every segment's slots)
    out = sum_i p_i V_i,    mass_i = mean over the group's heads of p_i (summed over queries)

a dozen ops in all. The result equals the block-wise read up to float32 summation order
(tests/attention/test_mass_read.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from confkv.attention.segments import KVSegment

#: most float32 scores (B * Hq * Q * L) the read materialises at once; larger reads use the block-wise one
MAX_SCORES = 1 << 22


def mass_read_eligible(query: Tensor, segments: Sequence[KVSegment], softcap: float | None) -> bool:
    """Whether :func:`mass_read` computes this read: a CPU query, full-precision keys and values
    (of any float dtype), every slot visible, no soft-cap, at least one non-empty segment, and
    the scores under :data:`MAX_SCORES`."""
    if softcap is not None or query.device.type != "cpu" or not query.is_floating_point():
        return False
    total = sum(s.length for s in segments)
    if not total or query.shape[0] * query.shape[1] * query.shape[2] * total > MAX_SCORES:
        return False
    return all(s.visible is None and not s.keys_int8 and not s.values_int8
               and s.keys.is_floating_point() and s.values.is_floating_point() for s in segments)


def mass_read(query: Tensor, segments: Sequence[KVSegment], scaling: float) -> tuple[Tensor, list[Tensor]]:
    """Softmax attention over the concatenation of ``segments`` (all visible), with each slot's mass.

    Args:
        query: [B, Hq, Q, D] on CPU, Hq = Hkv * G.
        segments: full-precision segments [B, Hkv, L_s, D], ``visible`` None (empty ones allowed).
        scaling: score multiplier (usually D ** -0.5).

    Returns:
        out: [B, Hq, Q, D] in ``query.dtype``.
        mass: one [B, Hkv, L_s] float32 tensor per segment: the softmax probability of each
            slot, averaged over the query heads of its KV group and summed over the Q queries
            (the block-wise read's contract).
    """
    batch, q_heads, num_queries, head_dim = query.shape
    kv_heads = next(s for s in segments if s.length).keys.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"Hq={q_heads} is not a multiple of Hkv={kv_heads}")
    group = q_heads // kv_heads
    # [B, Hq, Q, D] -> [B, Hkv, G*Q, D]: row g*Q + q of KV head j is query head j*G + g
    grouped = query.to(torch.float32).reshape(batch, kv_heads, group * num_queries, head_dim)
    lengths = [s.length for s in segments]
    scores = torch.cat([torch.matmul(grouped, s.keys.to(torch.float32).transpose(-1, -2))
                        for s in segments], dim=-1)  # [B, Hkv, G*Q, L]
    probs = torch.softmax(scores.mul_(scaling), dim=-1)
    out = None
    for part, segment in zip(probs.split(lengths, dim=-1), segments):
        if segment.length:
            term = torch.matmul(part, segment.values.to(torch.float32))  # [B, Hkv, G*Q, D]
            out = term if out is None else out.add_(term)
    mass = probs.view(batch, kv_heads, group, num_queries, -1).mean(dim=2).sum(dim=2)  # [B, Hkv, L]
    out = out.reshape(batch, q_heads, num_queries, head_dim).to(query.dtype)
    return out, list(mass.split(lengths, dim=-1))
