"""The memory target's floor (:func:`confkv.tiers.planner.floor_bytes`), worked out by hand."""

from types import SimpleNamespace

from confkv.config import StoreConfig
from confkv.tiers.byte_model import KVShape
from confkv.tiers.planner import floor_bytes

# 2 KV heads of 8 channels in bf16: one token of one layer is 2 (K, V) x 2 x 8 x 2 = 64 bytes
SHAPE = KVShape(kv_heads=2, head_dim=8, element_size=2, sliding_windows=(None, 6, None, 4))
LAYOUT = SimpleNamespace(managed=[0, 2], sliding_windows=[None, 6, None, 4])


def test_the_floor_is_the_hot_tokens_of_every_managed_layer_plus_full_sliding_windows():
    # managed: 2 layers x 10 tokens x 64 = 1,280; sliding windows hold w - 1 tokens: (5 + 3) x 64 = 512
    assert floor_bytes(SHAPE, LAYOUT, 10, StoreConfig()) == 1_280 + 512
    assert floor_bytes(SHAPE, LAYOUT, 10, StoreConfig(), batch=3) == 3 * (1_280 + 512)


def test_an_int8_store_adds_its_key_channel_scale_to_every_managed_layer():
    # the frozen channel scale: 2 heads x 8 channels x 4 bytes (float32) = 64 bytes per managed layer
    assert floor_bytes(SHAPE, LAYOUT, 10, StoreConfig(kv_int8=True)) == 1_280 + 2 * 64 + 512
    assert floor_bytes(SHAPE, LAYOUT, 10, StoreConfig(kv_int8=True), batch=2) == 2 * (1_280 + 2 * 64 + 512)


def test_a_full_target_without_a_reserve_keeps_every_token_to_the_byte():
    """memory=1 with nothing held besides the tokens (no INT8 scale, ``reserve_bytes=0``): the layer's share is
    exactly its full bytes, and not one byte more is asked, so nothing is evicted; one byte less is a plan that
    evicts. With an INT8 store's scale held (``reserve_bytes``), the full bytes cannot hold the tokens and the scale:
    a plan that evicts; while the scale is not held yet (``reserve_held=False``: ``int8_from="over_budget"``
    before the store goes over), nothing is evicted. B 2, 100 positions, 1,536-byte tokens, 4 managed layers."""
    from confkv.tiers.planner import plan_step
    from confkv.tiers.storage import MemoryTarget, Storage

    shape = dict(batch=2, seen=100, token_bytes=1536, managed=4, sliding_bytes=0, floor_tokens=4,
                 bottom_token_bytes=0.0)
    full = 4 * 2 * 100 * 1536
    kept = plan_step(MemoryTarget(1.0, None), Storage(), reserve_bytes=0, reserve_held=True, **shape)
    assert kept.hot_budget is None and kept.layer_bytes == 2 * 100 * 1536 and kept.full_bytes == full
    tight = plan_step(MemoryTarget(None, full - 4), Storage(), reserve_bytes=0, reserve_held=True, **shape)
    assert tight.hot_budget is not None
    held = plan_step(MemoryTarget(1.0, None), Storage(), reserve_bytes=512, reserve_held=True, **shape)
    assert held.hot_budget is not None
    pending = plan_step(MemoryTarget(1.0, None), Storage(), reserve_bytes=512, reserve_held=False, **shape)
    assert pending.hot_budget is None


def test_with_a_ladder_the_hot_tier_gets_its_share_of_the_layer_after_the_reserve():
    """Under a ladder the hot tier takes ``hot_share`` of each layer's bytes once the reserve is out, in whole
    tokens of every sequence: worked out by hand for memory=0.25, B 2, 1,000 positions, 1,536-byte tokens,
    4 managed layers, a 60,000-byte reserve per layer."""
    from confkv.tiers.planner import plan_step
    from confkv.tiers.storage import MemoryTarget, Storage

    storage = Storage()
    plan = plan_step(MemoryTarget(0.25, None), storage, batch=2, seen=1000, token_bytes=1536, managed=4,
                     sliding_bytes=0, floor_tokens=4, reserve_bytes=60_000, bottom_token_bytes=0.0, reserve_held=True)
    layer = 2 * 1000 * 1536 // 4  # the target of one layer: a quarter of its full bytes (768,000)
    assert plan.layer_bytes == layer
    assert plan.hot_budget == int(storage.hot_share * (layer - 60_000)) // (2 * 1536) > 4


