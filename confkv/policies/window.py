"""``window``: the last ``budget`` tokens only, no sinks (the sliding-window baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.config import _require
from confkv.policies.base import Policy


@dataclass(frozen=True)
class WindowPolicy(Policy):
    """Sliding window: keep the ``budget`` most recent tokens (Beltagy et al. 2020, Longformer's
    local attention; the baseline of every KV-eviction paper)."""

    name = "window"
    budget: int = 512
    protect: int = 0

    def __post_init__(self) -> None:
        _require(isinstance(self.budget, int) and not isinstance(self.budget, bool) and self.budget >= 1,
                 "budget", f"must be a positive integer, got {self.budget!r}")
        super().__post_init__()

    def min_budget(self) -> int:
        return self.budget

    def max_budget(self) -> int:
        return self.budget

    def scores(self, stats: dict[str, torch.Tensor], positions: torch.Tensor,
               current_position: torch.Tensor) -> torch.Tensor:
        return positions.float()
