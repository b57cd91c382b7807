"""The native read of packed cold pages (issue 32): dense segments and KIVI pages in one C call.

:func:`page_read` computes what :func:`confkv.attention.blockwise.blockwise_attention` computes over
``densify(segments)`` (the torch reference: gather and dequantize every selected page, then the block-wise
read), but reads each selected page still packed (``kernels.c``'s ``confkv_page_read``): the codes of one
token row are unpacked and dequantized into a D-float buffer, and every segment's slots go through one
float32 softmax. Visibility masks (left padding, invalid slots, pages a sequence does not read) are applied
in the kernel. It returns the same per-slot attention mass ([B, Hkv, L_s] per segment, a page segment's
slots in rank order), which the cold tier's page heat and the ranking take.

The checked entry (:func:`page_read`, :func:`unsupported`, which the read plan asks, :func:`rotation_matrix`,
:func:`reader_of`) is :mod:`confkv.native.page_entry`; this module is what a decode step
runs: the call (:class:`PageReader`, with its in-place updates, :class:`InPlaceUpdate`), a cold tier's pages
dropped in one C call (:func:`keep_pages`), and INT8 token rows quantized and decoded in one C call each
(:func:`quantize_int8_rows`, :func:`decode_int8_rows`: the hot tier's and the open page's). What a page segment
carries beyond its codes (outliers, per-channel key widths) is laid out by :mod:`confkv.native.page_extras`.
"""

from __future__ import annotations

import ctypes
import math
import operator
import struct
from array import array
from typing import Sequence

import torch
from torch import Tensor

from confkv.native import _sum_lanes, loader
from confkv.native.loader import library
from confkv.native.page_extras import OUTLIER_NAMES as _OUTLIER_NAMES, inner_contiguous, key_widths, outlier_tensors

_CODES = {torch.float32: 0, torch.bfloat16: 1}
_PTRS, _META = 14, 52  # a segment's own entries (kernels.c's PR_PTRS, PR_META less the update's)
_UPDATE_META = 5  # kernels.c's PR_UPDATE_META: then the update's entries, and its target as the last pointer
UPDATE_STATISTIC, UPDATE_PAGE_HEAT = 1, 2  # kernels.c's UPDATE_*
_NO_UPDATE = [0] * _UPDATE_META
_REFUSED = "confkv native page read: a page segment's bits, group size or outlier storage is not one it takes"
#: bit widths of the packed pages the kernel reads
BITS = (2, 3, 4, 8)
_META_PADDING = [0] * _META
_WIDTHS_AT = 48  # kernels.c's meta[48]: keys at per-channel widths (then their strides)


def _is_paged(segment) -> bool:
    return hasattr(segment, "index") and hasattr(segment, "counts")


def _dense(segment, batch: int, kv_heads: int, queries: int, keep: list) -> tuple[list, list]:
    keys, values = segment.keys, segment.values
    if keys.dtype not in _CODES:
        keys = keys.float()
    if values.dtype not in _CODES:
        values = values.float()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    length = keys.shape[2]
    meta = [0, length, _CODES[keys.dtype], _CODES[values.dtype], *keys.stride()[:3], *values.stride()[:3]]
    mask = 0
    if segment.visible is not None:
        visible = segment.visible
        while visible.dim() < 4:
            visible = visible.unsqueeze(0)
        visible = visible.to(torch.bool).expand(batch, kv_heads, queries, length)
        meta += list(visible.stride())
        keep.append(visible)
        mask = visible.data_ptr()
    else:
        meta += [0, 0, 0, 0]
    keep += [keys, values]
    return [keys.data_ptr(), values.data_ptr(), mask] + [0] * (_PTRS - 3), meta


def _paged(segment, keep: list) -> tuple[list, list]:
    """The pointers and layout of a page segment, as the call takes them (the tensors they point into added to
    ``keep``); kept on the segment (:attr:`~confkv.attention.segments.PagedSegment.native_args`) for its next read
    when every tensor pointed into is the segment's own or a copy of its page numbers and counts, and used again
    while every field they were worked out from is the same object (a segment copied field by field with one
    changed works them out again)."""
    fields = _fields_of(segment)
    cached = getattr(segment, "native_args", None)
    if cached is not None and all(map(operator.is_, cached[0], fields)):  # the fields it was worked out from
        keep += cached[3]
        return cached[1], cached[2]
    held: list[Tensor] = []
    ptrs, meta = _paged_args(segment, held)
    keep += held
    if hasattr(segment, "native_args") and all(any(t is mine for mine in fields) for t in held[2:]):
        segment.native_args = (fields, ptrs, meta, held)  # no page tensor copied (a copy would go stale)
    return ptrs, meta


