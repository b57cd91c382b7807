"""Forking a layer store: one shared prefill, then each policy on its own copy (see ``ConfKVCache.fork``)."""

from __future__ import annotations

from typing import Callable

import torch

from confkv.policies.base import Policy
from confkv.region import Region
from confkv.store import LayerStore


def fork_store(store: LayerStore, policy: Policy,
               stats_of: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> LayerStore:
    """An independent copy of ``store`` run by ``policy`` (:meth:`LayerStore.fork` documents the contract)."""
    twin = LayerStore(policy, store.config, sliding_window=store.sliding_window,
                      page_file=store.cold.page_file if store.cold is not None else None, storage=store.storage)
    if store.cold is not None and twin.cold is not None:
        twin.cold = store.cold.clone()
    if not store.is_initialized:
        return twin
    if store.pending:
        raise ValueError("confkv: cannot fork a store in the middle of a forward pass")

    def copy(region: Region) -> Region:
        # a sliding-window layer keeps no statistics for any policy: nothing to map
        stats = stats_of(region.stats) if stats_of is not None and twin.stat_names else region.stats
        missing = [name for name in twin.stat_names if name not in stats]
        if missing:
            raise ValueError(f"confkv: cannot fork for policy {policy.name!r}: statistics {missing} were "
                             "never collected (prefill with a TeePolicy that includes it)")
        return Region(keys=region.keys.clone(), values=region.values.clone(),
                      positions=region.positions.clone(), valid=region.valid.clone(),
                      stats={name: stats[name].clone() for name in twin.stat_names},
                      key_scale=_clone(region.key_scale), value_scale=_clone(region.value_scale),
                      dense=region.dense)

    twin.old, twin.recent = copy(store.old), copy(store.recent)
    twin.channel_scale = _clone(store.channel_scale)
    twin.seen_tokens = store.seen_tokens
    twin.seen_real = store.seen_real.clone()
    return twin


def _clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()
