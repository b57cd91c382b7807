"""Where the lean decode step's time goes: SmolLM2-135M in bfloat16 with INT8 weights, CONF-KV (budget 1,024,
gate 768 / 1,280, slack 64) after a 1,024-token prefill, decode steps back to back through the lean decoder,
with a timer around each part (the fused layer calls, the LM head's GEMV, the mass read, the store's append,
attend or decode step, the native decode step, and the end of step: the stores' and the cache's, with its confidence). Prints the median step and each part's mean ms per step, for --rounds rounds.

    .venv/bin/python benchmarks/lean_step_split.py [--threads 2] [--activation-bits 16|8] [--steps 30] [--rounds 3]
"""
import argparse
import statistics
import time

import torch

import confkv.native as native
import confkv.native.layer as layer
import confkv.hf.cache as hf_cache
import confkv.store as store
from confkv.native.decode import DecodePlan
from confkv.config import StoreConfig
from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder
from confkv.hf.weights import quantize_linear_weights
from confkv.models import load_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--activation-bits", type=int, default=16, choices=(16, 8),
                        help="16: weight-only INT8 (W8A16); 8: int8 activation blocks too (W8A8)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model("smollm2", dtype=torch.bfloat16)
    quantize_linear_weights(model, activation_bits=args.activation_bits)
    gate = {"n_high": 768, "n_low": 1280, "tau": 0.5}
    ids = torch.randint(1, 40000, (1, 1024 + args.rounds * (args.steps + 5)), generator=torch.Generator().manual_seed(0))
    cache = ConfKVCache.for_model(model, "confkv", **gate, store=StoreConfig(evict_slack=64))
    with torch.no_grad():
        prefill(model, cache, ids[:, :1024], chunk=256)
    decoder = LeanDecoder(model)
    spent: dict[str, float] = {}

    def timed(owner, name, label):
        original = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
        setattr(owner, name, wrapper)

    timed(layer.LayerKernels, "attention_inputs", "norm+qkv+rotary (C)")
    timed(layer.LayerKernels, "mlp", "o+norm+MLP (C)")
    timed(native.Int8Projection, "__call__", "LM head GEMV")
    timed(native, "mass_read", "mass read (C)")
    timed(store.LayerStore, "decode_step", "store.decode_step incl. read")
    timed(store.LayerStore, "append", "store.append")
    timed(store.LayerStore, "attend", "store.attend incl. read")
    timed(store.LayerStore, "end_step", "store.end_step")
    timed(hf_cache.ConfKVCache, "end_step", "cache.end_step")
    timed(hf_cache, "confidence_of", "confidence")
    timed(DecodePlan, "step", "native decode step (C)")
    position = 1024
    for _ in range(args.rounds):
        for _ in range(5):  # unmeasured
            decoder(ids[:, position:position + 1], cache)
            position += 1
        spent.clear()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            decoder(ids[:, position:position + 1], cache)
            times.append(time.perf_counter() - start)
            position += 1
        parts = "; ".join(f"{k} {v / args.steps * 1e3:.2f}" for k, v in spent.items())
        print(f"threads {args.threads}: step median {statistics.median(times) * 1e3:.2f} ms; {parts}")


if __name__ == "__main__":
    main()
