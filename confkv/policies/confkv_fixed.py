"""``confkv-fixed``: CONF-KV's ranking with the confidence gate off (a constant budget)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.policies.confkv import ConfKVPolicy
from confkv.policies.fixed_budget import FixedBudgetPolicy


@dataclass(frozen=True)
class ConfKVFixedPolicy(FixedBudgetPolicy, ConfKVPolicy):
    """Fixed-budget CONF-KV (METHOD.md, "Baselines"): isolates the confidence gate.

    The ranking is :class:`~confkv.policies.confkv.ConfKVPolicy`'s, inherited unchanged
    (EMA of attention mass + recency bonus, ``protect=32``, ``sinks=4``); the budget is the
    constant ``budget`` in every layer at every step, whatever the confidence. The
    ``gate``'s ``tau``/``n_high``/``n_low`` are ignored (its confidence weights still
    define the confidence recorded in the trace). To compare at equal memory with a gated
    run, set ``budget`` to that run's mean kept tokens.
    """

    name = "confkv-fixed"
    protect: int = 32  # ConfKVPolicy's defaults (FixedBudgetPolicy would bring the base ones)
    sinks: int = 4

    def layer_budgets(self, confidence: torch.Tensor, num_layers: int) -> torch.Tensor:
        return torch.full((confidence.shape[0], num_layers), self.budget, dtype=torch.int64)
