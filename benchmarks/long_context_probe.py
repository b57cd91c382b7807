"""Where a long-context decode step of the memory preset goes, per layer, in minutes instead of an hour.

A real 32K bench on Qwen2.5-1.5B prefills for 45 minutes before its first step (results/qwen/README.md). The
store's work per layer depends only on the KV shapes, the context and the target, so this probe builds a
randomly initialised Llama-shaped model with the KV shapes of a real one (default: Qwen2.5-1.5B's 12 query heads,
2 KV heads of 128 channels) but 2 thin layers, prefills it to ``--context`` tokens (about 3 minutes at 32K on one
thread), runs ``--steps`` decode steps with the bench's section timers on, and prints each section's time per
layer and step, then the functions with the most time of their own (cProfile).

What it is not: a quality run (random weights attend nowhere in particular, so which pages heat up differs from a
real model's) nor a figure of the model's own layers (they are thin here). Multiply a section's per-layer time by
the real model's layer count for its share of a real step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_context_probe.py --context 32768
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from confkv import profiling
from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder
from confkv.models import tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768, help="tokens prefilled before the timed steps")
    parser.add_argument("--memory", type=float, default=0.25, help="the preset's memory target")
    parser.add_argument("--query-heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps (after 3 untimed ones)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=1024, help="prefill chunk")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hidden = args.query_heads * 32
    model = tiny_model("llama", num_hidden_layers=args.layers, hidden_size=hidden, intermediate_size=hidden,
                       num_attention_heads=args.query_heads, num_key_value_heads=args.kv_heads,
                       head_dim=args.head_dim, max_position_embeddings=args.context + 64).to(torch.bfloat16)
    cache = ConfKVCache.for_model(model, memory=args.memory)
    ids = torch.randint(3, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.no_grad():
        logits = prefill(model, cache, ids, torch.ones_like(ids), chunk=args.chunk)
    print(f"prefill of {args.context} tokens: {time.perf_counter() - start:.0f} s; "
          f"KV held {cache.kv_bytes() / 2**20:.1f} MiB", flush=True)
    decoder = LeanDecoder(model)
    token = logits.argmax(-1)[:, None]
    for _ in range(3):
        decoder(token, cache)
    timers, profile = profiling.Timers(), cProfile.Profile()
    start = time.perf_counter()
    with profiling.enabled(timers):
        profile.enable()
        for _ in range(args.steps):
            decoder(token, cache)
        profile.disable()
    per_step = (time.perf_counter() - start) / args.steps
    print(f"\nstep {1000 * per_step:.2f} ms over {args.layers} layers "
          f"({1000 * per_step / args.layers:.2f} ms a layer, model included)\n")
    print(f"{'section':42s} {'ms / layer-step':>16s} {'calls':>6s}")
    for name, seconds in sorted(timers.seconds.items(), key=lambda item: -item[1]):
        print(f"{name:42s} {1000 * seconds / args.steps / args.layers:16.3f} {timers.calls[name]:6d}")
    print()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
