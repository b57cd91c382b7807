"""PyramidKV-style per-layer budgets: deeper layers keep less, the mean stays fixed."""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache


def pyramid_budgets(mean_budget: int, num_layers: int, beta: float = 20.0, *, min_budget: int = 0) -> list[int]:
    """Linear per-layer budgets (PyramidKV; Cai et al. 2024, "PyramidKV: Dynamic KV Cache
    Compression based on Pyramidal Information Funneling").

    With ``k = mean_budget`` and ``L = num_layers``::

        lo = k / beta,   hi = 2k - lo,   b_l = hi - l * (hi - lo) / (L - 1),   l = 0 .. L-1

    so ``b_0 = hi`` (first layer, the most), ``b_{L-1} = lo`` (last layer) and the mean is
    exactly ``k``. ``beta = 1`` gives a flat allocation.

    Floor: layers may not go below ``min_budget`` (the tokens a layer can never evict:
    protected tokens, sinks, FP window). Layers under it are raised to it and the deficit
    is taken from the other layers in proportion to their excess ``b_l - min_budget`` (one
    pass suffices; the order is kept, the mean stays ``k``).

    Rounding: every layer gets ``floor(b_l)`` and the ``R = L*k - sum(floor(b_l))`` leftover
    tokens go one each to the first (shallowest) ``R`` layers whose ``b_l`` is not an
    integer. So the sum is exactly ``L * k``, each budget is ``floor(b_l)`` or ``ceil(b_l)``
    (strictly within 1 of its real value), and budgets never increase with depth. Computed
    in exact rational arithmetic.

    Returns:
        ``num_layers`` ints, non-increasing, each ``>= min_budget``, summing to ``num_layers * mean_budget``.
    Raises:
        ValueError: on non-positive sizes, ``beta < 1`` or ``mean_budget < min_budget``.
    """
    return list(_pyramid(mean_budget, num_layers, beta, min_budget))


@lru_cache(maxsize=256)
def _pyramid(mean_budget: int, num_layers: int, beta: float, min_budget: int) -> tuple[int, ...]:
    if not (isinstance(mean_budget, int) and mean_budget >= 1):
        raise ValueError(f"mean_budget must be a positive integer, got {mean_budget!r}")
    if not (isinstance(num_layers, int) and num_layers >= 1):
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta >= 1):
        raise ValueError(f"beta must be a finite number >= 1, got {beta!r}")
    if not (isinstance(min_budget, int) and 0 <= min_budget <= mean_budget):
        raise ValueError(f"min_budget must be an integer in [0, mean_budget={mean_budget}], got {min_budget!r}")
    if num_layers == 1:
        return (mean_budget,)
    k = Fraction(mean_budget)
    lo = k / Fraction(beta)
    hi = 2 * k - lo
    step = (hi - lo) / (num_layers - 1)
    real = [hi - l * step for l in range(num_layers)]
    floor = Fraction(min_budget)
    deficit = sum((floor - b for b in real if b < floor), Fraction(0))
    if deficit > 0:
        excess = sum((b - floor for b in real if b >= floor), Fraction(0))
        shrink = 1 - deficit / excess
        real = [floor + (b - floor) * shrink if b >= floor else floor for b in real]
    budgets = [math.floor(b) for b in real]
    leftover = num_layers * mean_budget - sum(budgets)
    fractional = [l for l, b in enumerate(real) if b != budgets[l]]
    assert 0 <= leftover <= len(fractional)
    for l in fractional[:leftover]:
        budgets[l] += 1
    return tuple(budgets)