_STORAGE_NAMES = ("key_codes", "key_scale", "key_min", "value_codes", "value_scale", "value_min")
#: what :func:`_paged_args` reads of a segment: kept arguments serve a segment whose every one of these is the same object
_FIELDS = ("index", "counts", "valid", "bits", "group_size", "head_dim", "rotation", "value_bits") + _STORAGE_NAMES + \
    _OUTLIER_NAMES + ("key_widths",)
_FIELD_GETTER = operator.attrgetter(*_FIELDS)


def _fields_of(segment) -> tuple:
    """The segment's :data:`_FIELDS` (None for one it lacks), in one C-level lookup where it has them all."""
    try:
        return _FIELD_GETTER(segment)
    except AttributeError:
        return tuple(getattr(segment, name, None) for name in _FIELDS)


def _paged_args(segment, keep: list) -> tuple[list, list]:
    index = segment.index.to(torch.int64).contiguous()
    counts = segment.counts.to(device="cpu", dtype=torch.int64).contiguous()
    valid = inner_contiguous(segment.valid.to(torch.bool), 3)
    storage = [inner_contiguous(getattr(segment, name), 3) for name in _STORAGE_NAMES]
    if any(t.dtype != torch.float16 for t in storage[1:3] + storage[4:]) or any(
            t.dtype != torch.uint8 for t in (storage[0], storage[3])):
        raise ValueError("packed pages: codes must be uint8 and scales / minima float16")
    width, page = segment.width, segment.page_size
    key_bits, value_bits = getattr(segment, "widths", (segment.bits, segment.bits))
    meta = [1, width * page, width, page, key_bits, segment.group_size, min(segment.group_size, segment.head_dim),
            storage[0].shape[-1], index.stride(0), index.stride(1), counts.stride(0), *valid.stride()[:3]]
    for t in storage:
        meta += list(t.stride()[:3])
    # [32]: 1 keys and values coded in the call's rotation, 2 the values only (keys at per-channel widths)
    meta.append(0 if segment.rotation is None else 2 if getattr(segment, "key_widths", None) is not None else 1)
    meta += [value_bits, storage[3].shape[-1]]  # [33] value bits, [34] packed value bytes per row
    outliers = outlier_tensors(segment)
    meta.append(outliers[0].shape[-1] if outliers else 0)  # [35] outliers per page and tensor
    for t in outliers:
        meta += list(t.stride()[:3])
    keep += [index, counts, valid, *storage, *outliers]
    ptrs = [index.data_ptr(), counts.data_ptr(), valid.data_ptr()] + [t.data_ptr() for t in storage + outliers]
    widths = key_widths(segment)
    if widths is None:
        return ptrs + [0] * (_PTRS - len(ptrs)), meta
    keep.append(widths)  # [48] keys at per-channel widths, [49..51] their strides (b, h, n); the last pointer
    meta += [0] * (_WIDTHS_AT - len(meta)) + [1, *widths.stride()[:3]]
    return ptrs + [0] * (_PTRS - 1 - len(ptrs)) + [widths.data_ptr()], meta


class PageReader:
    """``page_entry.page_read`` for the reads of one store that the read plan sent here, checked once (issue 32: the
    path is decided when the kind of read changes, :meth:`confkv.store.read.AttentionRead._tiered_read`, and the
    steps between call the kernel without asking again).

    Args:
        lib: the loaded library.
        rotation: the pages' rotation matrix as :func:`~confkv.native.page_entry.rotation_matrix` gives it, or None.
    """

    __slots__ = ("lib", "rotation", "lanes")

    def __init__(self, lib: ctypes.CDLL, rotation: Tensor | None) -> None:
        self.lib, self.rotation = lib, rotation
        self.lanes = _sum_lanes(lib)  # torch's float sum order on this build and CPU (0: not matched)

    def __call__(self, query: Tensor, segments: Sequence, scaling: float, need_mass: bool = True,
                 updates: Sequence[InPlaceUpdate | None] | None = None) -> tuple[Tensor, list[Tensor] | None]:
        """``page_read``'s result for a read of the kind this reader was made for (not checked again), with
        ``updates`` (per segment, or None) made in place from the masses (see :meth:`takes`)."""
        return _read(self.lib, query, segments, scaling, need_mass, self.rotation, updates, self.lanes)

    def takes(self, updates: Sequence[InPlaceUpdate | None]) -> bool:
        """Whether this reader makes ``updates`` bit for bit as torch would: page heat needs torch's float sum order
        matched on this build and CPU (``confkv.native``'s calibration)."""
        return self.lanes > 0 or all(u is None or u.fields[0] != UPDATE_PAGE_HEAT for u in updates)


