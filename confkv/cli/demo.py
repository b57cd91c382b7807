"""``confkv demo``: the memory preset and the paper's CONF-KV next to the full cache on one prompt, with traces
and speed."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from confkv.config import StoreConfig
from confkv.hf import ConfKVCache
from confkv.cli.textplot import sparkline

DEFAULT_PROMPT = ("Explain, step by step and in detail, how a hash table works: hashing, collisions, "
                  "open addressing versus chaining, resizing, and the cost of each operation.")
#: the default prompt opens with this much of Python's own documentation, so that there is context to hold
CONTEXT_CHARACTERS = 3000


def _default_prompt() -> str:
    from pydoc_data.topics import topics

    reference = "\n\n".join(topics[key].strip() for key in ("typesmapping", "dict"))[:CONTEXT_CHARACTERS]
    return f"Python's documentation says:\n\n{reference}\n\n{DEFAULT_PROMPT}"
DEMO_POLICY = {"n_high": 48, "n_low": 112, "tau": 0.8, "protect": 16, "sinks": 4}
#: the memory preset at a quarter of the full cache's bytes (pages of 16 tokens: the prompt is short)
DEMO_MEMORY = {"memory": 0.25, "page_size": 16, "group_size": 16}


def _generate(model, tokenizer, input_ids, cache, max_new_tokens):
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), cache=cache,
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    seconds = time.perf_counter() - start
    new = out[0, input_ids.shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True), new.numel(), seconds


def _print_traces(cache: ConfKVCache) -> None:
    trace = cache.trace
    kept = trace.kept_tokens(0)
    kv = trace.total_kv_bytes()
    print("per decoding step (after the prompt), one column per step group:")
    print(f"  confidence   {sparkline(trace.confidences(0), low=0.0, high=1.0)}  (0..1)")
    print(f"  hot tokens   {sparkline(kept)}  ({min(kept):.0f}..{max(kept):.0f})")
    print(f"  KV bytes     {sparkline([float(b) for b in kv])}  ({min(kv) / 1e6:.2f}..{max(kv) / 1e6:.2f} MB, all tiers)")
    targets = [step.target_bytes for step in trace.steps if step.target_bytes]
    if targets:
        print(f"  target       {sparkline([float(b) for b in targets])}  ({min(targets) / 1e6:.2f}..{max(targets) / 1e6:.2f} MB: "
              f"memory x the full cache's bytes; never exceeded)")
    last = trace.steps[-1].rung_tokens if trace.steps else ()
    if last:
        print(f"  at the end   cold token slots per bit width (all layers): {dict(zip(cache.storage.ladder, last))}")
    print()


def run_demo(model_name: str = "smollm2", prompt: str | None = None, max_new_tokens: int = 160,
             store: StoreConfig | None = None) -> int:
    """Print both generations, the kept-token / KV-byte / confidence traces and the speed."""
    from confkv.models import load_model

    print(f"loading {model_name} ...", flush=True)
    model, tokenizer = load_model(model_name)
    prompt = prompt or _default_prompt()
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    print(f"prompt: {input_ids.shape[1]} tokens; generating {max_new_tokens} greedy tokens with each cache\n")

    full_cache = DynamicCache(config=model.config)
    full_text, full_n, full_s = _generate(model, tokenizer, input_ids, full_cache, max_new_tokens)
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in full_cache.layers)

    print("=== full KV cache (transformers DynamicCache) ===")
    print(full_text.strip(), "\n")
    rows = [("full KV", full_n / full_s, full_bytes, full_bytes, "")]
    for label, name, params in (("memory=0.25", None, DEMO_MEMORY), ("CONF-KV", "confkv", DEMO_POLICY)):
        cache = ConfKVCache.for_model(model, name, store=store, record_confidence=True, **params)
        text_out, n_out, seconds = _generate(model, tokenizer, input_ids, cache, max_new_tokens)
        settings = " ".join(f"{k}={v}" for k, v in params.items())
        name = name or "tiered, the default preset"
        print(f"=== {label} ({name}: {settings}){' INT8' if store and store.kv_int8 else ''} ===")
        print(text_out.strip(), "\n")
        _print_traces(cache)
        same = sum(a == b for a, b in zip(full_text.split(), text_out.split()))
        rows.append((label, n_out / seconds, cache.trace.total_kv_bytes()[-1], cache.trace.peak_kv_bytes(),
                     f"{same}/{max(len(full_text.split()), 1)}"))
    print(f"{'':12s}{'tokens/s':>10s}{'KV bytes at end':>18s}{'peak KV bytes':>16s}{'words as full KV':>18s}")
    for label, speed, end_bytes, peak, same in rows:
        print(f"{label:12s}{speed:10.1f}{end_bytes:18,d}{peak:16,d}{same:>18s}")
    print("\nmemory=0.25 holds a quarter of the full cache's bytes at every step: a full-precision hot tier and every\n"
          "other token in Hadamard-rotated pages that step down 8 -> 4 -> 3 bits before any is dropped. CONF-KV (the paper)\n"
          "evicts for good, its budget set by the model's confidence.")
    return 0
