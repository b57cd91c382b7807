"""``random``: uniform random eviction at the same budget (the ablation of METHOD.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.config import _require
from confkv.policies.fixed_budget import FixedBudgetPolicy

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (int64 tensor with values in [0, 2**32) -> same range)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def uniform_hash(seed: int, positions: torch.Tensor, current_position: torch.Tensor) -> torch.Tensor:
    """Deterministic pseudo-uniform numbers in [0, 1) for every slot, [B, Hkv, L] float32.

    A hash of ``(seed, token position, current position, KV head)``: a fresh, independent
    draw at every step, for every head, identical for identical inputs.
    """
    batch, heads, length = positions.shape
    h = _mix32(torch.full((), seed & _MASK32, dtype=torch.int64, device=positions.device))
    h = _mix32(h ^ (positions & _MASK32))
    h = _mix32(h ^ (current_position[:, None, None].to(positions.device) & _MASK32))
    h = _mix32(h ^ torch.arange(heads, dtype=torch.int64, device=positions.device)[None, :, None])
    return (h.double() / 2.0**32).float()


@dataclass(frozen=True)
class RandomPolicy(FixedBudgetPolicy):
    """Random eviction: keep ``budget`` tokens per layer, the evicted ones drawn uniformly.

    The ablation of the CONF-KV paper ("random eviction at the same ratio", METHOD.md). To
    change only the ranking, it keeps exactly CONF-KV's protection: the ``protect=32``
    most recent tokens and ``sinks=4`` first tokens are never evicted. Every other slot
    gets a score ``u ~ U[0, 1)`` drawn afresh at every eviction step::

        u = hash(seed, position, current_position, kv_head) / 2**32

    so at each step the evicted tokens are a uniformly random subset of the unprotected
    ones, independently per KV head. The draw is a pure function of its inputs (no global
    RNG is touched): the same ``seed`` gives the same evictions, another seed others. It
    does not depend on the layer (the interface does not pass it), so all layers draw
    alike, nor on the batch row (a sequence evicts the same way alone or in a batch, up to
    padding-shifted positions, which are real-token positions and so identical).
    """

    name = "random"

    seed: int = 0
    protect: int = 32
    sinks: int = 4

    def __post_init__(self) -> None:
        _require(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed",
                 f"must be an integer, got {self.seed!r}")
        super().__post_init__()

    def scores(self, stats: dict[str, torch.Tensor], positions: torch.Tensor,
               current_position: torch.Tensor) -> torch.Tensor:
        return uniform_hash(self.seed, positions, current_position)
