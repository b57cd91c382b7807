"""Native CPU kernels for the decode step: the mass read, RMSNorm, rotary and the INT8 weight
projections as one C call each.

A decode step of a small model on CPU is mostly per-op dispatch: the torch versions of these
three pieces take a dozen small ops each (casts, pow, mean, rsqrt, cat, neg, softmax, ...) per
layer. Here each is one call into ``kernels.c`` (compiled on first use by
:mod:`confkv.native.loader`; ``CONFKV_NATIVE=0`` switches it off). Callers check
:func:`available` and otherwise run their torch code; each function also returns None for
inputs it does not take (tensors off the CPU, dtypes other than float32 / bfloat16), and the
caller then runs the torch code.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch
from torch import Tensor

from confkv.native.loader import available, library

__all__ = ["ACTIVATION_BLOCK", "Int8Projection", "available", "confidence_terms", "gemv_settings", "int8_linear",
           "mass_read", "quantize_activation_blocks", "rms_norm", "rotary"]

_CODES = {torch.float32: 0, torch.bfloat16: 1}
#: W8A8: activations quantised to int8 in blocks of this many values, one scale each (kernels.c's ACT_BLOCK)
ACTIVATION_BLOCK = 32
#: widest row the RMSNorm takes in bfloat16: torch splits longer sums over threads (another order)
MAX_EXACT_WIDTH = 16384
#: most activation rows the INT8 GEMV takes (decode: batch x 1 token); prefill chunks run torch's kernel
MAX_GEMV_ROWS = 4
#: int64 entries of a GEMV plan (gemv_calls.c's confkv_int8_linear): weight, N, K, scale, its dtype, bias, its
#: dtype, activation bits (0 or 8), weight bits (8 or 4), the 4-bit weight's block minima
PLAN_LENGTH = 10
_lanes: dict[int, int] = {}  # id(library) -> the vector width of torch's float sum order (0: not matched)


def _sum_lanes(lib) -> int:
    """The vector width (8 or 16) with which kernels.c's ``torch_order_sum`` reproduces ``torch.sum``
    bit for bit on this torch build and CPU (checked once on rows of several lengths), else 0."""
    key = id(lib)
    if key not in _lanes:
        gen = torch.Generator().manual_seed(0)
        rows = [torch.randn(n, generator=gen).pow(2) for n in (8, 15, 17, 64, 576, 960, 2048, 4100, 8192)]
        _lanes[key] = next((lanes for lanes in (8, 16) if all(
            lib.confkv_torch_order_sum(r.data_ptr(), r.numel(), lanes) == r.sum().item() for r in rows)), 0)
    return _lanes[key]


def _on_cpu(*tensors: Tensor) -> bool:
    """Whether every tensor lives in CPU memory (the C code reads their data pointers)."""
    return all(t.device.type == "cpu" for t in tensors)


def _rows_contiguous(t: Tensor) -> Tensor:
    """``t`` itself when its last dimension is contiguous, else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def mass_read(query: Tensor, segments: Sequence, scaling: float) -> tuple[Tensor, list[Tensor]] | None:
    """:func:`confkv.attention.mass_read.mass_read` in one C call (same contract, float32 accumulation).

    Args:
        query: [B, Hq, Q, D] float32 or bfloat16 on CPU, Hq = Hkv * G.
        segments: :class:`~confkv.attention.KVSegment` s, keys/values [B, Hkv, L_s, D] float32 or
            bfloat16, every slot visible (the caller checked ``mass_read_eligible``).
        scaling: score multiplier.

    The B * Hkv (sequence, KV head) pairs run on up to ``torch.get_num_threads()`` threads (the INT8
    GEMV's pool) when the read is big enough; each pair's arithmetic is the same either way.

    Returns:
        (out [B, Hq, Q, D] in query.dtype, one mass [B, Hkv, L_s] float32 per segment), or None
        when the library is unavailable or a dtype is not float32 / bfloat16.
    """
    lib = library()
    if lib is None or query.dtype not in _CODES or query.device.type != "cpu":
        return None
    # one pass over the segments (a decode step makes this call in every layer: plain loops, no generators)
    keys, values, meta = [], [], []
    kv_heads = 0
    for segment in segments:
        k, v = segment.keys, segment.values
        if k.dtype not in _CODES or v.dtype not in _CODES or k.device.type != "cpu" or v.device.type != "cpu":
            return None
        k, v = _rows_contiguous(k), _rows_contiguous(v)
        length = k.shape[2]
        if length and not kv_heads:
            kv_heads = k.shape[1]
        ks, vs = k.stride(), v.stride()
        meta += (length, _CODES[k.dtype], _CODES[v.dtype], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2])
        keys.append(k)
        values.append(v)
    batch, q_heads, num_queries, head_dim = query.shape
    if q_heads % kv_heads:
        raise ValueError(f"Hq={q_heads} is not a multiple of Hkv={kv_heads}")
    query = _rows_contiguous(query)
    count = len(keys)
    pointers = ctypes.c_void_p * count
    out = torch.empty(batch, q_heads, num_queries, head_dim, dtype=query.dtype)
    mass = [torch.empty(batch, kv_heads, k.shape[2], dtype=torch.float32) for k in keys]
    qs = query.stride()
    status = lib.confkv_mass_read(
        query.data_ptr(), _CODES[query.dtype], qs[0], qs[1], qs[2], batch, q_heads, num_queries, head_dim,
        kv_heads, count, pointers(*[k.data_ptr() for k in keys]), pointers(*[v.data_ptr() for v in values]),
        (ctypes.c_int64 * len(meta))(*meta), scaling, out.data_ptr(), pointers(*[m.data_ptr() for m in mass]),
        torch.get_num_threads())
    if status:
        raise MemoryError("confkv native mass read: out of memory for the scores")
    return out, mass


