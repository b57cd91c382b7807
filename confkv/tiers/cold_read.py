"""Reading a layer's cold tier (:class:`confkv.tiers.cold.ColdTier`): which pages a read takes, and how.

Per sequence and KV head a read takes the ``k`` pages whose Quest digest bounds ``q . k`` highest for
the current queries (:meth:`~PageRead.digest_bound`), hands them over still packed for a backend that
reads pages itself (the Triton paged read) or decoded for the torch read, and adds the attention mass
they received to each page's heat. The page a read liked best can go back to the hot tier
(:meth:`~PageRead.take_best_read_page`, promotion).

The pages themselves (their layout, demotion, budget and the moves between rungs of a ladder) are
:mod:`confkv.tiers.cold`'s; :class:`~confkv.tiers.cold.ColdTier` is this class plus that one, split by job. The open
page's storage (the model's dtype, or 8 or 4 bits per token: ``open_bits``), which every read decodes, is at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from confkv import profiling
from confkv.attention import KVSegment
from confkv.config import ALL_PAGES
from confkv.attention.segments import OUTLIER_STORAGE, PagedSegment, gather_pages as _gather_pages, gather_pages_of
from confkv.native.pages import InPlaceUpdate, decode_int8_rows, quantize_int8_rows
from confkv.tiers import open_nibbles

if TYPE_CHECKING:
    from confkv.config import ColdConfig
    from confkv.tiers.formats import PageFormat

#: page storage a PagedSegment reads, by "unquantized" (bits == 16)
_STORAGE = {True: ("keys", "values"),
            False: ("key_codes", "key_scale", "key_min", "value_codes", "value_scale", "value_min")}


class PageRead:
    """The read half of :class:`~confkv.tiers.cold.ColdTier`: its attributes are documented there, and the read
    uses three of its members (``page_nbytes``, ``_digest_nbytes``, ``_keep_pages``)."""

    config: ColdConfig
    format: PageFormat | None
    fold_rotation: bool
    open: dict[str, Tensor] | None
    num_pages: int
    head_dim: int
    dtype: torch.dtype | None
    bytes_read: int
    reads: int
    _selected: Tensor | None
    #: the last read of every page handed over packed (:class:`EveryPageRead`), see :meth:`_paged`
    _every_page: EveryPageRead | None = None

    @property
    def pages(self) -> dict[str, Tensor]:
        """The sealed pages' tensors, name -> [B, H, N, ...] (see :class:`~confkv.tiers.cold.ColdTier`)."""
        return self._pages

    @pages.setter
    def pages(self, tensors: dict[str, Tensor]) -> None:
        # new page tensors: the kept every-page segment, which holds the old ones, goes with them (else they would
        # stay allocated, uncounted, until the next read)
        self._pages, self._every_page, self._heat_update = tensors, None, None

    def read_rotation(self, turns_pages: bool = False):
        """The format's rotation when this read can fold it into the query and output (pages to read,
        a format with one, :attr:`fold_rotation` on), else None (see :meth:`segments`' ``rotated``).

        ``turns_pages``: the read is the native page read, which takes packed pages with their rotation
        attached and turns the query itself; pages it takes so (``kivi+hadamard``) then carry the rotation
        (:attr:`PagedSegment.rotation`), and nothing is folded. (The Triton read takes packed pages only in
        the read's basis, so the rotation is folded for it.)
        """
        if not self.fold_rotation or self.format is None or not self.num_pages:
            return None
        if turns_pages and self.format.paged_when_rotated:
            return None
        return self.format.read_rotation

    def segments(self, query: Tensor, read_pages: Tensor, paged: bool = False, rotated: bool = False,
                 every_page: bool = False) -> list[KVSegment | PagedSegment]:
        """The open page and the ``read_pages[b]`` best pages of each sequence, as read segments.

        Args:
            query: [B, Hq, Q, D] (after RoPE).
            read_pages: [B] int64 pages to read per sequence.
            paged: hand the selected pages over as a :class:`PagedSegment` (still packed, for
                a backend that reads pages itself: the Triton paged read) instead of
                gathering and dequantizing them here.
            every_page: ``read_pages`` is at least every page in every sequence (the ladder's reads), known
                without reading the tensor.
        Returns:
            up to two segments: the open page (:class:`KVSegment`, model dtype), then the
            selected pages: a :class:`KVSegment` dequantized to float32 (invisible where a
            sequence reads fewer pages), or with ``paged`` the :class:`PagedSegment`. Either
            way the pages' attention mass is [B, H, K * P], what :meth:`observe` takes.
            With ``rotated`` (only when :meth:`read_rotation` is not None) both segments are in
            the rotated basis (the open page rotated, the pages not rotated back): the caller
            rotates the query and un-rotates the output, so the per-token inverse rotation of
            every page is skipped (the scores and the output are the same, the rotation being
            orthogonal).
        """
        self._selected = None
        self.bytes_read = 0
        self.reads += 1
        if self.open is None:
            return []
        segments: list[KVSegment | PagedSegment] = []
        rotation = self.format.read_rotation if rotated and self.format is not None else None
        if rotated and rotation is None:
            raise ValueError("cold tier: a rotated read needs a page format with a rotation")
        if self.open_length:
            valid = self.open["valid"]
            keys, values = decoded_open(self.open, self.dtype)
            if rotation is not None:
                keys, values = rotation.forward(keys), rotation.forward(values)
            all_valid = valid is self.open_known_valid or bool(valid.all())  # known: demote saw it
            segments.append(KVSegment(keys, values, None if all_valid else valid[:, None, None, :]))
            self.bytes_read += open_nbytes(self.open)
        want = (ALL_PAGES if every_page else int(read_pages.max())) if read_pages.numel() else 0
        if self.num_pages and want:
            segments.append(self._page_segment(query, read_pages, min(want, self.num_pages), paged, rotated,
                                               every_page))
        return segments

    def _page_segment(self, query: Tensor, read_pages: Tensor, width: int, paged: bool,
                      rotated: bool = False, every_page: bool = False) -> KVSegment | PagedSegment:
        batch, heads, count = self.pages["heat"].shape[0], self.pages["heat"].shape[1], self.num_pages
        device = query.device
        every = every_page or int(read_pages.min()) >= count
        if every:  # every sequence reads every page: no ranking needed
            cached = self._every_page.segment.index if self._every_page is not None else None
            index = cached if cached is not None and cached.shape == (batch, heads, count) and cached.device == device \
                else torch.arange(count, device=device).expand(batch, heads, count)
        else:
            with profiling.section("cold page selection (digest bound + top-k)"):
                bound = self.digest_bound(query)  # [B, H, N] (digests are of the original keys)
                # best first: a sequence that reads k pages reads the first k of the width
                index = bound.topk(width, dim=-1, sorted=True).indices
            self.bytes_read += batch * count * self._digest_nbytes()  # every digest is read
        self._selected = index
        self.bytes_read += batch * width * (self.page_nbytes() - self._digest_nbytes())
        if not (self.format.paged or self.format.paged_when_rotated):
            # formats the packed readers do not take: the torch decode (any backend)
            with profiling.section("cold pages (gather + decode)"):
                return self._decoded_segment(index, read_pages, width, rotated)
        # KIVI codes, maybe of rotated keys / values: in the read's basis when it folds the rotation, else
        # the pages carry it (the native read turns the query; to_dense decodes back)
        rotation = None if self.format.paged or rotated else self.format.rotation
        if paged and self.pages["valid"].device == device:  # pages elsewhere (e.g. offloaded to host): gather here
            return self._paged(index, read_pages, width, rotation, every)
        with profiling.section("cold pages (gather + dequantize)"):
            return self._paged(index, read_pages, width, rotation).to_dense()

    def _decoded_segment(self, index: Tensor, read_pages: Tensor, width: int, rotated: bool = False) -> KVSegment:
        """The read's pages decoded by the format (float32), as a dense :class:`KVSegment` (the
        reference read for formats the packed readers do not take); ``rotated``: left in the
        format's rotated basis."""
        live = {name: t.narrow(2, 0, self.num_pages) for name, t in self.pages.items()}
        if rotated:
            data = {name: _gather_pages(live[name], index) for name in self.format.storage}
            keys, values = self.format.decode(data, _gather_pages(live["positions"], index), rotated=True)
        else:
            keys, values = self._dequantized(live, index)
        batch, heads, _ = index.shape
        shape = (batch, heads, width * self.config.page_size, self.head_dim)
        visible = PagedSegment(index, read_pages.clamp_max(width), self.pages["valid"], self.config.bits,
                               self.config.group_size, self.head_dim).visible()
        return KVSegment(keys.reshape(shape), values.reshape(shape), visible)

    def _paged(self, index: Tensor, read_pages: Tensor, width: int, rotation=None, every: bool = False) -> PagedSegment:
        """The read's pages as a :class:`PagedSegment` (``index`` [B, H, width], ``read_pages`` [B]; ``rotation``:
        the basis their codes are in, None for the read's). ``every``: every page is read (``width`` pages, in page
        order): the segment of the last such read is handed over again while the pages' count and tensors are the
        same (a decode step's read under a byte target, where pages change once in many steps), and with it what the
        native read worked out from it (:attr:`PagedSegment.native_args`)."""
        names = _STORAGE[self.config.bits == 16]
        if "key_outlier_index" in self.format.storage:
            names = names + OUTLIER_STORAGE
        if "key_widths" in self.format.storage:
            names = names + ("key_widths",)
        storage = {name: self.pages[name] for name in names}
        if every:
            tensors, cached = (*storage.values(), self.pages["valid"]), self._every_page
            if cached is not None and cached.serves(index, rotation, tensors):
                return cached.segment
        value_bits = self.format.widths["value"] if self.config.bits != 16 else None
        segment = PagedSegment(index, read_pages.clamp_max(width), self.pages["valid"], self.config.bits,
                               self.config.group_size, self.head_dim, **storage, rotation=rotation,
                               value_bits=None if value_bits == self.config.bits else value_bits)
        if every:
            self._every_page = EveryPageRead(segment, tensors)
        return segment

    def _dequantized(self, live: dict[str, Tensor], index: Tensor) -> tuple[Tensor, Tensor]:
        """Pages ``index`` [B, H, K] of ``live`` decoded by the format: keys, values [B, H, K, P, D]
        (float32; the model's dtype at 16 bits)."""
        if self.config.bits == 16:
            return _gather_pages(live["keys"], index), _gather_pages(live["values"], index)
        data = gather_pages_of({name: live[name] for name in (*self.format.storage, "positions")}, index)
        return self.format.decode(data, data.pop("positions"))

    def digest_bound(self, query: Tensor) -> Tensor:
        """Quest's upper bound of ``q . k`` per page: [B, Hq, Q, D] -> [B, H, N] float32.

        The largest bound over the query heads of each KV head's group and over the queries.
        """
        batch, q_heads, queries, head_dim = query.shape
        heads = self.pages["heat"].shape[1]
        grouped = query.float().reshape(batch, heads, (q_heads // heads) * queries, head_dim)
        low = self.pages["digest_min"][:, :, :self.num_pages].float()
        high = self.pages["digest_max"][:, :, :self.num_pages].float()
        bound = grouped.clamp_min(0) @ high.transpose(-1, -2) + grouped.clamp_max(0) @ low.transpose(-1, -2)
        return bound.amax(dim=2)

    def take_best_read_page(self, mass: Tensor, threshold: float) -> dict[str, Tensor] | None:
        """Remove and return, in every head, the read page that took the most attention.

        Only when some head's best page took at least ``threshold`` of the attention and every
        head's chosen page has the same valid slots per sequence (so the hot tier stays dense).

        Args:
            mass: [B, H, K * P] attention mass of the last read's page segment.
        Returns:
            None, or keys/values [B, H, P, D] float32, positions [B, H, P], valid [B, P], and
            mass [B, H, P] (the attention each taken slot received).
        """
        if self._selected is None:
            return None
        index = self._selected
        per_page = mass.reshape(*index.shape, -1).sum(-1)  # [B, H, K]
        best_mass, best = per_page.max(-1)
        if not bool((best_mass >= threshold).any()):
            return None
        page = _gather_pages(index, best[..., None])  # [B, H, 1] page numbers
        live = {name: t.narrow(2, 0, self.num_pages) for name, t in self.pages.items()}
        valid = _gather_pages(live["valid"], page)[:, :, 0]  # [B, H, P]
        if not bool((valid == valid[:, :1]).all()):
            return None
        keys, values = self._dequantized(live, page)
        slot_mass = _gather_pages(mass.reshape(*index.shape, -1), best[..., None])[:, :, 0]
        taken = {"keys": keys[:, :, 0], "values": values[:, :, 0], "mass": slot_mass.float(),
                 "positions": _gather_pages(live["positions"], page)[:, :, 0], "valid": valid[:, 0]}
        others = torch.ones_like(live["heat"], dtype=torch.bool).scatter_(2, page, False)
        rest = others.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :self.num_pages - 1]
        self._keep_pages(rest)
        self._selected = None
        return taken

    def heat_updates(self, segments: list) -> list[InPlaceUpdate | None] | None:
        """Per segment of this tier's last read (``segments``, what :meth:`segments` gave), the page heat update a
        native read may make in place from that segment's masses, as :meth:`observe_read` would
        (:meth:`confkv.native.pages.InPlaceUpdate.page_heat`: ``pages["heat"]`` [B, H, N]), or None (nothing to add:
        the open page). None for the whole read when its pages were handed over otherwise than as the packed segment
        of the pages ``observe`` adds to. The update is kept while the heat tensor and the page count are the same."""
        if self._selected is None or not segments:
            return [None] * len(segments)
        pages = segments[-1]
        if not isinstance(pages, PagedSegment) or pages.index is not self._selected:
            return None
        heat, kept, count = self.pages["heat"], self._heat_update, self.num_pages
        # (the last check: in a copied tier, a view of its own heat, not of the original's)
        if kept is None or kept[0] is not heat or kept[1] != count or kept[2].target.data_ptr() != heat.data_ptr():
            kept = self._heat_update = (heat, count, InPlaceUpdate.page_heat(heat.narrow(2, 0, count)))
        return [None] * (len(segments) - 1) + [kept[2]]

    def observe_read(self, masses: list[Tensor]) -> None:
        """Page heat from the masses of this tier's last :meth:`segments` (open page first, pages last)."""
        if self._selected is not None and masses:
            self.observe(masses[-1])

    def observe(self, mass: Tensor) -> None:
        """Add the attention mass [B, H, K * P] the last read's pages received to their heat."""
        if self._selected is None:
            return
        index = self._selected
        per_page = mass.reshape(*index.shape, -1).sum(-1)
        self.pages["heat"].narrow(2, 0, self.num_pages).scatter_add_(2, index, per_page.float())


class EveryPageRead:
    """A cold tier's last read of every page, handed over packed: the :class:`PagedSegment` (page numbers, counts, the
    pages' tensors, and what the native read worked out from it) and the page tensors it was made from (its storage
    and validity, in the order :meth:`PageRead._paged` lists them), kept while the pages' count, the batch, heads,
    device, rotation and those tensors (by identity: the segment holds them, so no other object takes their ``id``)
    stay the same. A copied tier (``ConfKVCache.clone``) starts without one: the native read's part holds raw
    pointers into the original's tensors."""

    __slots__ = ("segment", "tensors")

    def __init__(self, segment: PagedSegment, tensors: tuple[Tensor, ...]) -> None:
        self.segment, self.tensors = segment, tensors

    def serves(self, index: Tensor, rotation, tensors: tuple[Tensor, ...]) -> bool:
        """Whether a read of every page with page numbers ``index`` [B, H, N], ``rotation`` and page tensors ``tensors``
        may take this segment."""
        mine = self.segment.index
        return (index.shape == mine.shape and index.device == mine.device and rotation is self.segment.rotation
                and len(tensors) == len(self.tensors) and all(a is b for a, b in zip(tensors, self.tensors)))

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (type(None), ())  # pickled as None, for the same reason


# -- the open page's storage ---------------------------------------------------------------------------------------
# The open page: the tokens the hot tier let go, waiting until a page fills. Its codec sits beside its reader (every
# read decodes it); the tier's demotion and sealing call it too. Layout (one layer; B sequences, H KV heads,
# S < P slots, D channels):
#
#     keys, values             [B, H, S, D]  the model's dtype (open_bits=16), or int8 codes (open_bits=8), or
#                              [B, H, S, D / 2] uint8, two 4-bit codes a byte (open_bits=4: confkv.tiers.open_nibbles)
#     key_scale, value_scale   [B, H, S]     float16, open_bits 8 and 4: a slot's channels are code * scale
#     positions, attention     [B, H, S]     int64 original positions; float32 attention received while hot
#     valid                    [B, S]        bool
#
# With open_bits=8 each token is quantized on its own, per KV head, symmetric: scale = max_d |x_d| / 127 in float16,
# code = round(x / scale) in [-127, 127] (as LMDeploy's INT8 KV cache): 2 * (D + 2) bytes a token and head against
# 4 * D in a 16-bit dtype (results/memory/README.md, "The open page in INT8"); a channel's error is at most scale / 2
# plus what the float16 rounding of scale moves the largest entry (tests/tiers/test_open_page.py). A page that fills
# is decoded to the model's dtype and sealed at its rung's bits. The slot axis is dim 2 of every tensor but valid.
_OPEN_SCALES = {"keys": "key_scale", "values": "value_scale"}


def empty_open(batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
               bits: int = 16) -> dict[str, Tensor]:
    """An open page with no slot (``dtype``: the model's; codes and float16 scales at ``bits`` 8 and 4)."""
    code_dtype, width = {16: (dtype, head_dim), 8: (torch.int8, head_dim), 4: (torch.uint8, head_dim // 2)}[bits]
    out = {"keys": torch.empty(batch, heads, 0, width, dtype=code_dtype, device=device),
           "values": torch.empty(batch, heads, 0, width, dtype=code_dtype, device=device),
           "positions": torch.empty(batch, heads, 0, dtype=torch.int64, device=device),
           "attention": torch.empty(batch, heads, 0, dtype=torch.float32, device=device),
           "valid": torch.empty(batch, 0, dtype=torch.bool, device=device)}
    if bits != 16:
        for scale in _OPEN_SCALES.values():
            out[scale] = torch.empty(batch, heads, 0, dtype=torch.float16, device=device)
    return out


def encode_open(keys: Tensor, values: Tensor, dtype: torch.dtype, bits: int) -> dict[str, Tensor]:
    """Open-page storage of keys / values [B, H, M, D] (any float dtype): cast to ``dtype`` at ``bits=16``; INT8
    codes and float16 scales [B, H, M] at ``bits=8`` (the section's comment above), 4-bit ones at ``bits=4``."""
    if bits == 16:
        return {"keys": keys.to(dtype), "values": values.to(dtype)}
    if bits == 4:
        return open_nibbles.encode(keys, values)
    key_codes, value_codes = quantize_int8_rows(keys, half_scales=True), quantize_int8_rows(values, half_scales=True)
    if key_codes is not None and value_codes is not None:  # the same codes and scales, one C call each
        return {"keys": key_codes[0], "values": value_codes[0], "key_scale": key_codes[1],
                "value_scale": value_codes[1]}
    x = torch.stack([keys, values]).float()  # [2, B, H, M, D]: keys and values in one pass
    scale = x.abs().amax(-1).div_(127.0).to(torch.float16)  # [2, B, H, M]
    # a scale of 0 (an all-zero token, or one too small for float16) divides by 1e-30: its codes are clamped, and
    # decode to 0 all the same
    codes = x.div_(scale.float().clamp_min_(1e-30)[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return {"keys": codes[0], "values": codes[1], "key_scale": scale[0], "value_scale": scale[1]}


def decoded_open(open_page: dict[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(keys, values) [B, H, S, D] of an open page (or of slots cut from one) in ``dtype``."""
    if "key_scale" not in open_page:
        return open_page["keys"], open_page["values"]
    if open_page["keys"].dtype == torch.uint8:  # 4-bit codes, two a byte
        return open_nibbles.decode(open_page, dtype)
    native = [decode_int8_rows(open_page[name], open_page[_OPEN_SCALES[name]], dtype) for name in ("keys", "values")]
    if native[0] is not None and native[1] is not None:  # the same values, one C call each
        return native[0], native[1]
    return tuple(torch.mul(open_page[name], open_page[_OPEN_SCALES[name]].float()[..., None]).to(dtype)  # type: ignore
                 for name in ("keys", "values"))


def open_nbytes(open_page: dict[str, Tensor]) -> int:
    """KV bytes of an open page: keys and values (codes or the model's dtype) and, at 8 and 4 bits, their scales."""
    return sum(open_page[name].nbytes for name in ("keys", "values", *_OPEN_SCALES.values()) if name in open_page)


def open_slot_bytes(heads: int, head_dim: int, element_size: int, bits: int) -> int:
    """KV bytes of one slot of one sequence (all KV heads): ``2 * H * D * element_size`` at 16 bits
    (``element_size``: the model dtype's), ``2 * H * (D + 2)`` at 8 bits, ``2 * H * (D / 2 + 2)`` at 4."""
    return 2 * heads * (head_dim * element_size if bits == 16 else (head_dim if bits == 8 else head_dim // 2) + 2)


def left_align(tokens: dict[str, Tensor]) -> dict[str, Tensor]:
    """Move each sequence's valid slots to the front (in order) and drop all-invalid trailing slots."""
    valid = tokens["valid"]
    if bool(valid.all()):
        return tokens
    width = int(valid.sum(-1).max()) if valid.numel() else 0
    order = (~valid).to(torch.int8).argsort(dim=-1, stable=True)[:, :width]  # [B, W]
    heads = tokens["keys"].shape[1]
    head_order = order[:, None, :].expand(-1, heads, -1)
    out = {"valid": valid.gather(1, order)}
    for name, tensor in tokens.items():
        if name == "valid":
            continue
        index = head_order if tensor.dim() == 3 else head_order[..., None].expand(-1, -1, -1, tensor.shape[-1])
        out[name] = tensor.gather(2, index)
    return out
