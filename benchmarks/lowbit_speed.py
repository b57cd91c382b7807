"""Micro-benchmark: the cost of a cold-page format per decode step at a given context, against 4-bit KIVI.

Under the KIVI policy every step decodes every sealed page of every layer (the torch read), and
seals one page per ``page_size`` steps per layer. Per layer and step this times

    decode: gather + decode of all pages (``context / page_size`` pages, SmolLM2's 3 KV heads x 64)
    encode: one page encoded (digest excluded), divided by ``page_size`` (its share of a step)

with the format's own code path (``PageFormat.decode`` / ``PageFormat.encode``; a rotated format decodes
in its basis and turns a query and an output, as the read does), and prints each format's median time
per step and the median ratio to 4-bit plain KIVI timed in alternation with it (pairs, so a load
that drifts on a shared machine hits both alike)::

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/lowbit_speed.py --context 8192 --formats kivi hadamard
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from confkv.attention.segments import gather_pages
from confkv.tiers.formats import build_format


def _step(name: str, bits: int, context: int, heads: int, dim: int, page: int, group: int,
          value_bits: int | None = None):
    """A callable doing one step's page work of format ``name`` (decode every page, 1/page of an encode)."""
    from confkv.tiers.prerope import Rope

    pages = context // page
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, heads, pages, page, dim, generator=gen) * 2
    values = torch.randn(1, heads, pages, page, dim, generator=gen)
    valid = torch.ones(1, heads, pages, page, dtype=torch.bool)
    positions = torch.arange(pages * page).reshape(1, 1, pages, page).expand(1, heads, pages, page)
    rope = Rope(1.0 / (100000.0 ** (torch.arange(0, dim, 2).float() / dim)))  # SmolLM2's theta
    fmt = build_format(bits, group, dim, torch.bfloat16, name, 0.01, rope=rope, value_bits=value_bits)
    folded = fmt.read_rotation is not None
    data = fmt.encode(keys, values, valid, positions)
    index = torch.arange(pages).expand(1, heads, pages)
    query = torch.randn(1, 3 * heads, 1, dim, generator=gen)

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

    return fmt, folded, decode, encode


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_format(name: str, bits: int, context: int, heads: int, dim: int, page: int, group: int,
                repeats: int, value_bits: int | None = None) -> dict:
    """Median time per step of format ``name`` and of 4-bit KIVI, timed in alternation (pairs), and the
    median of the per-pair ratios (robust to a machine whose load drifts)."""
    shape = dict(context=context, heads=heads, dim=dim, page=page, group=group)
    fmt, folded, decode, encode = _step(name, bits, **shape, value_bits=value_bits)
    _, _, ref_decode, ref_encode = _step("kivi", 4, **shape)
    decode(), ref_decode(), encode(), ref_encode()
    mine, ref, ratios, enc, ref_enc = [], [], [], [], []
    for _ in range(repeats):
        a, b = _timed(decode), _timed(ref_decode)
        e, f = _timed(encode), _timed(ref_encode)
        mine.append(a + e / page)
        ref.append(b + f / page)
        ratios.append(mine[-1] / ref[-1])
        enc.append(e)
        ref_enc.append(f)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    widths = {"bits": bits} if value_bits in (None, bits) else {"bits": bits, "value_bits": value_bits}
    return {"format": fmt.name, **widths, "rotation_folded": folded, "per_step_ms": med(mine) * 1e3,
            "kivi4_per_step_ms": med(ref) * 1e3, "encode_page_ms": med(enc) * 1e3,
            "kivi4_encode_page_ms": med(ref_enc) * 1e3, "ratio_to_kivi4": med(ratios)}


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
    parser.add_argument("--value-bits", type=int, default=None,
                        help="values at this width, keys at --bits (default: values at --bits too)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = dict(context=args.context, heads=args.heads, dim=args.head_dim, page=args.page_size,
                 group=args.group_size, repeats=args.repeats)
    for bits in args.bits:
        for name in args.formats:
            row = time_format(name, bits, **shape, value_bits=args.value_bits)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
