"""The attention read of a prefill chunk in one C call (``confkv_prefill_read``, confkv/native/c/prefill.c).

A prefill chunk reads many query rows (``G * Q``: a KV head's query heads times the chunk's tokens) over
every key kept so far, with a causal mask on the chunk's own keys. On this project's CPU the block-wise
torch read (:mod:`confkv.attention.blockwise`) multiplies in float32 at 55-64 GFLOP/s, 62% of an 8K prefill
of Qwen2.5-1.5B (results/qwen/README.md, "Prefill: where its time goes"). The C read multiplies bfloat16
queries and keys with ``vdpbf16ps`` (AVX512-BF16: the products are exact in float32, summed in float32),
keeps the softmax and ``p @ v`` in float32, skips key blocks no row sees, and returns the attention mass
when asked: the block-wise read's contract up to the order of the float32 sums.

It takes: a CPU bfloat16 query, dense segments in bfloat16 (the model's keys) or float32 (cold pages, which the
read plan dequantizes first: ``PagedSegment.to_dense``, once per chunk), no INT8, any mask, no softcap, a head
size that is a multiple of 16 (the vector kernels), and at least :data:`MIN_ROWS` query rows (a decode step stays
on the reads made for it). :func:`eligible` says so; the read plan (:mod:`confkv.attention.read_plan`) asks it.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch
from torch import Tensor

from confkv.native.loader import library

#: fewest query rows (G * Q) a read must have to take this path: decode reads (a few rows) have their own
MIN_ROWS = 64
#: most segments one call takes (prefill.c's seg_start array)
MAX_SEGMENTS = 64
#: slots per segment in the C call's meta (prefill.c's PF_META)
_META = 14
_CODES = {torch.float32: 0, torch.bfloat16: 1}
#: tests set this True to run the plain C arithmetic where the CPU has AVX512-BF16 (both paths reached)
portable = False


def vectorised(lib) -> bool:
    """Whether ``lib`` was built with the AVX512-BF16 kernels (``-march=native`` on a CPU that has them)."""
    return bool(lib.confkv_prefill_vectorised())


def eligible(query: Tensor, segments: Sequence, softcap: float | None) -> bool:
    """Whether the read plan may send this read here (see the module docstring): dense segments in bfloat16 or
    float32, or packed pages (``to_dense`` gives float32, or the model's dtype at 16 bits), on the CPU."""
    if softcap is not None or query.device.type != "cpu" or query.dtype != torch.bfloat16 or query.dim() != 4:
        return False
    batch, q_heads, num_queries, head_dim = query.shape
    if head_dim % 16 or not segments or len(segments) > MAX_SEGMENTS:
        return False
    first = segments[0]
    kv_heads = first.kv_heads if hasattr(first, "to_dense") else first.keys.shape[1]
    if kv_heads == 0 or q_heads % kv_heads or (q_heads // kv_heads) * num_queries < MIN_ROWS:
        return False
    for s in segments:
        if hasattr(s, "to_dense"):  # packed pages: dequantized to float32 (16 bits: the model's dtype) first
            if s.valid.device.type != "cpu" or s.head_dim != head_dim:
                return False
            continue
        if s.keys.dtype not in _CODES or s.values.dtype not in _CODES:
            return False
        if s.keys.device.type != "cpu" or s.values.device.type != "cpu":
            return False
        if s.visible is not None and s.visible.device.type != "cpu":
            return False
    lib = library()
    return lib is not None and vectorised(lib)


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def prefill_read(query: Tensor, segments: Sequence, scaling: float,
                 need_mass: bool) -> tuple[Tensor, list[Tensor] | None] | None:
    """Softmax attention of ``query`` over the concatenation of ``segments``, the contract of
    :func:`confkv.attention.blockwise.blockwise_attention` (float32 sums, output in bfloat16).

    Args:
        query: [B, Hq, Q, D] bfloat16 on CPU, Hq = Hkv * G.
        segments: dense :class:`~confkv.attention.KVSegment` s, keys / values [B, Hkv, L_s, D] bfloat16 or
            float32, ``visible`` None or bool broadcastable to [B, Hkv, Q, L_s].
        scaling: score multiplier.
        need_mass: also return each slot's mass ([B, Hkv, L_s] float32 per segment).

    Runs on up to ``torch.get_num_threads()`` threads; the result is the same with any number.

    Returns:
        (out [B, Hq, Q, D] bfloat16, masses or None), or None when the library is off or a segment's dtype is
        neither bfloat16 nor float32. Raises MemoryError
        when the C read cannot allocate its scratch, ValueError for an odd head size or more than
        :data:`MAX_SEGMENTS` segments (the C read's own check: :func:`eligible` refuses them first).
    """
    lib = library()
    if lib is None:
        return None
    batch, q_heads, num_queries, head_dim = query.shape
    kv_heads = segments[0].keys.shape[1]
    query = _rows(query)
    keys, values, masks, meta, keep = [], [], [], [], []
    for segment in segments:
        k, v = _rows(segment.keys), _rows(segment.values)
        length = k.shape[2]
        ks, vs = k.stride(), v.stride()
        if k.dtype not in _CODES or v.dtype not in _CODES:
            return None
        entry = [length, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], 0, 0, 0, 0, 0, _CODES[k.dtype], _CODES[v.dtype]]
        mask_pointer = None
        if segment.visible is not None and length:
            visible = segment.visible.to(torch.bool)
            while visible.dim() < 4:
                visible = visible.unsqueeze(0)
            visible = visible.expand(batch, kv_heads, num_queries, length)
            ms = visible.stride()
            entry[7:12] = [1, ms[0], ms[1], ms[2], ms[3]]
            mask_pointer = visible.data_ptr()
            keep.append(visible)
        keys.append(k)
        values.append(v)
        masks.append(mask_pointer)
        meta += entry
    count = len(keys)
    pointers = ctypes.c_void_p * count
    out = torch.empty(batch, q_heads, num_queries, head_dim, dtype=torch.bfloat16)
    mass = [torch.empty(batch, kv_heads, k.shape[2], dtype=torch.float32) for k in keys] if need_mass else None
    qs = query.stride()
    status = lib.confkv_prefill_read(
        query.data_ptr(), qs[0], qs[1], qs[2], batch, q_heads, num_queries, head_dim, kv_heads, count,
        pointers(*[k.data_ptr() for k in keys]), pointers(*[v.data_ptr() for v in values]), pointers(*masks),
        (ctypes.c_int64 * len(meta))(*meta), scaling, out.data_ptr(),
        pointers(*[m.data_ptr() for m in mass]) if mass is not None else None, torch.get_num_threads(),
        int(portable))
    if status == 2:
        raise ValueError(f"confkv native prefill read: takes an even head size and at most {MAX_SEGMENTS} segments, "
                         f"got head size {head_dim} and {count} segments; check eligible() first, or read with "
                         "confkv.attention.blockwise.blockwise_attention")
    if status:
        raise MemoryError("confkv native prefill read: out of memory for its packed keys and mass")
    return out, mass
