"""Counting the calls of one method during a block (tests of which path a step takes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def counted_calls(owner: type, name: str) -> Iterator[list[int]]:
    """Inside the block, every call of ``owner.name`` appends 1 to the yielded list (the method still runs)."""
    calls: list[int] = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield calls
    finally:
        setattr(owner, name, original)