def confidence_terms(logits: Tensor) -> Tensor | None:
    """The entropy and the two largest log-probabilities of each row of ``logits`` in one call
    (:func:`confkv.confidence.confidence`'s terms, temperature 1, float32).

    Args:
        logits: [B, V] float32 or bfloat16 on CPU, last dimension contiguous.
    Returns:
        [B, 3] float32 (entropy, log p1, log p2), or None when the library is off, the input is not
        one it takes, or a row holds a NaN or an infinity (the torch code handles those).
    """
    lib = library()
    if lib is None or logits.dtype not in _CODES or logits.device.type != "cpu" or logits.ndim != 2:
        return None
    if logits.shape[1] == 0:
        return None
    logits = _rows_contiguous(logits)
    out = torch.empty(logits.shape[0], 3, dtype=torch.float32)
    status = lib.confkv_confidence_terms(logits.data_ptr(), _CODES[logits.dtype], logits.shape[0], logits.shape[1],
                                         logits.stride(0), out.data_ptr())
    if status == 2:
        raise MemoryError("confkv native confidence: out of memory for a row of logits")
    return None if status else out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """LlamaRMSNorm's forward in one call: ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``.

    Args:
        x: [..., n] float32 or bfloat16 (rows with a contiguous last dimension).
        weight: [n] float32 or bfloat16.
    The mean's sum runs in torch's own order (see ``torch_order_sum`` in kernels.c, matched against
    ``torch.sum`` once per process), so that the output equals LlamaRMSNorm's bit for bit; where no
    order matches (another torch build), bfloat16 inputs return None (the torch path) and float32
    ones are summed in double precision.

    Returns:
        [..., n] in the promoted dtype of x and weight (as torch's ``weight * y``), or None when
        unavailable or a dtype is not float32 / bfloat16.
    """
    lib = library()
    if (lib is None or x.dtype not in _CODES or weight.dtype not in _CODES or weight.shape != x.shape[-1:]
            or not _on_cpu(x, weight)):
        return None
    shape = x.shape
    width = x.shape[-1]
    lanes = _sum_lanes(lib) if width <= MAX_EXACT_WIDTH else 0
    if not lanes and x.dtype != torch.float32:
        return None
    if x.is_contiguous():
        rows, row_stride = x.numel() // max(width, 1), width
    else:
        flat = _rows_contiguous(x.reshape(-1, width))
        x, rows, row_stride = flat, flat.shape[0], flat.stride(0)
    if not weight.is_contiguous():
        weight = weight.contiguous()
    out_dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(shape, dtype=out_dtype)
    lib.confkv_rms_norm(x.data_ptr(), _CODES[x.dtype], row_stride, weight.data_ptr(), _CODES[weight.dtype],
                        out.data_ptr(), _CODES[out_dtype], rows, width, eps, lanes)
    return out


