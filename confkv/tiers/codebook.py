"""Non-uniform levels: one small codebook per layer and tensor, fitted by k-means (Lloyd) on its first pages.

KIVI places the ``L = 2**bits`` levels of a group evenly between its minimum and maximum.
The entries of a group are not spread evenly (after a Hadamard rotation they are close to
Gaussian, dense in the middle), so evenly spaced levels waste precision on the edges. Here a
group is still mapped to ``u = (x - min) / scale`` in ``[0, L - 1]`` (the same float16
minimum and scale per group as KIVI, ``scale = (max - min) / (L - 1)``), but ``u`` is
rounded to the nearest of ``L`` levels ``c_0 < ... < c_{L-1}`` in ``[0, L - 1]`` and
decoded as ``min + scale * c_code``. The levels are the 1-D k-means of the ``u`` of the
first pages the layer encodes (NormalFloat-style, but fitted to this layer's keys or values
rather than assumed Gaussian), then frozen: every later page uses them, so a page's codes
always decode with the levels they were made with. Even levels (``c_i = i``) are KIVI.

Bytes: ``L`` float32 levels per tensor and layer (counted once per layer).
"""

from __future__ import annotations

import torch
from torch import Tensor

LEVEL_DTYPE = torch.float32
#: most samples the k-means looks at (a random subset, fixed seed, beyond this)
FIT_SAMPLES = 1 << 18


def even_levels(bits: int) -> Tensor:
    return torch.arange(1 << bits, dtype=LEVEL_DTYPE)


def fit_levels(u: Tensor, bits: int, iterations: int = 30) -> Tensor:
    """1-D k-means of samples ``u`` (any shape, values in ``[0, L - 1]``) into ``L = 2**bits`` sorted levels.

    Starts from the even levels (so it can only lower the squared error of KIVI's rounding
    on these samples); an empty cell keeps its level.
    """
    levels = even_levels(bits).to(u.device)
    samples = u.detach().reshape(-1).float()
    if samples.numel() > FIT_SAMPLES:
        generator = torch.Generator(device="cpu").manual_seed(0)
        samples = samples[torch.randperm(samples.numel(), generator=generator)[:FIT_SAMPLES].to(u.device)]
    if samples.numel() == 0:
        return levels.cpu()
    for _ in range(iterations):
        codes = nearest(samples, levels)
        sums = torch.zeros_like(levels).scatter_add_(0, codes, samples)
        counts = torch.zeros_like(levels).scatter_add_(0, codes, torch.ones_like(samples))
        moved = torch.where(counts > 0, sums / counts.clamp_min(1), levels)
        if torch.allclose(moved, levels, atol=1e-6):
            break
        levels = moved.sort().values
    return levels.cpu()


def nearest(u: Tensor, levels: Tensor) -> Tensor:
    """Index (int64) of the nearest level (sorted ``levels``) for each entry of ``u``."""
    midpoints = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(u.contiguous(), midpoints.to(u.device))
