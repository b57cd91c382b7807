"""Benchmark of the decode attention read (CPU, not a test: no timed asserts).

Times, at 1K / 4K / 8K kept tokens, B=1 Q=1, SmolLM2-135M's attention shape
(Hq=9, Hkv=3, D=64), float32 on CPU with 2 threads:

* ``sdpa_fp``: torch.nn.functional.scaled_dot_product_attention over the
  FP tokens (GQA via ``enable_gqa``) - the reference;
* ``ours_fp``: :func:`confkv.attention.blockwise_attention` on the FP tokens
  (with and without the attention mass);
* ``ours_int8``: the same read on INT8 tokens (with mass, as the eviction
  policy needs it, and without).

Reports median and spread (p10-p90) over repeats after a warm-up, and each
median's ratio to SDPA's median from the same run.

    .venv/bin/python -m confkv.eval.bench.attention [--lengths 1024 4096 8192]
        [--repeats 200] [--block-size N] [--batch 1] [--out results/attention_read_bench.txt]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from confkv.attention.blockwise import DEFAULT_BLOCK_SIZE, blockwise_attention
from confkv.attention.segments import KVSegment
from confkv.quant import key_channel_scale, quantize_keys, quantize_values

Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def time_interleaved(fns: dict, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Wall times (microseconds) of each function, calls interleaved round-robin
    so that every variant sees the same machine load (the CPU may be shared)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e6)
    return times


def summarize(times: list[float]) -> tuple[float, float, float]:
    """(median, p10, p90) in microseconds."""
    ordered = sorted(times)
    pick = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]  # noqa: E731
    return statistics.median(ordered), pick(0.1), pick(0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lines = [
        "command: .venv/bin/python -m confkv.eval.bench.attention " + " ".join(sys.argv[1:]),
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, B={args.batch}, Q=1, Hq={Q_HEADS}, "
        f"Hkv={KV_HEADS}, D={HEAD_DIM}, float32 CPU, block_size={args.block_size}, "
        f"repeats={args.repeats} (warm-up {args.warmup})",
        "times in microseconds: median, p10, p90; ratio = median / sdpa_fp median, p10ratio = p10 / sdpa_fp p10 "
        "(same run, calls interleaved round-robin; p10 is the less load-sensitive figure on a shared CPU)",
        "",
        f"{'tokens':>6}  {'variant':<22} {'median':>9} {'p10':>9} {'p90':>9} {'ratio':>6} {'p10ratio':>8}",
    ]
    print("\n".join(lines), flush=True)
    scaling = HEAD_DIM**-0.5
    for length in args.lengths:
        query = torch.randn(args.batch, Q_HEADS, 1, HEAD_DIM)
        keys = torch.randn(args.batch, KV_HEADS, length, HEAD_DIM)
        keys[..., 5] *= 20.0  # an outlier channel, as real keys have
        values = torch.randn(args.batch, KV_HEADS, length, HEAD_DIM)
        channel_scale = key_channel_scale(keys)
        key_q, key_ts = quantize_keys(keys, channel_scale)
        value_q, value_ts = quantize_values(values)
        fp_segment = [KVSegment(keys, values, None)]
        int8_segment = [KVSegment(key_q, value_q, None, key_ts, channel_scale, value_ts)]
        bs = args.block_size
        variants = {
            "sdpa_fp": lambda: F.scaled_dot_product_attention(query, keys, values, scale=scaling, enable_gqa=True),
            "ours_fp (mass)": lambda: blockwise_attention(query, fp_segment, scaling, bs, need_mass=True),
            "ours_fp (no mass)": lambda: blockwise_attention(query, fp_segment, scaling, bs, need_mass=False),
            "ours_int8 (mass)": lambda: blockwise_attention(query, int8_segment, scaling, bs, need_mass=True),
            "ours_int8 (no mass)": lambda: blockwise_attention(query, int8_segment, scaling, bs, need_mass=False),
        }
        with torch.inference_mode():
            times = time_interleaved(variants, args.repeats, args.warmup)
        reference, reference_p10, _ = summarize(times["sdpa_fp"])
        for name, samples in times.items():
            median, p10, p90 = summarize(samples)
            line = (
                f"{length:>6}  {name:<22} {median:>9.1f} {p10:>9.1f} {p90:>9.1f} "
                f"{median / reference:>6.2f} {p10 / reference_p10:>8.2f}"
            )
            lines.append(line)
            print(line, flush=True)
        lines.append("")
        print(flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
