"""The memory planner and the memory trace: what each step may hold, and what it held.

**The plan**: from a :class:`~confkv.tiers.storage.MemoryTarget` to each step's hot budget
and each layer's byte budget, computed from the stores' own byte counts (nothing is simulated).

At the end of every step, for a cache of ``B`` sequences that has seen ``T`` positions:

- ``full = sum over managed layers of B * T * fp_bytes + bytes of the sliding-window layers``, the
  bytes transformers' ``DynamicCache`` holds at this length in the model's dtype (``fp_bytes =
  2 * kv_heads * head_dim * element_size`` per token and layer), the reference of ``memory``;
- ``floor``: the smallest hot set (``floor_tokens`` per managed layer: sinks and protected recent
  tokens, the least budget the policy accepts) in full precision, plus the sliding layers;
- ``target = target_bytes(target, full, floor)``; each managed layer gets an equal share,
  ``layer = (target - sliding bytes) // managed layers``;
- the hot budget: everything while ``B * T * fp_bytes <= layer`` (a target at least the full
  cache evicts nothing), else ``hot_tokens``, or ``hot_share * layer / (B * fp_bytes)`` tokens
  with a cold ladder, or ``layer / (B * fp_bytes)`` tokens without one; never below the floor;
- with ``Storage.hot_split="keep_all"`` the ladder's hot share shrinks while the ladder could not
  otherwise keep every token: to the ``h`` with ``B * (h * fp_bytes + (T - h) * bottom_bytes + page_size *
  (fp_bytes - bottom_bytes)) <= layer`` (``bottom_bytes``: a token on the bottom rung; the open page's
  tokens in full precision), so the hot tier steps down before any token is dropped;
- after eviction each layer's cold ladder steps down until the layer holds at most ``layer`` bytes.

**The record** (:class:`StepRecord`, :class:`MemoryTrace`; until 5 Dec ``confkv/trace.py``, a path that
still imports this module): after the plan, at the end of every step, what every layer's store holds
(budget, kept tokens, exact bytes, offloaded bytes, tokens per rung), a by-product of the stores' exact
byte accounting (nothing is estimated). Every cache records it, with a memory target or without.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from confkv.config import StoreConfig, _require
from confkv.display import budget_to_json
from confkv.errors import ConfigError
from confkv.tiers.byte_model import KVShape, channel_scale_bytes, fp_token_bytes
from confkv.tiers.formats import build_format
from confkv.tiers.ladder import LadderTier
from confkv.tiers.storage import MemoryTarget, Storage

if TYPE_CHECKING:
    from confkv.store import LayerStore

__all__ = ["MemoryTrace", "StepPlan", "StepRecord", "bottom_token_bytes", "check_cap", "floor_bytes", "floor_tokens", "fp_token_bytes", "plan_step",
           "reserve_bytes", "smallest_budget", "target_bytes"]  # fp_token_bytes: from the one byte model


@dataclass(frozen=True)
class StepPlan:
    """One step's plan.

    Attributes:
        target_bytes: the bytes the whole cache may hold at the end of this step.
        full_bytes: what the full cache would hold at this length.
        layer_bytes: each managed layer's share of the target.
        hot_budget: tokens per sequence in each managed layer's hot tier (None: no eviction).
    """

    target_bytes: int
    full_bytes: int
    layer_bytes: int
    hot_budget: int | None


def plan_step(target: MemoryTarget, storage: Storage, *, batch: int, seen: int, token_bytes: int,
              managed: int, sliding_bytes: int, floor_tokens: int, reserve_bytes: int,
              bottom_token_bytes: float, reserve_held: bool) -> StepPlan:
    """The plan of one step (see the module docstring).

    Args:
        batch: sequences ``B``; seen: positions ``T`` fed so far (padding included).
        token_bytes: :func:`fp_token_bytes` of one managed layer.
        managed: managed (evictable) layers; sliding_bytes: bytes the sliding-window layers hold now.
        floor_tokens: the smallest hot budget the policy (and an INT8 store's never-evicted FP window) accepts.
        reserve_bytes: bytes each managed layer holds besides its tokens (an INT8 store's key channel scale; 0
            for others).
        bottom_token_bytes: bytes of one token of one layer on the ladder's bottom rung (its page's bytes over
            its tokens; read under ``hot_split="keep_all"`` only, 0.0 for others).
        reserve_held: False while an INT8 store that starts over budget (``int8_from="over_budget"``) holds no
            scale yet: the reserve then counts in the hot budget but not in the test for evicting nothing, so a
            target of the full cache evicts nothing.
    """
    per_layer_full = batch * seen * token_bytes
    full = managed * per_layer_full + sliding_bytes
    floor = managed * (batch * min(seen, floor_tokens) * token_bytes + reserve_bytes) + sliding_bytes
    total = target_bytes(target, full, floor)
    layer = (total - sliding_bytes) // max(managed, 1)
    if per_layer_full + reserve_bytes * reserve_held <= layer:
        return StepPlan(total, full, layer, None)
    fits = (layer - reserve_bytes) // (batch * token_bytes)
    if storage.hot_tokens is not None:
        hot = min(storage.hot_tokens, fits)
    elif storage.ladder:
        hot = int(storage.hot_share * (layer - reserve_bytes)) // (batch * token_bytes)
        gain = token_bytes - bottom_token_bytes  # what a token costs more in the hot tier than at the bottom
        if storage.hot_split == "keep_all" and gain > 0:  # (a 16-bit bottom rung costs what the hot tier does)
            spare = layer - reserve_bytes - batch * (seen * bottom_token_bytes + storage.page_size * gain)
            hot = min(hot, int(spare // (batch * gain)))
    else:
        hot = fits
    return StepPlan(total, full, layer, max(hot, floor_tokens))


def bottom_token_bytes(storage: Storage, shape: KVShape, dtype: torch.dtype) -> float:
    """Bytes of one token of one layer and sequence on ``storage``'s bottom rung: a sealed page's bytes in its
    format (codes, scales, outliers; no digest) over the page's tokens. 0.0 without a ladder."""
    if not storage.ladder:
        return 0.0
    page = build_format(storage.ladder[-1], storage.group_size, shape.head_dim, dtype, storage.format,
                        storage.outlier_fraction).page_nbytes(shape.kv_heads, shape.head_dim, storage.page_size)
    return page / storage.page_size


