"""`confkv bench` runs end to end on a tiny model (structure only: no timing is asserted)."""

import pytest
import torch

from confkv.eval.bench.run import POLICY_SECTIONS, run_bench
from confkv.models import tiny_model, tiny_tokenizer


@pytest.mark.filterwarnings("ignore")
def test_bench_grid_breakdown_and_throughput_on_a_tiny_model():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    lines = []
    result = run_bench(contexts=[320, 192], budget=128, slack=8, steps=1, repeats=1, warmup=0, chunk=32, batches=[2],
                       batch_steps=1, breakdown_steps=2,
                       configs=["dynamic", "full", "window", "confkv", "confkv+slack8", "confkv-int8"],
                       model=model, tokenizer=tok, log=lines.append)
    assert result["contexts"] == [192, 320]
    for context in ("192", "320"):
        rows = result["latency"][context]
        assert rows["dynamic"]["speedup_vs_dynamic"] == pytest.approx(1.0)
        assert rows["window"]["kept_tokens"] <= 128 < rows["full"]["kept_tokens"]
        assert rows["full"]["kv_bytes"] == rows["dynamic"]["kv_bytes"]  # same tokens, same dtype
        assert rows["confkv-int8"]["kv_bytes"] < rows["confkv"]["kv_bytes"]
    breakdown = result["breakdown"]["confkv"]
    sections = breakdown["sections_ms"]
    assert "attention read" in sections and "confidence" in sections
    assert breakdown["policy_work_ms"] == pytest.approx(sum(v for k, v in sections.items() if k in POLICY_SECTIONS))
    assert 0 < breakdown["policy_work_ms"] <= breakdown["cache_overhead_ms"] < breakdown["step_ms"]
    assert set(result["throughput"]["2"]) >= {"dynamic", "confkv"}
    assert any(line.startswith("breakdown of one confkv step") for line in lines)


@pytest.mark.filterwarnings("ignore")
def test_format_rows_run_the_preset_with_that_page_format():
    """``--formats kivi+hadamard`` adds ``tiered[kivi+hadamard]@<percent>`` beside ``tiered@<percent>``: the same
    target, its pages in that format (their bytes no more than the target, like the preset's)."""
    from confkv.eval.bench.run import default_configs, preset_rows

    assert preset_rows((0.25, 0.125), ("kivi+hadamard",)) == [
        "tiered@25", "tiered@12.5", "tiered@25-lean", "tiered@12.5-lean", "tiered@25+int8-lean",
        "tiered@12.5+int8-lean", "tiered@25+open8-lean", "tiered@12.5+open8-lean", "tiered-int8@25-lean",
        "tiered-int8@12.5-lean", "tiered[kivi+hadamard]@25", "tiered[kivi+hadamard]@12.5"]
    assert preset_rows((0.25,), (), 64) == ["tiered@25", "tiered@25-lean", "tiered@25+slack64-lean",
                                             "tiered@25+int8-lean", "tiered@25+open8-lean", "tiered-int8@25-lean"]
    assert preset_rows((0.25,), (), 64, (0.125, 64)) == ["tiered@25", "tiered@25-lean", "tiered@25+slack64-lean",
                                                         "tiered@25+slack0.125-lean", "tiered@25+int8-lean",
                                                         "tiered@25+open8-lean", "tiered-int8@25-lean"]
    share = next(c for c in default_configs(128, 64, (0.25,), preset_slacks=(0.125,))
                 if c.name == "tiered@25+slack0.125-lean")
    assert share.store == {"evict_slack": 0.125} and share.lean and share.params == {"memory": 0.25}
    row = next(c for c in default_configs(128, 8, (0.25,), ("kivi+hadamard",)) if c.name == "tiered[kivi+hadamard]@25")
    assert row.params == {"memory": 0.25, "format": "kivi+hadamard"}
    model, tok = tiny_model("llama"), tiny_tokenizer()
    result = run_bench(contexts=[320], budget=128, slack=0, steps=1, repeats=1, warmup=0, chunk=64, batches=[],
                       batch_steps=1, breakdown_steps=2, configs=["full", "tiered@50", "tiered[kivi+hadamard]@50"],
                       memory=(0.5,), formats=("kivi+hadamard",), model=model, tokenizer=tok, log=lambda _: None)
    rows = result["latency"]["320"]
    for name in ("tiered@50", "tiered[kivi+hadamard]@50"):
        assert 0 < rows[name]["kv_bytes"] <= 0.5 * rows["full"]["kv_bytes"]
    assert "tiered[kivi+hadamard]@50" in result["breakdown"]


