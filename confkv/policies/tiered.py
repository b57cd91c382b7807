"""Shared piece of the tiered policies (``confkv-r``, ``quest``, ``kivi``): a cold tier.

Not a policy itself. A tiered policy keeps the usual hot set (its ``budget``, ranked as
its base policy ranks) and demotes what the hot set evicts to a cold tier of low-bit
pages (:class:`~confkv.config.ColdConfig`, :mod:`confkv.tiers.cold`) instead of deleting it.
The policy decides how many cold pages each step reads (:meth:`cold_read_pages`); the
tier decides how they are stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from confkv.config import ColdConfig, _require
from confkv.policies.base import Policy


@dataclass(frozen=True)
class TieredPolicy(Policy):
    """Adds ``cold`` (the cold tier's settings) and the read budget per step.

    Without a confidence gate every step reads ``cold.k_low`` pages.
    """

    cold: ColdConfig = field(default_factory=ColdConfig)

    def __post_init__(self) -> None:
        _require(isinstance(self.cold, ColdConfig), "cold", f"must be a ColdConfig, got {type(self.cold).__name__}")
        super().__post_init__()

    def cold_read_pages(self, confidence: torch.Tensor) -> torch.Tensor:
        """Cold pages each sequence reads at the next step: confidence [B] -> [B] int64."""
        return torch.full(confidence.shape, self.cold.k_low, dtype=torch.int64, device=confidence.device)

    def first_read_pages(self) -> int:
        """Pages read before any confidence exists (the prompt's first chunk): the uncertain budget."""
        return self.cold.k_low
