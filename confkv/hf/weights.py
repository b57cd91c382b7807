"""Weight-only INT8 for a model's linear layers, on torch's own CPU kernel (issue "Speed", item 2).

A decode step on a CPU reads every weight once: SmolLM2-135M holds 540 MB in float32,
270 MB in bfloat16 and about 135 MB in INT8. :func:`quantize_linear_weights` replaces each
``nn.Linear`` of the decoder layers and the LM head by :class:`Int8Linear`: the weight
``W [out, in]`` becomes ``round(W / s)`` in int8 with one scale ``s = max|W_row| / 127`` per
output channel (symmetric, per-channel: the "W8A16" scheme of LLM.int8()'s weight path and
torchao's ``int8_weight_only``), and the product is computed by
``torch._weight_int8pack_mm(x, W_int8, s)``, which dequantizes inside the kernel. The
activations keep the model's dtype: the kernel is fast for bfloat16 activations and slow for
float32 ones on CPU, so use it with a bfloat16 model (:func:`quantize_linear_weights` refuses
other dtypes unless told otherwise). The embedding table stays as it is (a lookup reads one
row). Quality is measured, never assumed: ``confkv bench`` prints perplexity next to each
weight setting.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """``y = x @ (W_int8 * scale[:, None]).T + bias`` for x [..., in] -> y [..., out].

    Attributes:
        weight_int8: [out, in] int8.
        scale: [out] in the activations' dtype.
        bias: [out] or None.
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        exact = weight.abs().amax(dim=1).clamp_min(torch.finfo(dtype).tiny) / 127.0
        scale = exact.to(dtype)  # rounded up to the stored dtype, so that no weight's code passes 127
        scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, torch.inf)), scale)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.round(weight / scale.float()[:, None]).clamp(-127, 127)
                             .to(torch.int8).contiguous())
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.scale.dtype:
            raise TypeError(f"Int8Linear was built for {self.scale.dtype} activations, got {flat.dtype}")
        out = torch._weight_int8pack_mm(flat.contiguous(), self.weight_int8, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] float32: the weight the kernel multiplies by."""
        return self.weight_int8.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linear_weights(model: nn.Module, *, allow_float32: bool = False) -> int:
    """Replace the decoder's and the LM head's ``nn.Linear`` modules of ``model`` by :class:`Int8Linear`, in place.

    Returns the number of layers replaced. The model must be in bfloat16 or float16
    (float32 activations run the int8 kernel slowly on CPU; ``allow_float32=True`` permits it,
    e.g. for a quality check). The embedding stays in the model's dtype; a tied LM head gets
    its own INT8 copy.
    """
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.bfloat16, torch.float16) and not (allow_float32 and dtype == torch.float32):
        raise ValueError(f"weight-only INT8 runs with bfloat16 (or float16) activations, but the model is in {dtype}; "
                         f"load it with dtype=torch.bfloat16 (CLI: --dtype bfloat16)")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    if not targets:
        raise ValueError("the model has no nn.Linear layers to quantize (GPT-2's Conv1D projections are not supported)")
    for parent, name, child in targets:
        setattr(parent, name, Int8Linear(child, dtype))
    return len(targets)
