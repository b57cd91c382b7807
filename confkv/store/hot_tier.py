"""The hot tier of one layer: its slots, and how tokens leave them.

**The slots** (:class:`Region`, until 5 Dec ``confkv/store/region.py``): a dense run of KV slots of one
layer, in full precision or INT8. All tensors share the slot axis and are gathered together, so a kept
token keeps its bytes, its scales, its position and its policy statistics bit for bit.

**Eviction** (once ``confkv/store/eviction.py``, ``confkv/eviction.py``, ``confkv/store/tier_moves.py``):

* Which slots are kept, one rule for every policy (:mod:`confkv.store.selection`, still imported from here).
* Where the others go: :func:`dropped_slots` names them and :func:`demote_dropped` hands them to the
  layer's cold tier (dequantized first when INT8) instead of dropping them.
* And back: a page the cold tier gives back becomes hot slots again, merged into the older region in position
  order (:mod:`confkv.store.promotion`, here until stop 67).
* The common case in one C call (:func:`split_by_rank`, ``c/evict.c``): a region of valid slots that drops the same
  number in every sequence is split into its kept and dropped slots, every per-slot tensor at once, where the
  selection above takes some 60 torch calls a layer; the C call declines (and the torch path runs) whenever its
  choice could differ from the torch path's (a tie at the boundary, a NaN, a protected slot in the way).
* A decode step's ageing with it (:func:`age_and_evict_at_once`, ``confkv_age_evict_rows``): in the steady state
  the window's oldest slots join the older region and the lowest ranked leave in the same call, the older region
  rewritten in place, where the store's ``_age`` and ``_evict`` copy it three times (stop 59, issue 32); an INT8
  older region too (stop 62); CONF-KV's scores worked out in the call, ``..._ema`` (stop 67).
"""

from __future__ import annotations

import ctypes
import warnings
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from confkv import profiling
from confkv.attention.segments import take_rows
from confkv.native import loader
from confkv.policies.base import UNLIMITED, Policy
from confkv.store.selection import dropped_slots, protected_mask, select_kept  # noqa: F401 - their old home
from confkv.tiers.cold import ColdTier

if TYPE_CHECKING:
    from confkv.store.layer import LayerStore


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
        """Slots ``start:end`` (same for every head); with ``copy`` in fresh tensors, so that the parent's storage
        can be freed (a view would keep all of it alive and the byte accounting would miss it)."""
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


def demote_dropped(cold: ColdTier, old: Region, kept_index: torch.Tensor, kept_valid: torch.Tensor,
                   channel_scale: torch.Tensor | None, dtype: torch.dtype, policy: Policy | None = None,
                   current: torch.Tensor | None = None, queries: int = 1) -> None:
    """Hand ``old``'s valid slots that are not in ``kept_index`` [B, Hkv, K] (``kept_valid`` [B, K]) to ``cold``,
    with the attention ``policy`` estimates each received per query (:meth:`Policy.attention_per_read`).

    A policy divides a pass's attention by all of its ``queries``; a token of that pass (``current`` [B]: the
    newest position) was seen only by the queries at or after it, so its estimate is scaled by ``queries /
    seen``: otherwise a prefill chunk's earlier tokens would rank above its later ones for being older.
    INT8 slots are dequantized to ``dtype`` with their per-token scales and ``channel_scale`` [B, Hkv, D].
    """
    index, valid = dropped_slots(kept_index, kept_valid, old.valid)
    if not bool(valid.any()):
        return
    demote_slots(cold, old.gather(index, valid), valid, channel_scale, dtype, policy, current, queries)


def demote_slots(cold: ColdTier, dropped: Region, valid: torch.Tensor, channel_scale: torch.Tensor | None,
                 dtype: torch.dtype, policy: Policy | None = None, current: torch.Tensor | None = None,
                 queries: int = 1) -> None:
    """Hand the slots of ``dropped`` ([B, Hkv, M], ``valid`` [B, M]) to ``cold`` (see :func:`demote_dropped`)."""
    with profiling.section("cold demotion (quantize + seal)"):
        keys, values = dropped.keys, dropped.values
        if dropped.is_int8:
            from confkv import quant  # noqa: PLC0415 - the INT8 path only

            keys = quant.dequantize_keys(keys, dropped.key_scale, channel_scale, dtype)
            values = quant.dequantize_values(values, dropped.value_scale, dtype)
        attention = policy.attention_per_read(dropped.stats) if policy is not None else None
        if attention is not None and queries > 1 and current is not None:
            seen = (current[:, None, None] - dropped.positions + 1).clamp(1, queries)
            attention = attention * (queries / seen)
        cold.demote(keys, values, dropped.positions, valid, attention)


