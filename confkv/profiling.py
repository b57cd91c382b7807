"""Opt-in wall-clock timers around the policy's functions (``confkv bench`` breakdown).

Off by default: each instrumented section then costs one module-attribute read and a
comparison. ``with profiling.enabled(timers): ...`` turns them on for the block.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

#: the active :class:`Timers`, or None (the hot path checks this and nothing else)
ACTIVE: "Timers | None" = None

clock = time.perf_counter


class Timers:
    """Seconds and call counts per section name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1


@contextmanager
def enabled(timers: Timers) -> Iterator[Timers]:
    """Record the instrumented sections into ``timers`` inside the block."""
    global ACTIVE
    previous, ACTIVE = ACTIVE, timers
    try:
        yield timers
    finally:
        ACTIVE = previous