def test_kivi_rows_compare_page_formats_at_one_load():
    """``--kivi 4 4/2:hadamard+outliers`` adds KIVI rows (every older token in pages, all read): keys and values at
    their widths, the format asked, 64-token pages; a spec not of the form is named."""
    from confkv.eval.bench.configs import kivi_rows

    plain, mixed = kivi_rows(("4", "4/2:hadamard+outliers"))
    assert (plain.name, plain.policy, plain.params) == (
        "kivi-4", "kivi", {"bits": 4, "group_size": 64, "page_size": 64, "format": "kivi"})
    assert mixed.name == "kivi-4/2:hadamard+outliers"
    assert mixed.params == {"bits": 4, "value_bits": 2, "group_size": 64, "page_size": 64, "format": "hadamard+outliers"}
    for bad in ("four", "4/", "4/x", "4:", "/2"):
        with pytest.raises(ValueError, match="is not BITS\\[/VALUE_BITS\\]\\[:FORMAT\\]"):
            kivi_rows((bad,))
    model, tok = tiny_model("llama"), tiny_tokenizer()
    result = run_bench(contexts=[320], budget=128, slack=0, steps=1, repeats=1, warmup=0, chunk=64, batches=[],
                       batch_steps=1, breakdown_steps=1, configs=["full", "kivi-4", "kivi-4/2:hadamard+outliers"],
                       kivi=("4", "4/2:hadamard+outliers"), model=model, tokenizer=tok, log=lambda _: None)
    rows = result["latency"]["320"]
    # (320 - 128) older tokens in 3 pages of 64: 4-bit keys and 2-bit values hold fewer bytes than 4 bits each
    assert rows["kivi-4/2:hadamard+outliers"]["kv_bytes"] < rows["kivi-4"]["kv_bytes"] < rows["full"]["kv_bytes"]
    assert {"kivi-4", "kivi-4/2:hadamard+outliers"} <= set(result["breakdown"])


@pytest.mark.filterwarnings("ignore")
def test_the_preset_through_the_lean_decoder_holds_the_same_cache_at_batch_1_and_2(monkeypatch):
    """``tiered@<percent>-lean`` decodes through ``LeanDecoder``: after the same text its cache holds what the
    ``model(...)`` row's holds (same bytes, same tokens), and it runs the batched throughput too."""
    from confkv.eval.bench.run import default_configs
    from confkv.hf.lean import LeanDecoder

    batches = []
    real = LeanDecoder.__call__
    monkeypatch.setattr(LeanDecoder, "__call__", lambda self, ids, cache: batches.append(ids.shape[0]) or
                        real(self, ids, cache))

    row = next(c for c in default_configs(128, 8, (0.5,)) if c.name == "tiered@50-lean")
    assert row.lean and row.params == {"memory": 0.5}
    model, tok = tiny_model("llama"), tiny_tokenizer()
    result = run_bench(contexts=[320], budget=128, slack=0, steps=2, repeats=1, warmup=0, chunk=64, batches=[1, 2],
                       batch_steps=1, breakdown_steps=0, configs=["tiered@50", "tiered@50-lean"], memory=(0.5,),
                       model=model, tokenizer=tok, log=lambda _: None)
    plain, lean = result["latency"]["320"]["tiered@50"], result["latency"]["320"]["tiered@50-lean"]
    assert lean["kv_bytes"] == plain["kv_bytes"] > 0 and lean["kept_tokens"] == plain["kept_tokens"]
    for batch in ("1", "2"):
        rows = result["throughput"][batch]
        assert rows["tiered@50-lean"]["kv_bytes"] == rows["tiered@50"]["kv_bytes"] > 0
    assert 1 in batches and 2 in batches  # the lean row's steps, at both batch sizes, went through LeanDecoder


