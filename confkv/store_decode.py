"""A layer store's decode step in place: the new token written into the FP window's preallocated slots and
read at once (:meth:`confkv.store.LayerStore.decode_step`; issue "Speed", item 1).

Where the native library takes the layer's tensors, the write, the mass read and, for a policy with a
linear statistics update, the update are one C call (:class:`confkv.native.decode.DecodePlan`);
otherwise the window's :meth:`~confkv.window_buffer.WindowBuffer.append_one`, the mass read and the
policy's ``observe`` run in Python. Either way the state and the output equal ``append`` + ``attend``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from confkv import native, profiling
from confkv.attention import KVSegment
from confkv.attention.mass_read import MAX_SCORES, mass_read
from confkv.native.decode import DecodePlan
from confkv.window_buffer import WindowBuffer

if TYPE_CHECKING:
    from confkv.store import LayerStore


def decodes_in_place(store: LayerStore, keys: torch.Tensor, query: torch.Tensor) -> bool:
    """Whether ``store``'s decode step may be taken in place: one initialised, non-pending token of a full-precision
    store without a cold tier or a sliding window, dense regions, a policy that needs the attention mass, and the
    conditions under which ``attention_read`` would take the mass read (``auto`` backend, CPU, scores that fit).

    ``attention_read``'s dispatch must stay in step with this test; ``tests/test_window_buffer.py`` compares the two
    paths' logits and state."""
    if not store.is_initialized or store.pending or keys.shape[2] != 1 or query.shape[2] != 1:
        return False
    if store.cold is not None or store.sliding_window is not None or store.int8 or not store.stat_names:
        return False
    if store.storage is not None:  # under a memory target: no spare window slots beyond the planned bytes
        return False
    if not (store.old.dense and store.recent.dense and store.policy.needs_attention):
        return False
    if store.config.read_backend != "auto" or query.device.type != "cpu" or keys.dtype != store.recent.keys.dtype:
        return False
    return query.shape[0] * query.shape[1] * (store.physical_length + 1) <= MAX_SCORES


def decode_in_place(store: LayerStore, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """The in-place decode step (the caller checked :func:`decodes_in_place`): keys and values [B, Hkv, 1, D],
    query [B, Hq, 1, D] -> [B, Hq, 1, D]. A window buffer with ``move_block`` + 1 spare slots is made when the
    window has none left (its bytes are counted by ``kv_bytes``)."""
    window, length = store.window, store.recent.length
    if window is None or length >= window.capacity or not window.backs(store.recent):
        store.window = window = WindowBuffer.around(store.recent, length + store.config.move_block + 1)
    plan = store.decode_plan
    if plan is None or not plan.serves(window, store.old):
        plan = store.decode_plan = DecodePlan.build(window, store.old, query.shape[1], store.policy.linear_observe(1))
    if (plan is not None and query.dtype == keys.dtype and keys.stride(-1) == 1 and values.stride(-1) == 1
            and store.seen_real.dtype == torch.int64):
        with profiling.section("native decode step"):
            out, masses = plan.step(query, keys, values, store.seen_real.contiguous(), length, scaling)
            store.recent = window.views(length + 1)
            store.seen_real = store.seen_real + 1
            store.seen_tokens += 1
            if masses is not None:
                for region, mass in zip((store.old, store.recent), masses):
                    store.policy.observe(region.stats, mass, 1)
        return out
    with profiling.section("append (FP window)"):
        store.recent = window.append_one(length, keys, values, store.seen_real)
        store.seen_real = store.seen_real + 1
        store.seen_tokens += 1
        regions = [r for r in (store.old, store.recent) if r.length]
    with profiling.section("attention read"):
        segments = [KVSegment(r.keys, r.values, None) for r in regions]
        read = native.mass_read(query, segments, scaling)
        out, masses = read if read is not None else mass_read(query, segments, scaling)
    with profiling.section("EMA / stats update"):
        for region, mass in zip(regions, masses):
            store.policy.observe(region.stats, mass, 1)
    return out