def rotary(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor] | None:
    """``x * cos + rotate_half(x) * sin`` for the query and the key (Su et al. 2021, RoFormer), each
    product and sum rounded to the dtype as torch's elementwise ops do.

    Args:
        query: [B, Q, Hq, D], key: [B, Q, Hkv, D] (projections viewed per head, before the transpose).
        cos, sin: [B, Q, D], all of one dtype, float32 or bfloat16.
    Returns:
        (query, key), contiguous [B, Q, H, D], or None when unavailable or the dtypes differ.
    """
    lib = library()
    dtype = query.dtype
    if lib is None or dtype not in _CODES or any(t.dtype != dtype for t in (key, cos, sin)) \
            or not _on_cpu(query, key, cos, sin):
        return None
    cos, sin = _rows_contiguous(cos), _rows_contiguous(sin)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    results = []
    for x in (query, key):
        x = _rows_contiguous(x)
        batch, length, heads, dim = x.shape
        out = torch.empty(x.shape, dtype=dtype)
        lib.confkv_rotary(x.data_ptr(), *x.stride()[:3], cos.data_ptr(), sin.data_ptr(), *cos.stride()[:2],
                          _CODES[dtype], out.data_ptr(), batch, length, heads, dim)
        results.append(out)
    return results[0], results[1]


def int8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor | None:
    """``torch._weight_int8pack_mm(x, weight, scale) (+ bias)`` for a few rows, on torch's thread count.

    Args:
        x: [M, K] float32 or bfloat16 on CPU, M <= :data:`MAX_GEMV_ROWS`, rows with a contiguous last dimension.
        weight: [N, K] int8, contiguous (weight-only INT8, one scale per output channel).
        scale: [N] float32 or bfloat16; bias: [N] float32 or bfloat16, or None.
    The dot products run in float32 (their order differs from torch's: results agree to float32
    summation order), the scale multiplies the sum, one rounding to x.dtype, then ``+ bias`` rounded
    again as torch's add. The output rows are split over ``torch.get_num_threads()`` threads: the
    caller and persistent workers (kernels.c's pool; 1 thread = no worker).

    Returns:
        [M, N] in x.dtype, or None when the library is unavailable or the inputs are not of this kind
        (the caller then runs torch's kernel).
    """
    lib = library()
    if (lib is None or x.dtype not in _CODES or scale.dtype not in _CODES or weight.dtype != torch.int8
            or x.dim() != 2 or x.shape[0] > MAX_GEMV_ROWS or weight.dim() != 2 or not weight.is_contiguous()):
        return None
    rows, width = x.shape
    outputs = weight.shape[0]
    if weight.shape[1] != width or scale.shape != (outputs,) or (bias is not None and (
            bias.shape != (outputs,) or bias.dtype not in _CODES)):
        return None
    if not _on_cpu(x, weight, scale, *(() if bias is None else (bias,))):
        return None
    x = _rows_contiguous(x)
    scale = scale if scale.is_contiguous() else scale.contiguous()
    out = torch.empty(rows, outputs, dtype=x.dtype)
    if bias is None:
        bias_ptr, bias_code = None, 0
    else:
        bias = bias if bias.is_contiguous() else bias.contiguous()
        bias_ptr, bias_code = bias.data_ptr(), _CODES[bias.dtype]
    status = lib.confkv_int8_gemv(x.data_ptr(), _CODES[x.dtype], x.stride(0), rows, width, weight.data_ptr(), outputs,
                                  scale.data_ptr(), _CODES[scale.dtype], bias_ptr, bias_code, out.data_ptr(),
                                  _CODES[x.dtype], torch.get_num_threads())
    if status:
        raise MemoryError("confkv native INT8 GEMV: out of memory for the widened activations")
    return out


def quantize_activation_blocks(x: Tensor) -> Tensor:
    """The W8A8 activations as numbers: ``x`` [..., K] -> float32 [..., K] with each row's blocks of
    :data:`ACTIVATION_BLOCK` values replaced by ``round(x / s) * s``, ``s = max|x| / 127`` in float32 (round half
    to even; an all-zero block stays zero); the last block may be shorter. The torch reference of
    :class:`Int8Projection` with ``activation_bits=8``, and the prefill path of such a layer."""
    x = x.float()
    width = x.shape[-1]
    pad = (-width) % ACTIVATION_BLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, ACTIVATION_BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = torch.where(scale > 0, torch.round(blocks / safe), torch.zeros_like(blocks)) * scale
    return quantized.reshape(*x.shape[:-1], -1)[..., :width]


