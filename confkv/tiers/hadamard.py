"""A randomized Walsh-Hadamard rotation of each KV head's channels (QuaRot / SpinQuant, llama.cpp's rotated K/V).

Keys and values often have a few channels far larger than the rest; an orthogonal rotation
``R = H diag(s) / sqrt(n)`` (``H`` the Sylvester Hadamard matrix, ``s`` fixed random signs)
spreads every channel over all of them, so per-token and per-channel ranges shrink and the
low-bit codes waste fewer levels. Because ``R`` is orthogonal, ``(R q) . (R k) = q . k``:
rotating keys and queries alike leaves the attention scores unchanged. A page format rotates
keys and values before quantizing and rotates back after dequantizing, so every read sees
the original basis.

``head_dim`` need not be a power of two: the rotation acts on blocks of the largest power
of two dividing it (64-channel blocks at head_dim 192, say).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor


def power_of_two_block(head_dim: int) -> int:
    """The largest power of two dividing ``head_dim``."""
    return head_dim & -head_dim


def fwht(x: Tensor) -> Tensor:
    """Orthonormal fast Walsh-Hadamard transform along the last dim (a power of two): ``H x / sqrt(n)``.

    ``n log2 n`` additions; the transform is its own inverse.
    """
    *lead, n = x.shape
    if n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    y = x
    h = 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(*lead, n) * (n ** -0.5)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """[n, n] orthonormal Sylvester Hadamard matrix (symmetric, its own inverse)."""
    return fwht(torch.eye(n, dtype=dtype))


class HadamardRotation:
    """``x -> H (s * x) / sqrt(n)`` per block of ``n`` channels, and its inverse.

    Args:
        head_dim: channels of a KV head.
        seed: of the random signs ``s`` (fixed, so nothing is stored: 0 bytes per layer).
    """

    def __init__(self, head_dim: int, seed: int = 0) -> None:
        self.head_dim = head_dim
        self.block = power_of_two_block(head_dim)
        generator = torch.Generator().manual_seed(seed)
        self.signs = (torch.randint(0, 2, (head_dim,), generator=generator) * 2 - 1).float()
        # the rotation as one [D, D] matrix for the matmul path: y = x @ matrix, x = y @ matrix.T
        blocks = head_dim // self.block
        h = hadamard_matrix(self.block)
        dense = torch.block_diag(*([h] * blocks)) if blocks > 1 else h
        self.matrix = self.signs[:, None] * dense  # rows scaled by s: (x * s) @ H
        self._cache: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def _on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._cache:
            self._cache[device] = (self.matrix.to(device), self.matrix.t().contiguous().to(device))
        return self._cache[device]

    def forward(self, x: Tensor) -> Tensor:
        """[..., D] float32 -> rotated [..., D] float32."""
        return x.float() @ self._on(x.device)[0]

    def inverse(self, y: Tensor) -> Tensor:
        """Undo :meth:`forward`."""
        return y.float() @ self._on(y.device)[1]

    def forward_fwht(self, x: Tensor) -> Tensor:
        """:meth:`forward` by butterflies (the same rotation, ``D log D`` adds instead of a matmul)."""
        signed = x.float() * self.signs.to(x.device)
        return fwht(signed.reshape(*x.shape[:-1], -1, self.block)).reshape(x.shape)

    def inverse_fwht(self, y: Tensor) -> Tensor:
        """:meth:`inverse` by butterflies."""
        return fwht(y.float().reshape(*y.shape[:-1], -1, self.block)).reshape(y.shape) * self.signs.to(y.device)


@lru_cache(maxsize=None)
def shared_rotation(head_dim: int, seed: int = 0) -> HadamardRotation:
    """One :class:`HadamardRotation` per (head size, seed), shared by every format that asks: the rungs of a
    ladder then hold the same object, which a read checks by identity before comparing matrices."""
    return HadamardRotation(head_dim, seed)
