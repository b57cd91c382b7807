"""Decode-step A/B of the native INT8 GEMV: SmolLM2-135M in bfloat16 with weight-only INT8, the lean
decoder, CONF-KV `streaming` at budget 1,024 + slack 64 after a 1,024-token prefill; in one process,
interleaved blocks of steps for each variant (so a loaded machine slows all alike), medians in ms/step:

- `gemv`: every native kernel, the INT8 projections through confkv.native (the default);
- `torch-gemv`: the other native kernels, the projections through torch._weight_int8pack_mm;
- `torch`: no native kernel (CONFKV_NATIVE=0's path);
at 1 and 2 torch threads, and at 2 threads with the GEMV workers' spin set by --spins (us; 0 = they
sleep on a condition variable after every call).

    .venv/bin/python benchmarks/gemv_step_ab.py [--blocks 6] [--steps 5] [--spins 0 50 1000]
"""
import argparse
import copy
import statistics
import time

import torch

from confkv import native
from confkv.config import StoreConfig
from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder
from confkv.hf.weights import Int8Linear, quantize_linear_weights
from confkv.models import load_model
from confkv.native import loader


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--spins", type=float, nargs="+", default=[0, 50, 1000])
    args = parser.parse_args()
    model, _ = load_model("smollm2", dtype=torch.bfloat16)
    quantize_linear_weights(model)
    ids = torch.randint(1, 40000, (1, 1024 + 2 * args.blocks * args.steps * 16), generator=torch.Generator().manual_seed(0))
    cache = ConfKVCache.for_model(model, "streaming", budget=1024, store=StoreConfig(evict_slack=64))
    torch.set_num_threads(2)
    with torch.no_grad():
        prefill(model, cache, ids[:, :1024], chunk=256)
    decoder = LeanDecoder(model)
    variants = [(1, "gemv", None), (1, "torch-gemv", None), (1, "torch", None), (2, "torch-gemv", None),
                (2, "torch", None)] + [(2, "gemv", spin) for spin in args.spins]
    times = {v: [] for v in variants}
    position = 1024
    with torch.no_grad():
        for _ in range(args.blocks):
            for variant in variants:
                threads, kind, spin = variant
                torch.set_num_threads(threads)
                if spin is not None:
                    native.gemv_settings(spin_us=spin)
                Int8Linear.use_native_gemv = kind == "gemv"
                saved = loader._state.get("lib")
                if kind == "torch":
                    loader._state["lib"] = None
                decoder(ids[:, position:position + 1], cache)  # one unmeasured step after the switch
                position += 1
                for _ in range(args.steps):
                    start = time.perf_counter()
                    decoder(ids[:, position:position + 1], cache)
                    times[variant].append((time.perf_counter() - start) * 1e3)
                    position += 1
                loader._state["lib"] = saved
    Int8Linear.use_native_gemv = True
    base = {threads: statistics.median(times[(threads, "torch-gemv", None)]) for threads in (1, 2)}
    print(f"{'threads':>7s} {'variant':12s} {'spin us':>7s} {'median ms':>9s} {'p10-p90 ms':>13s} {'x torch-gemv':>12s}")
    for (threads, kind, spin), values in times.items():
        deciles = statistics.quantiles(values, n=10)
        print(f"{threads:7d} {kind:12s} {'' if spin is None else f'{spin:g}':>7s} {statistics.median(values):9.2f} "
              f"{deciles[0]:6.2f}-{deciles[-1]:6.2f} {base[threads] / statistics.median(values):12.2f}")


if __name__ == "__main__":
    main()
