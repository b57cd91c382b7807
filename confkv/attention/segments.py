"""The segments an attention read takes: a run of cached tokens in the model's dtype or INT8
(:class:`KVSegment`), and selected cold pages still in their packed storage (:class:`PagedSegment`).

**KVSegment**: keys and values [B, Hkv, L, D], float or int8 (with per-token and per-channel scales,
:mod:`confkv.quant`), and an optional visibility mask broadcastable to [B, Hkv, Q, L].

**PagedSegment**: the cold tier (:mod:`confkv.tiers.cold`) keeps demoted tokens in fixed-size pages, low-bit and
KIVI-style (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache"; packing in :mod:`confkv.tiers.lowbit`), and picks per sequence and KV head the ``K``
pages whose key digest bounds ``q . k`` highest (Tang et al. 2024, "Quest"). A
:class:`PagedSegment` names those pages without copying them: the Triton paged read
(:mod:`confkv.attention.triton_pages`) and the native page read (:mod:`confkv.native.pages`) read the codes
straight from the page storage; the torch reads call :meth:`PagedSegment.to_dense` (gather + dequantize,
the reference).

Shapes (``B`` sequences, ``H`` KV heads, ``N`` pages of storage, ``P`` tokens per page,
``D`` head dim, ``G`` group size, ``Gv = min(G, D)``, ``C = lowbit.packed_width(D, bits)``)::

    index       [B, H, K] int64   page numbers, best first; -1 = no page at this rank
    counts      [B] int64         ranks read per sequence (rank >= counts[b] is not read)
    valid       [B, H, N, P] bool  slot holds a token (padding slots do not)
    bits 16:    keys, values [B, H, N, P, D] model dtype
    bits 2-8:   key_codes, value_codes [B, H, N, P, C] uint8
                key_scale, key_min     [B, H, N, P / G, D] float16  (per channel, G tokens)
                value_scale, value_min [B, H, N, P, D / Gv] float16 (per token, Gv channels)
    value_bits:  the value codes' width when it differs from ``bits`` (``C_v = packed_width(D, value_bits)``),
                 else None
    outliers:   key_outlier_index, key_outlier_value, value_outlier_index, value_outlier_value
                [B, H, N, O] int16 / float16 (a format with ``outliers``, :mod:`confkv.tiers.outliers`):
                a correction added to entry ``t * D + d`` of the dequantized page, O per page and tensor
    key_widths: [B, H, N, D] uint8 (a format with ``channel_bits``, :mod:`confkv.tiers.channel_bits`): each key
                channel's width in its page, the key codes ``C = row_bytes(bits, D, P)`` bytes a token; the keys
                are then never rotated (a ``rotation`` turns the values only)

The segment's slots are the ``K * P`` slots of the selected pages in rank order (slot
``j * P + t`` is token ``t`` of the rank-``j`` page), so its attention mass is
[B, H, K * P], the shape :meth:`confkv.tiers.cold.ColdTier.observe` takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from confkv.tiers import channel_bits, lowbit
from confkv.tiers.outliers import restore

#: the optional outlier storage of a :class:`PagedSegment` (all four or none)
OUTLIER_STORAGE = ("key_outlier_index", "key_outlier_value", "value_outlier_index", "value_outlier_value")


@dataclass
class KVSegment:
    """One contiguous run of cached tokens, in FP or INT8 storage.

    Attributes:
        keys: [B, Hkv, L, D] float (model dtype) or int8.
        values: [B, Hkv, L, D] float or int8.
        visible: bool, broadcastable to [B, Hkv, Q, L]; True = the query may
            attend this slot.  None = all visible.
        key_token_scale: [B, Hkv, L] float32, iff keys are int8.
        key_channel_scale: [B, Hkv, D] float32, iff keys are int8.
        value_token_scale: [B, Hkv, L] float32, iff values are int8.
    """

    keys: Tensor
    values: Tensor
    visible: Tensor | None
    key_token_scale: Tensor | None = None
    key_channel_scale: Tensor | None = None
    value_token_scale: Tensor | None = None

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def keys_int8(self) -> bool:
        return self.keys.dtype == torch.int8

    @property
    def read_kind(self) -> tuple:
        """What a read plan looks at in this segment (dtypes, device, a mask or none, empty or not): two segments of
        one kind go the same way (:func:`confkv.attention.read_plan.plan`)."""
        return ("dense", self.keys.dtype, self.values.dtype, self.keys.device, self.visible is None, self.length > 0)

    @property
    def values_int8(self) -> bool:
        return self.values.dtype == torch.int8

    def validate(self) -> None:
        """Raise ValueError if the scales do not match the storage dtypes."""
        if self.keys.shape != self.values.shape:
            raise ValueError(f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} differ")
        if self.keys_int8 != (self.key_token_scale is not None and self.key_channel_scale is not None):
            raise ValueError("int8 keys need key_token_scale and key_channel_scale (and fp keys must have none)")
        if self.values_int8 != (self.value_token_scale is not None):
            raise ValueError("int8 values need value_token_scale (and fp values must have none)")

    def to_float(self) -> "KVSegment":
        """This segment itself, or with its INT8 keys and/or values dequantized to float32 [B, Hkv, L, D]
        (for reads that take no INT8 segment: the native page read beside cold pages)."""
        if not (self.keys_int8 or self.values_int8):
            return self
        from confkv import quant  # noqa: PLC0415 - the INT8 path only

        keys, values = self.keys, self.values
        if self.keys_int8:
            keys = quant.dequantize_keys(keys, self.key_token_scale, self.key_channel_scale)
        if self.values_int8:
            values = quant.dequantize_values(values, self.value_token_scale)
        return KVSegment(keys, values, self.visible)


def take_rows(t: Tensor, index: Tensor) -> Tensor:
    """``t`` [B, H, L, D] at slots ``index`` [B, H, K] of each head: ``t.gather(2, index[..., None].expand(..., D))``,
    the same values, as one ``index_select`` of whole rows (a decode step's compaction gathers a few hundred
    rows per head: about 4x faster than the element-wise gather, `benchmarks/take_rows_micro.py`). Every index must be
    in [0, L): unlike ``gather``, a slot past L is not refused but read from the next head's rows (the callers' indices
    are in range by construction). Also ``confkv.store.hot_tier.take_rows``."""
    batch, heads, length, dim = t.shape
    return t.reshape(batch * heads * length, dim).index_select(0, _flat_rows(index, length)).reshape(
        batch, heads, -1, dim)


def _flat_rows(index: Tensor, length: int) -> Tensor:
    """[B * H * K] the rows of ``index`` [B, H, K] (slots or pages of each head, in [0, length)) in a [B * H * length,
    ...] view of their tensor: :func:`take_rows`' and :func:`gather_pages_of`' ``index_select``."""
    batch, heads = index.shape[:2]
    return (index.reshape(batch * heads, -1) + (torch.arange(batch * heads, device=index.device) * length)[:, None]
            ).reshape(-1)


def gather_pages(tensor: Tensor, index: Tensor) -> Tensor:
    """``tensor`` [B, H, N, ...] at pages ``index`` [B, H, K] (valid page numbers) -> [B, H, K, ...].

    A contiguous tensor is read as whole pages by :func:`take_rows` (the same values, several times faster than the
    element-wise ``gather`` of a page's many entries); every page number must then be in [0, N), as the callers' are
    by construction."""
    tail = tensor.shape[3:]
    if tail and tensor.numel() and tensor.is_contiguous() and index.shape[:2] == tensor.shape[:2]:
        return take_rows(tensor.reshape(*tensor.shape[:3], -1), index).reshape(*index.shape, *tail)
    expanded = index.reshape(*index.shape, *([1] * len(tail))).expand(*index.shape, *tail)
    return tensor.gather(2, expanded)


def gather_pages_of(tensors: dict[str, Tensor], index: Tensor) -> dict[str, Tensor]:
    """:func:`gather_pages` of each of ``tensors`` ([B, H, N, ...], the same B, H and N) at pages ``index`` [B, H, K],
    the same values, with the rows to take worked out once for all of them (a cold tier's step-down gathers a dozen
    tensors of its pages at the same index): one ``index_select`` each, of whole pages. A tensor that is not
    contiguous (or shaped otherwise) goes through :func:`gather_pages`. Page numbers must be in [0, N)."""
    batch, heads, _ = index.shape
    out, rows = {}, None
    for name, tensor in tensors.items():
        if not (tensor.is_contiguous() and tensor.dim() >= 3 and tensor.shape[:2] == index.shape[:2]
                and tensor.numel()):
            out[name] = gather_pages(tensor, index)
            continue
        count = tensor.shape[2]
        if rows is None or rows[0] != count:
            rows = (count, _flat_rows(index, count))
        taken = tensor.reshape(batch * heads * count, -1).index_select(0, rows[1])
        out[name] = taken.reshape(*index.shape, *tensor.shape[3:])
    return out


@dataclass
class PagedSegment:
    """Selected cold pages of one layer, unread (see the module docstring for shapes)."""

    index: Tensor
    counts: Tensor
    valid: Tensor
    bits: int
    group_size: int
    head_dim: int
    keys: Tensor | None = None
    values: Tensor | None = None
    key_codes: Tensor | None = None
    key_scale: Tensor | None = None
    key_min: Tensor | None = None
    value_codes: Tensor | None = None
    value_scale: Tensor | None = None
    value_min: Tensor | None = None
    #: the orthogonal rotation the codes are in (a rotated format, :mod:`confkv.tiers.hadamard`: codes of
    #: ``k @ rotation.matrix`` and ``v @ rotation.matrix``, ``matrix`` [D, D] float32), or None. The native
    #: read turns the query into it and the pages' share of the output back; :meth:`to_dense` decodes back.
    rotation: Any = None
    #: the value codes' width when it differs from ``bits`` (keys at ``bits``), else None
    value_bits: int | None = None
    key_outlier_index: Tensor | None = None
    key_outlier_value: Tensor | None = None
    value_outlier_index: Tensor | None = None
    value_outlier_value: Tensor | None = None
    #: [B, H, N, D] uint8 each key channel's width in its page (format ``channel_bits``), or None (one width)
    key_widths: Tensor | None = None
    #: what the native page read worked out from this segment (its pointers and layout, :mod:`confkv.native.pages`),
    #: kept for the next read of the same segment object (a decode step's cold tier hands the same one over while
    #: its pages do not change); None until the first native read
    native_args: Any = field(default=None, repr=False, compare=False)

    @property
    def widths(self) -> tuple[int, int]:
        """(key bits, value bits)."""
        return self.bits, self.bits if self.value_bits is None else self.value_bits

    @property
    def has_outliers(self) -> bool:
        return self.key_outlier_index is not None

    @property
    def plain(self) -> bool:
        """One width and no outliers: the storage the Triton paged read takes."""
        return self.widths[0] == self.widths[1] and not self.has_outliers and self.key_widths is None

    @property
    def page_size(self) -> int:
        return self.valid.shape[3]

    @property
    def read_kind(self) -> tuple:
        """What a read plan looks at in these pages (widths, outliers, device, head size, the rotation object's
        identity): pages of one kind go the same way (:func:`confkv.attention.read_plan.plan`)."""
        return ("pages", self.widths, self.has_outliers, self.key_widths is not None, self.valid.device,
                self.head_dim, None if self.rotation is None else id(self.rotation))

    @property
    def width(self) -> int:
        """K, the selected pages per sequence and head."""
        return self.index.shape[2]

    @property
    def length(self) -> int:
        """K * P slots."""
        return self.width * self.page_size

    @property
    def kv_heads(self) -> int:
        return self.index.shape[1]

    def validate(self) -> None:
        """Raise ValueError if the storage does not match ``bits``."""
        if self.bits == 16:
            if self.keys is None or self.values is None:
                raise ValueError("16-bit pages need keys and values")
        elif self.bits in (2, 3, 4, 8):
            names = ("key_codes", "key_scale", "key_min", "value_codes", "value_scale", "value_min")
            missing = [name for name in names if getattr(self, name) is None]
            if missing:
                raise ValueError(f"{self.bits}-bit pages need {', '.join(missing)}")
            if self.widths[1] not in (2, 3, 4, 8):
                raise ValueError(f"value_bits must be one of 2, 3, 4, 8, got {self.value_bits!r}")
            outliers = [getattr(self, name) is None for name in OUTLIER_STORAGE]
            if any(outliers) and not all(outliers):
                raise ValueError(f"pages with outliers need all of {', '.join(OUTLIER_STORAGE)}")
        else:
            raise ValueError(f"bits must be one of 2, 3, 4, 8, 16, got {self.bits!r}")

    def visible(self) -> Tensor:
        """[B, H, 1, K * P] bool: the slots read (a selected page's valid slots, ranks < counts)."""
        batch, heads, width = self.index.shape
        device = self.index.device
        rank_ok = torch.arange(width, device=device)[None, :] < self.counts.to(device)[:, None]  # [B, K]
        live = (self.index >= 0) & rank_ok[:, None, :]
        slots = gather_pages(self.valid, self.index.clamp_min(0))  # [B, H, K, P]
        return (slots & live[..., None]).reshape(batch, heads, 1, width * self.page_size)

    def to_dense(self) -> KVSegment:
        """The reference read: gather the pages and dequantize them with torch.

        Returns:
            a :class:`KVSegment` of length K * P: keys / values [B, H, K * P, D]
            (model dtype at 16 bits, else float32; in the model's basis, a :attr:`rotation` undone)
            and the :meth:`visible` mask.
        """
        self.validate()
        index = self.index.clamp_min(0)
        batch, heads, width = index.shape
        if self.bits == 16:
            keys, values = gather_pages(self.keys, index), gather_pages(self.values, index)
        else:
            bits, group, dim = self.bits, self.group_size, self.head_dim
            qk = lowbit.Quantized(*(gather_pages(t, index) for t in (self.key_codes, self.key_scale, self.key_min)))
            qv = lowbit.Quantized(*(gather_pages(t, index) for t in (self.value_codes, self.value_scale, self.value_min)))
            if self.key_widths is None:
                keys = lowbit.dequantize_keys(qk, bits, dim, group)
            else:  # each channel at its page's width; scale and minimum per channel and group, as KIVI's
                codes = channel_bits.unpack(qk.codes, gather_pages(self.key_widths, index))
                lead = codes.shape[:-2]
                grouped = codes.reshape(*lead, codes.shape[-2] // group, group, dim)
                keys = channel_bits.dequantize_groups(grouped, qk.scale.unsqueeze(-2),
                                                      qk.minimum.unsqueeze(-2)).reshape(codes.shape)
            values = lowbit.dequantize_values(qv, self.widths[1], dim, group)
            if self.has_outliers:
                keys = restore(keys, gather_pages(self.key_outlier_index, index),
                               gather_pages(self.key_outlier_value, index))
                values = restore(values, gather_pages(self.value_outlier_index, index),
                                 gather_pages(self.value_outlier_value, index))
        if self.rotation is not None:
            values = self.rotation.inverse(values)
            keys = keys if self.key_widths is not None else self.rotation.inverse(keys)
        shape = (batch, heads, width * self.page_size, self.head_dim)
        return KVSegment(keys.reshape(shape), values.reshape(shape), self.visible())


def densify(segments: list) -> list[KVSegment]:
    """Every :class:`PagedSegment` of ``segments`` replaced by :meth:`PagedSegment.to_dense`."""
    return [s.to_dense() if isinstance(s, PagedSegment) else s for s in segments]
