"""The per-step memory trace: a by-product of the store's exact byte accounting."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from confkv.display import budget_to_json
from confkv.tiers.ladder import LadderTier

if TYPE_CHECKING:
    from confkv.store import LayerStore


@dataclass
class StepRecord:
    """One end-of-step snapshot.

    Attributes:
        confidence: [B] float32; NaN at a step that did not work it out (a cache without
            ``record_confidence`` works it out only at steps that use it).
        budget: [B] int64 budget of the managed layers (their mean, for a pyramid).
        kept: [num_layers, B] int64 tokens kept per layer and sequence.
        kv_bytes: [num_layers] int64 exact KV bytes held per layer.
        seen: logical tokens fed so far (padding included).
        cold_bytes_read: cold-tier bytes the step's attention reads took (tiered policies).
        offloaded_bytes: of ``kv_bytes``, the bytes kept in the page file rather than RAM.
        target_bytes: the memory target of the step (all layers), or None without one.
        rung_tokens: token slots (summed over sequences) on each rung of the cold ladders, top rung
            first (its open page included), all layers; empty without a ladder.
    """

    confidence: torch.Tensor
    budget: torch.Tensor
    kept: torch.Tensor
    kv_bytes: torch.Tensor
    seen: int
    cold_bytes_read: int = 0
    offloaded_bytes: int = 0
    target_bytes: int | None = None
    rung_tokens: tuple[int, ...] = ()

    @classmethod
    def of_stores(cls, stores: list[LayerStore], confidence: torch.Tensor, budget: torch.Tensor,
                  target_bytes: int | None) -> StepRecord:
        """The record of the step that just ended, from every layer's store (index = layer).

        Args:
            confidence: [B] the step's confidence (any device).
            budget: [B, managed] the budgets the step ran with (recorded as their mean).
        """
        ladders = [s.cold for s in stores if isinstance(s.cold, LadderTier)]
        rungs = tuple(map(sum, zip(*(ladder.rung_slot_counts() for ladder in ladders)))) if ladders else ()
        return cls(target_bytes=target_bytes, rung_tokens=rungs,
                   confidence=confidence.cpu(), budget=budget.float().mean(-1).round().long().cpu(),
                   kept=torch.tensor([s.kept_list() for s in stores], dtype=torch.int64),
                   kv_bytes=torch.tensor([s.kv_bytes() for s in stores], dtype=torch.int64),
                   seen=stores[0].seen_tokens,
                   cold_bytes_read=sum(s.cold.bytes_read for s in stores if s.cold is not None),
                   offloaded_bytes=sum(s.offloaded_bytes() for s in stores))


@dataclass
class MemoryTrace:
    """The list of :class:`StepRecord` with summaries.

    Attributes:
        steps: the records kept, oldest first.
        max_steps: keep only the newest ``max_steps`` records (None: all). For streams
            that never end: memory stays bounded, while :meth:`peak_kv_bytes`,
            :meth:`mean_kv_bytes` and :attr:`recorded` still cover every step (running
            totals of the dropped records).
    """

    steps: list[StepRecord] = field(default_factory=list)
    max_steps: int | None = None
    dropped: int = 0  # records dropped by max_steps
    _dropped_sum: int = 0
    _dropped_peak: int = 0
    _dropped_resident_peak: int = 0

    def __post_init__(self) -> None:
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int)
                                           or self.max_steps < 1):
            raise ValueError(f"trace max_steps must be a positive integer or None, got {self.max_steps!r}")

    def record(self, step: StepRecord) -> None:
        self.steps.append(step)
        if self.max_steps is not None and len(self.steps) > self.max_steps:
            old = self.steps.pop(0)
            total = int(old.kv_bytes.sum())
            self.dropped += 1
            self._dropped_sum += total
            self._dropped_peak = max(self._dropped_peak, total)
            self._dropped_resident_peak = max(self._dropped_resident_peak, total - old.offloaded_bytes)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def recorded(self) -> int:
        """Steps recorded since the start, dropped ones included."""
        return self.dropped + len(self.steps)

    def total_kv_bytes(self) -> list[int]:
        """Total KV bytes over layers, per kept step."""
        return [int(s.kv_bytes.sum()) for s in self.steps]

    def peak_kv_bytes(self) -> int:
        """Largest total KV bytes of any step, dropped ones included."""
        return max(self.total_kv_bytes() + [self._dropped_peak], default=0)

    def peak_resident_bytes(self) -> int:
        """Largest KV bytes in RAM of any step: the total less the page file's (offloaded) bytes."""
        resident = [int(s.kv_bytes.sum()) - s.offloaded_bytes for s in self.steps]
        return max(resident + [self._dropped_resident_peak], default=0)

    def mean_kv_bytes(self) -> float:
        """Mean total KV bytes over every step, dropped ones included."""
        totals = self.total_kv_bytes()
        count = len(totals) + self.dropped
        return (sum(totals) + self._dropped_sum) / count if count else 0.0

    def kept_tokens(self, sequence: int = 0) -> list[float]:
        """Mean kept tokens over layers for one sequence, per step."""
        return [float(s.kept[:, sequence].float().mean()) for s in self.steps]

    def confidences(self, sequence: int = 0) -> list[float]:
        return [float(s.confidence[sequence]) for s in self.steps]

    def to_dict(self) -> dict:
        """Plain lists, ready for JSON (an unlimited budget is written ``"unlimited"``)."""
        return {
            "seen": [s.seen for s in self.steps],
            "confidence": [[None if math.isnan(c) else c for c in s.confidence.tolist()] for s in self.steps],
            "budget": [budget_to_json(s.budget.tolist()) for s in self.steps],
            "kept": [s.kept.tolist() for s in self.steps],
            "kv_bytes": [s.kv_bytes.tolist() for s in self.steps],
            "cold_bytes_read": [s.cold_bytes_read for s in self.steps],
            "offloaded_bytes": [s.offloaded_bytes for s in self.steps],
            "target_bytes": [s.target_bytes for s in self.steps],
            "rung_tokens": [list(s.rung_tokens) for s in self.steps],
        }
