"""Micro-benchmark: the cost of a cold-page format per decode step at a given context, against 4-bit KIVI.

Under the KIVI policy every step decodes every sealed page of every layer (the torch read), and
seals one page per ``page_size`` steps per layer. Per layer and step this times

    decode: gather + decode of all pages (``context / page_size`` pages, SmolLM2's 3 KV heads x 64)
    encode: one page encoded (digest excluded), divided by ``page_size`` (its share of a step)

with the format's own code path (``ColdTier._dequantized`` / ``PageFormat.encode``), and prints each
format's time per step and its ratio to 4-bit plain KIVI measured in the same run::

    OMP_NUM_THREADS=1 python benchmarks/lowbit_speed.py --context 8192 --formats kivi hadamard
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from confkv.attention.paged import gather_pages
from confkv.tiers.formats import build_format


def time_format(name: str, bits: int, context: int, heads: int, dim: int, page: int, group: int,
                repeats: int) -> dict:
    pages = context // page
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, heads, pages, page, dim, generator=gen) * 2
    values = torch.randn(1, heads, pages, page, dim, generator=gen)
    valid = torch.ones(1, heads, pages, page, dtype=torch.bool)
    positions = torch.arange(pages * page).reshape(1, 1, pages, page).expand(1, heads, pages, page)
    from confkv.tiers.prerope import Rope

    rope = Rope(1.0 / (100000.0 ** (torch.arange(0, dim, 2).float() / dim)))  # SmolLM2's theta
    fmt = build_format(bits, group, dim, torch.bfloat16, name, 0.01, rope=rope)
    folded = fmt.read_rotation is not None
    data = fmt.encode(keys, values, valid, positions)
    index = torch.arange(pages).expand(1, heads, pages)

    query = torch.randn(1, 3 * 3, 1, dim, generator=gen)

    def decode():  # what a read does: pages gathered and decoded (a rotated format: in its basis, query turned)
        gathered = {n: gather_pages(data[n], index) for n in fmt.storage}
        if folded:
            fmt.read_rotation.forward(query)
            out = fmt.decode(gathered, gather_pages(positions, index), rotated=True)
            fmt.read_rotation.inverse(query)  # the output, [B, Hq, 1, D] like the query
            return out
        return fmt.decode(gathered, gather_pages(positions, index))

    def encode():
        return fmt.encode(keys[:, :, :1], values[:, :, :1], valid[:, :, :1], positions[:, :, :1])

    best = {}
    for label, fn, reps in (("decode", decode, repeats), ("encode", encode, repeats * 4)):
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        best[label] = sorted(times)[len(times) // 2]  # median
    per_step = best["decode"] + best["encode"] / page
    return {"format": fmt.name, "bits": bits, "rotation_folded": folded, "decode_ms": best["decode"] * 1e3, "encode_page_ms": best["encode"] * 1e3,
            "per_step_ms": per_step * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2])
    parser.add_argument("--formats", nargs="+", default=["kivi", "hadamard", "outliers", "codebook"])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = dict(context=args.context, heads=args.heads, dim=args.head_dim, page=args.page_size,
                 group=args.group_size, repeats=args.repeats)
    reference = time_format("kivi", 4, **shape)
    print(json.dumps({**reference, "ratio_to_kivi4": 1.0}), flush=True)
    for bits in args.bits:
        for name in args.formats:
            row = time_format(name, bits, **shape)
            row["ratio_to_kivi4"] = row["per_step_ms"] / reference["per_step_ms"]
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
