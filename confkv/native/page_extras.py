"""What a packed page segment carries beyond its codes, as the native page read takes it (issue 32): the outliers
kept apart (format ``outliers``) and each page's key widths (format ``channel_bits``), checked and laid out for
:mod:`confkv.native.pages` (their place in the kernel's entries is there and in ``c/pages.c``).
"""

from __future__ import annotations

import torch
from torch import Tensor

OUTLIER_NAMES = ("key_outlier_index", "key_outlier_value", "value_outlier_index", "value_outlier_value")


def inner_contiguous(t: Tensor, lead: int) -> Tensor:
    """``t`` itself when its dimensions past the first ``lead`` are contiguous (row-major), else a copy."""
    if t.is_contiguous():  # the usual case, checked in C
        return t
    expected, step = [], 1
    for size in reversed(t.shape[lead:]):
        expected.append(step)
        step *= size
    actual = [s for s, n in zip(reversed(t.stride()[lead:]), reversed(t.shape[lead:]))]
    ok = all(a == e or n == 1 for a, e, n in zip(actual, expected, reversed(t.shape[lead:])))
    return t if ok else t.contiguous()


def key_widths(segment) -> Tensor | None:
    """The segment's key widths ([B, H, N, D] uint8, each page's rows contiguous) as the kernel reads them, or None
    for pages whose key channels share one width."""
    widths = getattr(segment, "key_widths", None)
    if widths is None:
        return None
    if widths.dtype != torch.uint8:
        raise ValueError("packed pages: key widths must be uint8")
    return inner_contiguous(widths, 3)


def outlier_tensors(segment) -> list[Tensor]:
    """The segment's outlier storage (key index, key value, value index, value value) as the kernel reads it, or
    [] for pages without outliers (or with none kept)."""
    if getattr(segment, "key_outlier_index", None) is None:
        return []
    index_type, value_type = torch.int16, torch.float16
    tensors = [inner_contiguous(getattr(segment, name), 3) for name in OUTLIER_NAMES]
    if any(t.dtype != want for t, want in zip(tensors, (index_type, value_type) * 2)):
        raise ValueError("packed pages: outlier indices must be int16 and outlier values float16")
    if len({t.shape[-1] for t in tensors}) != 1:
        raise ValueError("packed pages: keys and values must keep as many outliers per page")
    return tensors if tensors[0].shape[-1] else []