def target_bytes(target: MemoryTarget, full_bytes: int, floor_bytes: int) -> int:
    """The bytes the whole cache may hold at the end of a step: ``memory`` x ``full_bytes`` (the full cache's
    bytes at this length), or ``max_kv_bytes``; never below ``floor_bytes`` (the cache's floor).

    Raises:
        ConfigError: ``max_kv_bytes`` is below the floor (named, with the smallest cap that fits).
    """
    if target.memory is not None:
        return max(int(target.memory * full_bytes), floor_bytes)
    check_cap(target.max_kv_bytes, floor_bytes)  # type: ignore[arg-type]
    return target.max_kv_bytes  # type: ignore[return-value]


def check_cap(max_kv_bytes: int, floor_bytes: int) -> None:
    """Raise :class:`~confkv.errors.ConfigError` when a cap cannot hold the smallest hot set."""
    _require(max_kv_bytes >= floor_bytes, "max_kv_bytes",
             f"{max_kv_bytes} bytes cannot hold the smallest hot set of this cache ({floor_bytes} bytes: the sinks "
             f"and protected recent tokens of every layer in full precision, plus sliding-window layers); "
             f"give max_kv_bytes >= {floor_bytes}, or lower the policy's protect / sinks")


def smallest_budget(policy: Any, search: int = 4096) -> int:
    """The smallest per-layer budget ``policy`` accepts (``protect + sinks + 1`` for most policies;
    more when the policy's own checks ask it, e.g. H2O's recent share). The floor of a memory target."""
    start = policy.protect + policy.sinks + 1
    if not any(f.name == "budget" for f in dataclasses.fields(policy)):
        return start
    for budget in range(start, start + search):
        try:
            dataclasses.replace(policy, budget=budget)
        except ConfigError:
            continue
        return budget
    raise ConfigError(f"policy: no budget in [{start}, {start + search}) is valid for {policy.name!r}")


def floor_tokens(policy: Any, store: StoreConfig) -> int:
    """The smallest hot budget under a memory target: the policy's (:func:`smallest_budget`), or an INT8 store's
    never-evicted full-precision window plus the sinks (:func:`confkv.store.check_store_fits`), whichever is larger."""
    smallest = smallest_budget(policy)
    return max(smallest, store.fp_window + policy.sinks + 1) if store.kv_int8 else smallest


def reserve_bytes(shape: KVShape, store: StoreConfig) -> int:
    """Bytes a managed layer of one sequence holds besides its tokens: an INT8 store's frozen key channel scale."""
    return channel_scale_bytes(shape.kv_heads, shape.head_dim) if store.kv_int8 else 0


def floor_bytes(shape: KVShape, layout: Any, tokens: int, store: StoreConfig, batch: int = 1) -> int:
    """The floor of a memory target: ``tokens`` hot tokens in the model's dtype and the reserve in
    every managed layer, plus full sliding windows, for ``batch`` sequences (``layout``: a
    :class:`~confkv.hf.support.LayerLayout`, anything with ``managed`` and ``sliding_windows``)."""
    sliding = sum(w - 1 for w in layout.sliding_windows if w is not None)
    per_sequence = len(layout.managed) * (tokens * shape.token_bytes + reserve_bytes(shape, store))
    return batch * (per_sequence + sliding * shape.token_bytes)


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
