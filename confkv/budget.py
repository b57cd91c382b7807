"""The budget controller: confidence per sequence -> budget per sequence and layer (METHOD.md step 2)."""

from __future__ import annotations

import torch

from confkv.policies.base import Policy


class BudgetController:
    """Turns each step's confidence into budgets, keeping the gate's smoothing state.

    Args:
        policy: the policy whose ``layer_budgets`` maps (gated) confidence to budgets;
            its ``gate.smoothing`` (if any) sets the EMA of the confidence.
        num_layers: managed (evictable) layers.
    """

    def __init__(self, policy: Policy, num_layers: int) -> None:
        self.policy = policy
        self.num_layers = num_layers
        gate = getattr(policy, "gate", None)
        self.smoothing = float(gate.smoothing) if gate is not None else 0.0
        self.gated: torch.Tensor | None = None  # [B] smoothed confidence

    def step(self, confidence: torch.Tensor) -> torch.Tensor:
        """confidence [B] float32 -> budgets [B, num_layers] int64."""
        if self.smoothing and self.gated is not None and self.gated.shape == confidence.shape:
            self.gated = self.smoothing * self.gated + (1.0 - self.smoothing) * confidence
        else:
            self.gated = confidence.clone()
        return self.policy.layer_budgets(self.gated, self.num_layers)

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep the smoothing state of batch rows ``index`` [B']."""
        if self.gated is not None:
            self.gated = self.gated.index_select(0, index.to(self.gated.device))
