"""The cold tier of one layer: evicted tokens are demoted to low-bit pages, not deleted.

Layout (per layer; ``B`` sequences, ``H`` KV heads, ``P`` tokens per page, ``N`` pages)::

    open page : keys/values [B, H, S, D] model dtype (or INT8 per token), S < P   read in full every step
    pages     : codes + float16 scales/minima (KIVI, :mod:`confkv.tiers.lowbit`) [B, H, N, P, ...]
    digest    : per-channel key min / max [B, H, N, D] float16 (Quest)
    positions : [B, H, N, P] int64 original positions;  valid: [B, H, N, P] bool
    attention : [B, H, N] float32 what the page's tokens received per query while hot (open page: [B, H, S])

Each KV head demotes its own tokens (eviction is per head), so a page holds one head's
tokens of one sequence: pages never mix the sequences of a batch. A decode step reads,
per sequence and KV head, the ``k`` pages whose digest bounds ``q . k`` highest for the
current queries (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context
LLM Inference"): for a query ``q`` and a page with key minima ``m`` and maxima ``M``,
``q . k <= sum_d max(q_d m_d, q_d M_d)`` for every key ``k`` of the page. With GQA the
bound of a KV head is the largest over its query heads (and over a prefill chunk's queries).

``cold_budget`` bounds the tier: when it holds more tokens, the coldest pages (the least
attention received when read, then the oldest) are evicted for good.
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv.native import pages as native_pages
from confkv.tiers import lowbit
from confkv.attention.segments import gather_pages as _gather_pages, gather_pages_of
from confkv.tiers.cold_read import PageRead, decoded_open, empty_open, encode_open, left_align, open_nbytes
from confkv.config import ColdConfig
from confkv.tiers.page_file import PageFile
from confkv.tiers.formats import PageFormat, format_for


#: page tensors that stay in RAM when sealed pages are offloaded (metadata and digests)
_RESIDENT = ("positions", "valid", "heat", "sealed_at", "confidence", "attention", "digest_min", "digest_max")

#: per-page tensors that describe a page rather than encode it (kept when a page changes rung)
_METADATA = ("positions", "valid", "heat", "sealed_at", "confidence", "attention")


class ColdTier(PageRead):
    """Low-bit pages of one layer's demoted tokens (see the module docstring): the pages, their demotion,
    budget and moves between rungs here; their read (:class:`~confkv.tiers.cold_read.PageRead`) in :mod:`confkv.tiers.cold_read`.

    Args:
        config: bits, page and group size, page format, read budgets, cold budget, offload.
        page_file: where sealed pages live when ``config.offload`` (None: in RAM).
        rope: the model's rotary parameters (:class:`confkv.tiers.prerope.Rope`), for page
            formats that store keys before the rotary embedding (None: none known).
    """

    def __init__(self, config: ColdConfig, page_file: PageFile | None = None, rope=None) -> None:
        self.config = config
        self.page_file = page_file
        self.rope = rope
        self.format: PageFormat | None = None  # built at the first demotion (it needs head_dim and dtype)
        #: let reads fold the format's rotation into the query and output (False: decode every page back)
        self.fold_rotation = True
        self.open: dict[str, Tensor] | None = None  # keys, values [B,H,S,D]; positions, attention [B,H,S]; valid [B,S]
        self.open_known_valid: Tensor | None = None  # the open page's ``valid`` when demote saw it all True
        self.pages: dict[str, Tensor] = {}  # name -> [B, H, N, ...]; N = capacity
        self.num_pages = 0
        self.head_dim = 0
        self.dtype: torch.dtype | None = None
        self.bytes_read = 0  # cold bytes read by the last attention read
        self.reads = 0  # attention reads of this layer so far (the clock of a page's mean heat)
        self._selected: Tensor | None = None  # [B, H, K] pages read by the last read
        self.exact_capacity = False  # no spare page (a ladder counts every allocated byte), else grown by doubling
        self.step_confidence: Tensor | None = None  # [B] the model's confidence at this step (page metadata)
        #: (bytes of a sealed page, of its digest, the format's per layer), all KV heads: fixed once it holds tokens
        self._page_sizes: tuple[int, int, int] | None = None

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def open_length(self) -> int:
        return 0 if self.open is None else self.open["keys"].shape[2]

    def token_count(self) -> Tensor | None:
        """[B] int64 valid tokens held (open page + sealed pages), or None before the first demotion."""
        if self.open is None:
            return None
        held = self.open["valid"].sum(-1)
        if self.num_pages:
            held = held + self.pages["valid"][:, 0, :self.num_pages].sum((-1, -2))
        return held

    def page_nbytes(self) -> int:
        """Bytes of one sealed page of one sequence (all KV heads): the format's data and side data, digest."""
        return self._sizes()[0]

    def _sizes(self) -> tuple[int, int, int]:
        """(:meth:`page_nbytes`, :meth:`_digest_nbytes`, the format's per-layer bytes), worked out at the first
        call (the tier holds tokens, so its format is fixed: a format's codebook size never changes)."""
        if self._page_sizes is None:
            heads = self.open["keys"].shape[1]
            digest = 2 * heads * self.head_dim * 2 if self.config.needs_digest else 0
            self._page_sizes = (self.format.page_nbytes(heads, self.head_dim, self.config.page_size) + digest, digest,
                                self.format.layer_nbytes())
        return self._page_sizes

    def kv_bytes(self) -> int:
        """Exact bytes: the open page's keys/values, every sealed page's data, side data and digest,
        and the format's per-layer state (codebooks)."""
        if self.open is None:
            return 0
        batch = self.open["keys"].shape[0]
        page, _, layer = self._sizes()
        return open_nbytes(self.open) + batch * self.num_pages * page + layer

    def offloaded_bytes(self) -> int:
        """Bytes of sealed page data kept in the page file (0 in RAM); digests stay resident."""
        if self.page_file is None or self.open is None:
            return 0
        batch = self.open["keys"].shape[0]
        return batch * self.num_pages * (self.page_nbytes() - self._digest_nbytes())

    def _digest_nbytes(self) -> int:
        """Bytes of one page's digest, all KV heads (0 when pages carry none): per channel a min and a max, fp16."""
        return self._sizes()[1]

    def bookkeeping_bytes(self) -> int:
        """Positions, validity and page heat (not KV)."""
        if self.open is None:
            return 0
        total = self.open["positions"].nbytes + self.open["valid"].nbytes + self.open["attention"].nbytes
        for name in _METADATA:
            if name in self.pages:
                tensor = self.pages[name]
                total += tensor.nbytes * self.num_pages // max(tensor.shape[2], 1)
        return total

    # -- demotion --------------------------------------------------------------------------------
    def demote(self, keys: Tensor, values: Tensor, positions: Tensor, valid: Tensor,
               attention: Tensor | None = None) -> None:
        """Take evicted tokens.

        Args:
            keys, values: [B, H, M, D] float (any float dtype; stored in the tier's dtype).
            positions: [B, H, M] int64 original positions.
            valid: [B, M] bool; invalid slots (padding, rows that evicted fewer) are dropped.
            attention: [B, H, M] what each token received per query while hot (None: 0); a page keeps its
                valid tokens' sum (:mod:`confkv.tiers.ladder` orders unread pages by it).
        """
        if self.open is None:
            batch, heads, _, head_dim = keys.shape
            self._start(head_dim, keys.dtype)
            self.open = empty_open(batch, heads, head_dim, keys.dtype, keys.device, self.config.open_bits)
        if attention is None:
            attention = torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
        incoming = {**encode_open(keys, values, self.dtype, self.config.open_bits), "positions": positions,
                    "valid": valid, "attention": attention.float()}
        merged = {name: torch.cat([self.open[name], incoming[name]], dim=1 if name == "valid" else 2)
                  for name in self.open}
        all_valid = bool(merged["valid"].all())
        self.open = merged if all_valid else left_align(merged)
        page = self.config.page_size
        full = self.open_length // page
        if full:
            sealed = {name: t[..., :full * page] if name == "valid" else t[:, :, :full * page]
                      for name, t in self.open.items()}
            self.open = {name: (t[..., full * page:] if name == "valid" else t[:, :, full * page:]).clone()
                         for name, t in self.open.items()}
            self._seal(sealed, full)
        self.open_known_valid = self.open["valid"] if all_valid else None  # the read asks it again otherwise
        self._enforce_budget()

    def _seal(self, tokens: dict[str, Tensor], count: int) -> None:
        """Quantize ``count`` pages from ``tokens`` (``count * P`` slots) and append them."""
        batch, heads = tokens["keys"].shape[:2]  # (codes of D / 2 bytes at open_bits=4: the head's D is head_dim)
        page, head_dim = self.config.page_size, self.head_dim
        keys, values = (t.reshape(batch, heads, count, page, head_dim) for t in decoded_open(tokens, self.dtype))
        valid = tokens["valid"].reshape(batch, count, page)
        head_valid = valid[:, None].expand(batch, heads, count, page)
        meta = {"positions": tokens["positions"].reshape(batch, heads, count, page), "valid": head_valid,
                "heat": torch.zeros(batch, heads, count, dtype=torch.float32, device=keys.device),
                "sealed_at": torch.full((batch, heads, count), self.reads, dtype=torch.int64, device=keys.device),
                "confidence": self.confidence_now(batch, keys.device)[:, None, None].expand(batch, heads, count),
                "attention": tokens["attention"].reshape(batch, heads, count, page).masked_fill(~head_valid, 0).sum(-1)}
        self._append_pages({**meta, **self._encode(keys, values, head_valid, meta["positions"])}, count)

    def _start(self, head_dim: int, dtype: torch.dtype) -> None:
        """Fix the layer's head dim and dtype and build its page format (raises on a shape it cannot pack)."""
        self.head_dim, self.dtype = head_dim, dtype
        if self.format is None:
            self.format = format_for(self.config, head_dim, dtype, self.rope)

    def confidence_now(self, batch: int, device: torch.device) -> Tensor:
        """[B] float32: the model's confidence at this step (set by the store; 0.5 before the first step)."""
        if self.step_confidence is None or self.step_confidence.shape[0] != batch:
            return torch.full((batch,), 0.5, dtype=torch.float32, device=device)
        return self.step_confidence.to(device=device, dtype=torch.float32)

    def _encode(self, keys: Tensor, values: Tensor, valid: Tensor, positions: Tensor | None = None) -> dict[str, Tensor]:
        """Page storage of keys / values [B, H, N, P, D] (valid, positions [B, H, N, P]): digest, then the
        format's codes and side data (:meth:`confkv.tiers.formats.PageFormat.encode`)."""
        fresh: dict[str, Tensor] = {}
        if self.config.needs_digest:
            float_keys = keys.float()
            fresh["digest_min"] = float_keys.masked_fill(~valid[..., None], float("inf")).amin(-2)
            fresh["digest_max"] = float_keys.masked_fill(~valid[..., None], float("-inf")).amax(-2)
            for name in ("digest_min", "digest_max"):  # an all-invalid page (never read) gets a zero digest
                tensor = fresh[name]
                fresh[name] = torch.where(torch.isfinite(tensor), tensor, torch.zeros_like(tensor)).to(lowbit.SCALE_DTYPE)
        if self.format is None:  # pages sealed before any demotion fixed the layer (tests seal directly)
            self.format = format_for(self.config, keys.shape[-1], self.dtype or keys.dtype, self.rope)
        fresh.update(self.format.encode(keys, values, valid, positions))
        return fresh

    def _append_pages(self, fresh: dict[str, Tensor], count: int) -> None:
        needed = self.num_pages + count
        capacity = self._capacity()
        if self.exact_capacity and self.page_file is None and capacity == self.num_pages:
            joined = _joined_pages(self.pages, fresh)
            if joined is not None:
                self.pages, self.num_pages = joined, needed
                return
        if needed > capacity:
            grown = needed if self.exact_capacity else max(needed, 2 * capacity, 8)
            self.pages = {name: _grow(self.pages.get(name), fresh[name], grown,
                                      self.page_file if self._offloaded(name) else None)
                          for name in fresh}
        for name, tensor in fresh.items():
            self.pages[name].narrow(2, self.num_pages, count).copy_(tensor)
        self.num_pages = needed

    def _capacity(self) -> int:
        return 0 if not self.pages else self.pages["valid"].shape[2]

    def _offloaded(self, name: str) -> bool:
        return self.page_file is not None and name not in _RESIDENT

    def _enforce_budget(self) -> None:
        """Evict the coldest sealed pages while the tier holds more than ``cold_budget`` tokens.

        A page's heat is the attention mass it received per read since it was sealed (reads that
        skipped it count as zero): the total alone would favour the oldest pages for ever and
        evict every new page first, freezing the tier on the start of the stream. A page not yet
        read once is kept; among equals the newest stays.
        """
        budget = self.config.cold_budget
        if budget is None or not self.num_pages:
            return
        keep_pages = max((budget - self.open_length) // self.config.page_size, 0)
        if self.num_pages <= keep_pages:
            return
        # ascending heat; a stable sort keeps equal heats oldest first: the last pages are the hottest, then newest
        coldest_first = torch.sort(self.page_value("heat"), dim=-1, stable=True).indices
        order = coldest_first[..., self.num_pages - keep_pages:].sort(-1).values
        self._keep_pages(order)

    def _keep_pages(self, index: Tensor) -> None:
        """Keep pages ``index`` [B, H, K] (per head), compacted to the front."""
        kept = index.shape[-1]
        if self.exact_capacity and self.page_file is None:  # the gathered pages become the tier's: no spare page
            self.pages = {name: _gather_pages(t.narrow(2, 0, self.num_pages), index) for name, t in self.pages.items()}
        else:
            for tensor in self.pages.values():
                tensor.narrow(2, 0, kept).copy_(_gather_pages(tensor.narrow(2, 0, self.num_pages), index))
        self.num_pages = kept

    # -- moves between rungs of a ladder (confkv.tiers.ladder) ----------------------------------
    def page_value(self, signal: str) -> Tensor:
        """[B, H, N] float64 keep-value of each sealed page; the lowest steps down (or is dropped) first.

        ``"heat"``: attention received per read since sealing (a page not yet read: +inf, kept);
        ``"confidence"``: ``1 - c`` for the model's confidence ``c`` at the step the page was sealed
        (pages demoted at uncertain steps keep their precision longer); ``"age"``: the page's newest
        position (the oldest pages go first).
        """
        count = self.num_pages
        if signal == "heat":
            reads = (self.reads - self.pages["sealed_at"][:, :, :count]).double()
            total = self.pages["heat"][:, :, :count].double()
            return torch.where(reads > 0, total / reads.clamp_min(1), torch.full_like(total, float("inf")))
        if signal == "confidence":
            return 1.0 - self.pages["confidence"][:, :, :count].double()
        if signal == "age":
            return self.pages["positions"][:, :, :count].amax(-1).double()
        raise ValueError(f"signal: must be 'heat', 'confidence' or 'age', got {signal!r}")

    def take_pages(self, index: Tensor) -> dict[str, Tensor]:
        """Remove sealed pages ``index`` [B, H, M] (distinct per head) and return them decoded.

        Returns keys / values [B, H, M, P, D] float32 and the pages' metadata (positions, valid,
        heat, sealed_at, confidence), each [B, H, M, ...], for :meth:`put_pages` of another rung.
        """
        live = {name: t.narrow(2, 0, self.num_pages) for name, t in self.pages.items()}
        keys, values = self._dequantized(live, index)
        taken = gather_pages_of({name: live[name] for name in _METADATA if name in live}, index)
        taken["keys"], taken["values"] = keys.float(), values.float()
        self.drop_pages(index)
        return taken

    def drop_pages(self, index: Tensor) -> None:
        """Delete sealed pages ``index`` [B, H, M] (distinct per head); the rest keep their order (in one C call where
        it can, :func:`confkv.native.pages.keep_pages`: the bytes of :meth:`_keep_pages`' gather)."""
        exact, left = self.exact_capacity and self.page_file is None, self.num_pages - index.shape[-1]
        moved = native_pages.keep_pages(list(self.pages.values()), index, self.num_pages, exact)
        if moved is not None:
            self.pages, self.num_pages = (dict(zip(self.pages, moved)) if exact else self.pages), left
            return
        gone = torch.zeros(self.pages["heat"].shape[:2] + (self.num_pages,), dtype=torch.bool,
                           device=index.device).scatter_(2, index, True)
        self._keep_pages(gone.to(torch.int8).argsort(dim=-1, stable=True)[..., :left].sort(-1).values)

    def put_pages(self, taken: dict[str, Tensor], dtype: torch.dtype) -> None:
        """Encode pages from :meth:`take_pages` at this tier's bits and append them, metadata kept.

        ``dtype``: the model's dtype (the storage of 16-bit pages and of the open page).
        """
        batch, heads, count, page, head_dim = taken["keys"].shape
        if page != self.config.page_size:
            raise ValueError(f"page_size: pages of {page} tokens cannot join a tier of {self.config.page_size}")
        if self.open is None:
            self._start(head_dim, dtype)
            self.open = empty_open(batch, heads, head_dim, dtype, taken["keys"].device, self.config.open_bits)
        meta = {name: taken[name] for name in _METADATA}
        encoded = self._encode(taken["keys"], taken["values"], taken["valid"], taken["positions"])
        self._append_pages({**meta, **encoded}, count)

    def drop_open(self, count: int | None = None) -> None:
        """Delete the open page's ``count`` oldest slots (all when None): when even no sealed page leaves
        room for them."""
        if self.open is not None:
            start = self.open_length if count is None else min(count, self.open_length)
            self.open = left_align({name: (t[..., start:] if name == "valid" else t[:, :, start:]).clone()
                                     for name, t in self.open.items()})

    def seal_open(self) -> None:
        """Seal the open page now, its empty slots invalid (a partial page costs a whole page's bytes)."""
        if not self.open_length:
            return
        page, filled = self.config.page_size, self.open_length
        padded = {}
        for name, tensor in self.open.items():
            if name == "valid":
                padded[name] = torch.cat([tensor, tensor.new_zeros(tensor.shape[0], page - filled)], dim=1)
            else:
                spare = tensor.new_zeros(tensor.shape[:2] + (page - filled,) + tensor.shape[3:])
                padded[name] = torch.cat([tensor, spare], dim=2)
        self.drop_open()
        self._seal(padded, 1)

    # -- batch -----------------------------------------------------------------------------------
    def select_batch(self, index: Tensor) -> None:
        """Keep batch rows ``index`` [B']."""
        if self.open is None:
            return
        self.open = {name: t.index_select(0, index.to(t.device)) for name, t in self.open.items()}
        self.pages = {name: t.index_select(0, index.to(t.device)) for name, t in self.pages.items()}

    def clone(self) -> "ColdTier":
        twin = ColdTier(self.config, self.page_file, self.rope)
        twin.format = self.format  # shared: a fitted codebook never changes, so both decode alike
        twin.fold_rotation = self.fold_rotation
        twin.head_dim, twin.dtype, twin.num_pages, twin.reads = self.head_dim, self.dtype, self.num_pages, self.reads
        twin.step_confidence = self.step_confidence
        twin.exact_capacity = self.exact_capacity
        if self.open is not None:
            twin.open = {name: t.clone() for name, t in self.open.items()}
            twin.pages = {name: _grow(None, t, t.shape[2], self.page_file if self._offloaded(name) else None)
                          for name, t in self.pages.items()}
            for name, t in self.pages.items():
                twin.pages[name].copy_(t)
        return twin


def _joined_pages(old: dict[str, Tensor], fresh: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """A tier of exact capacity's page tensors with ``fresh``'s pages after ``old``'s, one ``cat`` a tensor: the
    pages and bytes of :func:`_grow` and the copy after it; None (the caller grows) where their names, dtypes or
    devices differ."""
    if old.keys() != fresh.keys() or any(old[n].dtype != t.dtype or old[n].device != t.device for n, t in fresh.items()):
        return None
    return {name: torch.cat([old[name], tensor], dim=2) for name, tensor in fresh.items()}


def _grow(old: Tensor | None, like: Tensor, capacity: int, page_file: PageFile | None) -> Tensor:
    """A tensor shaped like ``like`` with ``capacity`` pages (axis 2), holding ``old``'s pages first."""
    shape = [*like.shape[:2], capacity, *like.shape[3:]]
    grown = page_file.allocate(shape, like.dtype) if page_file is not None else torch.zeros(shape, dtype=like.dtype,
                                                                                              device=like.device)
    if old is not None:
        grown.narrow(2, 0, old.shape[2]).copy_(old)
        if page_file is not None:
            page_file.release(old)
    return grown
