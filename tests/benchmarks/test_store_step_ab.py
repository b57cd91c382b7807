"""benchmarks/store_step_ab.py: its "off" variant turns each named shortcut off and puts it back, and a cache stepped
with every shortcut off leaves what it leaves with them on (so the A/B compares two ways to the same state)."""

import importlib.util
import sys
from pathlib import Path

import torch

from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder
from confkv.models import tiny_model
from confkv.store import hot_tier
from confkv.store.read import AttentionRead
from confkv.tiers.cold_read import EveryPageRead

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "store_step_ab.py"
sys.path.insert(0, str(SCRIPT.parent))
spec = importlib.util.spec_from_file_location("store_step_ab", SCRIPT)
store_step_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(store_step_ab)


def test_the_switch_turns_off_what_it_names_and_puts_it_back():
    originals = (hot_tier.age_and_evict_at_once, EveryPageRead.serves, AttentionRead.decode_step)
    saved = store_step_ab.switch({"age_evict", "append_one"})
    assert hot_tier.age_and_evict_at_once is not originals[0] and AttentionRead.decode_step is not originals[2]
    assert EveryPageRead.serves is originals[1]
    store_step_ab.restore(saved)
    assert (hot_tier.age_and_evict_at_once, EveryPageRead.serves, AttentionRead.decode_step) == originals


def test_both_variants_leave_the_same_cache():
    model = tiny_model("llama")
    ids = torch.randint(0, 250, (1, 260), generator=torch.Generator().manual_seed(4))
    logits, bytes_held = [], []
    for off in (set(store_step_ab.SHORTCUTS), set()):
        cache = ConfKVCache.for_model(model, memory=0.25)
        with torch.no_grad():
            prefill(model, cache, ids[:, :200], chunk=64)
        decoder = LeanDecoder(model)
        saved = store_step_ab.switch(off)
        try:
            logits.append(torch.stack([decoder(ids[:, t:t + 1], cache) for t in range(200, 260)]))
        finally:
            store_step_ab.restore(saved)
        bytes_held.append(cache.kv_bytes())
    assert torch.equal(logits[0], logits[1]) and bytes_held[0] == bytes_held[1]


def test_the_page_codec_switch_turns_off_both_halves_and_puts_them_back():
    from confkv.native import page_encode

    originals = (page_encode.encode_kivi, page_encode.decode_kivi)
    saved = store_step_ab.switch({"page_codec"})
    assert page_encode.encode_kivi(None) is None and page_encode.decode_kivi(None) is None
    assert (page_encode.encode_kivi, page_encode.decode_kivi) != originals
    store_step_ab.restore(saved)
    assert (page_encode.encode_kivi, page_encode.decode_kivi) == originals


def test_the_benchmarks_codec_switch_and_settings():
    import argparse

    import pytest

    from confkv.native import page_encode
    from preset_step_profile import add_setting_arguments, setting_of, torch_codec

    originals = (page_encode.encode_kivi, page_encode.decode_kivi)
    with pytest.raises(RuntimeError), torch_codec():
        assert page_encode.encode_kivi(None) is None and page_encode.decode_kivi(None) is None
        raise RuntimeError  # put back all the same
    assert (page_encode.encode_kivi, page_encode.decode_kivi) == originals
    parser = argparse.ArgumentParser()
    add_setting_arguments(parser)
    assert setting_of(parser.parse_args(["--policy", "tiered-int8", "--param", "open_bits=8"])) == \
        ("tiered-int8", {"open_bits": 8}, "tiered-int8 open_bits=8")
    assert setting_of(parser.parse_args([])) == (None, {}, "the preset")
