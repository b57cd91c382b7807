"""The FP window's slots allocated with spare capacity, so that a decode step's append is an index write
(issue "Speed", item 1: "preallocated per-layer buffers with spare capacity").

:meth:`confkv.store.LayerStore.decode_step` keeps the recent region (``[B, Hkv, L]`` slots, see
:mod:`confkv.region`) as views of the first ``L`` slots of a :class:`WindowBuffer` of capacity
``C >= L``; a new token is written into slot ``L`` and the region becomes the views of ``L + 1``
slots, instead of concatenating every tensor of the region (a fresh copy per step). Ageing replaces
the recent region by a fresh copy; the next decode step then copies it into a new buffer. The
buffer's bytes (used or spare) are counted by the store's ``kv_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from confkv.region import Region


@dataclass
class WindowBuffer:
    """Capacity ``C`` slots for one layer's recent region.

    Attributes:
        keys, values: [B, Hkv, C, D] in the model's dtype.
        positions: [B, Hkv, C] int64; valid: [B, C] bool; stats: name -> [B, Hkv, C] float32.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    stats: dict[str, torch.Tensor]

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @classmethod
    def around(cls, region: Region, capacity: int) -> "WindowBuffer":
        """A buffer of ``capacity`` >= ``region.length`` slots holding a copy of ``region`` (full precision) in its first slots."""
        if capacity < region.length or region.key_scale is not None:
            raise ValueError(f"a window buffer holds a full-precision region in {capacity} >= {region.length} slots")
        def room(t: torch.Tensor) -> torch.Tensor:
            out = t.new_empty((*t.shape[:2], capacity, *t.shape[3:]))
            out[:, :, :t.shape[2]] = t
            return out
        valid = region.valid.new_zeros((region.valid.shape[0], capacity))
        valid[:, :region.length] = region.valid
        return cls(room(region.keys), room(region.values), room(region.positions), valid,
                   {name: room(t) for name, t in region.stats.items()})

    def backs(self, region: Region) -> bool:
        """Whether every tensor of ``region`` is the view of this buffer's first ``region.length`` slots."""
        return (region.keys.data_ptr() == self.keys.data_ptr() and region.values.data_ptr() == self.values.data_ptr()
                and region.positions.data_ptr() == self.positions.data_ptr()
                and region.valid.data_ptr() == self.valid.data_ptr() and region.stats.keys() == self.stats.keys()
                and all(t.data_ptr() == self.stats[name].data_ptr() for name, t in region.stats.items())
                and region.length <= self.capacity and region.keys.shape == (*self.keys.shape[:2], region.length,
                                                                               self.keys.shape[3]))

    def append_one(self, length: int, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> Region:
        """Write one new token per sequence into slot ``length`` (< capacity): keys and values [B, Hkv, 1, D],
        its position [B] int64, valid, zero statistics; returns the region of the first ``length + 1`` slots."""
        self.keys[:, :, length:length + 1] = keys
        self.values[:, :, length:length + 1] = values
        self.positions[:, :, length] = position[:, None]
        self.valid[:, length] = True
        for t in self.stats.values():
            t[:, :, length] = 0.0
        end = length + 1
        return Region(keys=self.keys[:, :, :end], values=self.values[:, :, :end], positions=self.positions[:, :, :end],
                      valid=self.valid[:, :end], stats={name: t[:, :, :end] for name, t in self.stats.items()},
                      dense=True)

    def nbytes(self) -> int:
        """Bytes of the keys and values of every slot, used or spare (the KV measure of :meth:`Region.nbytes`)."""
        return self.keys.nbytes + self.values.nbytes
