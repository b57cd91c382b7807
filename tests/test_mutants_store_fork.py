"""Forking a layer store (:func:`confkv.store_fork.fork_store`): a sliding-window layer stays a
sliding-window layer whatever the policy, and an offloaded cold tier's copy shares the page file
instead of opening one more.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

import torch

from confkv import store as store_module
from confkv.config import StoreConfig
from confkv.policies import make_policy
from confkv.store import LayerStore


def _step(store: LayerStore, gen: torch.Generator, budget: int) -> torch.Tensor:
    store.append(torch.randn(1, 2, 1, 4, generator=gen), torch.randn(1, 2, 1, 4, generator=gen))
    out = store.attend(torch.randn(1, 4, 1, 4, generator=gen), scaling=0.5)
    store.end_step(torch.full((1,), budget, dtype=torch.int64))
    return out


def test_a_forked_sliding_window_layer_keeps_its_window_and_ignores_the_new_policy():
    # W = 4: the layer keeps the last W - 1 = 3 tokens, whatever the policy's budget (6)
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(move_block=1), sliding_window=4)
    for seed in range(7):
        _step(store, torch.Generator().manual_seed(seed), budget=6)
    twin = store.fork(make_policy("tova", budget=6))
    assert twin.sliding_window == 4
    for seed in range(7, 10):
        out, ref = _step(twin, torch.Generator().manual_seed(seed), 6), _step(store, torch.Generator().manual_seed(seed), 6)
        assert torch.equal(out, ref)
    # tokens 0..9 seen: the last 3 kept, in both
    kept = sorted(twin.old.positions[0, 0].tolist() + twin.recent.positions[0, 0].tolist())
    assert kept == [7, 8, 9] and twin.kept_list() == [3] and twin.stat_names == ()


def test_forking_an_offloaded_tiered_store_shares_its_page_file(tmp_path, monkeypatch):
    policy = make_policy("confkv-r", budget=4, protect=2, sinks=0, bits=2, page_size=2, group_size=2, k=1,
                         offload=True, offload_dir=str(tmp_path))
    store = LayerStore(policy, StoreConfig(move_block=1))
    gen = torch.Generator().manual_seed(0)
    for _ in range(9):
        _step(store, gen, budget=4)
    assert store.offloaded_bytes() > 0
    opened = []
    real = store_module.PageFile
    monkeypatch.setattr(store_module, "PageFile", lambda directory: opened.append(directory) or real(directory))
    twin = store.fork(policy)
    assert opened == []  # no second file for the copy
    assert twin.cold.page_file is store.cold.page_file
    assert twin.offloaded_bytes() == store.offloaded_bytes() and twin.kv_bytes() == store.kv_bytes()
    store.cold.page_file.close()
