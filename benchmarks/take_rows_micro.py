"""Timing probe: ``Region.gather``'s row take (``confkv.store.hot_tier.take_rows``, one ``index_select`` of whole
rows) against the element-wise ``gather`` it replaced, at a decode step's compaction shape (SmolLM2's 3 KV
heads, head dim 64, a hot region of ``--slots`` slots in bfloat16, all but one slot kept). Interleaved, median
microseconds and their ratio; the outputs are checked equal.

    python benchmarks/take_rows_micro.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from confkv.store.hot_tier import take_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=370)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(1, 3, args.slots, 64, generator=gen).to(torch.bfloat16)
    index = torch.randperm(args.slots, generator=gen)[:args.slots - 1].sort().values.expand(1, 3, -1).contiguous()
    ways = {"gather": lambda: t.gather(2, index[..., None].expand(-1, -1, -1, t.shape[-1])),
            "take_rows": lambda: take_rows(t, index)}
    assert torch.equal(ways["gather"](), ways["take_rows"]())
    times = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            began = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - began)
    gather, rows = (1e6 * statistics.median(times[k]) for k in ("gather", "take_rows"))
    print(f"[1, 3, {args.slots}, 64] bf16, {args.slots - 1} slots kept, {args.threads} thread(s), median of "
          f"{args.repeats}: gather {gather:.1f} us, take_rows {rows:.1f} us, {gather / rows:.2f}x")


if __name__ == "__main__":
    main()
