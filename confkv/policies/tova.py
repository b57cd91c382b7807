"""``tova``: Token Omission Via Attention, the current query's attention only."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.policies.fixed_budget import FixedBudgetPolicy


@dataclass(frozen=True)
class TOVAPolicy(FixedBudgetPolicy):
    """TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs", EMNLP 2024).

    At every step, when the layer holds more than ``budget`` tokens, drop the tokens with
    the lowest attention from the *current* query, averaged over all heads of the layer::

        score_j = (1 / H) * sum_h softmax(q_t^h K^h / sqrt(d))_j

    No accumulation: the statistic ``attn`` is overwritten by every forward pass. All KV
    heads of a layer get the same score, so they keep the same tokens. For a pass with
    several queries (a prefill chunk) the score is the chunk's mean attention.

    Defaults follow the paper: no recent window (``protect=0``) and no sinks. The store
    still never evicts its FP window (``fp_window`` tokens with ``kv_int8``), which then acts
    as a recent window.
    """

    name = "tova"
    stat_names = ("attn",)
    needs_attention = True

    protect: int = 0
    sinks: int = 0

    def observe(self, stats: dict[str, torch.Tensor], mass: torch.Tensor, num_queries: int) -> None:
        layer_mean = mass.mean(dim=1, keepdim=True) / max(num_queries, 1)  # [B, 1, L]
        stats["attn"].copy_(layer_mean.expand_as(mass))

    def attention_per_read(self, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """The last pass's mean attention per query (its score)."""
        return stats["attn"]

    def scores(self, stats: dict[str, torch.Tensor], positions: torch.Tensor,
               current_position: torch.Tensor) -> torch.Tensor:
        return stats["attn"]
