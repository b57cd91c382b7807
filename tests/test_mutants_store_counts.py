"""What a :class:`confkv.store.LayerStore` reports it keeps (:meth:`kept_counts`), and that INT8
ageing keeps an unpadded store on its mask-free path; expectations worked out by hand.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

from __future__ import annotations

import torch

from confkv.config import StoreConfig
from confkv.policies import make_policy
from confkv.store import LayerStore


def _step(store: LayerStore, gen: torch.Generator, batch: int, new: int,
          padding: torch.Tensor | None = None) -> None:
    store.append(torch.randn(batch, 2, new, 4, generator=gen), torch.randn(batch, 2, new, 4, generator=gen))
    store.attend(torch.randn(batch, 4, new, 4, generator=gen), scaling=0.5, padding=padding)
    store.end_step(None)


def test_an_empty_store_keeps_an_empty_int64_count():
    counts = LayerStore(make_policy("full"), StoreConfig()).kept_counts()
    assert counts.shape == (0,) and counts.dtype == torch.int64


def test_counts_live_on_the_device_of_the_cache():
    """On the ``meta`` device (no data): the counts are made where the keys are, as int64 per sequence."""
    store = LayerStore(make_policy("full"), StoreConfig())
    store.append(torch.zeros(2, 2, 3, 4, device="meta"), torch.zeros(2, 2, 3, 4, device="meta"))
    counts = store.kept_counts()
    assert counts.device.type == "meta" and counts.shape == (2,) and counts.dtype == torch.int64


def test_padded_tokens_are_not_counted_when_only_the_window_has_padding():
    """A left-padded prompt of 3 (sequence 0: one pad token) then one step: the older region is
    still empty (all valid) while the FP window holds the pad, so the count must look at validity."""
    store = LayerStore(make_policy("full"), StoreConfig(fp_window=8))
    gen = torch.Generator().manual_seed(0)
    _step(store, gen, batch=2, new=3, padding=torch.tensor([[False, True, True], [True, True, True]]))
    assert store.old.length == 0 and store.old.all_valid and not store.recent.all_valid
    assert store.kept_counts().tolist() == [2, 3]
    assert store.kept_list() == [2, 3]


def test_int8_ageing_of_an_unpadded_store_keeps_it_dense():
    """Ten single-token steps through a 2-slot FP window, moved in blocks of 2: 8 slots become INT8,
    every one of them valid, so the store keeps reading without masks and counting by lengths."""
    store = LayerStore(make_policy("full"), StoreConfig(kv_int8=True, fp_window=2, move_block=2))
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        _step(store, gen, batch=2, new=1)
    assert store.old.keys.dtype == torch.int8 and (store.old.length, store.recent.length) == (8, 2)
    assert store.old.all_valid and store.recent.all_valid
    assert store.kept_counts().tolist() == [10, 10]
