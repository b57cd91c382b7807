"""Every budgeted policy keeps exactly the budget its parameters say, and never evicts the
tokens its parameters protect.

The expectations are computed here from the parameters passed to the policy (``budget``,
``n_high``/``n_low`` with a gate forced one way, ``protect``, ``sinks``, ``recent_ratio``, the
store's ``fp_window``), not from ``policy.layer_budgets`` or the store's ``recent_len``.
"""

import pytest
import torch

from confkv.config import StoreConfig
from confkv.hf import ConfKVCache
from confkv.models import tiny_model

BATCH, STEPS = 2, 44

# (policy, params, budget expected, recent tokens always kept besides `protect`)
CASES = [
    ("window", {"budget": 12}, 12, 12),
    ("streaming", {"budget": 12, "sinks": 3}, 12, 9),
    ("h2o", {"budget": 12, "protect": 2, "sinks": 1, "recent_ratio": 0.25}, 12, 3),  # round(0.25 * 12)
    ("scissorhands", {"budget": 12, "protect": 4, "sinks": 2, "recent_ratio": 0.25, "history": 6}, 12, 4),
    ("tova", {"budget": 12, "protect": 3, "sinks": 2}, 12, 3),
    ("random", {"budget": 12, "protect": 3, "sinks": 2, "seed": 5}, 12, 3),
    ("confkv-fixed", {"budget": 12, "protect": 3, "sinks": 2}, 12, 3),
    ("confkv", {"n_high": 10, "n_low": 14, "tau": 0.0, "protect": 3, "sinks": 2}, 10, 3),  # c >= 0: always n_high
    ("confkv", {"n_high": 10, "n_low": 14, "tau": 1.0, "protect": 3, "sinks": 2}, 14, 3),  # c < 1 here: n_low
]


def _held_positions(store, b: int, h: int) -> set[int]:
    held = set()
    for region in (store.old, store.recent):
        valid = region.valid[b]
        held.update(region.positions[b, h][valid].tolist())
    return held


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("policy, params, budget, recent", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_kept_tokens_follow_the_parameters(policy, params, budget, recent, int8):
    fp_window = 5
    store = StoreConfig(kv_int8=True, fp_window=fp_window, move_block=3) if int8 else StoreConfig(move_block=3)
    model = tiny_model("llama", seed=2)
    cache = ConfKVCache.for_model(model, policy, store=store, **params)
    ids = torch.randint(0, 250, (BATCH, STEPS), generator=torch.Generator().manual_seed(4))
    protect = params.get("protect", 0)
    sinks = params.get("sinks", 0)
    # never evicted: the first `sinks`, the last max(protect, recent part, INT8 FP window)
    always_recent = max(protect, recent, fp_window if int8 else 0)
    with torch.no_grad():
        for t in range(STEPS):
            model(ids[:, t:t + 1], cache=cache, use_cache=True)
            expected = min(t + 1, budget)
            for layer in cache.layers:
                s = layer.store
                assert s.kept_counts().tolist() == [expected] * BATCH, (t, policy)
                for b in range(BATCH):
                    for h in range(s.recent.keys.shape[1]):
                        held = _held_positions(s, b, h)
                        assert len(held) == expected
                        assert set(range(max(0, t + 1 - always_recent), t + 1)) <= held, (t, b, h)
                        assert set(range(min(sinks, t + 1))) <= held, (t, b, h)
                        if policy in ("window", "streaming"):  # the whole kept set is known
                            assert held == set(range(min(sinks, t + 1))) | set(range(max(0, t + 1 - (budget - sinks)), t + 1))
    assert [int(v) for v in cache.trace.steps[-1].budget] == [budget] * BATCH
