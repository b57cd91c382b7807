"""The 4-bit weight GEMV (W4A8) prepared for one weight: :class:`Int4Projection`.

A weight row of ``K`` columns is stored in blocks of :data:`~confkv.native.ACTIVATION_BLOCK` = 32 as 4-bit codes
with a float16 scale and minimum per block (the weight is ``minimum + code * scale``: Q4_1's form, llama.cpp's
4-bit weights with a minimum), packed by :func:`confkv.hf.int4_blocks.pack_int4_blocks`. The activations are
quantised to int8 blocks of 32 as for W8A8 (:func:`confkv.native.quantize_activation_blocks`), and each block's
product is summed in integers (AVX-512 VNNI where the CPU has it; ``kernels.c``'s ``c/gemv_w4.c``). A decode step
reads every weight once: a 4-bit weight is half an INT8 one's bytes, plus 4 bytes of scale and minimum a block.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from confkv.native import _CODES, ACTIVATION_BLOCK, PLAN_LENGTH, Int8Projection, _on_cpu, library

#: columns per packed line of 64 bytes (kernels.c's W4_STEP): a weight row's length is rounded up to it
PACK_STEP = 128


def padded_columns(columns: int) -> int:
    """``columns`` rounded up to a multiple of :data:`PACK_STEP` (the packed row's columns)."""
    return -(-columns // PACK_STEP) * PACK_STEP


class Int4Projection(Int8Projection):
    """:class:`~confkv.native.Int8Projection`'s call for a 4-bit weight (W4A8), its operands checked and packed once.

    Args:
        codes: [N, Kq / 2] uint8 (Kq = K rounded up to 128; each 128 columns in 64 bytes, column i in the low nibble
            of byte i and column 64 + i in the high one); scale, minimum: [N, Kq / 32] float16 per block; bias: [N]
            float32 or bfloat16, or None; all contiguous on CPU, held (not copied).
        dtype: the activations' dtype (float32 or bfloat16).
        inputs: K.
    Raises:
        ValueError: the library is unavailable or the operands are not of this kind (callers check :meth:`fits`).
    """

    def __init__(self, codes: Tensor, scale: Tensor, minimum: Tensor, bias: Tensor | None, dtype: torch.dtype,
                 inputs: int) -> None:
        lib = library()
        if lib is None or not self.fits(codes, scale, minimum, bias, dtype, inputs):
            raise ValueError("Int4Projection needs the native library, uint8 [N, Kq / 2] codes (Kq = K rounded up to "
                             f"{PACK_STEP}), float16 [N, Kq / 32] "
                             "scales and minima, a [N] float32 / bfloat16 bias or none, all contiguous on CPU")
        self.lib, self.tensors = lib, (codes, scale, minimum, bias)  # held: the plan points into them
        self.outputs, self.inputs = codes.shape[0], inputs
        self.dtype, self._code = dtype, _CODES[dtype]
        self.activation_bits = 8
        self._plan = (ctypes.c_int64 * PLAN_LENGTH)(codes.data_ptr(), self.outputs, inputs, scale.data_ptr(), 0,
                                                    0 if bias is None else bias.data_ptr(),
                                                    0 if bias is None else _CODES[bias.dtype], 8, 4,
                                                    minimum.data_ptr())
        self._call = lib.confkv_int8_linear

    @staticmethod
    def fits(codes: Tensor, scale: Tensor, minimum: Tensor, bias: Tensor | None, dtype: torch.dtype,
             inputs: int) -> bool:
        """Whether the operands are of this kind (shapes, dtypes, contiguous, on CPU)."""
        if codes.dim() != 2 or dtype not in _CODES or inputs < 1:
            return False
        outputs, blocks = codes.shape[0], padded_columns(inputs) // ACTIVATION_BLOCK
        tensors = (codes, scale, minimum) if bias is None else (codes, scale, minimum, bias)
        return (codes.dtype == torch.uint8 and tuple(codes.shape) == (outputs, padded_columns(inputs) // 2)
                and all(t.dtype == torch.float16 and tuple(t.shape) == (outputs, blocks) for t in (scale, minimum))
                and (bias is None or (bias.dtype in _CODES and tuple(bias.shape) == (outputs,)))
                and all(t.is_contiguous() for t in tensors) and _on_cpu(*tensors))
