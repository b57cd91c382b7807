"""How budgets are shown to a person: the "never evict" sentinel reads ``unlimited``.

Internally a budget of :data:`confkv.policies.base.UNLIMITED` (``2**62``) means "never
evict" (``full``, or a layer a policy does not limit). That number must never reach a
person: printed summaries, trace JSON, report pages and plots show ``"unlimited"``.
"""

from __future__ import annotations

import math
from typing import Any

from confkv.policies.base import UNLIMITED

#: what a person reads for an unlimited budget (also the value written in trace JSON)
UNLIMITED_TEXT = "unlimited"


def is_unlimited(budget: Any) -> bool:
    """True for the "never evict" sentinel (any value at or above ``UNLIMITED``, or the text)."""
    if isinstance(budget, str):
        return budget == UNLIMITED_TEXT
    try:
        value = budget if isinstance(budget, float) else int(budget)  # ints (and tensors) compare exactly
    except (TypeError, ValueError):
        return False
    return value >= UNLIMITED


def budget_text(budget: Any) -> str:
    """A budget for a person: ``"512"``, or ``"unlimited"`` for the sentinel."""
    return UNLIMITED_TEXT if is_unlimited(budget) else str(int(budget))


def budgets_text(budgets: list[Any], most: int = 6) -> str:
    """The distinct budgets of a run, sorted: ``"[128, 256]"``, ``"[unlimited]"``, ``"[64, ...] ..."``."""
    distinct = sorted({UNLIMITED if is_unlimited(b) else int(b) for b in budgets})
    shown = ", ".join(budget_text(b) for b in distinct[:most])
    return f"[{shown}]{' ...' if len(distinct) > most else ''}"


def budget_to_json(budget: Any) -> Any:
    """A budget (int or nested list of ints) for JSON: the sentinel becomes ``"unlimited"``."""
    if isinstance(budget, (list, tuple)):
        return [budget_to_json(b) for b in budget]
    return UNLIMITED_TEXT if is_unlimited(budget) else budget


def budget_from_json(budget: Any) -> Any:
    """Inverse of :func:`budget_to_json`: ``"unlimited"`` back to ``UNLIMITED`` (nested lists too)."""
    if isinstance(budget, (list, tuple)):
        return [budget_from_json(b) for b in budget]
    return UNLIMITED if is_unlimited(budget) else budget


def budget_for_plot(budget: Any) -> float:
    """A budget on a plot's token axis: the sentinel is not drawn (NaN), so it cannot stretch the axis."""
    return math.nan if is_unlimited(budget) else float(budget)