class InPlaceUpdate:
    """What a page read updates in place from one segment's masses, so that the store makes no call for it
    (kernels.c's ``update_in_place``): a dense segment's linear statistic (:meth:`statistic`) or a page segment's
    page heat (:meth:`page_heat`). ``target``: the float32 tensor written; ``fields``: the call's entries for it.
    The constructor checks the target (:meth:`statistic`, on the decode step's path, leaves that to its caller)."""

    __slots__ = ("target", "fields")

    def __init__(self, target: Tensor, fields: list[int]) -> None:
        if target.dtype != torch.float32 or target.dim() != 3 or target.device.type != "cpu" or (
                target.stride(2) != 1 and target.shape[2] > 1):
            raise ValueError(f"an in-place update's target must be a float32 [B, Hkv, N] CPU tensor with its last "
                             f"dimension contiguous, got {target.dtype} {tuple(target.shape)} on {target.device}")
        self.target, self.fields = target, fields

    @classmethod
    def statistic(cls, stat: Tensor, scale_and_gain_bits: tuple[int, int]) -> "InPlaceUpdate":
        """``stat`` [B, Hkv, L] (the segment's slots) becomes ``stat * scale + mass * gain``, rounded as torch's
        ``stat.mul_(scale).add_(mass, alpha=gain)`` (a policy's ``linear_observe``), scale and gain given as their
        float32 bits (:func:`float32_bits`). Not checked: the caller (a decode step, once a region and layer) holds a
        float32 contiguous CPU tensor."""
        update = cls.__new__(cls)
        update.target, update.fields = stat, [UPDATE_STATISTIC, stat.stride(0), stat.stride(1), *scale_and_gain_bits]
        return update

    @classmethod
    def page_heat(cls, heat: Tensor) -> "InPlaceUpdate":
        """Each page the segment reads, ``heat[b, h, page]`` ([B, Hkv, N]) += its slots' masses summed in torch's
        order: the cold tier's ``observe`` (``mass.reshape(B, H, K, P).sum(-1)``, then ``scatter_add_``)."""
        return cls(heat, [UPDATE_PAGE_HEAT, heat.stride(0), heat.stride(1), 0, 0])  # [3]: the lanes, at the read


