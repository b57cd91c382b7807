"""Attention read over mixed FP / INT8 KV segments.

* :func:`blockwise_attention` - the PyTorch reference (CPU and GPU);
* :func:`confkv.attention.triton_read.triton_attention` - a Triton kernel
  (CUDA tensors; optional ``triton`` dependency);
* :func:`attention_read` - picks one.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from confkv.attention.blockwise import DEFAULT_BLOCK_SIZE, KVSegment, blockwise_attention

__all__ = ["KVSegment", "blockwise_attention", "attention_read", "DEFAULT_BLOCK_SIZE"]

BACKENDS = ("auto", "torch", "triton")


def attention_read(
    query: Tensor,
    segments: Sequence[KVSegment],
    scaling: float,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softcap: float | None = None,
    need_mass: bool = True,
    backend: str = "auto",
) -> tuple[Tensor, list[Tensor] | None]:
    """Dispatch the read to a backend; same contract as :func:`blockwise_attention`.

    Args:
        backend: "torch" (always available), "triton" (CUDA tensors and the
            ``triton`` package required; raises otherwise), or "auto": triton
            when the query is on CUDA and triton imports, else torch.
            ``block_size`` only applies to the torch backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        from confkv.attention import triton_read

        backend = "triton" if query.is_cuda and triton_read.triton_available() else "torch"
    if backend == "triton":
        from confkv.attention.triton_read import triton_attention

        return triton_attention(query, segments, scaling, softcap=softcap, need_mass=need_mass)
    return blockwise_attention(query, segments, scaling, block_size, softcap=softcap, need_mass=need_mass)
