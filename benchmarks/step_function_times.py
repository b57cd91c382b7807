"""Where the memory preset's lean decode step goes, by whole functions: each named function of the store wrapped
with a wall-clock timer (inclusive: a function's time holds its callees'), over decode steps after a prefill of
``N`` random tokens (:func:`preset_step_profile.prefilled_preset`: bf16, W8A8, ``memory=0.25``). Unlike cProfile
(``preset_step_profile.py``) it adds one timer a call, not one a Python call, so the small calls it is about keep
their weight.

    .venv/bin/python benchmarks/step_function_times.py 1024 [--steps 64] [--threads 1] [--param open_bits=8]
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from preset_step_profile import add_setting_arguments, prefilled_preset, setting_of  # noqa: E402

from confkv.hf.cache import ConfKVCache  # noqa: E402
from confkv.native.pages import PageReader  # noqa: E402
from confkv.policies.confkv import ConfKVPolicy  # noqa: E402
from confkv.store import hot_tier  # noqa: E402
from confkv.store.layer import LayerStore  # noqa: E402
from confkv.store.read import AttentionRead  # noqa: E402
from confkv.tiers.cold import ColdTier  # noqa: E402
from confkv.tiers.ladder import LadderTier  # noqa: E402
from confkv.tiers.planner import StepRecord  # noqa: E402

#: (owner, attribute) of every timed function
TIMED = [(AttentionRead, "decode_step"), (AttentionRead, "_append_one"), (AttentionRead, "_tiered_read"),
         (PageReader, "__call__"), (LadderTier, "segments"), (ConfKVCache, "end_step"), (LayerStore, "end_step"),
         (hot_tier, "age_and_evict_at_once"), (hot_tier, "_age_split"), (ConfKVPolicy, "scores"),
         (hot_tier, "demote_slots"), (ColdTier, "demote"), (LayerStore, "fit"), (LadderTier, "_step_down"),
         (LadderTier, "kv_bytes"), (LayerStore, "hot_bytes"), (StepRecord, "of_stores")]


def timed(function, name: str, totals: collections.Counter, calls: collections.Counter):
    """``function`` adding its wall time to ``totals[name]`` and one to ``calls[name]`` at every call."""
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - began
            calls[name] += 1
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    add_setting_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policy, storage, label = setting_of(args)
    decoder, cache, ids, position = prefilled_preset(args.model, args.tokens, args.steps, warm=5, policy=policy,
                                                     **storage)
    totals: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for owner, attribute in TIMED:  # static methods and module functions alike: the attribute as looked up
        name = f"{getattr(owner, '__name__', owner)}.{attribute}".split(".")[-2:]
        setattr(owner, attribute, timed(getattr(owner, attribute), ".".join(name), totals, calls))
    began = time.perf_counter()
    for _ in range(args.steps):
        decoder(ids[:, position:position + 1], cache)
        position += 1
    step = 1e3 * (time.perf_counter() - began) / args.steps
    print(f"{args.model}, {label}, {args.tokens} tokens, {args.threads} thread(s): {step:.2f} ms a step "
          f"({args.steps} steps, timers included)")
    for name, seconds in totals.most_common():
        print(f"  {name:36s} {1e3 * seconds / args.steps:7.2f} ms a step  {calls[name] / args.steps:6.1f} calls a step")


if __name__ == "__main__":
    main()
