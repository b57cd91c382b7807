"""``h2o``: Heavy-Hitter Oracle, accumulated attention + a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.policies.fixed_budget import (FixedBudgetPolicy, check_ratio, check_recent_fits, recent_first,
                                          recent_part)


@dataclass(frozen=True)
class H2OPolicy(FixedBudgetPolicy):
    """H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference
    of Large Language Models", NeurIPS 2023).

    Every kept slot of every KV head accumulates the attention it has received from all
    queries since it entered the cache::

        acc <- acc + mass          (mass summed over the pass's queries, averaged over the
                                    query heads of the KV group: with GQA "per head" means
                                    per KV head)

    Budget ``budget`` per layer, split as in the paper's "heavy + recent" setup (10% + 10%,
    i.e. half each): the ``n_recent = max(protect, round(recent_ratio * budget))`` most
    recent tokens are always kept and the remaining ``budget - n_recent`` slots go to the
    tokens with the largest ``acc`` (the heavy hitters), chosen per KV head.

    The recent part is implemented by scoring (recent tokens score ``+inf``, see
    :func:`~confkv.policies.fixed_budget.recent_first`), not through ``protect``, so the
    store's never-evicted FP window (``protect``, or ``fp_window`` with INT8) stays small
    and independent of the split; when that window is longer than ``n_recent`` it wins.
    No attention sinks (``sinks=0``), as in the paper.
    """

    name = "h2o"
    stat_names = ("acc",)
    needs_attention = True

    recent_ratio: float = 0.5
    protect: int = 32
    sinks: int = 0

    def __post_init__(self) -> None:
        check_ratio(self.recent_ratio, "recent_ratio")
        super().__post_init__()
        check_recent_fits(self)

    @property
    def n_recent(self) -> int:
        """Tokens of the recent part of the budget."""
        return recent_part(self.budget, self.protect, self.recent_ratio)

    def observe(self, stats: dict[str, torch.Tensor], mass: torch.Tensor, num_queries: int) -> None:
        stats["acc"].add_(mass)

    def linear_observe(self, num_queries: int) -> dict[str, tuple[float, float]] | None:
        if type(self).observe is not H2OPolicy.observe:  # a subclass with its own update
            return None
        return {"acc": (1.0, 1.0)}

    def scores(self, stats: dict[str, torch.Tensor], positions: torch.Tensor,
               current_position: torch.Tensor) -> torch.Tensor:
        return recent_first(stats["acc"], positions, current_position, self.n_recent)
