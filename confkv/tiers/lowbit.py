"""Low-bit (2/3/4/8-bit) KIVI-style quantization of KV pages, with real bit packing.

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"):

* keys are quantized **per channel**: each group of ``group_size`` consecutive tokens
  shares one (min, scale) pair per channel, because keys have outlier channels;
* values are quantized **per token**: each group of ``group_size`` consecutive channels
  of one token shares one (min, scale) pair.

Both are asymmetric (``x ~= code * scale + min``, codes in ``[0, 2**bits - 1]``), with
round-to-nearest. Scales and minima are stored in float16 (2 bytes each), and the codes
are packed densely: ``bits * D / 8`` bytes per token, head and tensor (3-bit codes go 8
to 3 bytes). So the byte counts of :func:`page_bytes` are what the tensors hold.

Shapes: a page batch is ``[..., P, D]`` (``P`` tokens of ``D`` channels); ``group_size``
must divide ``P`` (keys) and ``D`` (values; a group larger than ``D`` is clipped to ``D``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SCALE_DTYPE = torch.float16


def _word_layout(bits: int) -> tuple[int, int]:
    """(codes per word, bytes per word): the smallest run of codes that fills whole bytes."""
    codes = {2: 4, 3: 8, 4: 2, 8: 1}[bits]
    return codes, codes * bits // 8


def packed_width(head_dim: int, bits: int) -> int:
    """Bytes of ``head_dim`` packed codes."""
    codes, nbytes = _word_layout(bits)
    return head_dim // codes * nbytes


def check_packable(head_dim: int, bits: int) -> None:
    """Raise ValueError unless ``head_dim`` codes of ``bits`` bits pack into whole words."""
    codes, _ = _word_layout(bits)
    if head_dim % codes:
        raise ValueError(f"bits: {bits}-bit codes pack {codes} to a word; head_dim {head_dim} is not a multiple "
                         f"of {codes}; choose bits in (2, 4, 8) for this model")


def pack(codes: Tensor, bits: int) -> Tensor:
    """[..., D] uint8 codes in ``[0, 2**bits)`` -> [..., packed_width(D, bits)] uint8."""
    if bits == 8:
        return codes.to(torch.uint8)
    per_word, word_bytes = _word_layout(bits)
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_word, per_word).to(torch.int32)
    shifts = torch.arange(per_word, device=codes.device, dtype=torch.int32) * bits
    word = (grouped << shifts).sum(-1)  # [..., D / per_word] int32 (<= 24 bits used)
    byte_shifts = torch.arange(word_bytes, device=codes.device, dtype=torch.int32) * 8
    packed = (word[..., None] >> byte_shifts) & 0xFF
    return packed.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack(packed: Tensor, bits: int, head_dim: int) -> Tensor:
    """Inverse of :func:`pack`: [..., packed_width] uint8 -> [..., head_dim] integer codes
    (int32 at 8 bits, int64 otherwise)."""
    if bits == 8:
        return packed.to(torch.int32)
    per_word, word_bytes = _word_layout(bits)
    grouped = packed.reshape(*packed.shape[:-1], head_dim // per_word, word_bytes).to(torch.int32)
    byte_shifts = torch.arange(word_bytes, device=packed.device, dtype=torch.int32) * 8
    word = (grouped << byte_shifts).sum(-1)
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * bits
    codes = (word[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], head_dim)


_BYTE_TABLES: dict[tuple[int, torch.device], Tensor] = {}  # (bits, device) -> code_table(bits)


def code_table(bits: int, levels: Tensor | None = None, device: torch.device | str = "cpu") -> Tensor:
    """The lookup table of :func:`lookup_codes`: what each packed unit decodes to, float32.

    Bits 2, 4, 8: [256, 8 // bits], the codes of one byte. Bits 3: [4096, 4], the codes of
    12 bits (half of a 3-byte word: 4 codes). ``levels`` [2**bits]: decode code ``c`` to
    ``levels[c]`` (a codebook) instead of ``c``.
    """
    unit, per_unit = (4096, 4) if bits == 3 else (256, 8 // bits)
    value = torch.arange(unit, dtype=torch.int64, device=device)[:, None]
    shifts = torch.arange(per_unit, dtype=torch.int64, device=device) * bits
    codes = (value >> shifts) & ((1 << bits) - 1)
    return codes.float() if levels is None else levels.detach().float().to(device)[codes]


def lookup_codes(packed: Tensor, bits: int, head_dim: int, table: Tensor) -> Tensor:
    """[..., packed_width] uint8 -> [..., head_dim] float32 through ``table`` (:func:`code_table`, on
    ``packed``'s device): one lookup per byte (bits 2, 4, 8) or per 12 bits (bits 3)."""
    if bits == 3:
        *lead, width = packed.shape
        grouped = packed.reshape(*lead, width // 3, 3).to(torch.int32)
        word = grouped[..., 0] | (grouped[..., 1] << 8) | (grouped[..., 2] << 16)
        units = torch.stack((word & 0xFFF, word >> 12), dim=-1)
    else:
        units = packed
    return torch.nn.functional.embedding(units.long(), table).reshape(*packed.shape[:-1], head_dim)


def unpack_float(packed: Tensor, bits: int, head_dim: int) -> Tensor:
    """:func:`unpack` as float32 codes: [..., packed_width] uint8 -> [..., head_dim] float32.

    One table lookup per byte (2, 4, 8 bits: a byte is a whole word) or per 12 bits (3 bits:
    four codes) replaces the shifts and masks (the read path's hot spot).
    """
    key = (bits, packed.device)
    if key not in _BYTE_TABLES:
        _BYTE_TABLES[key] = code_table(bits, device=packed.device)
    return lookup_codes(packed, bits, head_dim, _BYTE_TABLES[key])


@dataclass
class Quantized:
    """Packed codes with their float16 scales and minima.

    Attributes:
        codes: [..., P, packed_width(D, bits)] uint8.
        scale, minimum: float16, [..., P / G, D] for keys, [..., P, D / G] for values.
    """

    codes: Tensor
    scale: Tensor
    minimum: Tensor


def masked_extremes(x: Tensor, valid: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """The smallest and largest ``valid`` entries of ``x`` over ``dim`` (kept as size 1); 0 and 0 for a group
    without a valid entry."""
    top = x.masked_fill(~valid, float("-inf")).amax(dim=dim, keepdim=True)
    bottom = x.masked_fill(~valid, float("inf")).amin(dim=dim, keepdim=True)
    empty = ~torch.isfinite(top)
    return torch.where(empty, torch.zeros_like(bottom), bottom), torch.where(empty, torch.zeros_like(top), top)


def scale_and_minimum(bottom: Tensor, top: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """The stored (:data:`SCALE_DTYPE`) scale and minimum of ``2**bits`` even levels from ``bottom`` to ``top``; the
    scale is taken from the minimum as stored, so the top level lands on ``top`` as nearly as float16 allows."""
    minimum = bottom.to(SCALE_DTYPE)
    return ((top - minimum.float()) / ((1 << bits) - 1)).to(SCALE_DTYPE), minimum


def levels_in_range(x: Tensor, scale: Tensor, minimum: Tensor, bits: int) -> Tensor:
    """``x`` in units of ``scale`` above ``minimum``, clamped to ``[0, 2**bits - 1]`` (float32, not yet rounded); a
    zero scale (a constant group) counts as 1."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    return ((x - minimum.float()) / safe).clamp_(0, (1 << bits) - 1)


def _asymmetric(x: Tensor, valid: Tensor, dim: int, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Codes, scale, minimum of ``x`` [float32] with the range taken over ``dim`` (valid entries only)."""
    scale, minimum = scale_and_minimum(*masked_extremes(x, valid, dim), bits)
    codes = torch.round(levels_in_range(x, scale, minimum, bits))
    return codes.to(torch.uint8), scale, minimum


def quantize_keys(keys: Tensor, valid: Tensor, bits: int, group_size: int) -> Quantized:
    """Per-channel key quantization (KIVI), one (min, scale) per ``group_size`` tokens and channel.

    Args:
        keys: [..., P, D] float; valid: [..., P] bool (invalid slots do not widen the range).
    Returns:
        codes [..., P, packed], scale/minimum [..., P / group_size, D] float16.
    """
    *lead, page, head_dim = keys.shape
    grouped = keys.detach().float().reshape(*lead, page // group_size, group_size, head_dim)
    mask = valid.reshape(*lead, page // group_size, group_size, 1)
    codes, scale, minimum = _asymmetric(grouped, mask, dim=-2, bits=bits)
    return Quantized(pack(codes.reshape(*lead, page, head_dim), bits), scale.squeeze(-2), minimum.squeeze(-2))


def quantize_values(values: Tensor, bits: int, group_size: int) -> Quantized:
    """Per-token value quantization (KIVI), one (min, scale) per ``group_size`` channels.

    Args:
        values: [..., P, D] float.
    Returns:
        codes [..., P, packed], scale/minimum [..., P, D / group_size] float16.
    """
    *lead, page, head_dim = values.shape
    group = min(group_size, head_dim)
    grouped = values.detach().float().reshape(*lead, page, head_dim // group, group)
    codes, scale, minimum = _asymmetric(grouped, torch.ones((), dtype=torch.bool, device=values.device), -1, bits)
    return Quantized(pack(codes.reshape(*lead, page, head_dim), bits), scale.squeeze(-1), minimum.squeeze(-1))


def dequantize_keys(q: Quantized, bits: int, head_dim: int, group_size: int) -> Tensor:
    """[..., P, packed] -> [..., P, D] float32."""
    codes = unpack_float(q.codes, bits, head_dim)
    *lead, page, _ = codes.shape
    grouped = codes.reshape(*lead, page // group_size, group_size, head_dim)
    out = torch.addcmul(q.minimum.unsqueeze(-2).float(), grouped, q.scale.unsqueeze(-2).float())
    return out.reshape(*lead, page, head_dim)


def dequantize_values(q: Quantized, bits: int, head_dim: int, group_size: int) -> Tensor:
    """[..., P, packed] -> [..., P, D] float32."""
    codes = unpack_float(q.codes, bits, head_dim)
    *lead, page, _ = codes.shape
    group = min(group_size, head_dim)
    grouped = codes.reshape(*lead, page, head_dim // group, group)
    out = torch.addcmul(q.minimum.unsqueeze(-1).float(), grouped, q.scale.unsqueeze(-1).float())
    return out.reshape(*lead, page, head_dim)


def page_bytes(kv_heads: int, head_dim: int, page_size: int, bits: int, group_size: int,
               fp_element_size: int = 2, digest: bool = True) -> int:
    """Exact bytes of one sealed page of one sequence and layer: codes + scales + minima + digest.

    With ``bits=16`` the page holds keys and values in the model's dtype
    (``fp_element_size`` bytes per element) and no scales. The digest (per-channel key
    min and max, float16) is counted when the page has one (``digest``).
    """
    digest = 2 * kv_heads * head_dim * 2 if digest else 0
    if bits == 16:
        return 2 * kv_heads * page_size * head_dim * fp_element_size + digest
    codes = 2 * kv_heads * page_size * packed_width(head_dim, bits)
    key_params = 2 * kv_heads * (page_size // group_size) * head_dim * 2
    value_params = 2 * kv_heads * page_size * (head_dim // min(group_size, head_dim)) * 2
    return codes + key_params + value_params + digest
