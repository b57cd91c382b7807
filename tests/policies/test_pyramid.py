"""PyramidKV allocation (``pyramid_budgets``) and its use by ``confkv-l``."""

from fractions import Fraction

import pytest
import torch

from confkv.config import StoreConfig
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.policies import make_policy
from confkv.policies.pyramid import pyramid_budgets
from thread_counts import torch_threads


def test_reference_formula_smollm2_shape():
    budgets = pyramid_budgets(512, 30, 20.0)
    lo, hi = 512 / 20, 2 * 512 - 512 / 20
    for layer, b in enumerate(budgets):
        real = hi - layer * (hi - lo) / 29
        assert abs(b - real) < 1
    assert budgets[0] == 999 and budgets[-1] == 25
    assert sum(budgets) == 30 * 512


@pytest.mark.parametrize("mean", [1, 7, 64, 255, 512, 1000, 4097])
@pytest.mark.parametrize("layers", [1, 2, 3, 12, 30, 61])
@pytest.mark.parametrize("beta", [1.0, 2.5, 20.0, 1000.0])
@pytest.mark.parametrize("floor", [0, 5, 60])
def test_sum_order_floor_and_rounding(mean, layers, beta, floor):
    if floor > mean:
        with pytest.raises(ValueError):
            pyramid_budgets(mean, layers, beta, min_budget=floor)
        return
    budgets = pyramid_budgets(mean, layers, beta, min_budget=floor)
    assert len(budgets) == layers and all(isinstance(b, int) for b in budgets)
    assert sum(budgets) == layers * mean                      # memory equals the uniform budget
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))  # deeper layers never get more
    assert min(budgets) >= floor
    if layers > 1 and floor == 0:                             # unclamped: within 1 of the linear formula
        lo = Fraction(mean) / Fraction(beta)
        hi = 2 * mean - lo
        for layer, b in enumerate(budgets):
            assert abs(b - (hi - layer * (hi - lo) / (layers - 1))) < 1
    if beta == 1.0:
        assert budgets == [mean] * layers


def test_floor_redistributes_from_shallow_layers():
    plain = pyramid_budgets(512, 30, 20.0)
    clamped = pyramid_budgets(512, 30, 20.0, min_budget=100)
    assert clamped[-1] == 100 and plain[-1] < 100
    assert clamped[0] < plain[0] and sum(clamped) == sum(plain)
    assert pyramid_budgets(100, 4, 20.0, min_budget=100) == [100] * 4


def test_rejects_bad_arguments():
    for args, kwargs in (((0, 4), {}), ((10, 0), {}), ((10, 4, 0.5), {}), ((10, 4), {"min_budget": 11})):
        with pytest.raises(ValueError):
            pyramid_budgets(*args, **kwargs)
    budgets = pyramid_budgets(64, 4)
    budgets[0] = -1  # callers get their own list (the cache behind it stays intact)
    assert pyramid_budgets(64, 4)[0] != -1


@pytest.mark.parametrize("kv_int8", [False, True], ids=["fp", "int8"])
def test_trace_shows_the_per_layer_split(kv_int8):
    with torch_threads(1):  # restored after, however the test ends
        model = tiny_model("llama", seed=3, num_hidden_layers=4)
        mean = 32
        params = dict(n_high=mean, n_low=mean, tau=0.0, protect=4, sinks=2, min_layer_budget=12)
        cache = ConfKVCache.for_model(model, "confkv-l", store=StoreConfig(kv_int8=kv_int8, fp_window=8, move_block=4),
                                      **params)
        expected = make_policy("confkv-l", **params).pyramid(mean, 4)
        assert expected == pyramid_budgets(mean, 4, 20.0, min_budget=12) and expected[0] > expected[-1]
        ids = torch.randint(0, 250, (2, 90), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            for t in range(ids.shape[1]):
                model(ids[:, t:t + 1], cache=cache, use_cache=True)
        last = cache.trace.steps[-1]
        assert last.kept[:, 0].tolist() == expected and last.kept[:, 1].tolist() == expected
        assert last.kept.sum(0).tolist() == [4 * mean] * 2     # same total as uniform CONF-KV
        assert int(last.budget[0]) == mean                     # the trace's budget is the layer mean
        bytes_per_layer = last.kv_bytes.tolist()
        assert all(a > b for a, b in zip(bytes_per_layer, bytes_per_layer[1:]))
        # uniform CONF-KV at the same mean keeps the same tokens in total
        uniform = ConfKVCache.for_model(model, "confkv", store=StoreConfig(kv_int8=kv_int8, fp_window=8, move_block=4),
                                        n_high=mean, n_low=mean, tau=0.0, protect=4, sinks=2)
        with torch.no_grad():
            for t in range(ids.shape[1]):
                model(ids[:, t:t + 1], cache=uniform, use_cache=True)
        assert uniform.trace.steps[-1].kept.sum(0).tolist() == [4 * mean] * 2
        if not kv_int8:
            assert sum(bytes_per_layer) == sum(uniform.trace.steps[-1].kv_bytes.tolist())
