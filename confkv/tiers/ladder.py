"""The cold tier as a ladder of bit widths: pages step down before anything is dropped.

Layout (one layer): one :class:`~confkv.tiers.cold.ColdTier` per rung, top rung first::

    rung 0 (e.g. 8 bits)  open page [B, H, S, D] model dtype + sealed pages [B, H, N0, ...]
    rung 1 (4 bits)       sealed pages [B, H, N1, ...]
    ...                   ...
    rung k (2 bits)       sealed pages [B, H, Nk, ...]

Tokens the hot tier lets go enter rung 0 (its open page, sealed at rung 0's bits when full).
:meth:`LadderTier.fit` brings the tier under a byte budget: while over, the least valuable page
of each KV head on one of the rungs above the bottom is re-quantized one rung down (MiKV, Yang et
al. 2024, "No Token Left Behind"); which rung gives it is ``Storage.step_order``: by default the
one where that page's value times the growth of the quantization error per byte freed is least,
so that a cheap step (8 -> 4 bits) is taken on a warm page before a costly one (3 -> 2) on a cold
page. Only when every page is at the bottom are the least valuable bottom pages dropped. When no page is
left, an open page that costs more than a bottom page is sealed early (a partial page, then stepped
down); a smaller one loses its oldest slots, as few as the budget needs. Every page of every rung is
read at every step (reading all pages beat every top-k at equal bytes; results/archive/tiered).
Each head keeps the same number of pages on each rung, so a rung stays one dense tensor.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from confkv import profiling
from confkv.tiers import lowbit
from confkv.tiers.cold import ColdTier
from confkv.tiers.cold_read import open_slot_bytes
from confkv.config import ALL_PAGES, ColdConfig
from confkv.tiers.page_file import PageFile
from confkv.tiers.storage import Storage


class LadderTier:
    """A layer's cold tier on the bit ladder of ``storage`` (see the module docstring).

    Offers the part of :class:`ColdTier`'s interface the layer store uses (``demote``,
    ``segments``, ``observe_read``, byte and token counts, batch selection, cloning).
    """

    def __init__(self, storage: Storage, page_file: PageFile | None = None) -> None:
        self.storage = storage
        self.page_file = page_file if storage.offload else None
        self.rungs = [ColdTier(ColdConfig(bits=bits, page_size=storage.page_size, group_size=storage.group_size,
                                          k_high=ALL_PAGES, k_low=ALL_PAGES, format=storage.format,
                                          outlier_fraction=storage.outlier_fraction, open_bits=storage.open_bits,
                                          rotation_seed=storage.rotation_seed),
                               self.page_file)
                      for bits in storage.ladder]
        for rung in self.rungs:
            rung.exact_capacity = True  # every allocated page counted: the target is on bytes held
        self.config = self.rungs[0].config  # promotion is off (config.promote is None)
        self._read_counts: list[int] = []

    @property
    def top(self) -> ColdTier:
        return self.rungs[0]

    @property
    def rope(self):
        """The model's rotary embedding, for page formats that store keys before it (every rung)."""
        return self.top.rope

    @rope.setter
    def rope(self, value) -> None:
        for rung in self.rungs:
            rung.rope = value

    def read_rotation(self, turns_pages: bool = False):
        """The rotation a read may fold into the query and output (pages left rotated on every rung), or None.

        Not None only when some rung holds pages and every rung that has a format has the same
        rotation and folds it (every rung's format is the storage's, so a ladder of one rotated format
        qualifies; a 16-bit rung, which has none, does not). ``turns_pages`` (the native page read,
        which turns the query itself): None when every rung's pages are read packed in their rotation
        (``kivi+hadamard``: the pages carry it, :meth:`ColdTier.read_rotation`).
        """
        if not any(rung.num_pages for rung in self.rungs):
            return None
        built = [rung for rung in self.rungs if rung.format is not None]
        if turns_pages and all(rung.format.paged_when_rotated for rung in built):
            return None
        rotations = [rung.format.read_rotation for rung in built]
        first = rotations[0]
        if first is None or not all(rung.fold_rotation for rung in built):
            return None
        return first if all(r is first for r in rotations[1:]) else None  # one object per head size (shared_rotation)

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def bytes_read(self) -> int:
        return sum(rung.bytes_read for rung in self.rungs)

    def token_count(self) -> Tensor | None:
        """[B] int64 valid tokens held on every rung, or None before the first demotion."""
        counts = [rung.token_count() for rung in self.rungs if rung.open is not None]
        return None if not counts else torch.stack(counts).sum(0)

    def rung_slot_counts(self) -> list[int]:
        """Token slots held on each rung, summed over the batch (the open page counted on the top rung).

        Counted from page counts, without reading a tensor (it runs every step for the trace): a slot of a
        left-padded sequence's page that holds no token is counted too (:meth:`token_count` counts tokens).
        """
        out = []
        for rung in self.rungs:
            if rung.open is None:
                out.append(0)
                continue
            batch = rung.open["keys"].shape[0]
            out.append(batch * (rung.num_pages * rung.config.page_size + rung.open_length))
        return out

    def kv_bytes(self) -> int:
        return sum(rung.kv_bytes() for rung in self.rungs)

    def offloaded_bytes(self) -> int:
        return sum(rung.offloaded_bytes() for rung in self.rungs)

    def bookkeeping_bytes(self) -> int:
        return sum(rung.bookkeeping_bytes() for rung in self.rungs)

    # -- demotion and reading --------------------------------------------------------------------
    def demote(self, keys: Tensor, values: Tensor, positions: Tensor, valid: Tensor,
               attention: Tensor | None = None) -> None:
        """Take tokens the hot tier lets go ([B, H, M, D], positions [B, H, M], valid [B, M]; ``attention``
        [B, H, M] or None: what each received per query while hot) on the top rung."""
        self.top.demote(keys, values, positions, valid, attention)

    def set_confidence(self, confidence: Tensor | None) -> None:
        """The model's confidence [B] at this step, recorded on the pages sealed now."""
        self.top.step_confidence = confidence

    def segments(self, query: Tensor, read_pages: Tensor, paged: bool = False, rotated: bool = False) -> list:
        """Every rung's read segments (open page, then its pages), rung by rung; all pages are read.
        ``rotated`` (only when :meth:`read_rotation` is not None): in that rotation's basis."""
        out: list = []
        self._read_counts = []
        every = torch.full_like(read_pages, ALL_PAGES)
        for rung in self.rungs:
            parts = rung.segments(query, every, paged=paged, rotated=rotated, every_page=True)
            self._read_counts.append(len(parts))
            out += parts
        return out

    def heat_updates(self, segments: list) -> list | None:
        """Each rung's :meth:`~confkv.tiers.cold.ColdTier.heat_updates` for its part of ``segments`` (the last
        :meth:`segments`), in order; None when a rung's is."""
        out: list = []
        start = 0
        for rung, count in zip(self.rungs, self._read_counts):
            updates = rung.heat_updates(segments[start:start + count]) if count else []
            if updates is None:
                return None
            out += updates
            start += count
        return out if start == len(segments) else None

    def observe_read(self, masses: list[Tensor]) -> None:
        """Add each rung's page masses (the read's masses of :meth:`segments`, in order) to its heat."""
        start = 0
        for rung, count in zip(self.rungs, self._read_counts):
            rung.observe_read(masses[start:start + count])
            start += count

    # -- holding a budget --------------------------------------------------------------------------
    def fit(self, budget: int, dtype: torch.dtype) -> None:
        """Step pages down, then drop, until :meth:`kv_bytes` <= ``budget`` (see the module docstring).

        ``dtype``: the model's dtype (storage of 16-bit rungs). A budget below zero empties the tier.
        """
        signal, slack = self.storage.step_down_by, self.storage.ladder_slack
        with profiling.section("ladder (step down / drop)"):
            if slack and self.kv_bytes() > budget > 0:  # over: free past the bytes by a share of them
                budget -= math.floor(slack * budget)
            while (excess := self.kv_bytes() - budget) > 0:
                movable = [i for i, rung in enumerate(self.rungs[:-1]) if rung.num_pages]
                if movable:
                    source = min(movable, key=lambda i: self._step_cost(i, signal))
                    self._step_down(source, excess, signal, dtype)
                elif (self.storage.seal_before_drop and 2 * self.top.open_length >= self.storage.page_size
                      and self._open_outweighs_a_bottom_page()):  # at least half full: a partial page wastes its rest
                    self.top.seal_open()  # a step down of the open page's full precision: it then steps down the rungs
                elif self.rungs[-1].num_pages:
                    bottom = self.rungs[-1]
                    count = min(bottom.num_pages, math.ceil(excess / self._batch_page_bytes(len(self.rungs) - 1)))
                    order = _unread_order(self.storage.unread_by, dropping=True)
                    bottom.drop_pages(_coldest(bottom, signal, count, order))
                elif self.top.open_length:
                    self._fit_open(excess)
                elif any(rung.open is not None for rung in self.rungs):
                    for rung in self.rungs:  # empty rungs still count a format's per-layer state (codebooks)
                        rung.open = None  # counted as nothing; the next demotion or page starts it again
                else:
                    return

    def _fit_open(self, excess: int) -> None:
        """No sealed page is left and the open page is over: seal it as a partial page when its tokens
        cost more than a bottom-rung page (the loop then steps it down), else drop its oldest slots."""
        top = self.top
        if self.storage.seal_early and self._open_outweighs_a_bottom_page():
            top.seal_open()
        else:
            top.drop_open(math.ceil(excess / self._open_slot_bytes()))

    def _open_outweighs_a_bottom_page(self) -> bool:
        """Whether the open page's tokens, as it stores them, cost more than one bottom-rung page (all sequences).
        Asked only while the open page holds tokens (both callers check ``open_length`` first)."""
        return self.top.open_length * self._open_slot_bytes() > self._batch_page_bytes(len(self.rungs) - 1)

    def _open_slot_bytes(self) -> int:
        """Bytes of one open-page slot for every sequence of the batch (the model's dtype, or INT8 and scales)."""
        top = self.top
        batch, heads = top.open["keys"].shape[:2]  # (its last dim is D / 2 at 4 bits: the head's is top.head_dim)
        size = top.dtype.itemsize
        return batch * open_slot_bytes(heads, top.head_dim, size, self.storage.open_bits)

    def _step_cost(self, rung: int, signal: str) -> float:
        """The price of stepping rung ``rung``'s least valuable page one rung down (the lowest goes first).

        ``step_order="coldest"``: that page's value. ``"error"``: its value times the growth of a uniform
        quantizer's mean squared error (``4**-bits``, 0 at 16 bits: the model's dtype is exact here) per
        byte the step frees.
        """
        value = _coldest_mean(self.rungs[rung], signal)
        if self.storage.step_order == "coldest":
            return value
        upper, lower = self.storage.ladder[rung], self.storage.ladder[rung + 1]
        growth = 4.0 ** -lower - (0.0 if upper == 16 else 4.0 ** -upper)
        saving = self._batch_page_bytes(rung) - self._batch_page_bytes(rung + 1)
        return value * growth / max(saving, 1)

    def _step_down(self, source: int, excess: int, signal: str, dtype: torch.dtype) -> None:
        upper, lower = self.rungs[source], self.rungs[source + 1]
        saving = self._batch_page_bytes(source) - self._batch_page_bytes(source + 1)
        count = min(upper.num_pages, max(1, math.ceil(excess / max(saving, 1))))
        order = _unread_order(self.storage.unread_by, dropping=False)
        lower.put_pages(upper.take_pages(_coldest(upper, signal, count, order)), dtype)

    def _batch_page_bytes(self, rung: int) -> int:
        """Bytes of one page on rung ``rung`` for every sequence of the batch."""
        top = self.top
        batch, heads = top.open["keys"].shape[:2]
        size = top.dtype.itemsize
        config = self.rungs[rung].config
        return batch * lowbit.page_bytes(heads, top.head_dim, config.page_size, config.bits, config.group_size,
                                         size, digest=False)

    # -- batch -----------------------------------------------------------------------------------
    def select_batch(self, index: Tensor) -> None:
        for rung in self.rungs:
            rung.select_batch(index)

    def clone(self) -> "LadderTier":
        twin = LadderTier.__new__(LadderTier)
        twin.storage, twin.page_file, twin.config = self.storage, self.page_file, self.config
        twin.rungs = [rung.clone() for rung in self.rungs]
        twin._read_counts = []  # a read's bookkeeping is per step, as each rung's (its clone reads afresh)
        return twin


