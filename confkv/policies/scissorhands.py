"""``scissorhands``: persistence of importance over a sliding history window of queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.config import _require
from confkv.policies.fixed_budget import (FixedBudgetPolicy, check_ratio, check_recent_fits, recent_first,
                                          recent_part)

#: history bits packed in one float32 statistic (float32 holds integers < 2**24 exactly)
_BITS_PER_WORD = 24
_WORDS = 2
#: longest exact history this policy can track
MAX_HISTORY = _BITS_PER_WORD * _WORDS


@dataclass(frozen=True)
class ScissorhandsPolicy(FixedBudgetPolicy):
    """Scissorhands (Liu et al. 2023, "Scissorhands: Exploiting the Persistence of Importance
    Hypothesis for LLM KV Cache Compression at Test Time", NeurIPS 2023).

    Persistence of importance: a token that received high attention in the recent past
    will receive it again. For every kept slot and KV head, over the last ``history``
    forward passes (queries)::

        count_j = sum_{s = t - history + 1}^{t} 1[ a_s(j) > threshold ]

    where ``a_s(j)`` is the attention query ``s`` gave token ``j`` (averaged over the query
    heads of the KV group). ``threshold`` defaults to ``1 / budget``: after each eviction
    the layer holds ``budget`` tokens, so this is the uniform attention level ``1/num_kept``
    (the paper's "above average" cut). The ``n_recent = max(protect, round(recent_ratio *
    budget))`` most recent tokens are always kept (the paper's recent window); the rest of
    the budget goes to the largest counts, ties broken towards the more recent token.

    The count is *exact* over a sliding window, not a decayed approximation: each slot
    carries its last ``history`` hit bits as a shift register packed into float32 words
    (``sh_bits0``, ``sh_bits1``; 24 bits each, exact in float32, shifted in int64), plus the
    running count ``sh_count``. Each pass shifts a new bit in, and the bit that leaves the
    window is subtracted from the count. This caps ``history`` at 48 (``MAX_HISTORY``). A
    token is counted only over the passes it was in the cache for. A pass with several
    queries (a prefill chunk) counts as one history step, judged on its mean attention.
    """

    name = "scissorhands"
    stat_names = ("sh_count",) + tuple(f"sh_bits{i}" for i in range(_WORDS))
    needs_attention = True

    history: int = 32
    threshold: float | None = None
    recent_ratio: float = 0.5
    protect: int = 32
    sinks: int = 0

    def __post_init__(self) -> None:
        _require(isinstance(self.history, int) and not isinstance(self.history, bool)
                 and 1 <= self.history <= MAX_HISTORY, "history",
                 f"must be an integer in [1, {MAX_HISTORY}] (exact sliding count), got {self.history!r}")
        _require(self.threshold is None or (isinstance(self.threshold, (int, float)) and 0 <= self.threshold < 1),
                 "threshold", f"must be None (1/budget) or a number in [0, 1), got {self.threshold!r}")
        check_ratio(self.recent_ratio, "recent_ratio")
        super().__post_init__()
        check_recent_fits(self)

    @property
    def n_recent(self) -> int:
        """Tokens of the recent part of the budget."""
        return recent_part(self.budget, self.protect, self.recent_ratio)

    @property
    def effective_threshold(self) -> float:
        return 1.0 / self.budget if self.threshold is None else float(self.threshold)

    def observe(self, stats: dict[str, torch.Tensor], mass: torch.Tensor, num_queries: int) -> None:
        carry = (mass / max(num_queries, 1) > self.effective_threshold).to(torch.int64)
        entering = carry
        for i in range(_WORDS):
            bits = min(_BITS_PER_WORD, self.history - i * _BITS_PER_WORD)
            if bits <= 0:
                break
            word = stats[f"sh_bits{i}"].to(torch.int64)
            leaving = (word >> (bits - 1)) & 1
            stats[f"sh_bits{i}"].copy_((((word << 1) | carry) & ((1 << bits) - 1)).float())
            carry = leaving
        # `carry` is now the bit that left the history window
        stats["sh_count"].add_((entering - carry).float())

    def scores(self, stats: dict[str, torch.Tensor], positions: torch.Tensor,
               current_position: torch.Tensor) -> torch.Tensor:
        # recency tie-break in [0, 0.5): never outweighs one count
        recency = 0.5 * positions.float() / (current_position[:, None, None].float() + 1.0)
        return recent_first(stats["sh_count"] + recency, positions, current_position, self.n_recent)
