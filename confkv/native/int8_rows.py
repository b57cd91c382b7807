"""INT8 rows with one scale each, in one C call (``c/int8_rows.c``): the hot tier's INT8 tokens
(:mod:`confkv.quant`'s rule) and the ladder's INT8 open page (:func:`confkv.tiers.cold_read.encode_open`'s rule).

A decode step quantizes a token or two a layer; the torch code spends about fifteen small calls on each
(50-60 us a layer for the hot tier's keys), the C call one. Both give the same codes and scales bit for bit
(the same float32 operations in the same order; tests/native/test_int8_rows.py). Each function returns None
where the torch code must run instead: no library, a device or dtype it does not take, or a NaN or an infinity
in the rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv.native import loader

_CODES = {torch.float32: 0, torch.bfloat16: 1}
#: the library as of the loader's generation: looked up again only when that moved, so a decode step enters no
#: code of the loader (docs/ARCHITECTURE.md)
_LOADED: dict = {"generation": None, "lib": None}


def library():
    """The loaded kernels, or None (:func:`confkv.native.loader.library`, asked once per loader generation)."""
    if _LOADED["generation"] != loader.generation:
        _LOADED["lib"], _LOADED["generation"] = loader.library(), loader.generation
    return _LOADED["lib"]


def _taken(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def quantize(x: Tensor, divisor: Tensor | None = None, half_scales: bool = False) -> tuple[Tensor, Tensor] | None:
    """Symmetric INT8 codes of ``x`` [B, H, L, D] (float32 or bfloat16), one scale per row of D.

    Args:
        divisor: None, or [B, H, D] float32: each row divided by its (b, h) row first (quant.py's keys, by their
            channel scale).
        half_scales: False: quant.py's rule, scales float32 ``absmax / 127`` (a zero scale divides by 1);
            True: the open page's rule, scales float16, codes divided by ``max(float(scale), 1e-30)``.
    Returns:
        (codes int8 [B, H, L, D], scales [B, H, L] float32 or float16), or None (the torch code's turn).
    """
    lib = library()
    if lib is None or x.dtype not in _CODES or x.ndim != 4 or not _taken(x):
        return None
    batch, heads, length, width = x.shape
    if divisor is not None and (divisor.dtype != torch.float32 or divisor.shape != (batch, heads, width)
                                or not _taken(divisor)):
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


def decode(codes: Tensor, scales: Tensor, dtype: torch.dtype, multiplier: Tensor | None = None) -> Tensor | None:
    """``(codes * scales[..., None]) [* multiplier[:, :, None, :]]`` in float32, rounded once to ``dtype``.

    Args:
        codes: [B, H, L, D] int8; scales: [B, H, L] float32 or float16; multiplier: None or [B, H, D] float32
        (quant.py's channel scale). Returns [B, H, L, D] in ``dtype`` (float32 or bfloat16), or None.
    """
    lib = library()
    if (lib is None or dtype not in _CODES or codes.dtype != torch.int8 or codes.ndim != 4
            or scales.dtype not in (torch.float32, torch.float16) or not _taken(codes, scales)):
        return None
    batch, heads, length, width = codes.shape
    if multiplier is not None and (multiplier.dtype != torch.float32 or multiplier.shape != (batch, heads, width)
                                   or not _taken(multiplier)):
        return None
    codes, scales = codes.contiguous(), scales.contiguous()
    if multiplier is not None:
        multiplier = multiplier.contiguous()
    out = torch.empty(codes.shape, dtype=dtype)
    lib.confkv_int8_rows_decode(codes.data_ptr(), scales.data_ptr(), int(scales.dtype == torch.float16),
                                batch * heads * length, width, None if multiplier is None else multiplier.data_ptr(),
                                max(length, 1), _CODES[dtype], out.data_ptr())
    return out