def _unread_order(unread_by: str, dropping: bool) -> str:
    """``"age"`` or ``"attention"``: the order among unread pages of ``Storage.unread_by`` for a drop (``dropping``)
    or a step down (``"attention-drops"``: attention for drops only). Here, not on Storage, so that a step enters
    no more files (docs/ARCHITECTURE.md)."""
    return "attention" if unread_by == "attention" or (dropping and unread_by == "attention-drops") else "age"


def _coldest(rung: ColdTier, signal: str, count: int, unread_by: str) -> Tensor:
    """[B, H, count] the ``count`` least valuable sealed pages of each head. Ties (pages not yet read, all
    +inf by heat): the oldest sealed first, or with ``unread_by="attention"`` the least attention while hot."""
    value = rung.page_value(signal)
    if unread_by == "attention" and signal == "heat":
        by_attention = torch.sort(rung.pages["attention"][:, :, :rung.num_pages], dim=-1, stable=True).indices
        then_by_value = torch.sort(value.gather(-1, by_attention), dim=-1, stable=True).indices
        return by_attention.gather(-1, then_by_value)[..., :count]
    return torch.sort(value, dim=-1, stable=True).indices[..., :count]


def _coldest_mean(rung: ColdTier, signal: str) -> float:
    """The mean over sequences and heads of each head's least page value (+inf counted as a large value;
    values are made positive, so that a price proportional to them orders as they do)."""
    value = rung.page_value(signal).amin(-1)
    if signal == "age":  # positions: the oldest page is the least valuable; + 1 keeps position 0 above zero
        value = value + 1.0
    return float(torch.nan_to_num(value, posinf=1e30).mean()) + 1e-12