class Int8Projection:
    """:func:`int8_linear` for one weight, its operands checked and packed once (a decode step makes
    ~200 such calls: the per-call Python and ctypes work is most of a small projection's time).

    Args:
        weight: [N, K] int8 contiguous; scale: [N]; bias: [N] or None; scale and bias float32 or
            bfloat16; all on CPU. The tensors are held (not copied); their owner prepares a
            new projection when it replaces them (:class:`confkv.hf.weights.Int8Linear`).
        activation_bits: 16 (default): the activations as they are, float32 sums (W8A16, the contract of
            ``torch._weight_int8pack_mm``); 8: each row's blocks of :data:`ACTIVATION_BLOCK` values
            quantised to int8 (scale max|x| / 127, round half to even) and the products summed in
            integers per block (W8A8, llama.cpp's Q8_0 activations; AVX-512 VNNI where the CPU has it):
            :func:`quantize_activation_blocks` then the W8A16 product gives the same numbers up to float32
            summation order.
    Raises:
        ValueError: when the library is unavailable or the operands are not of this kind (callers
            check :func:`available` and :meth:`supports` first).
    """

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None = None, *, activation_bits: int = 16) -> None:
        lib = library()
        if activation_bits not in (8, 16):
            raise ValueError(f"activation_bits must be 16 (the activations as they are, W8A16) or 8 (int8 blocks of "
                             f"{ACTIVATION_BLOCK}, W8A8), got {activation_bits!r}")
        if lib is None or not self.supports(weight, scale, bias):
            raise ValueError("Int8Projection needs the native library and an int8 [N, K] contiguous CPU weight with "
                             "a float32 / bfloat16 [N] scale (and bias); use int8_linear's torch fallback otherwise")
        self.lib, self.tensors = lib, (weight, scale, bias)  # held: the plan points into them
        self.outputs, self.inputs = weight.shape
        self.dtype, self._code = scale.dtype, _CODES[scale.dtype]  # the activations' dtype: the scale's
        self.activation_bits = activation_bits
        self._plan = (ctypes.c_int64 * PLAN_LENGTH)(weight.data_ptr(), weight.shape[0], weight.shape[1],
                                                    scale.data_ptr(), _CODES[scale.dtype],
                                                    0 if bias is None else bias.data_ptr(),
                                                    0 if bias is None else _CODES[bias.dtype],
                                                    8 if activation_bits == 8 else 0, 8, 0)
        self._call = lib.confkv_int8_linear

    @staticmethod
    def supports(weight: Tensor, scale: Tensor, bias: Tensor | None) -> bool:
        """Whether the operands fit: int8 contiguous [N, K], contiguous [N] float32 / bfloat16 scale and bias, CPU."""
        tensors = (weight, scale) if bias is None else (weight, scale, bias)
        return (weight.dtype == torch.int8 and weight.dim() == 2 and all(t.is_contiguous() for t in tensors)
                and all(t.dtype in _CODES and t.shape == weight.shape[:1] for t in tensors[1:]) and _on_cpu(*tensors))

    def __call__(self, x: Tensor) -> Tensor | None:
        """x [..., K] on CPU in the scale's dtype with at most MAX_GEMV_ROWS rows -> [..., N] in x.dtype, else None."""
        shape = x.shape
        if x.dtype is not self.dtype or not x.is_cpu or shape[-1] != self.inputs:
            return None
        rows = x.numel() // self.inputs if self.inputs else 0
        if rows > MAX_GEMV_ROWS or not rows:
            return None
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty(*shape[:-1], self.outputs, dtype=x.dtype)
        if self._call(self._plan, x.data_ptr(), self._code, self.inputs, rows, out.data_ptr(), torch.get_num_threads()):
            raise MemoryError("confkv native INT8 GEMV: out of memory for the widened activations")
        return out


def gemv_settings(spin_us: float | None = None, min_parallel: int | None = None) -> int:
    """Tune the INT8 GEMV's worker pool (benchmarks, tests); None keeps a setting.

    Args:
        spin_us: how long an idle worker spins before it sleeps on a condition variable (default 50 us).
        min_parallel: the smallest product, M * N * K multiply-adds, split over threads (default 65,536).
    Returns:
        The number of workers running in this process (0 before the first parallel call and in a
        fork()ed child until its first one); -1 when the library is unavailable.
    """
    lib = library()
    if lib is None:
        return -1
    return lib.confkv_gemv_configure(-1 if spin_us is None else int(spin_us * 1000),
                                     -1 if min_parallel is None else int(min_parallel))
