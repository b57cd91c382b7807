"""Old home of the store's fork, now the method :meth:`confkv.store.LayerStore.fork` (kept for one release)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from confkv.policies.base import Policy
    from confkv.store import LayerStore


def fork_store(store: LayerStore, policy: Policy,
               stats_of: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> LayerStore:
    """Deprecated: ``store.fork(policy, stats_of)``."""
    return store.fork(policy, stats_of)
