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
(:mod:`confkv.attention.triton_pages`), the native page read on CPU in C
(:mod:`confkv.native.pages`); the torch paths gather and dequantize them
first (:meth:`~confkv.attention.paged.PagedSegment.to_dense`, the reference).
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from confkv import native, profiling
from confkv.attention import fused_cpu, read_plan
from confkv.attention.mass_read import mass_read
from confkv.attention.blockwise import DEFAULT_BLOCK_SIZE, KVSegment, blockwise_attention
from confkv.attention.paged import PagedSegment, densify
from confkv.native import pages as native_pages

__all__ = ["KVSegment", "PagedSegment", "blockwise_attention", "attention_read", "reads_pages", "DEFAULT_BLOCK_SIZE"]

BACKENDS = read_plan.BACKENDS


def reads_pages(query: Tensor, backend: str) -> bool:
    """True when ``attention_read(query, ..., backend=backend)`` runs the Triton read, which
    takes a :class:`PagedSegment` without a host-side gather + dequantize (the native page read
    takes them too: :func:`confkv.attention.read_plan.hands_pages` asks both)."""
    return read_plan.triton_reads(query, backend)


def attention_read(
    query: Tensor,
    segments: Sequence[KVSegment | PagedSegment],
    scaling: float,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softcap: float | None = None,
    need_mass: bool = True,
    backend: str = "auto",
) -> tuple[Tensor, list[Tensor] | None]:
    """Run the read on the path :func:`confkv.attention.read_plan.plan` names; same contract as
    :func:`blockwise_attention`.

    Args:
        backend: "torch" (the block-wise reference, always available), "fused"
            (PyTorch's fused CPU kernel; raises unless
            :func:`~confkv.attention.fused_cpu.fused_read_eligible`), "triton" (CUDA
            tensors and the ``triton`` package required; raises otherwise), or "auto":
            triton when the query is on CUDA and triton imports, else fused where
            eligible, else (the mass needed) :func:`mass_read` where eligible (in its native
            version, :func:`confkv.native.mass_read`, when available), else, with packed pages,
            the native page read (:func:`confkv.native.pages.page_read`), else torch.
            ``block_size`` only applies to the torch backend.
            The torch paths read a :class:`PagedSegment` via its ``to_dense``.
    A plan that leaves the native path is counted with its reason (:func:`confkv.profiling.left_native`).
    """
    chosen = read_plan.plan(query, segments, softcap, need_mass, backend)
    if chosen.reason is not None:
        profiling.left_native(chosen.reason)
    path = chosen.path
    if path == "triton":
        from confkv.attention.triton_read import triton_attention

        return triton_attention(query, segments, scaling, softcap=softcap, need_mass=need_mass)
    if path == "native_pages":
        fast_pages = native_pages.page_read(query, segments, scaling, need_mass)
        if fast_pages is not None:
            return fast_pages
        profiling.left_native("native page read declined")
        path = "torch"
    segments = densify(list(segments))  # the torch paths read packed pages gathered and dequantized
    if path == "fused":
        return fused_cpu.fused_attention(query, segments, scaling), None
    if path == "native_mass":
        fast = native.mass_read(query, segments, scaling)
        if fast is not None:
            return fast
        profiling.left_native("native mass read declined")
        path = "mass"
    if path == "mass":
        return mass_read(query, segments, scaling)
    return blockwise_attention(query, segments, scaling, block_size, softcap=softcap, need_mass=need_mass)
