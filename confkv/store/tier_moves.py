"""Moving tokens between a layer's hot tier (the :class:`~confkv.store.LayerStore` regions) and its cold tier.

* :func:`demote_dropped`: the slots an eviction drops go to the cold tier (dequantized first when INT8);
* :func:`promoted_region` and :func:`merge_in_position_order`: a page the cold tier gives back becomes
  hot slots again, merged into the older region in position order.
"""

from __future__ import annotations

import torch

from confkv import profiling
from confkv.tiers.cold import ColdTier
from confkv.eviction import dropped_slots
from confkv.policies.base import Policy
from confkv.store.region import Region, concat


def demote_dropped(cold: ColdTier, old: Region, kept_index: torch.Tensor, kept_valid: torch.Tensor,
                   channel_scale: torch.Tensor | None, dtype: torch.dtype, policy: Policy | None = None,
                   current: torch.Tensor | None = None, queries: int = 1) -> None:
    """Hand ``old``'s valid slots that are not in ``kept_index`` [B, Hkv, K] (``kept_valid`` [B, K]) to ``cold``,
    with the attention ``policy`` estimates each received per query (:meth:`Policy.attention_per_read`).

    A policy divides a pass's attention by all of its ``queries``; a token of that pass (``current`` [B]: the
    newest position) was seen only by the queries at or after it, so its estimate is scaled by ``queries /
    seen``: otherwise a prefill chunk's earlier tokens would rank above its later ones for being older.
    INT8 slots are dequantized to ``dtype`` with their per-token scales and ``channel_scale`` [B, Hkv, D].
    """
    index, valid = dropped_slots(kept_index, kept_valid, old.valid)
    if not bool(valid.any()):
        return
    with profiling.section("cold demotion (quantize + seal)"):
        dropped = old.gather(index, valid)
        keys, values = dropped.keys, dropped.values
        if dropped.is_int8:
            from confkv import quant  # noqa: PLC0415 - the INT8 path only

            keys = quant.dequantize_keys(keys, dropped.key_scale, channel_scale, dtype)
            values = quant.dequantize_values(values, dropped.value_scale, dtype)
        attention = policy.attention_per_read(dropped.stats) if policy is not None else None
        if attention is not None and queries > 1 and current is not None:
            seen = (current[:, None, None] - dropped.positions + 1).clamp(1, queries)
            attention = attention * (queries / seen)
        cold.demote(keys, values, dropped.positions, valid, attention)


def promoted_region(taken: dict[str, torch.Tensor], policy: Policy, stat_names: tuple[str, ...],
                    dtype: torch.dtype) -> Region:
    """A full-precision region from :meth:`ColdTier.take_best_read_page`'s output, its statistics
    started from the attention the page's slots received at this step (``policy.observe``)."""
    stats = {name: torch.zeros(taken["positions"].shape, dtype=torch.float32, device=taken["keys"].device)
             for name in stat_names}
    policy.observe(stats, taken["mass"], 1)
    return Region(keys=taken["keys"].to(dtype), values=taken["values"].to(dtype), positions=taken["positions"],
                  valid=taken["valid"], stats=stats, all_valid=bool(taken["valid"].all()))


def merge_in_position_order(old: Region, back: Region) -> Region:
    """``old`` and ``back`` (same precision) as one region whose slots are in position order in every head.

    Invalid slots go first in every head, so validity stays one row per sequence ([B, L]).
    """
    merged = concat(old, back)
    key = torch.where(merged.valid[:, None, :], merged.positions, torch.full_like(merged.positions, -1))
    order = key.argsort(dim=-1, stable=True)
    invalid = (~merged.valid).sum(-1)  # [B]
    valid = torch.arange(merged.length, device=invalid.device)[None, :] >= invalid[:, None]
    return merged.gather(order, valid, all_valid=bool(valid.all()))
