"""A dense run of KV slots of one layer, in full precision or INT8.

All tensors share the slot axis and are gathered together, so a kept token keeps
its bytes, its scales, its position and its policy statistics bit for bit.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from confkv.attention.segments import take_rows


@dataclass
class Region:
    """Slots ``[B, Hkv, L]`` of one layer.

    Attributes:
        keys, values: [B, Hkv, L, D], the model's dtype or int8.
        key_scale, value_scale: [B, Hkv, L] float32 per-token scales, iff int8.
        positions: [B, Hkv, L] int64 logical position of each slot's token.
        valid: [B, L] bool, False for padding and for slots beyond a sequence's count.
        stats: policy statistics, name -> [B, Hkv, L] float32.
        all_valid: True only when every slot is known to be valid (``valid.all()``) without
            looking at ``valid``; lets the store skip masks and count tokens as lengths.
            False is always safe. (Its old name ``dense`` still reads and writes it, deprecated.)
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    all_valid: bool = False

    @property
    def dense(self) -> bool:
        """Deprecated name of :attr:`all_valid` (kept for one release)."""
        warnings.warn("Region.dense is now Region.all_valid", DeprecationWarning, stacklevel=2)
        return self.all_valid

    @dense.setter
    def dense(self, value: bool) -> None:
        warnings.warn("Region.dense is now Region.all_valid", DeprecationWarning, stacklevel=2)
        self.all_valid = value

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def is_int8(self) -> bool:
        return self.keys.dtype == torch.int8

    @classmethod
    def empty(cls, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
              stat_names: tuple[str, ...], int8: bool = False) -> "Region":
        storage = torch.int8 if int8 else dtype
        def slots(*tail: int, dt: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty((batch, kv_heads, 0, *tail), dtype=dt, device=device)
        return cls(
            keys=slots(head_dim, dt=storage), values=slots(head_dim, dt=storage),
            positions=slots(dt=torch.int64), valid=torch.empty((batch, 0), dtype=torch.bool, device=device),
            stats={name: slots() for name in stat_names},
            key_scale=slots() if int8 else None, value_scale=slots() if int8 else None, all_valid=True,
        )

    def _per_slot(self) -> dict[str, torch.Tensor]:
        tensors = {"keys": self.keys, "values": self.values, "positions": self.positions}
        if self.key_scale is not None:
            tensors["key_scale"] = self.key_scale
            tensors["value_scale"] = self.value_scale
        return tensors

    def gather(self, index: torch.Tensor, valid: torch.Tensor, all_valid: bool = False) -> "Region":
        """Keep the slots ``index`` [B, Hkv, K] (per head), with new validity ``valid`` [B, K]
        (``all_valid``: the caller knows ``valid`` is all True)."""
        def take(t: torch.Tensor) -> torch.Tensor:
            return take_rows(t, index) if t.ndim == 4 else t.gather(2, index)
        parts = {name: take(t) for name, t in self._per_slot().items()}
        return Region(stats={name: take(t) for name, t in self.stats.items()}, valid=valid, all_valid=all_valid, **parts)

    def slice(self, start: int, end: int, copy: bool = False) -> "Region":
        """Slots ``start:end`` (same for every head).

        With ``copy`` the result owns fresh tensors, so the parent's storage can be
        freed (a view would keep all of it alive and the byte accounting would miss it).
        """
        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[:, :, start:end].clone() if copy else t[:, :, start:end]
        parts = {name: cut(t) for name, t in self._per_slot().items()}
        valid = self.valid[:, start:end]
        return Region(stats={n: cut(t) for n, t in self.stats.items()},
                      valid=valid.clone() if copy else valid, all_valid=self.all_valid, **parts)

    def clone(self, stats: dict[str, torch.Tensor] | None = None) -> "Region":
        """A copy that shares no tensor with this region; ``stats``: other statistics (cloned too) instead of its own."""
        parts = {name: t.clone() for name, t in self._per_slot().items()}
        stats = self.stats if stats is None else stats
        return Region(stats={name: t.clone() for name, t in stats.items()}, valid=self.valid.clone(),
                      all_valid=self.all_valid, **parts)

    def nbytes(self) -> int:
        """Bytes of the stored keys and values, including per-token scales."""
        total = self.keys.nbytes + self.values.nbytes
        if self.key_scale is not None:
            total += self.key_scale.nbytes + self.value_scale.nbytes
        return total

    def bookkeeping_nbytes(self) -> int:
        """Bytes of positions, validity and policy statistics (not KV, reported apart)."""
        return self.positions.nbytes + self.valid.nbytes + sum(t.nbytes for t in self.stats.values())


def concat(first: Region, second: Region) -> Region:
    """``first`` followed by ``second`` along the slot axis (same precision)."""
    def cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        return None if a is None else torch.cat([a, b], dim=2 if a.ndim >= 3 else 1)
    return Region(
        keys=cat(first.keys, second.keys), values=cat(first.values, second.values),
        positions=cat(first.positions, second.positions), valid=torch.cat([first.valid, second.valid], dim=1),
        stats={n: cat(first.stats[n], second.stats[n]) for n in first.stats},
        key_scale=cat(first.key_scale, second.key_scale), value_scale=cat(first.value_scale, second.value_scale),
        all_valid=first.all_valid and second.all_valid,
    )


def select_batch(region: Region, index: torch.Tensor) -> Region:
    """Rows ``index`` [B'] of the batch (beam reordering, finished-sequence removal)."""
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, index.to(t.device))
    return Region(keys=pick(region.keys), values=pick(region.values), positions=pick(region.positions),
                  valid=pick(region.valid), stats={n: pick(t) for n, t in region.stats.items()},
                  key_scale=pick(region.key_scale), value_scale=pick(region.value_scale), all_valid=region.all_valid)