def split_by_rank(old: Region, scores: torch.Tensor, current: torch.Tensor, protect: int, sinks: int,
                  keep: torch.Tensor) -> tuple[Region, Region] | None:
    """:func:`select_kept` (its floor of protected slots below ``keep`` not reached), then the kept and the dropped
    slots gathered (what ``old.gather`` of :func:`select_kept`'s and :func:`dropped_slots`' indices gives), in one
    C call.

    Args:
        old: a region whose every slot is valid (``all_valid``), [B, Hkv, L].
        scores: [B, Hkv, L] the policy's scores; current: [B] the newest position; protect, sinks: as
            :func:`protected_mask` takes them.
        keep: [B] slots each sequence keeps: the same in every sequence, and below L (else None).
    Returns:
        (kept [B, Hkv, L - drop], dropped [B, Hkv, drop]), both all valid, in slot order; or None where the
        torch path must decide (no native library, tensors not on CPU, a tie at the boundary between kept and
        dropped, a NaN score, or a protected slot among the lowest ``drop``: then the torch path keeps more).
    """
    evict_rows = _native_evict_rows()
    if (evict_rows is None or not old.all_valid or old.keys.device.type != "cpu"
            or old.positions.dtype != torch.int64):
        return None
    length, keeps = old.length, set(keep.tolist())
    drop = length - keeps.pop() if len(keeps) == 1 else 0
    if not 0 < drop < length:
        return None
    int8 = old.key_scale is not None
    tensors = [old.keys, old.values, old.positions] + ([old.key_scale, old.value_scale] if int8 else [])
    tensors += old.stats.values()
    batch, heads = old.positions.shape[:2]
    count, kept, dropped, sources, kept_out, dropped_out, row_bytes = len(tensors), [], [], [], [], [], []
    for tensor in tensors:  # one loop, no comprehension: this runs in every decode step of every layer
        if not tensor.is_contiguous():
            return None
        stay, leave = tensor.new_empty((batch, heads, length - drop) + tensor.shape[3:]), tensor.new_empty(
            (batch, heads, drop) + tensor.shape[3:])
        kept.append(stay)
        dropped.append(leave)
        sources.append(tensor.data_ptr())
        kept_out.append(stay.data_ptr())
        dropped_out.append(leave.data_ptr())
        row_bytes.append(tensor.element_size() * (tensor.shape[3] if tensor.ndim == 4 else 1))
    scores = scores.to(torch.float32).contiguous()
    current = current.to(torch.int64).contiguous()
    tables = [array("Q", addresses) for addresses in (sources, kept_out, dropped_out)] + [array("q", row_bytes)]
    status = evict_rows(batch, heads, length, drop, scores.data_ptr(), old.positions.data_ptr(), current.data_ptr(),
                        protect, sinks, count, *[table.buffer_info()[0] for table in tables])
    if status:
        return None
    names = list(old.stats)
    return (_region_of(kept, names, int8, old.valid.new_ones(batch, length - drop)),
            _region_of(dropped, names, int8, old.valid.new_ones(batch, drop)))


def _region_of(tensors: list[torch.Tensor], stat_names: list[str], int8: bool, valid: torch.Tensor) -> Region:
    """The region of :func:`split_by_rank`'s tensors (keys, values, positions, [key / value scales,] stats)."""
    first_stat = 5 if int8 else 3
    return Region(keys=tensors[0], values=tensors[1], positions=tensors[2], valid=valid,
                  stats=dict(zip(stat_names, tensors[first_stat:])), key_scale=tensors[3] if int8 else None,
                  value_scale=tensors[4] if int8 else None, all_valid=True)


