"""``snapkv``: the attention of an observation window, pooled along the sequence, per KV head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from confkv.config import _require
from confkv.policies.fixed_budget import FixedBudgetPolicy


@dataclass(frozen=True)
class SnapKVPolicy(FixedBudgetPolicy):
    """SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024).

    The last ``protect`` prompt tokens are the *observation window*: their queries vote for the older
    tokens, and each KV head keeps the tokens with the most votes, smoothed along the sequence::

        vote_j = (1 / Q) * sum over the pass's Q queries of softmax(q K / sqrt(d))_j   (mean over the heads
                                                                                        of the KV group)
        score_j = avg_pool1d(vote, kernel_size, stride 1, padding kernel_size // 2)_j

    The pooling keeps a selected token's neighbours with it (the paper's clustering; ``kernel_size`` 5
    and a window of 64 tokens are the defaults of the paper's code as kvpress runs it). Unlike TOVA
    each KV head ranks on its own, so heads may keep different tokens. The window itself is protected.

    The votes are those of a pass's last ``protect`` queries only (:meth:`observation_window`): a pass of
    more queries (a whole prompt through ``model.generate``, a prefill chunk) is read once for its output and
    its last ``protect`` queries again for their masses, so one prompt pass ranks as the paper's prefill
    does (``protect=0``: every query of a pass votes). SnapKV compresses once, after the prompt: the
    ``query-aware`` protocol (``confkv ruler --protocol query-aware``, ``confkv niah``) defers eviction to
    the end of the prompt, as the paper does. Under the ``streaming`` protocol each chunk is ranked by its
    own last ``protect`` queries, and a decode step under a memory target by its one query.

    Statistics ``attn`` [B, Hkv, L] float32: the last pass's mean attention per query, overwritten by
    every pass. Slots are pooled in slot order, which is position order in a store (kept slots stay in
    order; newer ones are appended), so a neighbour is the nearest kept token on either side.
    """

    name = "snapkv"
    stat_names = ("attn",)
    needs_attention = True

    protect: int = 64
    sinks: int = 0
    kernel_size: int = 5

    def __post_init__(self) -> None:
        _require(isinstance(self.kernel_size, int) and not isinstance(self.kernel_size, bool)
                 and self.kernel_size >= 1 and self.kernel_size % 2 == 1, "kernel_size",
                 f"must be a positive odd integer (a window centred on each token), got {self.kernel_size!r}")
        super().__post_init__()

    def observe(self, stats: dict[str, torch.Tensor], mass: torch.Tensor, num_queries: int) -> None:
        stats["attn"].copy_(mass / max(num_queries, 1))

    def observation_window(self) -> int | None:
        """The last ``protect`` queries of a pass vote (the window SnapKV also keeps); ``protect=0``: every query."""
        return self.protect or None

    def attention_per_read(self, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """The last pass's mean attention per query, per KV head (the votes before pooling)."""
        return stats["attn"]

    def scores(self, stats: dict[str, torch.Tensor], positions: torch.Tensor,
               current_position: torch.Tensor) -> torch.Tensor:
        votes = stats["attn"]
        if self.kernel_size == 1 or votes.shape[-1] == 0:
            return votes
        batch, heads, length = votes.shape
        pooled = F.avg_pool1d(votes.reshape(batch * heads, 1, length), self.kernel_size, stride=1,
                              padding=self.kernel_size // 2)
        return pooled.reshape(batch, heads, length)
