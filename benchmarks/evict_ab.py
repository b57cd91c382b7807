"""The memory preset's decode step with the hot tier's eviction in one C call (``c/evict.c``) against the torch
path, in one process: the same cache decodes blocks of steps with the C call on, then off, interleaved (both
paths give the same state, so the blocks continue one stream). Prints the median step of each and their ratio.

    .venv/bin/python benchmarks/evict_ab.py 1024 8192 [--model smollm2] [--threads 2] [--blocks 6] [--steps 5]
"""
import argparse
import statistics
import time

import torch

from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder
from confkv.hf.weights import quantize_linear_weights
from confkv.models import load_model
from confkv.store import hot_tier


def step_times(decoder, cache, ids, position: int, steps: int, native: bool) -> tuple[list[float], int]:
    switch = hot_tier._native_evict_rows
    if not native:
        hot_tier._native_evict_rows = lambda: None
    times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            decoder(ids[:, position:position + 1], cache)
            times.append(time.perf_counter() - start)
            position += 1
    finally:
        hot_tier._native_evict_rows = switch
    return times, position


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("contexts", type=int, nargs="+")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=6, help="blocks of each path, interleaved")
    parser.add_argument("--steps", type=int, default=5, help="decode steps a block")
    parser.add_argument("--memory", type=float, default=0.25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=torch.bfloat16)
    quantize_linear_weights(model, activation_bits=8)
    decoder = LeanDecoder(model)
    for context in args.contexts:
        need = context + 2 * args.blocks * args.steps + 10
        ids = torch.randint(1, 30000, (1, need), generator=torch.Generator().manual_seed(0))
        cache = ConfKVCache.for_model(model, memory=args.memory)
        with torch.no_grad():
            prefill(model, cache, ids[:, :context], chunk=512)
        position = context
        for _ in range(3):  # unmeasured
            decoder(ids[:, position:position + 1], cache)
            position += 1
        measured = {True: [], False: []}
        for block in range(2 * args.blocks):
            native = block % 2 == 0
            times, position = step_times(decoder, cache, ids, position, args.steps, native)
            measured[native] += times
        on, off = (statistics.median(measured[k]) * 1e3 for k in (True, False))
        print(f"context {context}: eviction in one C call {on:.1f} ms a step, torch path {off:.1f} ms "
              f"(median of {len(measured[True])} steps each; torch / C = {off / on:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