#: the library's generation, and its eviction functions by name: looked up again only when the library's state moved,
#: so a decode step calls no code of the loader
_native_functions: dict = {"generation": None}
_I, _P = ctypes.c_int64, ctypes.c_void_p
_ARGUMENTS = {"confkv_evict_rows": [_I] * 4 + [_P] * 3 + [_I] * 3 + [_P] * 4,
              "confkv_age_evict_rows": [_I] * 6 + [_P] * 3 + [_I] * 3 + [_P] * 6,
              "confkv_age_evict_rows_ema": [_I] * 6 + [_P] * 5 + [ctypes.c_float, _P] + [_I] * 4 + [_P] * 6}


def _native(name: str):
    """The library's eviction function ``name`` (``c/evict.c``) with its argument types, or None without the library."""
    if _native_functions["generation"] != loader.generation:
        lib = loader.library()
        _native_functions.clear()
        _native_functions["generation"] = loader.generation
        for function_name, arguments in _ARGUMENTS.items():
            function = None
            if lib is not None:
                function = getattr(lib, function_name)
                function.restype, function.argtypes = ctypes.c_int, arguments
            _native_functions[function_name] = function
    return _native_functions[name]


def _native_evict_rows():  # a function of its own, so that benchmarks/evict_ab.py can switch it off
    return _native("confkv_evict_rows")


def age_and_evict_at_once(store: LayerStore, budget: torch.Tensor | None) -> bool:
    """Age ``store``'s FP window and evict its older region down to ``budget`` [B] in one C call, as
    ``store._age(force=True)`` then ``store._evict(budget)`` would, byte for byte (the dropped slots demoted
    alike). True when done; False, with nothing changed, when this step is not one it takes:
    it takes a step over its budget with every slot valid, one budget for every sequence and no eviction slack, on
    CPU; the scores are those of the concatenation the two steps would rank (an EMA and a recency table's: worked
    out in the C call), and the C call declines where its choice could differ from the torch path's (a tie at the
    boundary, a NaN score, a protected slot among the lowest). INT8: the aged slots are quantized first."""
    old, recent = store.old, store.recent
    if (budget is None or store.sliding_window is not None or store.config.evict_slack or store.int8 != old.is_int8
            or not (old.all_valid and recent.all_valid) or old.keys.device.type != "cpu"
            or (store.int8 and store.channel_scale is None)):
        return False
    aged = recent.length - store.recent_len
    keeps = set(budget.tolist())
    if aged <= 0 or len(keeps) != 1:
        return False
    length = old.length + aged
    keep = max(min(keeps.pop(), UNLIMITED) - (recent.length - aged), 0)  # slots the older region keeps
    drop = length - keep
    evict = _native("confkv_age_evict_rows")
    if evict is None or not 0 < drop < length or old.positions.dtype != torch.int64:
        return False
    window = recent
    if store.int8:  # the window quantized (codes per token: its oldest `aged` join the INT8 region as _age's would)
        with profiling.section("quantization"):
            window = store._quantize(recent)
    with profiling.section("ageing + eviction (one call)"):
        split = _age_split_scored(old, recent, window, aged, drop, store)
        if split is False:  # the policy's scores are not an EMA and a table's: scored here, split in C
            current = store.seen_real - 1  # the concatenation the two steps would rank is scored (an op may round a
            # value otherwise at another place of a tensor), not the two regions apart
            positions = torch.cat([old.positions, recent.positions[:, :, :aged]], dim=2)
            stats = {name: torch.cat([old.stats[name], recent.stats[name][:, :, :aged]], dim=2) for name in old.stats}
            scores = store.policy.scores(stats, positions, current).to(torch.float32).contiguous()
            current = current.to(torch.int64).contiguous()  # held through the call, as scores and positions are
            split = _age_split(evict, old, window, aged, drop, (scores.data_ptr(), positions.data_ptr(),
                                                                current.data_ptr()), store.policy.protect,
                               store.policy.sinks)
        if split is None:
            return False
        store.old, dropped, store.recent = split
        if store.int8:  # the window's other slots stay in full precision
            store.recent.keys, store.recent.values = (t[:, :, aged:].clone() for t in (recent.keys, recent.values))
            store.recent.key_scale = store.recent.value_scale = None
        store.window = None  # as ageing does: the next decode step makes a buffer around the new window
        if store.cold is not None:
            ranked_by_attention = store.storage is not None and store.storage.unread_by != "age"  # no call: 12 files
            current = store.seen_real - 1 if store.last_queries > 1 else None  # only a chunk's scaling reads it
            demote_slots(store.cold, dropped, dropped.valid, store.channel_scale, recent.keys.dtype,
                         store.policy if ranked_by_attention else None, current, store.last_queries)
    return True


