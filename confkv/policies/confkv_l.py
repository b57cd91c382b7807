"""``confkv-l``: CONF-KV with pyramid (per-layer) budgets (METHOD.md step 5)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from confkv.config import _require
from confkv.policies.confkv import ConfKVPolicy
from confkv.policies.pyramid import pyramid_budgets


@dataclass(frozen=True)
class ConfKVLPolicy(ConfKVPolicy):
    """CONF-KV-L: the confidence gate picks the *mean* budget, a pyramid splits it over layers.

    Per sequence and step, the gate gives ``k = n_high`` (``c >= tau``) or ``n_low``; managed
    layer ``l`` of ``L`` then keeps :func:`~confkv.policies.pyramid.pyramid_budgets`
    ``(k, L, beta, min_budget=floor)[l]``: linear from ``2k - k/beta`` (first layer) down to
    ``k/beta`` (last), summing to exactly ``L * k``, so the memory equals uniform CONF-KV's.
    Ranking is CONF-KV's, inherited unchanged.

    Floor: a layer cannot keep fewer tokens than it never evicts, so layers are clamped to
    ``floor = max(min_layer_budget, protect + sinks + 1)`` and the shortfall is taken from
    the shallower layers (mean unchanged). With ``kv_int8`` the store's FP window is never
    evicted either: use ``min_layer_budget > fp_window + sinks`` (the cache checks it and
    refuses the configuration otherwise). Requires ``n_high >= floor``.
    """

    name = "confkv-l"

    beta: float = 20.0
    min_layer_budget: int = 64

    def __post_init__(self) -> None:
        _require(isinstance(self.beta, (int, float)) and not isinstance(self.beta, bool)
                 and math.isfinite(self.beta) and self.beta >= 1, "beta", f"must be a number >= 1, got {self.beta!r}")
        _require(isinstance(self.min_layer_budget, int) and not isinstance(self.min_layer_budget, bool)
                 and self.min_layer_budget >= 1, "min_layer_budget",
                 f"must be a positive integer, got {self.min_layer_budget!r}")
        super().__post_init__()
        _require(self.gate.n_high >= self.floor, "n_high",
                 f"the tight budget n_high={self.gate.n_high} is the mean of a pyramid whose layers may not go "
                 f"below {self.floor} (max(min_layer_budget, protect + sinks + 1)); raise n_high or lower the floor")

    @property
    def floor(self) -> int:
        """The smallest budget any layer gets."""
        return max(self.min_layer_budget, self.protect + self.sinks + 1)

    def min_budget(self) -> int:
        return self.floor

    def max_budget(self) -> int:
        return math.ceil(2 * self.gate.n_low - self.gate.n_low / self.beta)

    def pyramid(self, mean_budget: int, num_layers: int) -> list[int]:
        """Per-layer budgets for one mean budget."""
        return pyramid_budgets(mean_budget, num_layers, float(self.beta), min_budget=self.floor)

    def layer_budgets(self, confidence: torch.Tensor, num_layers: int) -> torch.Tensor:
        tight = torch.tensor(self.pyramid(self.gate.n_high, num_layers), dtype=torch.int64)
        loose = torch.tensor(self.pyramid(self.gate.n_low, num_layers), dtype=torch.int64)
        confident = (confidence >= self.gate.tau).cpu()[:, None]
        return torch.where(confident, tight[None, :], loose[None, :])
