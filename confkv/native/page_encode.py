"""KIVI pages encoded and decoded in one C call each (``c/page_encode.c``; issue 32: "demotion and quantization of
a page run in C"): what :class:`confkv.tiers.formats.KiviFormat` computes after its change of basis, for the pages
a cold tier seals and the ones a ladder steps down.

The codes, float16 scales and minima, and the decoded keys and values, equal the torch code's bit for bit (the same
float32 operations in the same order; a zero minimum may carry the other sign where a group holds zeros of both signs,
which decodes the same; ``tests/native/test_page_encode.py``). Both functions return None where the torch
code must run instead: no library, tensors off the CPU or not float32, a shape or width the call does not take,
or (encoding) a NaN, an infinity or a value past float16's range.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from confkv.native.pages import _moves_library

WIDTHS = (2, 3, 4, 8)
_CODES_PER_WORD = {2: 4, 3: 8, 4: 2, 8: 1}
_NAMES = ("key_codes", "key_scale", "key_min", "value_codes", "value_scale", "value_min")


def _takes(head_dim: int, page: int, key_bits: int, value_bits: int, group: int, vgroup: int) -> bool:
    return (key_bits in WIDTHS and value_bits in WIDTHS and page > 0 and group > 0 and page % group == 0
            and vgroup > 0 and head_dim % vgroup == 0
            and head_dim % _CODES_PER_WORD[key_bits] == 0 and head_dim % _CODES_PER_WORD[value_bits] == 0)


def encode_kivi(keys: Tensor, values: Tensor, valid: Tensor, key_bits: int, value_bits: int, group: int,
                vgroup: int) -> dict[str, Tensor] | None:
    """KIVI codes of pages in their quantization basis.

    Args:
        keys, values: [..., P, D] float32 (pages of P tokens); valid: [..., P] bool (keys' ranges from valid
            slots only; values' from every slot).
        key_bits, value_bits: 2, 3, 4 or 8. group: tokens a key group spans (per channel); vgroup: channels a
            value group spans (per token).
    Returns:
        ``key_codes`` [..., P, D * key_bits / 8] uint8, ``key_scale`` / ``key_min`` [..., P / group, D] float16,
        ``value_codes`` [..., P, D * value_bits / 8], ``value_scale`` / ``value_min`` [..., P, D / vgroup]; or None.
    """
    lib = _moves_library()
    if (lib is None or keys.dtype != torch.float32 or values.dtype != torch.float32 or keys.shape != values.shape
            or keys.ndim < 2 or valid.shape != keys.shape[:-1] or valid.dtype != torch.bool
            or any(t.device.type != "cpu" for t in (keys, values, valid))):
        return None
    *lead, page, dim = keys.shape
    if not _takes(dim, page, key_bits, value_bits, group, vgroup):
        return None
    pages = math.prod(lead)
    out = {"key_codes": torch.empty(*lead, page, dim * key_bits // 8, dtype=torch.uint8),
           "key_scale": torch.empty(*lead, page // group, dim, dtype=torch.float16),
           "value_codes": torch.empty(*lead, page, dim * value_bits // 8, dtype=torch.uint8),
           "value_scale": torch.empty(*lead, page, dim // vgroup, dtype=torch.float16)}
    out["key_min"], out["value_min"] = torch.empty_like(out["key_scale"]), torch.empty_like(out["value_scale"])
    keys, values, valid = keys.contiguous(), values.contiguous(), valid.contiguous()
    status = lib.confkv_kivi_encode(keys.data_ptr(), values.data_ptr(), valid.data_ptr(), pages, page, dim, key_bits,
                                    value_bits, group, vgroup, *(out[name].data_ptr() for name in _NAMES))
    if status == 2:
        raise MemoryError("confkv native page encode: out of memory for a page's codes")
    return None if status else {name: out[name] for name in _NAMES}


def decode_kivi(data: dict[str, Tensor], key_bits: int, value_bits: int, group: int,
                vgroup: int) -> tuple[Tensor, Tensor] | None:
    """Keys and values [..., P, D] float32 (in the pages' basis) of :func:`encode_kivi`'s ``data``, or None."""
    lib = _moves_library()
    if lib is None or any(name not in data for name in _NAMES):
        return None
    parts = {name: data[name] for name in _NAMES}
    codes = parts["key_codes"]
    if codes.ndim < 2 or any(t.device.type != "cpu" for t in parts.values()):
        return None
    *lead, page, width = codes.shape
    if key_bits not in WIDTHS or value_bits not in WIDTHS:
        return None
    dim = width * 8 // key_bits
    if (not _takes(dim, page, key_bits, value_bits, group, vgroup) or codes.dtype != torch.uint8
            or parts["value_codes"].shape != (*lead, page, dim * value_bits // 8)
            or parts["value_codes"].dtype != torch.uint8
            or any(parts[name].shape != (*lead, page // group, dim) for name in ("key_scale", "key_min"))
            or any(parts[name].shape != (*lead, page, dim // vgroup) for name in ("value_scale", "value_min"))
            or any(parts[name].dtype != torch.float16 for name in ("key_scale", "key_min", "value_scale", "value_min"))):
        return None
    parts = {name: tensor.contiguous() for name, tensor in parts.items()}
    keys = torch.empty(*lead, page, dim, dtype=torch.float32)
    values = torch.empty_like(keys)
    if lib.confkv_kivi_decode(*(parts[name].data_ptr() for name in _NAMES), math.prod(lead), page, dim, key_bits,
                              value_bits, group, vgroup, keys.data_ptr(), values.data_ptr()):
        raise MemoryError("confkv native page decode: out of memory for a group's ranges")
    return keys, values
