"""Which slots of a hot region are kept: the rule every policy's eviction follows, as tensor functions (the torch
path; :func:`confkv.store.hot_tier.split_by_rank` and :func:`~confkv.store.hot_tier.age_and_evict_at_once` take the
common cases in one C call and decline whatever this rule could decide otherwise). Given the policy's scores, the
slot validity and the protection mask, keep per (sequence, KV head) the ``keep_count[b]`` best slots, protected ones
first, padding never; every head of a sequence keeps the same number of slots (so a layer stays one dense
[B, Hkv, K, D] tensor), which slots may differ per head. (Until stop 59 part of ``confkv/store/hot_tier.py``, which
still imports them.)
"""

from __future__ import annotations

import math

import torch


def protected_mask(positions: torch.Tensor, valid: torch.Tensor, current_position: torch.Tensor,
                    protect: int, sinks: int) -> torch.Tensor:
    """Slots that must never be evicted.

    Args:
        positions: [B, Hkv, L] int64 logical token positions.
        valid: [B, L] bool, False for padding / empty slots.
        current_position: [B] int64, position of each sequence's newest token.
        protect: the ``protect`` most recent positions are protected.
        sinks: positions ``< sinks`` are protected.
    Returns:
        [B, Hkv, L] bool.
    """
    recent = positions > (current_position[:, None, None] - protect)
    sink = positions < sinks
    return (recent | sink) & valid[:, None, :]


def select_kept(scores: torch.Tensor, valid: torch.Tensor, protected: torch.Tensor,
                keep_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the slots to keep, in slot order, and the validity of the result.

    Args:
        scores: [B, Hkv, L] float, higher is kept first.
        valid: [B, L] bool.
        protected: [B, Hkv, L] bool, kept before anything else.
        keep_count: [B] int64, slots each sequence keeps (clipped to its valid count).
    Returns:
        kept_index: [B, Hkv, K] int64 with ``K = max_b keep_count[b]``, sorted ascending
            within the first ``keep_count[b]`` entries (the rest point at arbitrary slots
            and are marked invalid);
        kept_valid: [B, K] bool, ``arange(K) < keep_count[b]``.
    """
    batch, heads, length = scores.shape
    keep_count = torch.minimum(keep_count, valid.sum(dim=-1))
    width = int(keep_count.max()) if batch else 0
    priority = scores.float().masked_fill(protected, math.inf).masked_fill(~valid[:, None, :], -math.inf)
    top = priority.topk(width, dim=-1, sorted=True).indices  # [B, Hkv, K]
    kept_valid = torch.arange(width, device=scores.device)[None, :] < keep_count[:, None]  # [B, K]
    # Sort the kept slots by slot index (slot order = arrival order) and push the rest behind.
    order_key = torch.where(kept_valid[:, None, :], top, top + length)
    kept_index = order_key.sort(dim=-1).values % length if length else order_key
    return kept_index, kept_valid


def dropped_slots(kept_index: torch.Tensor, kept_valid: torch.Tensor, valid: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid slots that :func:`select_kept` did not keep, in slot order (for demotion).

    Args:
        kept_index: [B, Hkv, K] from :func:`select_kept`; kept_valid: [B, K].
        valid: [B, L] bool, the slots' validity before eviction.
    Returns:
        dropped_index: [B, Hkv, M] int64, ``M = max_b dropped[b]`` (every head of a sequence
            drops the same number of valid slots), sorted ascending in the first ``dropped[b]``
            entries (the rest point at arbitrary slots);
        dropped_valid: [B, M] bool, ``arange(M) < dropped[b]``.
    """
    batch, heads, _ = kept_index.shape
    length = valid.shape[-1]
    kept = torch.zeros((batch, heads, length), dtype=torch.int32, device=valid.device)
    kept.scatter_add_(2, kept_index, kept_valid[:, None, :].expand(-1, heads, -1).to(torch.int32))
    dropped = valid[:, None, :] & (kept == 0)  # [B, Hkv, L]
    counts = dropped[:, 0].sum(-1)  # [B]
    width = int(counts.max()) if batch else 0
    order = (~dropped).to(torch.int8).argsort(dim=-1, stable=True)[..., :width]
    dropped_valid = torch.arange(width, device=valid.device)[None, :] < counts[:, None]
    return order, dropped_valid
