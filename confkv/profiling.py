"""Opt-in wall-clock timers around the policy's functions (``confkv bench`` breakdown).

Instrumented code wraps a section in ``with profiling.section("attention read"): ...`` (always through
the module attribute, never a name imported from here). Off by default: :data:`section` is then
:class:`contextlib.nullcontext` itself, so an instrumented step calls no code of this module (no clock,
no timers; the bench's instrumentation stays out of the step's files, docs/ARCHITECTURE.md).
``with profiling.enabled(timers): ...`` rebinds it to the timed section for the block; each section then
adds its wall time and one call to ``timers``, also when the block raises (the exception propagates
unchanged).

Reads that leave the native path (:mod:`confkv.attention.read_plan`) are counted by reason with
:func:`left_native`: always in :data:`FALLBACKS` (one dict update; :func:`reset_fallbacks` clears
it), and in the active timers' ``fallbacks`` too, which the bench breakdown prints.

Sections may nest (e.g. the cold tier's demotion inside "compaction gather"): each records
its own span, so a nested section's time is also inside its parent's.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator

#: the active :class:`Timers`, or None
ACTIVE: "Timers | None" = None

clock = time.perf_counter

#: reads that left the native path since the last :func:`reset_fallbacks`, by reason
FALLBACKS: Counter[str] = Counter()


class Timers:
    """Seconds and call counts per section name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        #: reads that left the native path while these timers were active, by reason
        self.fallbacks: dict[str, int] = defaultdict(int)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1


class _Timed:
    """One timed span of a section, recorded into the timers active when it was opened."""

    __slots__ = ("name", "timers", "started")

    def __init__(self, name: str, timers: Timers) -> None:
        self.name = name
        self.timers = timers
        self.started = 0.0

    def __enter__(self) -> None:
        self.started = clock()

    def __exit__(self, *exc: Any) -> bool:
        self.timers.add(self.name, clock() - self.started)
        return False  # an exception inside the section propagates


def _timed_section(name: str) -> "_Timed":
    """The section while timers are active: a span recorded into the timers active when it opened."""
    return _Timed(name, ACTIVE)  # type: ignore[arg-type]


#: ``section(name)``: a context manager timing its block as section ``name`` while timers are active;
#: :class:`contextlib.nullcontext` otherwise (one small object, no call into this module)
section: Callable[[str], ContextManager[Any]] = nullcontext


@contextmanager
def enabled(timers: Timers) -> Iterator[Timers]:
    """Record the instrumented sections into ``timers`` inside the block."""
    global ACTIVE, section
    previous = ACTIVE, section
    ACTIVE, section = timers, _timed_section
    try:
        yield timers
    finally:
        ACTIVE, section = previous


def left_native(reason: str) -> None:
    """Count one read that left the native path, with its reason (see the module docstring)."""
    FALLBACKS[reason] += 1
    timers = ACTIVE
    if timers is not None:
        timers.fallbacks[reason] += 1


def reset_fallbacks() -> None:
    """Clear :data:`FALLBACKS`."""
    FALLBACKS.clear()