@pytest.mark.filterwarnings("ignore")
def test_the_preset_with_eviction_slack_stays_under_its_target_and_ranks_less_often():
    """``tiered@<percent>+slack<S>-lean``: the preset with ``evict_slack=S`` through the lean decoder. Its hot
    tier is evicted down to its budget - S, so its bytes stay under the target at every step, and the ranking
    runs on fewer steps than the preset's (once per S + 1 steps instead of every step)."""
    from confkv import profiling
    from confkv.eval.bench.run import _Runner, default_configs

    configs = {c.name: c for c in default_configs(128, 8, (0.5,))}
    slack = configs["tiered@50+slack8-lean"]
    assert slack.lean and slack.store == {"evict_slack": 8} and slack.params == {"memory": 0.5}
    model, tok = tiny_model("llama"), tiny_tokenizer()
    ids = torch.randint(3, 200, (1, 1000), generator=torch.Generator().manual_seed(0))
    ranked, kept = {}, {}
    for name in ("tiered@50-lean", "tiered@50+slack8-lean"):  # 960 tokens: a hot tier of ~96, ~56 past the window
        runner = _Runner(configs[name], model)
        runner.feed_to(ids, 960, 128)
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        full = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * model.dtype.itemsize  # a token
        timers = profiling.Timers()
        with profiling.enabled(timers):
            for _ in range(16):
                runner.next_step(ids)
                assert runner.kv_bytes() <= 0.5 * runner.fed * full  # the target, at every step
        # compactions: by rank alone, or with the step's ageing in one C call (hot_tier.age_and_evict_at_once)
        ranked[name] = timers.calls.get("ranking and top-k", 0) + timers.calls.get("ageing + eviction (one call)", 0)
        kept[name] = runner.kept_tokens()
    assert 0 < ranked["tiered@50+slack8-lean"] < ranked["tiered@50-lean"] / 2
    assert kept["tiered@50+slack8-lean"] < kept["tiered@50-lean"]  # the hot tier runs below its share


def _int8_hot_tokens(cache) -> bool:
    return all(layer.store.old.keys.dtype == torch.int8 for layer in cache.layers)


def _int8_open_pages(cache) -> bool:
    tops = [layer.store.cold.top for layer in cache.layers if layer.store.cold is not None]
    return bool(tops) and all(top.open["keys"].dtype == torch.int8 for top in tops)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("row, setting, in_int8", [("tiered@50+int8-lean", {"hot_int8_window": 8}, _int8_hot_tokens),
                                                   ("tiered@50+open8-lean", {"open_bits": 8}, _int8_open_pages)])
def test_the_preset_with_an_int8_setting_through_the_lean_decoder_holds_what_the_model_row_holds(row, setting,
                                                                                                  in_int8):
    """``tiered@<percent>+int8-lean`` (``hot_int8_window=8``) and ``tiered@<percent>+open8-lean`` (``open_bits=8``):
    the preset with that setting through the lean decoder. After the same text its cache holds what the same cache
    stepped by ``model(...)`` holds (bytes, tokens), in INT8 where the setting says (older hot tokens, open pages)."""
    import dataclasses

    from confkv.eval.bench.run import _Runner, default_configs

    lean = {c.name: c for c in default_configs(128, 0, (0.5,))}[row]
    assert lean.lean and lean.params == {"memory": 0.5, **setting}
    model = tiny_model("llama")
    ids = torch.randint(3, 200, (1, 700), generator=torch.Generator().manual_seed(0))
    held = {}
    for config in (lean, dataclasses.replace(lean, name=row.removesuffix("-lean"), lean=False)):
        runner = _Runner(config, model)
        runner.feed_to(ids, 640, 128)
        for _ in range(12):
            runner.next_step(ids)
        assert in_int8(runner.cache)
        held[config.lean] = (runner.kv_bytes(), runner.kept_tokens())
    assert held[True] == held[False]
