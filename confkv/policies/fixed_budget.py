"""Shared pieces of the constant-budget baselines (H2O, Scissorhands, TOVA, random).

Not a policy itself: :class:`FixedBudgetPolicy` validates a constant per-layer
``budget``; :func:`recent_first` turns an importance score into a keep score that
always keeps the ``n_recent`` most recent tokens (the "recent" half of H2O-style
heavy-hitter + recent splits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from confkv.config import _require
from confkv.policies.base import Policy


@dataclass(frozen=True)
class FixedBudgetPolicy(Policy):
    """A policy keeping at most ``budget`` tokens per sequence in every managed layer, every step."""

    budget: int = 512

    def __post_init__(self) -> None:
        _require(isinstance(self.budget, int) and not isinstance(self.budget, bool) and self.budget >= 1,
                 "budget", f"must be a positive integer number of tokens, got {self.budget!r}")
        super().__post_init__()

    def min_budget(self) -> int:
        return self.budget

    def max_budget(self) -> int:
        return self.budget


def check_ratio(value: float, field_name: str) -> None:
    _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
             and 0.0 <= value <= 1.0, field_name, f"must be a number in [0, 1], got {value!r}")


def recent_first(importance: torch.Tensor, positions: torch.Tensor, current_position: torch.Tensor,
                 n_recent: int) -> torch.Tensor:
    """``importance`` [B, Hkv, L], with the ``n_recent`` most recent tokens scored ``+inf``.

    A token is recent when ``current_position - position < n_recent``. Since at most
    ``n_recent <= budget`` slots get ``+inf``, exactly those are kept and the rest of the
    budget goes to the most important older tokens.
    """
    recent = (current_position[:, None, None] - positions) < n_recent
    return importance.float().masked_fill(recent, math.inf)
