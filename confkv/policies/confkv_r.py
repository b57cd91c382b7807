"""``confkv-r``: CONF-KV's ranking with a cold tier; confidence gates what is read back, not what is kept."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from confkv.config import ColdConfig
from confkv.policies.confkv_fixed import ConfKVFixedPolicy
from confkv.policies.tiered import TieredPolicy


@dataclass(frozen=True)
class ConfKVRPolicy(TieredPolicy, ConfKVFixedPolicy):
    """CONF-KV with recall (this project, beyond the paper; see the issue "keep every token").

    Hot set: ``budget`` tokens per layer, ranked as CONF-KV ranks them (EMA of attention +
    recency, ``protect`` recent tokens and ``sinks`` never evicted; :class:`ConfKVPolicy`).
    Evicted tokens are demoted to the cold tier (KIVI-style low-bit pages with Quest
    digests), never deleted (unless ``cold.cold_budget`` is set).

    The confidence gate (``gate.tau``, ``gate.smoothing``, the confidence weights) picks the
    cold read budget of the next step: ``cold.k_high`` pages when ``c >= tau`` (confident),
    ``cold.k_low`` pages otherwise. ``k_high == k_low`` is the same store without a gate;
    ``k_high > k_low`` the inverted gate. The gate's ``n_high``/``n_low`` are not used.
    """

    name = "confkv-r"
    budget: int = 256
    protect: int = 32  # ConfKVPolicy's defaults (restated: TieredPolicy brings the base ones)
    sinks: int = 4
    cold: ColdConfig = field(default_factory=lambda: ColdConfig(bits=2, page_size=32, group_size=32,
                                                               k_high=4, k_low=16))

    def cold_read_pages(self, confidence: torch.Tensor) -> torch.Tensor:
        confident = confidence >= self.gate.tau
        return torch.where(confident, self.cold.k_high, self.cold.k_low).to(torch.int64)
