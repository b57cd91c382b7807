"""The per-step memory trace: a by-product of the store's exact byte accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepRecord:
    """One end-of-step snapshot.

    Attributes:
        confidence: [B] float32.
        budget: [B] int64 budget of the managed layers (their mean, for a pyramid).
        kept: [num_layers, B] int64 tokens kept per layer and sequence.
        kv_bytes: [num_layers] int64 exact KV bytes held per layer.
        seen: logical tokens fed so far (padding included).
    """

    confidence: torch.Tensor
    budget: torch.Tensor
    kept: torch.Tensor
    kv_bytes: torch.Tensor
    seen: int


@dataclass
class MemoryTrace:
    """Append-only list of :class:`StepRecord` with summaries."""

    steps: list[StepRecord] = field(default_factory=list)

    def record(self, step: StepRecord) -> None:
        self.steps.append(step)

    def __len__(self) -> int:
        return len(self.steps)

    def total_kv_bytes(self) -> list[int]:
        """Total KV bytes over layers, per step."""
        return [int(s.kv_bytes.sum()) for s in self.steps]

    def peak_kv_bytes(self) -> int:
        return max(self.total_kv_bytes(), default=0)

    def mean_kv_bytes(self) -> float:
        totals = self.total_kv_bytes()
        return sum(totals) / len(totals) if totals else 0.0

    def kept_tokens(self, sequence: int = 0) -> list[float]:
        """Mean kept tokens over layers for one sequence, per step."""
        return [float(s.kept[:, sequence].float().mean()) for s in self.steps]

    def confidences(self, sequence: int = 0) -> list[float]:
        return [float(s.confidence[sequence]) for s in self.steps]

    def to_dict(self) -> dict:
        """Plain lists, ready for JSON."""
        return {
            "seen": [s.seen for s in self.steps],
            "confidence": [s.confidence.tolist() for s in self.steps],
            "budget": [s.budget.tolist() for s in self.steps],
            "kept": [s.kept.tolist() for s in self.steps],
            "kv_bytes": [s.kv_bytes.tolist() for s in self.steps],
        }
