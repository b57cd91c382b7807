"""A :class:`confkv.store.LayerStore` driven by hand: the timing breakdown it reports, what it keeps,
where each token lives, and its byte counts, against expectations worked out by hand.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

import itertools

import pytest
import torch

from confkv import profiling
from confkv.config import StoreConfig
from confkv.policies import make_policy
from confkv.store import LayerStore


def _step(store: LayerStore, gen: torch.Generator, budget: int | None, batch: int = 1, new: int = 1,
          padding: torch.Tensor | None = None) -> torch.Tensor:
    store.append(torch.randn(batch, 2, new, 4, generator=gen), torch.randn(batch, 2, new, 4, generator=gen))
    out = store.attend(torch.randn(batch, 4, new, 4, generator=gen), scaling=0.5, padding=padding)
    store.end_step(None if budget is None else torch.full((batch,), budget, dtype=torch.int64))
    return out


def test_timing_breakdown_names_every_section_and_counts_only_its_own_time(monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr(profiling, "clock", lambda: float(next(ticks)))
    store = LayerStore(make_policy("confkv", n_high=8, n_low=8, protect=2, sinks=1),
                       StoreConfig(kv_int8=True, fp_window=3, move_block=2))
    gen = torch.Generator().manual_seed(0)
    timers = profiling.Timers()
    with profiling.enabled(timers):
        for _ in range(12):
            _step(store, gen, budget=8)
    assert set(timers.calls) == {
        "append (FP window)", "positions and masks", "attention read", "EMA / stats update",
        "eviction bookkeeping", "quantization", "ageing (old-region concat)", "ranking and top-k",
        "compaction gather"}
    assert timers.calls["append (FP window)"] == 12 and timers.calls["attention read"] == 12
    elapsed = next(ticks)  # every clock reading so far
    # each section is a difference of two readings: a positive whole number of ticks, and the
    # sections never overlap, so together they cannot exceed the ticks that passed
    assert all(s >= 1 and s == int(s) for s in timers.seconds.values()), dict(timers.seconds)
    assert sum(timers.seconds.values()) <= elapsed


def test_store_without_profiling_records_nothing():
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(kv_int8=True, fp_window=2, move_block=1))
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        _step(store, gen, budget=6)
    assert profiling.ACTIVE is None and store.kept_list() == [6]
