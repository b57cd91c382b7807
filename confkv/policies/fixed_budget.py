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


def recent_part(budget: int, protect: int, recent_ratio: float) -> int:
    """Tokens of a budget reserved for the most recent ones (H2O / Scissorhands "recent" split)."""
    return min(budget, max(protect, round(recent_ratio * budget)))


def check_ratio(value: float, field_name: str) -> None:
    _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
             and 0.0 <= value <= 1.0, field_name, f"must be a number in [0, 1], got {value!r}")


def check_recent_fits(policy: FixedBudgetPolicy) -> None:
    """The recent part (``n_recent``, scored ``+inf``) plus the sinks must fit the budget.

    Otherwise the ``+inf`` recent tokens tie with the protected sinks in the top-k and a
    sink can be evicted (found by tests/hf/test_property_cache.py: h2o, budget=3, sinks=2).
    """
    n_recent = policy.n_recent  # type: ignore[attr-defined]
    _require(n_recent + policy.sinks <= policy.budget, "sinks",
             f"the recent part of the budget (n_recent={n_recent}, from recent_ratio={policy.recent_ratio!r} "  # type: ignore[attr-defined]
             f"and protect={policy.protect}) plus sinks={policy.sinks} exceeds budget={policy.budget}, so a "
             "never-evicted sink could be evicted; lower `recent_ratio`/`sinks` or raise `budget`")


def recent_first(importance: torch.Tensor, positions: torch.Tensor, current_position: torch.Tensor,
                 n_recent: int) -> torch.Tensor:
    """``importance`` [B, Hkv, L], with the ``n_recent`` most recent tokens scored ``+inf``.

    A token is recent when ``current_position - position < n_recent``. Since at most
    ``n_recent <= budget`` slots get ``+inf``, exactly those are kept and the rest of the
    budget goes to the most important older tokens.
    """
    recent = (current_position[:, None, None] - positions) < n_recent
    return importance.float().masked_fill(recent, math.inf)
