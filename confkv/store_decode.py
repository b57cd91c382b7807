"""Old home of the store's in-place decode step, now methods of :class:`confkv.store.LayerStore` (kept for one
release): the check :meth:`~confkv.store.LayerStore.can_decode_in_place` and the step itself, taken by
:meth:`~confkv.store.LayerStore.decode_step`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from confkv.store import LayerStore


def decodes_in_place(store: LayerStore, keys: torch.Tensor, query: torch.Tensor) -> bool:
    """Deprecated: ``store.can_decode_in_place(keys, query)``."""
    return store.can_decode_in_place(keys, query)


def decode_in_place(store: LayerStore, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """Deprecated: ``store.decode_step(keys, values, query, scaling=scaling)`` (which checks first)."""
    return store._decode_in_place(keys, values, query, scaling)
