"""Attention read over mixed FP / INT8 KV segments.

* :func:`blockwise_attention` - the PyTorch reference (CPU and GPU);
* :func:`confkv.attention.fused_cpu.fused_attention` - PyTorch's fused CPU kernel, for
  reads that need no mask, no mass and no INT8 (most decode steps of mass-free policies);
* :func:`confkv.attention.mass_read.mass_read` - one float32 softmax in a dozen ops, for
  reads that need the mass but no mask and no INT8 (decode steps of H2O, TOVA, CONF-KV);
  :func:`confkv.native.mass_read` computes the same in one C call where the native kernels
  are available (``CONFKV_NATIVE=0`` keeps the torch one);
* :func:`confkv.attention.triton_read.triton_attention` - a Triton kernel
  (CUDA tensors; optional ``triton`` dependency);
* :func:`attention_read` - picks one.

Selected cold pages may come as a :class:`~confkv.attention.paged.PagedSegment`
(still packed): the Triton backend reads them in its paged kernel
(:mod:`confkv.attention.triton_pages`); the others gather and dequantize them
first (:meth:`~confkv.attention.paged.PagedSegment.to_dense`, the reference).
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from confkv import native
from confkv.attention import fused_cpu
from confkv.attention.mass_read import mass_read, mass_read_eligible
from confkv.attention.blockwise import DEFAULT_BLOCK_SIZE, KVSegment, blockwise_attention
from confkv.attention.paged import PagedSegment, densify

__all__ = ["KVSegment", "PagedSegment", "blockwise_attention", "attention_read", "reads_pages", "DEFAULT_BLOCK_SIZE"]

BACKENDS = ("auto", "torch", "fused", "triton")


def reads_pages(query: Tensor, backend: str) -> bool:
    """True when ``attention_read(query, ..., backend=backend)`` runs the Triton read, which
    takes a :class:`PagedSegment` without a host-side gather + dequantize."""
    if backend == "triton":
        return True
    if backend != "auto" or not query.is_cuda:
        return False
    from confkv.attention import triton_read

    return triton_read.triton_available()


def attention_read(
    query: Tensor,
    segments: Sequence[KVSegment | PagedSegment],
    scaling: float,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softcap: float | None = None,
    need_mass: bool = True,
    backend: str = "auto",
) -> tuple[Tensor, list[Tensor] | None]:
    """Dispatch the read to a backend; same contract as :func:`blockwise_attention`.

    Args:
        backend: "torch" (the block-wise reference, always available), "fused"
            (PyTorch's fused CPU kernel; raises unless
            :func:`~confkv.attention.fused_cpu.fused_read_eligible`), "triton" (CUDA
            tensors and the ``triton`` package required; raises otherwise), or "auto":
            triton when the query is on CUDA and triton imports, else fused where
            eligible, else (the mass needed) :func:`mass_read` where eligible (in its native
            version, :func:`confkv.native.mass_read`, when available), else torch.
            ``block_size`` only applies to the torch backend.
            Every backend but triton reads a :class:`PagedSegment` via its ``to_dense``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not reads_pages(query, backend):
        segments = densify(list(segments))
    if backend in ("auto", "fused"):
        if fused_cpu.fused_read_eligible(query, segments, softcap, need_mass):
            return fused_cpu.fused_attention(query, segments, scaling), None
        if backend == "fused":
            raise ValueError("backend 'fused' needs a CPU query, full-precision segments of its dtype, no mask, "
                             "no softcap and need_mass=False; use backend='auto' to fall back to the block-wise read")
    if backend == "auto":
        from confkv.attention import triton_read

        backend = "triton" if query.is_cuda and triton_read.triton_available() else "torch"
        if backend == "torch" and need_mass and mass_read_eligible(query, segments, softcap):
            fast = native.mass_read(query, segments, scaling)  # None when unavailable
            return fast if fast is not None else mass_read(query, segments, scaling)
    if backend == "triton":
        from confkv.attention.triton_read import triton_attention

        return triton_attention(query, segments, scaling, softcap=softcap, need_mass=need_mass)
    return blockwise_attention(query, segments, scaling, block_size, softcap=softcap, need_mass=need_mass)
