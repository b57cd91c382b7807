"""Forking a layer store (:meth:`confkv.store.LayerStore.fork`): a sliding-window layer stays a
sliding-window layer whatever the policy, and an offloaded cold tier's copy shares the page file
instead of opening one more.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

import re

import pytest
import torch

from confkv.store import layer as store_module
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


def test_forking_an_int8_store_copies_its_scales_so_the_copy_reads_what_the_original_reads():
    # kv_int8 with a 2-token FP window: after 8 steps the older region holds INT8 keys/values with
    # per-token scales, and the layer's key channel scale is frozen
    config = StoreConfig(kv_int8=True, fp_window=2, move_block=1)
    store = LayerStore(make_policy("h2o", budget=6, protect=2), config)
    for seed in range(8):
        _step(store, torch.Generator().manual_seed(seed), budget=6)
    assert store.old.is_int8 and store.old.length > 0 and store.channel_scale is not None
    twin = store.fork(make_policy("h2o", budget=6, protect=2))
    for name in ("key_scale", "value_scale"):
        mine, theirs = getattr(twin.old, name), getattr(store.old, name)
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr(), name  # equal copies
    assert torch.equal(twin.channel_scale, store.channel_scale)
    assert twin.channel_scale.data_ptr() != store.channel_scale.data_ptr()
    for seed in range(8, 12):
        out, ref = _step(twin, torch.Generator().manual_seed(seed), 6), _step(store, torch.Generator().manual_seed(seed), 6)
        assert torch.equal(out, ref), seed


def test_forking_in_the_middle_of_a_forward_pass_is_refused():
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(move_block=1))
    _step(store, torch.Generator().manual_seed(0), budget=6)
    store.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))  # keys appended, attention not read yet
    with pytest.raises(ValueError, match="^" + re.escape("confkv: cannot fork a store in the middle of a forward pass") + "$"):
        store.fork(make_policy("h2o", budget=6, protect=2))


def test_forking_for_a_policy_whose_statistic_was_never_collected_names_it():
    # H2O collects "acc"; TOVA needs "attn", which no step of this store recorded
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(move_block=1))
    for seed in range(3):
        _step(store, torch.Generator().manual_seed(seed), budget=6)
    message = ("confkv: cannot fork for policy 'tova': statistics ['attn'] were never collected "
               "(prefill with a TeePolicy that includes it)")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        store.fork(make_policy("tova", budget=6))


def test_a_fork_keeps_the_regions_dense_flag():
    # `dense` (every slot valid, known without reading `valid`) lets the read skip the mask; a copy
    # of a dense region is dense too, not demoted to the masked path
    store = LayerStore(make_policy("h2o", budget=6, protect=2), StoreConfig(move_block=1))
    for seed in range(8):
        _step(store, torch.Generator().manual_seed(seed), budget=6)
    assert store.old.all_valid is True and store.recent.all_valid is True
    twin = store.fork(make_policy("h2o", budget=6, protect=2))
    assert twin.old.all_valid is True and twin.recent.all_valid is True
