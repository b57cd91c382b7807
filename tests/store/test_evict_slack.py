"""The opt-in eviction slack (StoreConfig.evict_slack) and the opt-in profiling timers."""

import pytest
import torch

from confkv import StoreConfig, profiling
from confkv.errors import ConfigError
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.store.hot_tier import Region
from confkv.store import hot_tier

BUDGET, SLACK = 16, 5


def _stream(cache, model, steps, batch=1, seed=0):
    ids = torch.randint(0, 250, (batch, steps), generator=torch.Generator().manual_seed(seed))
    kept = []
    with torch.no_grad():
        for t in range(steps):
            model(ids[:, t:t + 1], cache=cache, use_cache=True)
            kept.append(cache.kept_counts().clone())
    return kept


@pytest.mark.parametrize("policy,params", [("window", {"budget": BUDGET}), ("h2o", {"budget": BUDGET, "protect": 4}),
                                           ("confkv", {"n_high": BUDGET, "n_low": BUDGET, "protect": 4})])
@pytest.mark.parametrize("int8", [False, True])
def test_slack_never_exceeds_budget_and_compacts_once_per_slack_steps(monkeypatch, policy, params, int8):
    model = tiny_model("llama", seed=4)
    store = StoreConfig(evict_slack=SLACK, kv_int8=int8, fp_window=4 if int8 else 128, move_block=4)
    cache = ConfKVCache.for_model(model, policy, store=store, **params)
    gathers = {"n": 0}
    original = Region.gather

    def gather(self, index, valid, **kwargs):
        gathers["n"] += 1
        return original(self, index, valid, **kwargs)

    monkeypatch.setattr(Region, "gather", gather)
    kept = _stream(cache, model, 60, batch=2)
    layers = len(cache.managed)
    for step, counts in enumerate(kept):
        assert (counts <= BUDGET).all(), (step, counts)
        if step >= BUDGET:  # once warmed up, between budget - slack and budget
            assert (counts >= BUDGET - SLACK).all(), (step, counts)
    # steps BUDGET..59 evict; with slack, one compaction per (slack + 1) steps per layer
    evicting_steps = 60 - BUDGET
    assert gathers["n"] <= layers * (evicting_steps // (SLACK + 1) + 1)


def test_slack_zero_is_the_default_rule():
    model = tiny_model("llama", seed=4)
    plain = ConfKVCache.for_model(model, "window", budget=BUDGET)
    assert plain.store_config.evict_slack == 0
    kept = _stream(plain, model, 40)
    assert all(int(c.max()) == min(step + 1, BUDGET) for step, c in enumerate(kept))


@pytest.mark.parametrize("bad", [-1, 1.0, -0.25, 1.5, float("nan"), True, "8", None])
def test_slack_validation(bad):
    with pytest.raises(ConfigError, match=r"evict_slack: must be a number of tokens \(an integer >= 0\) or a share"):
        StoreConfig(evict_slack=bad)
    assert StoreConfig(evict_slack=0).evict_slack == 0 and StoreConfig(evict_slack=0.125).evict_slack == 0.125
    assert StoreConfig(evict_slack=0.0).evict_slack == 0  # a share of nothing: no slack


def test_a_share_under_a_memory_target_holds_the_target_and_compacts_less(monkeypatch):
    """The preset at memory=0.5 with hot_share=0.8 and evict_slack=0.25: the bytes at the end of every step within the
    target, as at 0; the hot tier's compactions under half as many as at 0. (The hot budget grows with the length,
    to about 120 tokens at 300, of which about 84 are kept by rank above the 36 protected tokens and sinks, so a
    quarter of those is a real slack; at the preset's default hot share the tiny model's budget is the floor, 37,
    and the share takes nothing.)"""
    model = tiny_model("llama", seed=4)
    original, gathers = Region.gather, {"n": 0}

    def gather(self, index, valid, **kwargs):
        gathers["n"] += 1
        return original(self, index, valid, **kwargs)

    split_by_rank = hot_tier.split_by_rank

    def split(*args, **kwargs):  # a compaction in one C call (c/evict.c): the two gathers it replaces (kept, dropped)
        out = split_by_rank(*args, **kwargs)
        gathers["n"] += 2 * (out is not None)
        return out

    at_once = hot_tier.age_and_evict_at_once

    def age_and_evict(store, budget):  # ageing and a compaction in one C call (age_and_evict_at_once): likewise
        done = at_once(store, budget)
        gathers["n"] += 2 * done
        return done

    monkeypatch.setattr(Region, "gather", gather)
    monkeypatch.setattr(hot_tier, "split_by_rank", split)
    monkeypatch.setattr(hot_tier, "age_and_evict_at_once", age_and_evict)
    counts = {}
    for slack in (0, 0.25):
        gathers["n"] = 0
        cache = ConfKVCache.for_model(model, memory=0.5, hot_share=0.8, store=StoreConfig(evict_slack=slack))
        _stream(cache, model, 300)
        for step in cache.trace.steps:
            assert int(step.kv_bytes.sum()) <= step.target_bytes, (slack, step.seen)
        counts[slack] = gathers["n"]
    assert counts[0.25] * 2 < counts[0], counts


def test_profiling_timers_record_sections_only_when_enabled():
    model = tiny_model("llama", seed=4)
    cache = ConfKVCache.for_model(model, "confkv", n_high=BUDGET, n_low=BUDGET, protect=4)
    _stream(cache, model, 20)
    assert profiling.ACTIVE is None
    timers = profiling.Timers()
    with profiling.enabled(timers):
        _stream(cache, model, 3, seed=1)
    assert profiling.ACTIVE is None
    for section in ("attention read", "confidence", "ageing + eviction (one call)", "trace record"):
        assert timers.calls[section] > 0, section


def test_the_command_line_reads_a_count_or_a_share():
    import argparse

    from confkv.cli.main import _slack

    assert _slack("64") == 64 and isinstance(_slack("64"), int)
    assert _slack("0.125") == 0.125
    with pytest.raises(argparse.ArgumentTypeError, match="neither a number of tokens"):
        _slack("an eighth")


def test_the_storage_slack_is_the_store_slack_as_a_storage_setting():
    """``hot_slack`` (a storage field, so a preset can carry it) runs as the store's ``evict_slack``: the same
    kept counts step by step; the store's own setting of the same value is accepted, another one refused with
    both fields named."""
    model = tiny_model("llama", seed=4)
    by_storage = ConfKVCache.for_model(model, memory=0.5, hot_share=0.8, hot_slack=0.25)
    assert by_storage.store_config.evict_slack == 0.25
    by_store = ConfKVCache.for_model(model, memory=0.5, hot_share=0.8, store=StoreConfig(evict_slack=0.25))
    runs = [_stream(cache, model, 200) for cache in (by_storage, by_store)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    ConfKVCache.for_model(model, memory=0.5, hot_slack=0.25, store=StoreConfig(evict_slack=0.25))
    with pytest.raises(ConfigError, match=r"hot_slack: the storage evicts with a slack \(hot_slack=0.25\) and the "
                                          r"store config asks for another \(evict_slack=8"):
        ConfKVCache.for_model(model, memory=0.5, hot_slack=0.25, store=StoreConfig(evict_slack=8))


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1, True, "0.1", None])
def test_a_bad_storage_slack_is_refused(bad):
    from confkv.tiers.storage import Storage

    with pytest.raises(ConfigError, match=r"hot_slack: must be a share of the hot tier's tokens kept by rank"):
        Storage(hot_slack=bad)
    assert Storage(hot_slack=0).hot_slack == 0 and Storage(hot_slack=0.125).hot_slack == 0.125
