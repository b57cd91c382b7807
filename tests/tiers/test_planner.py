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
