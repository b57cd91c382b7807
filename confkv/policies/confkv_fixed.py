"""``confkv-fixed``: CONF-KV's ranking with the confidence gate off (a constant budget)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.config import _require
from confkv.policies.confkv import ConfKVPolicy


@dataclass(frozen=True)
class ConfKVFixedPolicy(ConfKVPolicy):
    """Fixed-budget CONF-KV (METHOD.md, "Baselines"): isolates the confidence gate.

    The ranking is :class:`~confkv.policies.confkv.ConfKVPolicy`'s, inherited unchanged
    (EMA of attention mass + recency bonus, ``protect=32``, ``sinks=4``); the budget is the
    constant ``budget`` in every layer at every step, whatever the confidence. The
    ``gate``'s ``tau``/``n_high``/``n_low`` are ignored (its confidence weights still
    define the confidence recorded in the trace). To compare at equal memory with a gated
    run, set ``budget`` to that run's mean kept tokens.
    """

    name = "confkv-fixed"

    budget: int = 512

    def __post_init__(self) -> None:
        _require(isinstance(self.budget, int) and not isinstance(self.budget, bool) and self.budget >= 1,
                 "budget", f"must be a positive integer number of tokens, got {self.budget!r}")
        super().__post_init__()

    def min_budget(self) -> int:
        return self.budget

    def max_budget(self) -> int:
        return self.budget

    def layer_budgets(self, confidence: torch.Tensor, num_layers: int) -> torch.Tensor:
        return torch.full((confidence.shape[0], num_layers), self.budget, dtype=torch.int64)
