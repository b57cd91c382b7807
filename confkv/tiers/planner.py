"""The memory planner: from a :class:`~confkv.tiers.storage.MemoryTarget` to each step's hot budget
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
"""

from __future__ import annotations

from dataclasses import dataclass

import dataclasses
from typing import Any

import torch

from confkv.config import StoreConfig, _require
from confkv.errors import ConfigError
from confkv.tiers.byte_model import KVShape, channel_scale_bytes, fp_token_bytes
from confkv.tiers.formats import build_format
from confkv.tiers.storage import MemoryTarget, Storage

__all__ = ["StepPlan", "bottom_token_bytes", "check_cap", "floor_bytes", "floor_tokens", "fp_token_bytes", "plan_step",
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
