"""The native page read's checked entry (issue 32): :func:`page_read` with its checks, what it takes
(:func:`unsupported`, which the read plan asks), the pages' rotation (:func:`rotation_matrix`) and which of the
kernel's readers reads a segment (:func:`reader_of`). The call itself, and what a decode step runs, are in
:mod:`confkv.native.pages`.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch
from torch import Tensor

from confkv.native import pages
from confkv.native.loader import library
from confkv.native.pages import _META, _NO_UPDATE, _REFUSED, BITS, _is_paged


def unsupported(query: Tensor, segments: Sequence) -> str | None:
    """Why :func:`page_read` does not take this read, or None when it does (the library not checked)."""
    if query.device.type != "cpu":
        return "query not on CPU"
    if not query.is_floating_point():
        return "query dtype"
    for segment in segments:
        if _is_paged(segment):
            widths = getattr(segment, "widths", (segment.bits, segment.bits))
            if any(bits not in BITS for bits in widths):
                return f"{'/'.join(map(str, sorted(set(widths))))}-bit pages"
            if segment.valid.device.type != "cpu":
                return "pages not on CPU"
            if any(segment.head_dim % {2: 4, 3: 8, 4: 2, 8: 1}[bits] for bits in widths):
                return "head_dim not packable"
            if segment.rotation is not None and segment.rotation.matrix.shape != (query.shape[-1],) * 2:
                return "rotation not [D, D]"
        else:
            if segment.keys_int8 or segment.values_int8:
                return "INT8 segment"
            if not (segment.keys.is_floating_point() and segment.values.is_floating_point()):
                return "segment dtype"
            if segment.keys.device.type != "cpu":
                return "segment not on CPU"
    if len(_rotations(segments)) > 1:
        return "pages in different rotations"
    return None


def _rotations(segments: Sequence) -> list[Tensor]:
    """The distinct rotation matrices ([D, D] float32) of the rotated page segments."""
    found: list[Tensor] = []
    for segment in segments:
        rotation = getattr(segment, "rotation", None)
        if rotation is not None and not any(m is rotation.matrix or torch.equal(m, rotation.matrix) for m in found):
            found.append(rotation.matrix)
    return found


def page_read(query: Tensor, segments: Sequence, scaling: float,
              need_mass: bool = True) -> tuple[Tensor, list[Tensor] | None] | None:
    """Attention of ``query`` over ``segments`` (:class:`~confkv.attention.KVSegment` s, masks allowed, and
    :class:`~confkv.attention.segments.PagedSegment` s of 2-8 bits), the contract of ``blockwise_attention``.

    Args:
        query: [B, Hq, Q, D] on CPU (converted to float32), Hq = Hkv * G.
        segments: dense segments (float keys / values; float32 and bfloat16 read as they are, other float
            dtypes converted to float32) and packed page segments (keys and values each at 2, 3, 4 or 8 bits,
            outliers' corrections added to the dequantized rows); page segments with a ``rotation`` (codes
            of ``k @ rotation.matrix``, ``v @ rotation.matrix``; one rotation per call) are scored with the
            query turned into that basis and their share of the output turned back, in the kernel.
        scaling: score multiplier.
    Returns:
        (out [B, Hq, Q, D] in ``query.dtype``, one mass [B, Hkv, L_s] float32 per segment or None), or None
        when the library is unavailable or the read is not one it takes (:func:`unsupported`).
    """
    lib = library()
    if lib is None or unsupported(query, segments) is not None or not segments:
        return None
    return pages._read(lib, query, segments, scaling, need_mass, rotation_matrix(segments))


def rotation_matrix(segments: Sequence) -> Tensor | None:
    """The one rotation of the page segments as the kernel takes it ([D, D] float32, contiguous), or None."""
    rotations = _rotations(segments)
    return rotations[0].to(torch.float32).contiguous() if rotations else None


READERS = ("row by row", "plane order", "avx512", "avx2", "channel widths")  #: confkv_page_reader's answers, by number


def reader_of(query: Tensor, segment) -> str:
    """Which of the kernel's readers reads the packed page ``segment`` for ``query`` [B, Hq, Q, D]: "avx512"
    (c/page_simd.c: the preset's pages on a CPU with AVX-512 VBMI), "avx2" (c/page_avx2.c: the same pages, and pages
    with outliers, on a CPU with AVX2, FMA and F16C but not VBMI), "channel widths" (c/page_widths.c: keys at
    per-channel widths; their values take the reader named for the rest), "plane order" (c/page_codes.c) or "row by
    row" (c/pages.c), as :func:`page_read` would choose it (the kernel's own dispatch, asked without reading).
    Raises RuntimeError when the library is unavailable, ValueError for a segment the read refuses."""
    lib = library()
    if lib is None:
        raise RuntimeError("confkv native kernels unavailable")
    kv_heads = segment.kv_heads
    rows = query.shape[1] // kv_heads * query.shape[2]
    _, info = pages._paged(segment, [])
    meta = info + [0] * (_META - len(info)) + _NO_UPDATE
    reader = lib.confkv_page_reader((ctypes.c_int64 * len(meta))(*meta), rows, query.shape[-1])
    if reader < 0:
        raise ValueError(_REFUSED)
    return READERS[reader]
