"""Where two bench rows' decode steps differ: both fed the same random tokens to one context, then stepped in
turn (A, B, A, B, ...), every step profiled; prints each row's median step and its sections in ms per step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_sections_ab.py tiered@25-lean tiered@25+int8-lean

Rows are ``confkv bench`` configuration names (:func:`confkv.eval.bench.configs.default_configs` at budget 1024,
no slack, ``--memory``); a name ending in ``:torch-codec`` steps that row with the KIVI page codec's C calls off
(``confkv.native.page_encode``; the torch code instead, stop 63), so one run holds both. Compare rows within one run:
the figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from preset_step_profile import torch_codec  # noqa: E402

from confkv import profiling  # noqa: E402
from confkv.eval.bench.dtypes import models_by_dtype  # noqa: E402
from confkv.eval.bench.run import _Runner, default_configs  # noqa: E402
from confkv.models import load_model  # noqa: E402


TORCH_CODEC = ":torch-codec"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="+", help="bench configuration names")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16-w8")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--memory", type=float, nargs="+", default=[0.25])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=12, help="sections printed per row")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models, _ = models_by_dtype([args.dtype], args.model, None, None, load_model)
    configs = {c.name: c for c in default_configs(1024, 0, tuple(args.memory))}
    unknown = [name for name in args.rows if name.removesuffix(TORCH_CODEC) not in configs]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(configs)}")
    ids = torch.randint(10, 40000, (1, args.context + args.steps + 16), generator=torch.Generator().manual_seed(0))
    runners = {}
    for name in args.rows:
        runners[name] = _Runner(configs[name.removesuffix(TORCH_CODEC)], models[args.dtype], args.dtype)
        runners[name].feed_to(ids, args.context, 1024)
    times: dict[str, list[float]] = {name: [] for name in args.rows}
    timers = {name: profiling.Timers() for name in args.rows}
    for _ in range(args.steps):
        for name, runner in runners.items():
            with torch_codec() if name.endswith(TORCH_CODEC) else nullcontext(), profiling.enabled(timers[name]):
                start = time.perf_counter()
                runner.next_step(ids)
                times[name].append(time.perf_counter() - start)
    for name in args.rows:
        median, mean = 1e3 * statistics.median(times[name]), 1e3 * statistics.mean(times[name])
        print(f"{name}: median {median:.1f} ms, mean {mean:.1f} ({args.steps} profiled steps, context "
              f"{args.context}, {args.threads} thread(s))")
        for section, seconds in sorted(timers[name].seconds.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"   {section:34s} {1e3 * seconds / args.steps:7.2f} ms/step")


if __name__ == "__main__":
    main()