def test_keep_all_shrinks_the_hot_share_to_what_keeping_every_token_leaves():
    """``hot_split="keep_all"``, worked out by hand: 2 KV heads of 64 channels in bf16 (512-byte tokens); a 4-bit
    page of 64 tokens is 8,192 bytes of codes + 512 of key scales and minima + 512 of value ones = 144 bytes a
    token; 1,000 positions, one managed layer, floor 5. Keeping every token costs 1,000 x 144 at the bottom plus
    an open page of 64 tokens at 512 - 144 = 368 bytes more each (167,552 bytes); each hot token 368 more."""
    from confkv.tiers.planner import bottom_token_bytes, plan_step
    from confkv.tiers.storage import MemoryTarget, Storage

    storage = Storage(ladder=(8, 4), page_size=64, group_size=64, hot_split="keep_all")
    shape = KVShape(kv_heads=2, head_dim=64, element_size=2, sliding_windows=(None,))
    import torch

    bottom = bottom_token_bytes(storage, shape, torch.bfloat16)
    assert bottom == 144.0

    def hot(memory: float, split: str = "keep_all", batch: int = 1, reserve: int = 0) -> int:
        chosen = storage if split == "keep_all" else Storage(ladder=(8, 4), page_size=64, group_size=64)
        return plan_step(MemoryTarget(memory, None), chosen, batch=batch, seen=1000, token_bytes=512, managed=1,
                         sliding_bytes=0, floor_tokens=5, reserve_bytes=reserve, bottom_token_bytes=bottom,
                         reserve_held=True).hot_budget

    # 25%: 128,000 bytes cannot keep every token even with no hot tier: the floor
    assert hot(0.25) == 5 and hot(0.25, "share") == 25_600 // 512
    # 35%: 179,200 bytes; the share would be 71 tokens (35,840 bytes), keeping every token leaves
    # (179,200 - 167,552) // 368 = 31 hot tokens; with two sequences the same per sequence
    assert hot(0.35) == 31 and hot(0.35, "share") == 70 and hot(0.35, batch=2) == 31
    # an INT8 store's scale (3,680 bytes held besides the tokens) comes out of what keeping every token leaves:
    # (179,200 - 3,680 - 167,552) // 368 = 21 hot tokens
    assert hot(0.35, reserve=3680) == 21
    # 50%: 256,000 bytes leave room for 240 hot tokens: the share (100) is the smaller
    assert hot(0.5) == hot(0.5, "share") == 100
    # no ladder: nothing to keep at a bottom rung
    assert bottom_token_bytes(Storage(ladder=()), shape, torch.bfloat16) == 0.0
    # outliers are counted at the bottom rung too, at the storage's own fraction (not the formats' default, 0.01):
    # round(0.02 x 64 x 64) = 82 entries of each tensor, page and head, a float16 value and an int16 index each:
    # 82 x 2 tensors x 2 heads x 4 bytes / 64 tokens = 20.5 more; at 0.01, 41 entries: 10.25 more
    for fraction, more in ((0.02, 20.5), (0.01, 10.25)):
        with_outliers = Storage(ladder=(8, 4), page_size=64, group_size=64, hot_split="keep_all",
                                format="kivi+outliers", outlier_fraction=fraction)
        assert bottom_token_bytes(with_outliers, shape, torch.bfloat16) == 144.0 + more
    # a bottom rung only half a byte a token cheaper than the hot tier still keeps every token first: 1,000 tokens at
    # 511.5 bytes leave nothing of 35% (179,200 bytes) for hot tokens, so the floor
    assert plan_step(MemoryTarget(0.35, None), storage, batch=1, seen=1000, token_bytes=512, managed=1,
                     sliding_bytes=0, floor_tokens=5, reserve_bytes=0, bottom_token_bytes=511.5,
                     reserve_held=True).hot_budget == 5
    # a 16-bit bottom rung costs what a hot token does: nothing to give back, the share as it is
    full_rung = Storage(ladder=(16,), page_size=64, group_size=64, hot_split="keep_all")
    assert bottom_token_bytes(full_rung, shape, torch.bfloat16) == 512.0
    assert plan_step(MemoryTarget(0.35, None), full_rung, batch=1, seen=1000, token_bytes=512, managed=1,
                     sliding_bytes=0, floor_tokens=5, reserve_bytes=0, bottom_token_bytes=512.0,
                     reserve_held=True).hot_budget == 70


def test_hot_tokens_and_no_ladder_take_what_fits_and_never_less_than_the_floor():
    """Worked out by hand: B 2, 1,000 positions, 1,536-byte tokens, 4 managed layers, a 60,000-byte reserve, memory
    0.25: a layer's share is 768,000 bytes, of which (768,000 - 60,000) // (2 x 1,536) = 230 hot tokens fit. A fixed
    ``hot_tokens`` is taken up to that; without a ladder the hot tier takes all of it; the floor (4) is the least."""
    from confkv.tiers.planner import plan_step
    from confkv.tiers.storage import MemoryTarget, Storage

    def hot(storage: Storage) -> int:
        return plan_step(MemoryTarget(0.25, None), storage, batch=2, seen=1000, token_bytes=1536, managed=4,
                         sliding_bytes=0, floor_tokens=4, reserve_bytes=60_000, bottom_token_bytes=0.0,
                         reserve_held=True).hot_budget

    assert hot(Storage(hot_tokens=16)) == 16
    assert hot(Storage(hot_tokens=500)) == 230
    assert hot(Storage(hot_tokens=2)) == 4
    assert hot(Storage(ladder=())) == 230
