"""A cold page back in the hot tier (promotion; ``ColdTier.take_best_read_page``): its slots as a full-precision
region, merged into the older region in position order. Not part of the memory preset's decode step (the preset
promotes nothing). Until stop 67 part of ``confkv/store/hot_tier.py``."""

from __future__ import annotations

import torch

from confkv.policies.base import Policy
from confkv.store.hot_tier import Region, concat


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
