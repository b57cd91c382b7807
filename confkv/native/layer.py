"""A Llama-family decoder layer around its attention read in two native calls (issue "Speed", item 1).

The lean decoder (:mod:`confkv.hf.lean`) runs a layer as about fifteen Python-level calls
(two RMSNorms, seven projections, rotary, SiLU, a product, two sums); at 30 layers and a few
microseconds of Python, ctypes and thread hand-off each, that is milliseconds a step. With
weight-only INT8 projections (:class:`confkv.hf.weights.Int8Linear`) the layer needs only two calls
into ``kernels.c`` beside the store:

- :meth:`LayerKernels.attention_inputs`: RMSNorm, the q / k / v projections (one pool call for the
  three), rotary on q and k;
- :meth:`LayerKernels.mlp`: the o projection and the residual sum, RMSNorm, gate and up (one pool
  call), SiLU times up, the down projection and the residual sum.

Each step is rounded to the activations' dtype as the torch lines round it, and the products are
the same GEMV as :class:`~confkv.native.Int8Projection`'s, so the layer's output equals the
per-op path's up to SiLU's ``exp`` (libm's here, Sleef's in torch: at most one float32 ulp
before rounding); tests/native/test_native_layer.py compares both.
"""

from __future__ import annotations

import torch
from torch import Tensor

from confkv.native import _CODES, MAX_GEMV_ROWS, Int8Projection, _sum_lanes, library


class LayerKernels:
    """One layer's prepared operands for the two fused calls.

    Args:
        q, k, v, o, gate, up, down: the layer's projections, prepared :class:`Int8Projection` s
            (all of one activation dtype).
        input_norm, post_norm: (weight [hidden] in that dtype, epsilon) of the two RMSNorms.
        head_dim: D.
    Raises:
        ValueError: when the operands do not fit (callers check :meth:`supports` first).
    """

    def __init__(self, q: Int8Projection, k: Int8Projection, v: Int8Projection, o: Int8Projection,
                 gate: Int8Projection, up: Int8Projection, down: Int8Projection,
                 input_norm: tuple[Tensor, float], post_norm: tuple[Tensor, float], head_dim: int) -> None:
        lib = library()
        projections = (q, k, v, o, gate, up, down)
        if not self.supports(projections, input_norm, post_norm, head_dim):
            raise ValueError("LayerKernels needs the native library, prepared INT8 projections of one dtype with "
                             "matching shapes, norm weights of that dtype and a torch-order sum (see supports())")
        self.lib, self.projections = lib, projections  # held: the plans point into their tensors
        self.dtype, self.code = q.dtype, _CODES[q.dtype]
        self.hidden, self.head_dim = q.inputs, head_dim
        self.norms = (input_norm[0].contiguous(), float(input_norm[1]), post_norm[0].contiguous(), float(post_norm[1]))
        self.lanes = _sum_lanes(lib)

    @staticmethod
    def supports(projections: tuple[Int8Projection, ...], input_norm: tuple[Tensor, float],
                 post_norm: tuple[Tensor, float], head_dim: int) -> bool:
        """Whether the fused calls take this layer: one dtype, Llama's shapes, and the RMSNorm's sum in
        torch's order on this machine (else bfloat16 outputs would not equal the per-op path's)."""
        lib = library()
        if lib is None or any(p.lib is not lib for p in projections):
            return False
        q, k, v, o, gate, up, down = projections
        dtype, hidden = q.dtype, q.inputs
        if any(p.dtype is not dtype for p in projections) or dtype not in _CODES or not head_dim:
            return False
        if len({p.activation_bits for p in projections}) != 1:  # one call quantises an input once for its products
            return False
        shapes_fit = (k.inputs == v.inputs == gate.inputs == up.inputs == hidden == o.outputs == down.outputs
                      and o.inputs == q.outputs and k.outputs == v.outputs and gate.outputs == up.outputs == down.inputs
                      and q.outputs % head_dim == 0 and k.outputs % head_dim == 0)
        norms_fit = all(w.dtype is dtype and tuple(w.shape) == (hidden,) and w.device.type == "cpu"
                        for w, _ in (input_norm, post_norm))
        return shapes_fit and norms_fit and (_sum_lanes(lib) > 0 or dtype == torch.float32)

    def fits(self, x: Tensor) -> bool:
        """Whether ``x`` [B, Q, hidden] is a decode-sized CPU input of this layer's dtype, with the library
        still the one the plans were made for."""
        return (x.dtype is self.dtype and x.is_cpu and x.dim() == 3 and x.shape[-1] == self.hidden
                and 0 < x.shape[0] * x.shape[1] <= MAX_GEMV_ROWS and library() is self.lib)

    def attention_inputs(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x`` [B, Q, hidden] (checked by :meth:`fits`), cos and sin [B, Q, D] -> query [B, Q, Hq, D] and key
        [B, Q, Hkv, D] after rotary, value [B, Q, Hkv, D]."""
        batch, length, hidden = x.shape
        q, k, v = self.projections[:3]
        dim = self.head_dim
        x = x.contiguous()
        if cos.dtype is not self.dtype or sin.dtype is not self.dtype:
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride() != sin.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        query = torch.empty(batch, length, q.outputs // dim, dim, dtype=self.dtype)
        key = torch.empty(batch, length, k.outputs // dim, dim, dtype=self.dtype)
        value = torch.empty(batch, length, v.outputs // dim, dim, dtype=self.dtype)
        weight, eps = self.norms[0], self.norms[1]
        if self.lib.confkv_lean_qkv(x.data_ptr(), self.code, batch, length, hidden, weight.data_ptr(), eps, self.lanes,
                                    q._plan, k._plan, v._plan, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                                    cos.stride(1), dim, query.data_ptr(), key.data_ptr(), value.data_ptr(),
                                    torch.get_num_threads()):
            raise MemoryError("confkv native layer: out of memory for the attention's inputs")
        return query, key, value

    def mlp(self, attention: Tensor, hidden: Tensor) -> Tensor:
        """``attention`` [B, Q, Hq * D] (the read, heads merged) and the layer's input ``hidden`` [B, Q, hidden]
        -> the layer's output [B, Q, hidden]."""
        o, gate, up, down = self.projections[3:]
        batch, length, width = hidden.shape
        attention, hidden = attention.contiguous(), hidden.contiguous()
        out = torch.empty_like(hidden)
        weight, eps = self.norms[2], self.norms[3]
        if self.lib.confkv_lean_mlp(attention.data_ptr(), hidden.data_ptr(), self.code, batch * length, o.inputs, width,
                                    o._plan, weight.data_ptr(), eps, self.lanes, gate._plan, up._plan, down._plan,
                                    out.data_ptr(), torch.get_num_threads()):
            raise MemoryError("confkv native layer: out of memory for the MLP")
        return out
