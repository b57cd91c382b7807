"""``quest``: every token kept in full precision, a fixed number of pages read per step (the read-side anchor)."""

from __future__ import annotations

from dataclasses import dataclass, field

from confkv.config import ColdConfig
from confkv.policies.streaming import StreamingPolicy
from confkv.policies.tiered import TieredPolicy


@dataclass(frozen=True)
class QuestPolicy(TieredPolicy, StreamingPolicy):
    """Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
    Inference"): nothing is deleted and nothing is quantized; each step reads the ``sinks``
    first tokens, the ``budget - sinks`` most recent ones, and the ``cold.k_low`` pages of
    ``cold.page_size`` older tokens whose per-channel key min/max digest bounds the current
    query's score highest. Memory is the whole cache (``cold.bits = 16``); the saving is in
    what each step reads.
    """

    name = "quest"
    budget: int = 256
    protect: int = 0  # StreamingPolicy's defaults (restated: TieredPolicy brings the base ones)
    sinks: int = 4
    cold: ColdConfig = field(default_factory=lambda: ColdConfig(bits=16, page_size=16, group_size=16,
                                                               k_high=16, k_low=16))
