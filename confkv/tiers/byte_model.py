"""The one byte model: what a token or a page of keys and values costs, in one layer of one sequence.

Every byte count in confkv comes from these formulas: the memory planner's full-cache
reference and hot budgets (:mod:`confkv.tiers.planner`), the INT8 store's accounting
(:mod:`confkv.quant`), the cold tier's sealed pages (:func:`page_bytes`, defined next to the
page codec in :mod:`confkv.tiers.lowbit` and re-exported here), and the evaluation grids' report of
the full cache's bytes (:func:`full_cache_bytes`). The stores count the bytes they hold from
their tensors (``nbytes``); tests check the two agree.

- a full-precision token: keys and values, ``2 * kv_heads * head_dim`` elements of the model's dtype;
- an INT8 token: ``2 * kv_heads * head_dim`` int8 codes plus one float32 scale per head for the
  keys and one for the values; each layer that has INT8 tokens also holds one frozen key channel
  scale (``kv_heads * head_dim`` float32, :func:`channel_scale_bytes`);
- a sealed cold page: :func:`page_bytes` (codes, scales and minima, and the page's digest).
"""

from __future__ import annotations

from dataclasses import dataclass

from confkv.tiers.lowbit import page_bytes

#: bytes of one quantization scale (float32)
SCALE_BYTES = 4


def fp_token_bytes(kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes of one token's keys and values in one layer, in the model's dtype (``element_size`` bytes)."""
    return 2 * kv_heads * head_dim * element_size


def int8_half_token_bytes(kv_heads: int, head_dim: int) -> int:
    """Bytes of one token's INT8 keys (or values) in one layer: int8 codes and a float32 scale per head."""
    return kv_heads * head_dim + kv_heads * SCALE_BYTES


def int8_token_bytes(kv_heads: int, head_dim: int) -> int:
    """Bytes of one INT8 token's keys and values in one layer, per-token scales included
    (the layer's frozen channel scale is :func:`channel_scale_bytes`, counted once per layer)."""
    return 2 * int8_half_token_bytes(kv_heads, head_dim)


def channel_scale_bytes(kv_heads: int, head_dim: int) -> int:
    """Bytes of one layer's frozen key channel scale (``[kv_heads, head_dim]`` float32)."""
    return kv_heads * head_dim * SCALE_BYTES


@dataclass(frozen=True)
class KVShape:
    """What the byte formulas need to know about a model: its KV heads, head size, element size
    (the dtype of its weights, which its cache holds) and each layer's sliding window (None: a
    full-attention layer). Read from a transformers model by :func:`confkv.hf.support.kv_shape`."""

    kv_heads: int
    head_dim: int
    element_size: int
    sliding_windows: tuple[int | None, ...]

    @property
    def token_bytes(self) -> int:
        """:func:`fp_token_bytes` of one layer of this model."""
        return fp_token_bytes(self.kv_heads, self.head_dim, self.element_size)


def full_cache_bytes(shape: KVShape, tokens: int, batch: int = 1) -> int:
    """Bytes the full cache (transformers' ``DynamicCache`` in the model's dtype) holds after ``tokens``
    tokens of ``batch`` sequences: every token in every full-attention layer, at most ``window - 1``
    in a sliding-window layer (Gemma-3's local layers). The reference of a ``memory=`` target."""
    held = sum(tokens if w is None else min(tokens, w - 1) for w in shape.sliding_windows)
    return batch * held * shape.token_bytes


__all__ = ["KVShape", "SCALE_BYTES", "channel_scale_bytes", "fp_token_bytes", "full_cache_bytes",
           "int8_half_token_bytes", "int8_token_bytes", "page_bytes"]
