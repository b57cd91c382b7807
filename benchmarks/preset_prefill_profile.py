"""Where a chunked prefill's time goes under the memory preset, against full KV: one prefill of ``N`` random
tokens in chunks of ``C`` through each cache (SmolLM2 in bfloat16, one thread by default), its wall time, and for
the preset the confkv functions with the most cumulative time (cProfile).

    .venv/bin/python benchmarks/preset_prefill_profile.py 4096 128 [--threads 1] [--top 30]
"""
import argparse
import cProfile
import pstats
import time

import torch

from confkv.hf import ConfKVCache, prefill
from confkv.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int)
    parser.add_argument("chunk", type=int)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model("smollm2", dtype=torch.bfloat16)
    ids = torch.randint(1, 30000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    for name, options in (("full KV", {"policy": "full"}), ("the preset, memory=0.25", {"memory": 0.25})):
        cache = ConfKVCache.for_model(model, **options)
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        with torch.no_grad():
            prefill(model, cache, ids, chunk=args.chunk)
        profile.disable()
        print(f"{name}: {time.perf_counter() - start:.2f} s (under cProfile)")
    pstats.Stats(profile).sort_stats("cumtime").print_stats(r"confkv/(store|tiers|attention|hf/cache)", args.top)


if __name__ == "__main__":
    main()
