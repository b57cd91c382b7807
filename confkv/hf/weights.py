"""Weight-only INT8 (and 4-bit) for a model's linear layers, on torch's own CPU kernel (issue "Speed", item 2).

A decode step on a CPU reads every weight once: SmolLM2-135M holds 540 MB in float32,
270 MB in bfloat16 and about 135 MB in INT8. :func:`quantize_linear_weights` replaces each
``nn.Linear`` of the decoder layers and the LM head by :class:`Int8Linear`: the weight
``W [out, in]`` becomes ``round(W / s)`` in int8 with one scale ``s = max|W_row| / 127`` per
output channel (symmetric, per-channel: the "W8A16" scheme of LLM.int8()'s weight path and
torchao's ``int8_weight_only``), and the product is computed by
``torch._weight_int8pack_mm(x, W_int8, s)``, which dequantizes inside the kernel; decode-sized
inputs (at most ``confkv.native.MAX_GEMV_ROWS`` rows on CPU) run the same product in
:func:`confkv.native.int8_linear` (kernels.c, split over torch's thread count) when the native
kernels are on. With ``activation_bits=8`` each projection's input is also quantised to int8 in
blocks of 32 (W8A8, as llama.cpp's Q8_0 activations): the native GEMV then sums integer products
(AVX-512 VNNI) and prefill multiplies the same quantised numbers in float32
(:func:`confkv.native.quantize_activation_blocks`). With ``weight_bits=4`` (and ``activation_bits=8``) the
weights are stored as 4-bit blocks of 32 with a float16 scale and minimum each (:class:`Int4Linear`, W4A8, Q4_1's
form; :mod:`confkv.hf.int4_blocks`): a step reads about 5 bits a weight instead of 8. By default the
activations keep the model's dtype: the kernel is fast for bfloat16 activations and slow for
float32 ones on CPU, so use it with a bfloat16 model (:func:`quantize_linear_weights` refuses
other dtypes unless told otherwise). The embedding table stays as it is (a lookup reads one
row). Quality is measured, never assumed: ``confkv bench`` prints perplexity next to each
weight setting.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from confkv import native
from confkv.hf.int4_blocks import pack_int4_blocks, unpack_int4_blocks
from confkv.native.int4 import Int4Projection


class Int8Linear(nn.Module):
    """``y = x @ (W_int8 * scale[:, None]).T + bias`` for x [..., in] -> y [..., out].

    Attributes:
        weight_int8: [out, in] int8.
        scale: [out] in the activations' dtype.
        bias: [out] or None.
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, *, activation_bits: int = 16) -> None:
        super().__init__()
        if activation_bits not in (8, 16):
            raise ValueError(f"activation_bits must be 16 (weight-only INT8, W8A16) or 8 (int8 activations in blocks "
                             f"of {native.ACTIVATION_BLOCK}, W8A8), got {activation_bits!r}")
        self.activation_bits = activation_bits
        weight = linear.weight.detach().float()
        exact = weight.abs().amax(dim=1).clamp_min(torch.finfo(dtype).tiny) / 127.0
        scale = exact.to(dtype)  # rounded up to the stored dtype, so that no weight's code passes 127
        scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, torch.inf)), scale)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.round(weight / scale.float()[:, None]).clamp(-127, 127)
                             .to(torch.int8).contiguous())
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)

    #: 16: weight-only INT8 (W8A16); 8: int8 activations in blocks too (W8A8); see quantize_linear_weights
    activation_bits = 16
    # (library, its prepared GEMV or None) for this layer's tensors; dropped when the tensors change, and
    # prepared again when the library changes (CONFKV_NATIVE, loader.disabled()), never on every call
    _native: "tuple[object, native.Int8Projection | None] | None" = None
    #: False: every Int8Linear runs torch's kernel while the other native kernels stay on (A/B timings)
    use_native_gemv = True

    def native_projection(self) -> "native.Int8Projection | None":
        """The native GEMV prepared for this layer's tensors and the library now loaded (prepared on first
        use), or None when the library is off or the tensors do not fit."""
        prepared = self._native
        return prepared[1] if prepared is not None and prepared[0] is native.library() else self._projection()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]: the native GEMV (confkv.native) for decode-sized CPU inputs (at most
        ``native.MAX_GEMV_ROWS`` rows), else torch's kernel (:meth:`torch_forward`)."""
        projection = self.native_projection()
        out = projection(x) if projection is not None and self.use_native_gemv else None  # None: not a decode-sized CPU input
        if out is not None:
            return out
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.activation_dtype:
            raise TypeError(f"{type(self).__name__} was built for {self.activation_dtype} activations, got {flat.dtype}")
        return self.torch_forward(flat).reshape(*x.shape[:-1], self.out_features)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The activations' dtype this layer was built for (its scale's)."""
        return self.scale.dtype

    def torch_forward(self, flat: torch.Tensor) -> torch.Tensor:
        """[M, in] -> [M, out] with torch's kernel (prefill chunks, no native library; the tests' reference).

        torch 2.13's bfloat16 ``_weight_int8pack_mm`` reads past the rows when ``in`` is not a multiple
        of 16 (garbage out); such layers multiply by the dequantized weight in float32 instead.
        """
        if self.activation_bits == 8:  # W8A8: the activations' int8 blocks as numbers, the product in float32
            out = (native.quantize_activation_blocks(flat) @ self.weight_int8.float().T * self.scale.float()).to(flat.dtype)
        elif flat.dtype != torch.float32 and self.in_features % 16:
            out = (flat.float() @ self.weight_int8.float().T * self.scale.float()).to(flat.dtype)
        else:
            out = torch._weight_int8pack_mm(flat.contiguous(), self.weight_int8, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out

    def _projection(self) -> "native.Int8Projection | None":
        """The native GEMV prepared for this layer's tensors, or None when the library is off or the
        tensors do not fit (not on CPU)."""
        weight, scale, bias = self.weight_int8, self.scale, self.bias
        lib = native.library()
        ready = lib is not None and native.Int8Projection.supports(weight, scale, bias)
        projection = native.Int8Projection(weight, scale, bias, activation_bits=self.activation_bits) if ready else None
        self.__dict__["_native"] = (lib, projection)
        return projection

    def __setattr__(self, name: str, value) -> None:
        if name in ("weight_int8", "scale", "bias"):
            self.__dict__.pop("_native", None)  # the prepared GEMV points at the old tensors
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):  # .to(), .float(), .share_memory(), ...: tensors may move
        self.__dict__.pop("_native", None)
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):  # load_state_dict(assign=True) replaces the tensors
        self.__dict__.pop("_native", None)
        return super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_native", None)  # ctypes handles: prepared again on first use (pickle, deepcopy)
        return state

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] float32: the weight the kernel multiplies by."""
        return self.weight_int8.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation_bits={self.activation_bits}")


