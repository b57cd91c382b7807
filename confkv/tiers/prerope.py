"""Pre-RoPE keys (KVQuant): keys quantized before the rotary embedding, re-rotated at decode.

The store receives keys after the rotary embedding. Before RoPE a key channel keeps its
sign and scale across tokens (the outlier channels are steady); RoPE turns each channel pair
with the token's position, mixing the pair's values over a page, so per-channel ranges grow.
A ``prerope`` format un-rotates each key by its token's position before quantizing (the exact
inverse of RoPE: the rotation is orthogonal) and rotates the decoded key back at its position.

:class:`Rope` holds what that needs: the inverse frequencies of the rotary pairs (Hugging
Face's ``rotate_half`` layout: channel ``i`` pairs with ``i + rotary_dim / 2``), the
embedding's scaling of cos and sin, and the rotary width (the rest of the channels pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rope:
    """A model's rotary embedding (default / scaled inverse frequencies, as the model computes them).

    Attributes:
        inv_freq: [rotary_dim / 2] float32 inverse frequencies.
        scaling: the factor on cos and sin (``attention_scaling`` in transformers; 1 for plain RoPE).
    """

    inv_freq: Tensor
    scaling: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    @classmethod
    def from_model(cls, model) -> "Rope | None":
        """The rotary embedding of ``model``'s global layers, or None where it has none (GPT-2)."""
        inner = getattr(model, "model", model)
        inner = getattr(inner, "language_model", inner)  # multimodal wrappers
        rotary = getattr(inner, "rotary_emb", None)
        inv_freq = getattr(rotary, "inv_freq", None) if rotary is not None else None
        if inv_freq is None:
            return None
        return cls(inv_freq.detach().float().cpu().clone(), float(getattr(rotary, "attention_scaling", 1.0)))

    def _cos_sin(self, positions: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
        """[..., rotary_dim] cos and sin (unscaled) at ``positions`` [...]."""
        freqs = positions.to(device=device, dtype=torch.float64)[..., None] * self.inv_freq.to(device, torch.float64)
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().float(), angles.sin().float()

    def _turn(self, x: Tensor, positions: Tensor, sign: float, factor: float) -> Tensor:
        rot = self.rotary_dim
        if rot > x.shape[-1]:
            raise ValueError(f"prerope: rotary width {rot} exceeds head_dim {x.shape[-1]}")
        cos, sin = self._cos_sin(positions, x.device)
        part = x[..., :rot].float()
        half = rot // 2
        rotated_half = torch.cat([-part[..., half:], part[..., :half]], dim=-1)
        turned = (part * cos + sign * rotated_half * sin) * factor
        return torch.cat([turned, x[..., rot:].float()], dim=-1) if rot < x.shape[-1] else turned

    def rotate(self, keys: Tensor, positions: Tensor) -> Tensor:
        """Apply RoPE as the model does: keys [..., D] (float32) at ``positions`` [...] -> [..., D] float32."""
        return self._turn(keys, positions, 1.0, self.scaling)

    def unrotate(self, keys: Tensor, positions: Tensor) -> Tensor:
        """The inverse of :meth:`rotate`."""
        return self._turn(keys, positions, -1.0, 1.0 / self.scaling)