def float32_bits(x: float) -> int:
    """``x`` rounded to float32 as torch rounds a Python scalar for a float32 tensor, as its bit pattern."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _read(lib: ctypes.CDLL, query: Tensor, segments: Sequence, scaling: float, need_mass: bool,
          rotation: Tensor | None, updates: Sequence[InPlaceUpdate | None] | None = None,
          lanes: int = 0) -> tuple[Tensor, list[Tensor] | None]:
    """The C call of :func:`~confkv.native.page_entry.page_read` (the read checked by the caller; ``rotation``: the
    pages' [D, D] float32).
    ``updates``: per segment, what the call updates in place from its masses, or None; ``lanes``: the vector width
    of torch's float sum order (``confkv.native._sum_lanes``, the library's calibration), which page heat needs.

    It runs in every layer of every decode step, so its arguments go over as ``array`` buffers (a ctypes array
    built from a list costs a microsecond per few entries) and the masses are views of one float32 buffer."""
    batch, q_heads, queries, head_dim = query.shape
    kv_heads = segments[0].kv_heads if _is_paged(segments[0]) else segments[0].keys.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"Hq={q_heads} is not a multiple of Hkv={kv_heads}")
    if updates is not None and (not need_mass or len(updates) != len(segments)):
        raise ValueError("in-place updates: one entry per segment, and the masses they are made from (need_mass)")
    keep: list[Tensor] = []
    pointers, meta = array("Q"), array("q")
    lengths = []
    for number, segment in enumerate(segments):
        ptrs, info = _paged(segment, keep) if _is_paged(segment) else _dense(segment, batch, kv_heads, queries, keep)
        pointers.extend(ptrs)
        meta.extend(info)
        meta.extend(_META_PADDING[:_META - len(info)])
        lengths.append(info[1])
        update = updates[number] if updates is not None else None
        if update is None:
            pointers.append(0)
            meta.extend(_NO_UPDATE)
            continue
        target = update.target
        statistic = update.fields[0] == UPDATE_STATISTIC
        if target.shape[:2] != (batch, kv_heads) or (statistic and target.shape[2] != info[1]):
            raise ValueError(f"in-place update of segment {number}: target {tuple(target.shape)} does not match the "
                             f"segment ([{batch}, {kv_heads}, {info[1]}] slots, or pages)")
        if update.fields[0] == UPDATE_PAGE_HEAT and not lanes:
            raise ValueError("in-place page heat needs the lanes of torch's sum order (lanes=0: not matched here)")
        keep.append(target)
        pointers.append(target.data_ptr())
        meta.extend(update.fields if update.fields[0] != UPDATE_PAGE_HEAT else update.fields[:3] + [lanes, 0])
    q = query.to(torch.float32).contiguous()
    out = torch.empty(batch, q_heads, queries, head_dim, dtype=torch.float32)
    mass, mass_ptrs = None, None
    if need_mass:  # [B, Hkv, L_s] per segment, one after another in one buffer
        rows = batch * kv_heads
        flat = torch.empty(rows * sum(lengths), dtype=torch.float32)
        mass, mass_ptrs, start, base = [], array("Q"), 0, flat.data_ptr()
        for length in lengths:
            mass.append(flat.as_strided((batch, kv_heads, length), (kv_heads * length, length, 1), start))
            mass_ptrs.append(base + 4 * start)
            start += rows * length
    status = lib.confkv_page_read(q.data_ptr(), batch, q_heads, queries, head_dim, kv_heads, len(segments),
                                  pointers.buffer_info()[0], meta.buffer_info()[0], float(scaling), out.data_ptr(),
                                  mass_ptrs.buffer_info()[0] if need_mass else None,
                                  rotation.data_ptr() if rotation is not None else None, torch.get_num_threads())
    if status == 1:
        raise MemoryError("confkv native page read: out of memory for the scores")
    if status:
        raise ValueError(_REFUSED)
    return out.to(query.dtype), mass


_library_now: list = [None, None]  # (loader.generation, the library then): the moves run in every decode step


def _moves_library():
    """The library, looked up again only when the loader's generation changes (no call into the loader a step)."""
    if _library_now[0] != loader.generation:
        _library_now[:] = [loader.generation, library()]
    return _library_now[1]


def keep_pages(tensors: Sequence[Tensor], dropped: Tensor, live: int, exact: bool) -> list[Tensor] | None:
    """A cold tier's page tensors (each [B, H, capacity, ...], its first ``live`` pages per row live) without pages
    ``dropped`` [B, H, M] (distinct per row), the others in order at the front, in one C call (``c/page_moves.c``):
    new tensors of exactly ``live - M`` pages with ``exact``, else the same tensors, their pages moved down in place.
    The bytes of the torch path's gather (``cold.py``'s ``_keep_pages``). None (nothing changed) without the library,
    for tensors off the CPU or not contiguous, or an index out of range or repeated."""
    lib = _moves_library()
    if lib is None or dropped.device.type != "cpu" or dropped.dtype != torch.int64 or not tensors:
        return None
    if not all(t.device.type == "cpu" and t.is_contiguous() and t.dim() >= 3 for t in tensors):
        return None
    batch, heads, count = dropped.shape
    if any(tuple(t.shape[:2]) != (batch, heads) for t in tensors):
        return None
    kept = live - count
    out = [t.new_empty((batch, heads, kept) + tuple(t.shape[3:])) for t in tensors] if exact else list(tensors)
    index = dropped.contiguous()
    sources, targets = array("Q", [t.data_ptr() for t in tensors]), array("Q", [t.data_ptr() for t in out])
    capacity, capacity_out = array("q", [t.shape[2] for t in tensors]), array("q", [t.shape[2] for t in out])
    page_bytes = array("q", [t.element_size() * math.prod(t.shape[3:]) for t in tensors])
    if lib.confkv_keep_pages(batch, heads, live, count, index.data_ptr(), len(tensors), sources.buffer_info()[0],
                             capacity.buffer_info()[0], targets.buffer_info()[0], capacity_out.buffer_info()[0],
                             page_bytes.buffer_info()[0]):
        return None
    return out


