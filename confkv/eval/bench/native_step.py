"""The lean decode step of SmolLM2-135M (bf16 activations, INT8 weights; CONF-KV budget 1,024 +
slack 64, the bench's ``confkv+slack64-lean`` row) with and without the native kernels
(confkv.native), interleaved step by step on one cache at about 1K context; prints the medians and
their ratio per torch thread count.

    nice -n 0 .venv/bin/python -m confkv.eval.bench.native_step [--context 1024] [--steps 30] [--threads 1 2]
"""
import argparse
import statistics

import torch

from confkv import native
from confkv.data import corpus_tokens
from confkv.eval.bench.run import _Runner, default_configs
from confkv.eval.bench.dtypes import models_by_dtype
from confkv.models import load_model
from confkv.native import loader


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("the native kernels are unavailable (see the warning above)")
    models, tokenizer = models_by_dtype(["bfloat16-w8"], "smollm2", None, None, load_model)
    ids = corpus_tokens(tokenizer, "pydoc-topics", args.context + 2 * args.steps * len(args.threads) + 64)
    ids = ids if ids.ndim == 2 else ids[None]
    config = next(c for c in default_configs(1024, 64) if c.name == "confkv+slack64-lean")
    runner = _Runner(config, models["bfloat16-w8"], "bfloat16-w8")
    runner.feed_to(ids, args.context, 256)
    print(f"{'threads':>7s} {'torch ms':>9s} {'native ms':>10s} {'ratio':>6s}  (medians of {args.steps} steps each, "
          f"context {args.context}+)")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for _ in range(3):  # warm-up
            runner.next_step(ids)
        times = {"torch": [], "native": []}
        for _ in range(args.steps):  # interleaved A/B on the same cache
            times["native"].append(runner.next_step(ids))
            with loader.disabled():
                times["torch"].append(runner.next_step(ids))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{threads:7d} {med['torch']:9.1f} {med['native']:10.1f} {med['torch'] / med['native']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
