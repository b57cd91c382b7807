"""The FP window's slots allocated with spare capacity, so that a decode step's append is an index write
(issue "Speed", item 1: "preallocated per-layer buffers with spare capacity").

:meth:`confkv.store.LayerStore.decode_step` keeps the recent region (``[B, Hkv, L]`` slots, see
:mod:`confkv.store.hot_tier`) as views of the first ``L`` slots of a :class:`WindowBuffer` of capacity
``C >= L``; a new token is written into slot ``L`` and the region becomes the views of ``L + 1``
slots, instead of concatenating every tensor of the region (a fresh copy per step). Ageing replaces
the recent region by a fresh copy; the next decode step then copies it into a new buffer. The
buffer's bytes (used or spare) are counted by the store's ``kv_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from confkv.store.hot_tier import Region


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
    last: Region | None = field(default=None, repr=False, compare=False)  # the region append_one returned last

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @classmethod
    def around(cls, region: Region, capacity: int) -> "WindowBuffer":
        """A buffer of ``capacity`` >= ``region.length`` slots holding a copy of ``region`` (full precision) in its first slots."""
        if capacity < region.length:
            raise ValueError(f"a window buffer of {capacity} slots cannot hold a region of {region.length}")
        if region.key_scale is not None:
            raise ValueError("a window buffer holds a full-precision region, not an INT8 one")
        def room(t: torch.Tensor) -> torch.Tensor:
            out = t.new_empty((*t.shape[:2], capacity, *t.shape[3:]))
            out[:, :, :t.shape[2]] = t
            return out
        valid = region.valid.new_zeros((region.valid.shape[0], capacity))
        valid[:, :region.length] = region.valid
        return cls(room(region.keys), room(region.values), room(region.positions), valid,
                   {name: room(t) for name, t in region.stats.items()})

    def backs(self, region: Region) -> bool:
        """Whether ``region`` is the views of this buffer's first slots that :meth:`append_one` returned last
        (a store replaces its regions whole and writes into them only in place, so the object and its
        keys' and values' storage identify it)."""
        return (region is self.last and region.keys.data_ptr() == self.keys.data_ptr()
                and region.values.data_ptr() == self.values.data_ptr())

    def append_one(self, length: int, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> Region:
        """Write one new token per sequence into slot ``length`` (< capacity): keys and values [B, Hkv, 1, D],
        its position [B] int64, valid, zero statistics; returns the region of the first ``length + 1`` slots."""
        # narrow / copy_ rather than indexing: a decode step makes these calls in every layer
        self.keys.narrow(2, length, 1).copy_(keys)
        self.values.narrow(2, length, 1).copy_(values)
        self.positions.narrow(2, length, 1).copy_(position.view(-1, 1, 1))
        self.valid.narrow(1, length, 1).fill_(True)
        for t in self.stats.values():
            t.narrow(2, length, 1).zero_()
        return self.views(length + 1)

    def views(self, end: int) -> Region:
        """The region of the first ``end`` slots, as views (the one :meth:`backs` recognises from now on)."""
        self.last = Region(keys=self.keys.narrow(2, 0, end), values=self.values.narrow(2, 0, end),
                           positions=self.positions.narrow(2, 0, end), valid=self.valid.narrow(1, 0, end),
                           stats={name: t.narrow(2, 0, end) for name, t in self.stats.items()}, all_valid=True)
        return self.last

    def nbytes(self) -> int:
        """Bytes of the keys and values of every slot, used or spare (the KV measure of :meth:`Region.nbytes`)."""
        return self.keys.nbytes + self.values.nbytes