# -- INT8 rows with one scale each, in one C call (c/int8_rows.c): the hot tier's INT8 tokens (confkv/quant.py's
# rule) and the ladder's INT8 open page (tiers/cold_read.py's). A decode step quantizes a token or two a layer, which
# the torch code does in about fifteen small calls; both give the same codes and scales bit for bit (the same float32
# operations in the same order; tests/native/test_int8_rows.py). Here, not in a module of their own, so that a step
# enters no more files (docs/ARCHITECTURE.md). Each returns None where the torch code must run instead: no library,
# a device or dtype it does not take, or a NaN or an infinity in the rows.

def _on_cpu(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def quantize_int8_rows(x: Tensor, divisor: Tensor | None = None,
                       half_scales: bool = False) -> tuple[Tensor, Tensor] | None:
    """Symmetric INT8 codes of ``x`` [B, H, L, D] (float32 or bfloat16), one scale per row of D.

    Args:
        divisor: None, or [B, H, D] float32: each row divided by its (b, h) row first (quant.py's keys, by their
            channel scale).
        half_scales: False: quant.py's rule, scales float32 ``absmax / 127`` (a zero scale divides by 1);
            True: the open page's rule, scales float16, codes divided by ``max(float(scale), 1e-30)``.
    Returns:
        (codes int8 [B, H, L, D], scales [B, H, L] float32 or float16), or None (the torch code's turn).
    """
    lib = _moves_library()
    if lib is None or x.dtype not in _CODES or x.ndim != 4 or not _on_cpu(x):
        return None
    batch, heads, length, width = x.shape
    if divisor is not None and (divisor.dtype != torch.float32 or divisor.shape != (batch, heads, width)
                                or not _on_cpu(divisor)):
        return None
    x = x.contiguous()
    codes = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[:3], dtype=torch.float16 if half_scales else torch.float32)
    if divisor is not None:
        divisor = divisor.contiguous()
    status = lib.confkv_int8_rows(x.data_ptr(), _CODES[x.dtype], batch * heads * length, width,
                                  None if divisor is None else divisor.data_ptr(), max(length, 1), int(half_scales),
                                  codes.data_ptr(), scales.data_ptr())
    if status == 2:
        raise MemoryError("confkv native INT8 rows: out of memory for a row")
    return None if status else (codes, scales)


def decode_int8_rows(codes: Tensor, scales: Tensor, dtype: torch.dtype,
                     multiplier: Tensor | None = None) -> Tensor | None:
    """``(codes * scales[..., None]) [* multiplier[:, :, None, :]]`` in float32, rounded once to ``dtype``.

    Args:
        codes: [B, H, L, D] int8; scales: [B, H, L] float32 or float16; multiplier: None or [B, H, D] float32
        (quant.py's channel scale). Returns [B, H, L, D] in ``dtype`` (float32 or bfloat16), or None.
    """
    lib = _moves_library()
    if (lib is None or dtype not in _CODES or codes.dtype != torch.int8 or codes.ndim != 4
            or scales.dtype not in (torch.float32, torch.float16) or scales.shape != codes.shape[:3]
            or not _on_cpu(codes, scales)):
        return None
    batch, heads, length, width = codes.shape
    if multiplier is not None and (multiplier.dtype != torch.float32 or multiplier.shape != (batch, heads, width)
                                   or not _on_cpu(multiplier)):
        return None
    codes, scales = codes.contiguous(), scales.contiguous()
    if multiplier is not None:
        multiplier = multiplier.contiguous()
    out = torch.empty(codes.shape, dtype=dtype)
    lib.confkv_int8_rows_decode(codes.data_ptr(), scales.data_ptr(), int(scales.dtype == torch.float16),
                                batch * heads * length, width, None if multiplier is None else multiplier.data_ptr(),
                                max(length, 1), _CODES[dtype], out.data_ptr())
    return out


def score_entries(query: Tensor, segments: Sequence) -> int:
    """B * Hq * Q * (slots of every segment): the float32 scores the read holds at once."""
    total = sum(s.length for s in segments)
    return math.prod(query.shape[:3]) * total