class Int4Linear(Int8Linear):
    """``y = q(x) @ W4.T + bias`` for x [..., in] -> y [..., out], ``q`` the int8 activation blocks (as W8A8's),
    ``W4`` the 4-bit weight blocks of :mod:`confkv.hf.int4_blocks` (32 columns with a float16 scale and minimum,
    Q4_1's form). Decode-sized inputs run the native W4A8 GEMV (:class:`confkv.native.int4.Int4Projection`);
    prefill chunks the same quantised activations times the dequantized weight in float32. A subclass of
    :class:`Int8Linear`, so that the lean decoder fuses its layers the same way (the kernels read the plan's
    weight bits).

    Attributes:
        weight_codes: [out, Kq / 2] uint8 (Kq: ``in`` rounded up to 128); weight_scale, weight_min: [out, Kq / 32]
            float16; bias: [out] or None.
        dtype: the activations' dtype.
    """

    activation_bits = 8

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = dtype
        codes, scale, minimum = pack_int4_blocks(linear.weight.detach())
        self.register_buffer("weight_codes", codes)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_min", minimum)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.dtype

    def torch_forward(self, flat: Tensor) -> Tensor:
        """[M, in] -> [M, out]: the activations' int8 blocks as numbers times the dequantized weight, in float32,
        rounded to the activations' dtype, plus the bias (prefill chunks, no native library; the tests' reference)."""
        out = (native.quantize_activation_blocks(flat) @ self.dequantized_weight().T).to(flat.dtype)
        return out if self.bias is None else out + self.bias

    def _projection(self) -> Int4Projection | None:
        tensors = (self.weight_codes, self.weight_scale, self.weight_min, self.bias)
        lib = native.library()
        ready = lib is not None and Int4Projection.fits(*tensors, self.dtype, self.in_features)
        projection = Int4Projection(*tensors, self.dtype, self.in_features) if ready else None
        self.__dict__["_native"] = (lib, projection)
        return projection

    def __setattr__(self, name: str, value) -> None:
        if name in ("weight_codes", "weight_scale", "weight_min"):
            self.__dict__.pop("_native", None)  # the prepared GEMV points at the old tensors
        super().__setattr__(name, value)

    def dequantized_weight(self) -> Tensor:
        """[out, in] float32: the weight the kernel multiplies by."""
        return unpack_int4_blocks(self.weight_codes, self.weight_scale, self.weight_min, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight_bits=4, activation_bits=8")


def quantize_linear_weights(model: nn.Module, *, allow_float32: bool = False, activation_bits: int = 16,
                            weight_bits: int = 8) -> int:
    """Replace the decoder's and the LM head's ``nn.Linear`` modules of ``model`` by :class:`Int8Linear` (or
    :class:`Int4Linear`), in place.

    Returns the number of layers replaced. The model must be in bfloat16 or float16
    (float32 activations run the int8 kernel slowly on CPU; ``allow_float32=True`` permits it,
    e.g. for a quality check). The embedding stays in the model's dtype; a tied LM head gets
    its own INT8 copy. ``activation_bits=8`` also quantises each projection's input to int8 in
    blocks of 32 (W8A8, as llama.cpp's Q8_0 activations): the decode GEMV then sums integer
    products (AVX-512 VNNI), and prefill multiplies the same quantised numbers, so perplexity
    measures what decoding computes. ``weight_bits=4`` (with ``activation_bits=8``) stores the decoder
    layers' weights as 4-bit blocks instead (:class:`Int4Linear`, W4A8: about 5/8 of the bytes a step
    reads) and keeps the LM head in INT8 (W8A8), as llama.cpp's 4-bit files keep their output matrix at 6
    or 8 bits: SmolLM2's head in 4 bits cost +4.8% perplexity; with it in INT8, its 4-bit decoder layers (a
    4-bit GGUF's, found again up to bfloat16 rounding) +0.28% over float32, INT8 weights +0.45%
    (results/bench/w4a8/README.md).
    """
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.bfloat16, torch.float16) and not (allow_float32 and dtype == torch.float32):
        raise ValueError(f"weight-only INT8 runs with bfloat16 (or float16) activations, but the model is in {dtype}; "
                         f"load it with dtype=torch.bfloat16 (CLI: --dtype bfloat16)")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    if not targets:
        raise ValueError("the model has no nn.Linear layers to quantize (GPT-2's Conv1D projections are not supported)")
    if activation_bits not in (8, 16):
        raise ValueError(f"activation_bits must be 16 (weight-only INT8) or 8 (W8A8), got {activation_bits!r}")
    if weight_bits not in (4, 8) or (weight_bits == 4 and activation_bits != 8):
        raise ValueError(f"weight_bits must be 8, or 4 with activation_bits=8 (W4A8: the 4-bit GEMV sums int8 "
                         f"activation blocks), got weight_bits={weight_bits!r}, activation_bits={activation_bits!r}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for parent, name, child in targets:
        four = weight_bits == 4 and child is not head
        setattr(parent, name, Int4Linear(child, dtype) if four
                else Int8Linear(child, dtype, activation_bits=activation_bits))
    return len(targets)
