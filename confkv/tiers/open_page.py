"""The cold tier's open page: the tokens the hot tier let go, waiting until a page fills.

Layout (one layer; ``B`` sequences, ``H`` KV heads, ``S < P`` slots, ``D`` channels)::

    keys, values             [B, H, S, D]  the model's dtype (``open_bits=16``), or int8 codes (``open_bits=8``)
    key_scale, value_scale   [B, H, S]     float16, ``open_bits=8`` only: a slot's channels are ``code * scale``
    positions, attention     [B, H, S]     int64 original positions; float32 attention received while hot
    valid                    [B, S]        bool

With ``open_bits=8`` each token is quantized on its own, per KV head, symmetric: ``scale = max_d |x_d| / 127``
rounded to float16, ``code = round(x / scale)`` in [-127, 127] (LMDeploy's INT8 KV cache also quantizes per token and
head): a token costs ``2 * (D + 2)`` bytes per head where the model's 16-bit dtype
costs ``4 * D``, so under a memory target the open page takes about half the bytes it did (early in a run it
was most of the target: results/memory/README.md, "The open page in INT8"). The absolute error of a channel is
at most ``scale / 2`` (plus the float16 rounding of ``scale``, worked out in the tests). A page that fills is
decoded back to the model's dtype and sealed at its rung's bits as before.

Every tensor but ``valid`` has the slot axis at dim 2, so slicing, joining and gathering slots treat them alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: widths the open page may have: 16 = the model's dtype (exact), 8 = INT8 codes per token and head
OPEN_BITS = (16, 8)
_SCALES = {"keys": "key_scale", "values": "value_scale"}


def empty(batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
          bits: int = 16) -> dict[str, Tensor]:
    """An open page with no slot (``dtype``: the model's; int8 codes and float16 scales with ``bits=8``)."""
    code_dtype = dtype if bits == 16 else torch.int8
    out = {"keys": torch.empty(batch, heads, 0, head_dim, dtype=code_dtype, device=device),
           "values": torch.empty(batch, heads, 0, head_dim, dtype=code_dtype, device=device),
           "positions": torch.empty(batch, heads, 0, dtype=torch.int64, device=device),
           "attention": torch.empty(batch, heads, 0, dtype=torch.float32, device=device),
           "valid": torch.empty(batch, 0, dtype=torch.bool, device=device)}
    if bits == 8:
        for scale in _SCALES.values():
            out[scale] = torch.empty(batch, heads, 0, dtype=torch.float16, device=device)
    return out


def encode(keys: Tensor, values: Tensor, dtype: torch.dtype, bits: int) -> dict[str, Tensor]:
    """Open-page storage of keys / values [B, H, M, D] (any float dtype): cast to ``dtype`` at ``bits=16``; INT8
    codes and float16 scales [B, H, M] at ``bits=8`` (see the module docstring)."""
    if bits == 16:
        return {"keys": keys.to(dtype), "values": values.to(dtype)}
    x = torch.stack([keys, values]).float()  # [2, B, H, M, D]: keys and values in one pass
    scale = x.abs().amax(-1).div_(127.0).to(torch.float16)  # [2, B, H, M]
    # a scale of 0 (an all-zero token, or one too small for float16) divides by 1e-30: its codes are clamped, and
    # decode to 0 all the same
    codes = x.div_(scale.float().clamp_min_(1e-30)[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return {"keys": codes[0], "values": codes[1], "key_scale": scale[0], "value_scale": scale[1]}


def decoded(open_page: dict[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(keys, values) [B, H, S, D] of an open page (or of slots cut from one) in ``dtype``."""
    if "key_scale" not in open_page:
        return open_page["keys"], open_page["values"]
    return tuple(torch.mul(open_page[name], open_page[_SCALES[name]].float()[..., None]).to(dtype)  # type: ignore
                 for name in ("keys", "values"))


def nbytes(open_page: dict[str, Tensor]) -> int:
    """KV bytes of an open page: keys and values (codes or the model's dtype) and, at 8 bits, their scales."""
    return sum(open_page[name].nbytes for name in ("keys", "values", *_SCALES.values()) if name in open_page)


def slot_bytes(heads: int, head_dim: int, element_size: int, bits: int) -> int:
    """KV bytes of one slot of one sequence (all KV heads): ``2 * H * D * element_size`` at 16 bits
    (``element_size``: the model dtype's), ``2 * H * (D + 2)`` at 8 bits."""
    return 2 * heads * head_dim * element_size if bits == 16 else 2 * heads * (head_dim + 2)


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
