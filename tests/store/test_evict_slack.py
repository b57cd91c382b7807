"""The opt-in eviction slack (StoreConfig.evict_slack) and the opt-in profiling timers."""

import pytest
import torch

from confkv import StoreConfig, profiling
from confkv.errors import ConfigError
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.store.region import Region

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


def test_slack_validation():
    with pytest.raises(ConfigError, match="evict_slack"):
        StoreConfig(evict_slack=-1)


def test_profiling_timers_record_sections_only_when_enabled():
    model = tiny_model("llama", seed=4)
    cache = ConfKVCache.for_model(model, "confkv", n_high=BUDGET, n_low=BUDGET, protect=4)
    _stream(cache, model, 20)
    assert profiling.ACTIVE is None
    timers = profiling.Timers()
    with profiling.enabled(timers):
        _stream(cache, model, 3, seed=1)
    assert profiling.ACTIVE is None
    for section in ("attention read", "confidence", "ranking and top-k", "compaction gather", "trace record"):
        assert timers.calls[section] > 0, section
