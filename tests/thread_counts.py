"""torch's thread count in tests: set for a block and restored however it ends (:func:`torch_threads`), and
reading the same thing at one thread and at two (tests that a kernel's tasks share no memory)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's thread count set to ``count`` for the block (which may set it again), and the count from before
    restored on leaving it, however the block ends: a test that set it and failed, or never set it back, would
    run every later test of the process at its count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def same_bits_at_one_and_two_threads(read: Callable[[], tuple[Tensor, list[Tensor]]], repeats: int = 1) -> None:
    """``read()`` -> (output, masses) once at one thread, then ``repeats`` times at two: every result bit-equal to
    the first (tasks that shared memory would give other bits only when two ran at once, hence the repeats).
    torch's thread count is restored after."""
    with torch_threads(1):
        one, one_mass = read()
        torch.set_num_threads(2)
        for _ in range(repeats):
            two, two_mass = read()
            assert torch.equal(one, two) and len(one_mass) == len(two_mass)
            assert all(torch.equal(a, b) for a, b in zip(one_mass, two_mass))