def _age_split_scored(old: Region, recent: Region, window: Region, aged: int, drop: int,
                      store: LayerStore) -> tuple[Region, Region, Region] | None | bool:
    """:func:`_age_split` by ``confkv_age_evict_rows_ema``, which scores the slots itself where the policy's scores
    are an EMA plus a recency table's bonus (:meth:`Policy.recency_scores`; the preset's ranking, CONF-KV's), read in
    place from both regions: no concatenation, no torch op. False where it does not apply (the caller scores);
    otherwise :func:`_age_split`'s answer."""
    device = old.positions.device
    terms = store.policy.recency_scores(device)
    evict = _native("confkv_age_evict_rows_ema")
    if terms is None or evict is None:
        return False
    stat, weight, table = terms
    seen = store.seen_real
    tensors = (old.stats.get(stat), recent.stats.get(stat), old.positions, recent.positions, seen)
    if (any(t is None or not t.is_contiguous() or t.device != device for t in tensors)
            or old.stats[stat].dtype != torch.float32 or recent.stats[stat].dtype != torch.float32
            or recent.positions.dtype != torch.int64 or seen.dtype != torch.int64):
        return False
    priority = (*(t.data_ptr() for t in tensors), weight, table.data_ptr(), table.shape[0])
    return _age_split(evict, old, window, aged, drop, priority, store.policy.protect, store.policy.sinks)


def _age_split(evict, old: Region, recent: Region, aged: int, drop: int, priority: tuple, protect: int,
               sinks: int) -> tuple[Region, Region, Region] | None:
    """The C call ``evict`` (``confkv_age_evict_rows`` or ``_ema``, ``priority`` its arguments that rank the slots):
    (older region kept [B, Hkv, L - drop], dropped [B, Hkv, drop], window left [B, Hkv, W - aged]) of the
    concatenation of ``old`` [B, Hkv, L_old] and ``recent``'s first ``aged`` slots (L = L_old + aged), or None
    when it declines or a tensor is not contiguous. In the steady state (``aged == drop``) the kept slots are
    written over ``old``'s own tensors, and ``old`` itself is returned as the kept region."""
    names, int8 = list(old.stats), old.is_int8
    scales = ["key_scale", "value_scale"] if int8 else []  # INT8: each slot's scales move with its codes
    sources = [old.keys, old.values, old.positions] + [getattr(old, name) for name in scales] + [
        old.stats[name] for name in names]
    windows = [recent.keys, recent.values, recent.positions] + [getattr(recent, name) for name in scales] + [
        recent.stats[name] for name in names]
    batch, heads, length, rest = old.positions.shape[0], old.positions.shape[1], old.length + aged, recent.length - aged
    in_place = aged == drop
    kept, dropped, left, row_bytes = [], [], [], []
    for source, window in zip(sources, windows):  # one loop: this runs in every decode step of every layer
        if not (source.is_contiguous() and window.is_contiguous()) or source.dtype != window.dtype:
            return None
        tail = source.shape[3:]
        kept.append(source if in_place else source.new_empty((batch, heads, length - drop) + tail))
        dropped.append(source.new_empty((batch, heads, drop) + tail))
        left.append(source.new_empty((batch, heads, rest) + tail))
        row_bytes.append(source.element_size() * (tail[0] if tail else 1))
    # the tables as array buffers, their addresses passed (ctypes arrays built from lists cost more, every step)
    tables = [array("Q", [t.data_ptr() for t in group]) for group in (sources, windows, kept, dropped, left)]
    widths = array("q", row_bytes)
    status = evict(batch, heads, old.length, recent.length, aged, drop, *priority, protect, sinks, len(sources),
                   *[table.buffer_info()[0] for table in tables], widths.buffer_info()[0])
    if status:
        return None

    def region(tensors: list[torch.Tensor], slots: int) -> Region:
        return _region_of(tensors, names, int8, old.valid.new_ones(batch, slots))
    return old if in_place else region(kept, length - drop), region(dropped, drop), region(left, rest)
