"""The native packed-page read of each page format, timed interleaved on one layer's read (issues 31 and 32).

The read: SmolLM2-135M's layer (9 query heads, 3 KV heads, head dim 64), batch 1, one query, a hot tier of
``--hot`` float32 tokens plus ``--tokens`` tokens of sealed pages (64 a page, group 64), every page read, as the
KIVI rows of ``confkv bench`` read them. Each spec is ``BITS[/VALUE_BITS][:FORMAT]`` (``confkv bench --kivi``'s):
its pages are encoded by the format itself (keys and values Gaussian, a few key channels 4x wider, outliers at
``--outlier-fraction``). The specs are called in turn, ``--repeats`` rounds; the figure is each spec's median
ratio to the first spec's time in the same round (wall clock), with the medians in ms beside it.

    PYTHONPATH=. python benchmarks/page_format_read.py --specs 4 4:hadamard 4/2:hadamard+outliers+clip \
        --threads 1 2 --repeats 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from confkv.attention.segments import KVSegment, PagedSegment
from confkv.eval.bench.configs import kivi_rows
from confkv.native import page_entry
from confkv.tiers.formats import KiviFormat, parse_format

Q_HEADS, KV_HEADS, DIM, PAGE, GROUP = 9, 3, 64, 64, 64


def spec_format(spec: str, outlier_fraction: float) -> KiviFormat:
    """The page format of ``spec`` (``BITS[/VALUE_BITS][:FORMAT]``) at SmolLM2's head dim and group."""
    (row,) = kivi_rows((spec,))
    params = row.params
    return KiviFormat(params["bits"], GROUP, DIM, parse_format(params["format"]), outlier_fraction=outlier_fraction,
                      value_bits=params.get("value_bits"))


def gaussian_pages(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys, values [1, KV_HEADS, count, PAGE, DIM] float32 (Gaussian, four key channels 4x wider) and valid
    [1, KV_HEADS, count, PAGE] (every slot)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, KV_HEADS, count, PAGE, DIM, generator=gen)
    keys[..., :4] *= 4.0
    values = torch.randn(1, KV_HEADS, count, PAGE, DIM, generator=gen)
    return keys, values, torch.ones(1, KV_HEADS, count, PAGE, dtype=torch.bool)


def spec_segment(spec: str, tokens: int, outlier_fraction: float, seed: int = 0) -> PagedSegment:
    """Every page of ``tokens`` tokens (one sequence) in the format of ``spec``, as the cold tier hands them over."""
    fmt = spec_format(spec, outlier_fraction)
    count = tokens // PAGE
    keys, values, valid = gaussian_pages(count, seed)
    data = fmt.encode(keys, values, valid)
    index = torch.arange(count).expand(1, KV_HEADS, count).contiguous()
    value_bits = fmt.widths["value"]
    return PagedSegment(index, torch.tensor([count]), valid, fmt.bits, GROUP, DIM,
                        **{name: data[name] for name in fmt.storage}, rotation=fmt.rotation,
                        value_bits=None if value_bits == fmt.bits else value_bits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", nargs="+", default=["4", "4:hadamard", "4/2:hadamard+outliers+clip"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hot", type=int, default=512)
    parser.add_argument("--outlier-fraction", type=float, default=0.01)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(1)
    hot = KVSegment(torch.randn(1, KV_HEADS, args.hot, DIM, generator=gen),
                    torch.randn(1, KV_HEADS, args.hot, DIM, generator=gen), None)
    query = torch.randn(1, Q_HEADS, 1, DIM, generator=gen)
    reads = {spec: [hot, spec_segment(spec, args.tokens, args.outlier_fraction)] for spec in args.specs}
    for threads in args.threads:
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {spec: [] for spec in args.specs}
        for spec, segments in reads.items():  # warm up (the library, the pool)
            assert page_entry.page_read(query, segments, DIM ** -0.5) is not None, spec
        for _ in range(args.repeats):
            for spec, segments in reads.items():
                start = time.perf_counter()
                page_entry.page_read(query, segments, DIM ** -0.5)
                times[spec].append(time.perf_counter() - start)
        first = times[args.specs[0]]
        print(f"{threads} thread(s), {args.tokens} tokens of pages + {args.hot} hot, {args.repeats} rounds")
        for spec in args.specs:
            ratio = statistics.median(t / f for t, f in zip(times[spec], first))
            print(f"  {spec:32s} {statistics.median(times[spec]) * 1e3:7.3f} ms   {ratio:5.2f}x {args.specs[0]}")


if __name__ == "__main__":
    main()
