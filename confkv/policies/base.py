"""The eviction-policy interface shared by CONF-KV and every baseline.

A policy answers three questions for the cache, on plain tensors:

1. ``layer_budgets(confidence, num_layers)``: how many tokens each sequence may keep
   in each managed layer after this step -> [B, num_layers] int64.
2. ``observe(stats, mass, num_queries)``: fold the attention mass that the current
   queries gave each kept slot into the policy's per-slot statistics (in place).
3. ``scores(stats, positions, current_position)``: rank the slots; the highest are kept.

The cache does the rest the same way for every policy (:mod:`confkv.store.hot_tier`):
slots of the ``protect`` most recent tokens and of the first ``sinks`` tokens are
never evicted, padding slots go first, and the kept slots are compacted by one
dense gather.

Per-slot statistics live in the layer store as ``[B, Hkv, L]`` float32 tensors
named by ``stat_names``; they are gathered together with the keys and values,
so a kept token keeps its history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from confkv.config import _require

#: Budget value meaning "never evict".
UNLIMITED = 2**62


@dataclass(frozen=True)
class Policy:
    """Base class. Subclasses are frozen dataclasses registered by name.

    Attributes:
        protect: the ``P`` most recent tokens of each sequence are never evicted.
        sinks: the first ``sinks`` tokens of each sequence are never evicted
            (attention sinks, Xiao et al. 2023, "Efficient Streaming Language
            Models with Attention Sinks").
    """

    name: ClassVar[str] = "base"
    #: per-slot statistics this policy keeps (all [B, Hkv, L] float32, new slots start at 0)
    stat_names: ClassVar[tuple[str, ...]] = ()
    #: whether the attention read must return the queries' attention mass per slot
    needs_attention: ClassVar[bool] = False

    protect: int = 32
    sinks: int = 0

    def __post_init__(self) -> None:
        for field_name in ("protect", "sinks"):
            value = getattr(self, field_name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, field_name,
                     f"must be a non-negative integer, got {value!r}")
        minimum = self.min_budget()
        if minimum < UNLIMITED:
            _require(self.protect < minimum, "protect",
                     f"the protected tokens P={self.protect} must be smaller than the smallest budget "
                     f"({minimum}); lower `protect` or raise the budget")
            _require(self.protect + self.sinks < minimum, "sinks",
                     f"protect + sinks = {self.protect + self.sinks} must be smaller than the smallest budget "
                     f"({minimum}); lower `sinks`/`protect` or raise the budget")

    # -- budgets ---------------------------------------------------------------------------------
    def min_budget(self) -> int:
        """The smallest per-layer budget this policy can ask for."""
        return UNLIMITED

    def max_budget(self) -> int:
        """The largest per-layer budget this policy can ask for."""
        return UNLIMITED

    def layer_budgets(self, confidence: torch.Tensor, num_layers: int) -> torch.Tensor:
        """Budgets after this step.

        Args:
            confidence: [B] float32 in [0, 1] (ignored by policies without a gate).
            num_layers: number of managed (evictable) layers.
        Returns:
            [B, num_layers] int64.
        """
        return torch.full((confidence.shape[0], num_layers), self.max_budget(), dtype=torch.int64)

    # -- statistics ------------------------------------------------------------------------------
    def observe(self, stats: dict[str, torch.Tensor], mass: torch.Tensor, num_queries: int) -> None:
        """Update ``stats`` in place from this forward pass.

        Args:
            stats: name -> [B, Hkv, L] float32, aligned with the slots of ``mass``.
            mass: [B, Hkv, L] float32, attention probability each slot received, averaged
                over the query heads of its KV group and summed over the ``num_queries``
                queries of this pass.
            num_queries: queries in this pass (1 when decoding, the chunk during prefill).
        """

    def linear_observe(self, num_queries: int) -> dict[str, tuple[float, float]] | None:
        """``{name: (scale, gain)}`` when :meth:`observe` sets every statistic to ``stat * scale + mass * gain``
        (float32, rounded as torch's ``stat.mul_(scale).add_(mass, alpha=gain)``), so that a native
        decode step can update them itself (:mod:`confkv.native.decode`); None otherwise (the default)."""
        return None

    def observation_window(self) -> int | None:
        """Observe only the attention of a pass's last ``n`` queries (SnapKV's observation window), or None: every
        query's (the default). With ``n``, a pass of more than ``n`` queries is read once for its output and its
        last ``n`` queries again for their masses, which :meth:`observe` then gets with ``num_queries = n``."""
        return None

    def recency_scores(self, device: torch.device) -> tuple[str, float, torch.Tensor] | None:
        """``(stat, weight, table)`` when :meth:`scores` is ``stats[stat] + weight * table[min(age, len(table) - 1)]``
        (float32, each product and sum rounded as torch's ops; ``age = max(current_position - position, 0)``;
        the table's last entry 0), so that a native eviction can score slots itself (``c/evict.c``); None
        otherwise (the default)."""
        return None

    def attention_per_read(self, stats: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """[B, Hkv, L] float32: the attention each slot received per query, as estimated by ``stats`` (a pass's
        mass over all of its queries, as :meth:`observe` takes it), or None when the statistics hold no such
        estimate (the default). Orders the cold pages not yet read (:class:`confkv.tiers.storage.Storage`
        ``unread_by``; :func:`confkv.store.hot_tier.demote_dropped` scales a chunk's own tokens)."""
        return None

    def scores(self, stats: dict[str, torch.Tensor], positions: torch.Tensor,
               current_position: torch.Tensor) -> torch.Tensor:
        """Keep-priority of each slot; higher is kept first.

        Args:
            stats: name -> [B, Hkv, L] float32.
            positions: [B, Hkv, L] int64 logical position of each slot's token.
            current_position: [B] int64, position of the newest token of each sequence.
        Returns:
            [B, Hkv, L] float32.
        """
        return positions.float()
