"""``window``: the last ``budget`` tokens only, no sinks (the sliding-window baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.policies.fixed_budget import FixedBudgetPolicy


@dataclass(frozen=True)
class WindowPolicy(FixedBudgetPolicy):
    """Sliding window: keep the ``budget`` most recent tokens (Beltagy et al. 2020, Longformer's
    local attention; the baseline of every KV-eviction paper).

    ``budget`` counts the tokens held at the end of each step, so the token fed at the next
    step attends to itself and the ``budget`` tokens before it (docs/USAGE.md, "What a budget counts")."""

    name = "window"
    protect: int = 0

    def scores(self, stats: dict[str, torch.Tensor], positions: torch.Tensor,
               current_position: torch.Tensor) -> torch.Tensor:
        return positions.float()
