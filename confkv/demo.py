"""``confkv demo``: CONF-KV next to the full cache on one prompt, with traces and speed."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from confkv.config import StoreConfig
from confkv.hf import ConfKVCache
from confkv.textplot import sparkline

DEFAULT_PROMPT = ("Explain, step by step and in detail, how a hash table works: hashing, collisions, "
                  "open addressing versus chaining, resizing, and the cost of each operation.")
DEMO_POLICY = {"n_high": 48, "n_low": 112, "tau": 0.8, "protect": 16, "sinks": 4}


def _generate(model, tokenizer, input_ids, cache, max_new_tokens):
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), cache=cache,
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    seconds = time.perf_counter() - start
    new = out[0, input_ids.shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True), new.numel(), seconds


def run_demo(model_name: str = "smollm2", prompt: str | None = None, max_new_tokens: int = 160,
             store: StoreConfig | None = None) -> int:
    """Print both generations, the kept-token / KV-byte / confidence traces and the speed."""
    from confkv.models import load_model

    print(f"loading {model_name} ...", flush=True)
    model, tokenizer = load_model(model_name)
    prompt = prompt or DEFAULT_PROMPT
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    print(f"prompt: {input_ids.shape[1]} tokens; generating {max_new_tokens} greedy tokens twice\n")

    full_cache = DynamicCache(config=model.config)
    full_text, full_n, full_s = _generate(model, tokenizer, input_ids, full_cache, max_new_tokens)
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in full_cache.layers)

    cache = ConfKVCache.for_model(model, "confkv", store=store, **DEMO_POLICY)
    conf_text, conf_n, conf_s = _generate(model, tokenizer, input_ids, cache, max_new_tokens)

    print("=== full KV cache (transformers DynamicCache) ===")
    print(full_text.strip(), "\n")
    print(f"=== CONF-KV  n_high={DEMO_POLICY['n_high']} n_low={DEMO_POLICY['n_low']} tau={DEMO_POLICY['tau']} "
          f"protect={DEMO_POLICY['protect']} sinks={DEMO_POLICY['sinks']}"
          f"{' INT8' if store and store.kv_int8 else ''} ===")
    print(conf_text.strip(), "\n")

    trace = cache.trace
    kept = trace.kept_tokens(0)
    kv = trace.total_kv_bytes()
    conf = trace.confidences(0)
    print("per decoding step (after the prompt), one column per step group:")
    print(f"  confidence   {sparkline(conf, low=0.0, high=1.0)}  (0..1)")
    print(f"  kept tokens  {sparkline(kept)}  ({min(kept):.0f}..{max(kept):.0f})")
    print(f"  KV bytes     {sparkline([float(b) for b in kv])}  ({min(kv) / 1e6:.2f}..{max(kv) / 1e6:.2f} MB)")
    print(f"  kept tokens, last 24 steps: {[int(k) for k in kept[-24:]]}")
    print()
    print(f"{'':14s}{'tokens/s':>10s}{'KV bytes at end':>18s}{'peak KV bytes':>16s}")
    print(f"{'full KV':14s}{full_n / full_s:10.1f}{full_bytes:18,d}{full_bytes:16,d}")
    print(f"{'CONF-KV':14s}{conf_n / conf_s:10.1f}{kv[-1]:18,d}{trace.peak_kv_bytes():16,d}")
    same = sum(a == b for a, b in zip(full_text.split(), conf_text.split()))
    print(f"\nwords identical at the same position: {same}/{max(len(full_text.split()), 1)}")
    return 0
