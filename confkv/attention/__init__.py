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
* :func:`attention_read` - picks one (:mod:`confkv.attention.read_plan`: the plan, then the read).

Selected cold pages may come as a :class:`~confkv.attention.segments.PagedSegment`
(still packed): the Triton backend reads them in its paged kernel
(:mod:`confkv.attention.triton_pages`), the native page read on CPU in C
(:mod:`confkv.native.pages`); the torch paths gather and dequantize them
first (:meth:`~confkv.attention.segments.PagedSegment.to_dense`, the reference).
"""

from __future__ import annotations

from confkv.attention import read_plan
from confkv.attention.blockwise import DEFAULT_BLOCK_SIZE, blockwise_attention
from confkv.attention.read_plan import attention_read, reads_pages
from confkv.attention.segments import KVSegment, PagedSegment

__all__ = ["KVSegment", "PagedSegment", "blockwise_attention", "attention_read", "reads_pages", "DEFAULT_BLOCK_SIZE"]

BACKENDS = read_plan.BACKENDS
