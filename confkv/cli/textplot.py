"""Tiny terminal renderings of traces (for the demo and command summaries)."""

from __future__ import annotations

_BARS = " ▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 80, low: float | None = None, high: float | None = None) -> str:
    """``values`` resampled to ``width`` columns and drawn with block characters."""
    if not values:
        return ""
    step = max(1, -(-len(values) // width))
    cols = [max(values[i:i + step]) for i in range(0, len(values), step)]
    low = min(cols) if low is None else low
    high = max(cols) if high is None else high
    span = (high - low) or 1.0
    return "".join(_BARS[min(len(_BARS) - 1, max(0, round((v - low) / span * (len(_BARS) - 1))))] for v in cols)
