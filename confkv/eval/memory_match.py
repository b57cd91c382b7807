"""Memory matching: KV bytes predicted without a model forward, and the budget that fits a target.

:func:`simulate_kv_bytes` replays the store's bookkeeping step by step (tokens appended, FP
window ageing in ``move_block`` groups, INT8 for older tokens with per-token scales and one
frozen channel scale per layer, the cold tier's pages, eviction to the policy's per-layer
budgets) from bytes per token (:class:`BytesModel`). :func:`match_budget` searches a policy's
budget whose predicted peak or mean bytes are the largest not exceeding a target; the sweeps
(:mod:`confkv.eval.sweep`) and the NIAH budgets (:mod:`confkv.eval.niah.budgets`) use it.
Bytes are counted at the end of each step, when a layer holds its budget (README, "What a
budget counts").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from confkv.config import StoreConfig
from confkv.errors import ConfKVError
from confkv.policies.tiered import TieredPolicy
from confkv.policies import POLICIES, UNLIMITED, Policy, make_policy

GATED = ("confkv", "confkv-l")


@dataclass(frozen=True)
class BytesModel:
    """Bytes per token of one sequence, per layer, as the store counts them."""

    sliding_windows: tuple[int | None, ...]
    fp_bytes: int  # K+V of one full-precision token, one layer
    int8_bytes: int  # K+V of one INT8 token incl. per-token scales, one layer
    channel_scale_bytes: int  # one layer's frozen key channel scale
    kv_heads: int = 0  # for the cold tier's page bytes (tiered policies)
    head_dim: int = 0
    element_size: int = 2  # bytes of one element in the model's dtype

    @classmethod
    def for_model(cls, model: Any) -> "BytesModel":
        from confkv import quant
        from confkv.hf.support import layer_layout, text_config

        layout = layer_layout(model.config)
        config = text_config(model.config)
        heads = getattr(config, "num_attention_heads", None) or config.n_head
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        hidden = getattr(config, "hidden_size", None) or config.n_embd
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        dtype = next(model.parameters()).dtype
        return cls(layout.sliding_windows, quant.fp_bytes_per_token(kv_heads, head_dim, dtype),
                   quant.int8_bytes_per_token(kv_heads, head_dim), quant.channel_scale_bytes(kv_heads, head_dim),
                   kv_heads, head_dim, torch.empty((), dtype=dtype).element_size())

    @property
    def managed(self) -> int:
        return sum(1 for w in self.sliding_windows if w is None)


def simulate_kv_bytes(policy: Policy, bytes_model: BytesModel, steps: int, store: StoreConfig | None = None,
                      confidences: Sequence[float] | None = None, *, resident: bool = False) -> np.ndarray:
    """Predicted KV bytes (all layers, one sequence) after each of ``steps`` single-token steps.

    Replays :class:`confkv.store.LayerStore`'s ageing/eviction bookkeeping (``evict_slack``
    included); ``confidences`` (one per step, default 0 = uncertain) drive gated budgets.
    A tiered policy's evicted tokens go to its cold tier: an FP open page, then sealed
    pages of :func:`confkv.lowbit.page_bytes` each, at most ``cold.cold_budget`` tokens.
    With ``resident=True`` an offloaded cold tier (``cold.offload``) counts only what stays
    in RAM: a sealed page's digest (its codes and scales live in the page file), as
    ``kv_bytes() - offloaded_bytes()`` does.
    """
    store = store or StoreConfig()
    managed = bytes_model.managed
    from confkv.store import LayerStore

    recent_len = LayerStore(policy, store).recent_len  # the store's own rule for its never-evicted FP window
    old_bytes = bytes_model.int8_bytes if store.kv_int8 else bytes_model.fp_bytes
    recent = np.zeros(managed, dtype=np.int64)
    old = np.zeros(managed, dtype=np.int64)
    scaled = np.zeros(managed, dtype=bool)
    sliding = [w for w in bytes_model.sliding_windows if w is not None]
    cold = policy.cold if isinstance(policy, TieredPolicy) else None
    if cold is not None:
        from confkv.tiers.formats import format_for

        dtype = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32}[bytes_model.element_size]
        page_format = format_for(cold, bytes_model.head_dim, dtype)
        page_data = page_format.page_nbytes(bytes_model.kv_heads, bytes_model.head_dim, cold.page_size)  # side bytes too
        layer_state = page_format.layer_nbytes()  # codebooks: once per layer whose cold tier has started
        started = np.zeros(managed, dtype=bool)
        digest = 2 * bytes_model.kv_heads * bytes_model.head_dim * 2 if cold.needs_digest else 0
        page_bytes = digest if resident and cold.offload else page_data + digest  # offloaded: only the digest stays
        open_page = np.zeros(managed, dtype=np.int64)
        pages = np.zeros(managed, dtype=np.int64)
    out = np.empty(steps, dtype=np.float64)
    if confidences is not None and len(confidences) < steps:
        raise ValueError(f"{len(confidences)} confidences for {steps} steps")
    cache: dict[float, np.ndarray] = {}
    for t in range(steps):
        c = float(confidences[t]) if confidences is not None else 0.0
        key = c if policy.name in GATED else 0.0
        budget = cache.get(key)
        if budget is None:
            budget = policy.layer_budgets(torch.tensor([key], dtype=torch.float32), managed)[0].numpy()
            budget = np.minimum(budget, UNLIMITED)
            cache[key] = budget
        recent += 1
        over = (recent + old) > budget
        surplus = recent - recent_len
        move = (surplus > 0) & ((surplus >= store.move_block) | over)
        old = np.where(move, old + surplus, old)
        recent = np.where(move, recent_len, recent)
        scaled |= move & store.kv_int8
        keep_old = np.maximum(budget - recent, 0)
        if store.evict_slack:  # a layer over budget evicts down to budget - slack (StoreConfig.evict_slack)
            keep_old = np.where(old > keep_old, np.maximum(keep_old - store.evict_slack, 0), keep_old)
        floor = min(policy.sinks, t + 1)  # sinks are never evicted
        kept_old = np.minimum(old, np.maximum(keep_old, np.minimum(old, floor)))
        if cold is not None:  # the evicted tokens are demoted
            started |= (old - kept_old) > 0
            open_page += old - kept_old
            pages += open_page // cold.page_size
            open_page %= cold.page_size
            if cold.cold_budget is not None:
                pages = np.minimum(pages, np.maximum((cold.cold_budget - open_page) // cold.page_size, 0))
        old = kept_old
        total = int((recent * bytes_model.fp_bytes + old * old_bytes).sum())
        if cold is not None:
            total += int((open_page * bytes_model.fp_bytes + pages * page_bytes).sum()) + int(started.sum()) * layer_state
        total += int(scaled.sum()) * bytes_model.channel_scale_bytes
        total += sum(min(t + 1, w - 1) for w in sliding) * bytes_model.fp_bytes
        out[t] = total
    return out


def reference_bytes(bytes_model: BytesModel, window: int, steps: int, stat: str) -> float:
    """Peak or mean KV bytes of a full-precision ``window``-token sliding window over ``steps`` steps."""
    trace = simulate_kv_bytes(make_policy("window", budget=window), bytes_model, steps, StoreConfig())
    return float(trace.max() if stat == "peak" else trace.mean())


def _budget_params(name: str, n: int, ratio: float, *, cold: bool = False) -> dict[str, Any]:
    if cold:
        return {"cold_budget": n}
    if name in GATED:
        return {"n_low": n, "n_high": max(1, round(ratio * n))}
    return {"budget": n}


def matches_cold_budget(policy_name: str, extra: dict[str, Any] | None) -> bool:
    """True when matching searches a tiered policy's ``cold_budget`` rather than its hot budget.

    That is the case when ``extra`` fixes the hot ``budget`` of a policy with a cold tier and
    leaves ``cold_budget`` free: the bytes left over by the fixed hot tier go to low-bit pages.
    """
    extra = extra or {}
    return (policy_name in POLICIES and hasattr(POLICIES[policy_name], "cold_read_pages")
            and "budget" in extra and "cold_budget" not in extra)


def match_budget(policy_name: str, target_bytes: float, bytes_model: BytesModel, steps: int, *,
                 stat: str = "peak", store: StoreConfig | None = None, ratio: float = 0.5,
                 confidences: Sequence[float] | None = None, extra: dict[str, Any] | None = None,
                 max_tokens: int = 1 << 20, resident: bool = False) -> tuple[dict[str, Any], float]:
    """Budget parameters for ``policy_name`` whose predicted ``stat`` KV bytes are the largest <= ``target_bytes``.

    ``resident=True``: an offloaded cold tier's sealed pages count only their digests (the
    bytes that stay in RAM; :func:`simulate_kv_bytes`). Returns ``(params, predicted_bytes)``;
    params are the policy's budget fields (``budget``, or ``n_low``/``n_high`` for gated
    policies) merged with ``extra``. A tiered policy whose hot ``budget`` is fixed in ``extra``
    gets its ``cold_budget`` searched instead (:func:`matches_cold_budget`).
    Raises :class:`ConfKVError` when even the smallest valid budget exceeds the target.
    """
    extra = dict(extra or {})
    if policy_name == "full":
        trace = simulate_kv_bytes(make_policy("full", **extra), bytes_model, steps, store, confidences)
        return extra, float(trace.max() if stat == "peak" else trace.mean())
    fields = {f.name: f.default for f in dataclasses.fields(POLICIES[policy_name])}
    if store is not None and store.kv_int8 and "min_layer_budget" in fields and "min_layer_budget" not in extra:
        # a pyramid's smallest layer budget must hold the never-evicted FP window and the sinks
        sinks = extra.get("sinks", fields["sinks"])
        extra["min_layer_budget"] = max(fields["min_layer_budget"], store.fp_window + sinks + 1)

    cold = matches_cold_budget(policy_name, extra)

    def predicted(n: int) -> float | None:
        try:
            policy = make_policy(policy_name, **{**extra, **_budget_params(policy_name, n, ratio, cold=cold)})
            if store is not None and store.kv_int8 and store.fp_window + policy.sinks >= policy.min_budget():
                return None
        except ConfKVError:
            return None
        trace = simulate_kv_bytes(policy, bytes_model, steps, store, confidences, resident=resident)
        return float(trace.max() if stat == "peak" else trace.mean())

    low, high = 1, max_tokens
    while low <= high and predicted(low) is None:  # smallest valid budget (validation is monotone)
        low = low * 2 if low < 64 else low + 64
        if low > high:
            break
    # refine the smallest valid budget downwards
    lo_valid = low
    step = max(1, low // 2)
    while step >= 1:
        if lo_valid - step >= 1 and predicted(lo_valid - step) is not None:
            lo_valid -= step
        else:
            step //= 2
    first = predicted(lo_valid)
    if first is None:
        raise ConfKVError(f"{policy_name}: no budget up to {max_tokens} tokens is valid with {extra or 'its defaults'}"
                          + (f" and an INT8 store (FP window {store.fp_window})" if store is not None and store.kv_int8
                             else "") + "; check the policy's parameters (make_policy names the failing one)")
    if first > target_bytes:
        raise ConfKVError(f"{policy_name}: even the smallest valid budget ({lo_valid}) needs {first:.0f} B > "
                          f"target {target_bytes:.0f} B; use a larger reference window")
    lo, hi = lo_valid, min(max_tokens, max(lo_valid, steps + 1))
    if (predicted(hi) or math.inf) <= target_bytes:
        lo = hi
    while lo < hi:  # largest n with predicted(n) <= target
        mid = (lo + hi + 1) // 2
        value = predicted(mid)
        if value is not None and value <= target_bytes:
            lo = mid
        else:
            hi = mid - 1
    return {**extra, **_budget_params(policy_name, lo, ratio, cold=cold)}, float(predicted(lo))

