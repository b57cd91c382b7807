"""Timing probe: one layer's read of packed KIVI cold pages, native (one C call) against the torch path it replaces.

The torch path is what the memory preset ran before issue 32: ``PagedSegment.to_dense`` (gather and dequantize
every selected page) and the block-wise read; the native path is ``confkv.native.page_entry.page_read`` (the pages
read still packed). Shape: SmolLM2-135M's layer (9 query heads, 3 KV heads, head dim 64), batch 1, one query,
a hot tier of ``--hot`` tokens in float32 plus ``--tokens`` tokens of sealed pages (64 tokens a page, group 64),
for each bit width alone and for the ladder's mix (a third each at 8, 4 and 3 bits). Both reads run interleaved,
``--repeats`` times each, at ``--threads`` threads, timed by the process's CPU time (``--clock cpu``, the
default: at one thread a loaded machine's other processes do not count) or the wall clock (``--clock wall``);
the script prints the medians and their ratio (the absolute times depend on the machine and its load; the
ratio is the figure).

    python benchmarks/native_page_read.py --tokens 8192 --threads 1 --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from confkv.attention.blockwise import blockwise_attention
from confkv.attention.segments import KVSegment, PagedSegment, densify
from confkv.native import page_entry
from confkv.tiers import lowbit

Q_HEADS, KV_HEADS, DIM, PAGE, GROUP = 9, 3, 64, 64, 64


def page_segment(gen: torch.Generator, bits: int, tokens: int, kv_heads: int = KV_HEADS, dim: int = DIM,
                 rotation=None) -> PagedSegment:
    """``tokens`` tokens of random keys / values as sealed pages at ``bits`` (``rotation``: a
    :class:`~confkv.tiers.hadamard.HadamardRotation` the pages are marked as coded in, or None)."""
    pages = tokens // PAGE
    keys = torch.randn(1, kv_heads, pages, PAGE, dim, generator=gen)
    values = torch.randn(1, kv_heads, pages, PAGE, dim, generator=gen)
    valid = torch.ones(1, kv_heads, pages, PAGE, dtype=torch.bool)
    qk, qv = lowbit.quantize_keys(keys, valid, bits, GROUP), lowbit.quantize_values(values, bits, GROUP)
    index = torch.arange(pages).expand(1, kv_heads, pages)
    return PagedSegment(index, torch.tensor([pages]), valid, bits, GROUP, dim, key_codes=qk.codes,
                        key_scale=qk.scale, key_min=qk.minimum, value_codes=qv.codes, value_scale=qv.scale,
                        value_min=qv.minimum, rotation=rotation)


def torch_read(query, segments, scaling):
    return blockwise_attention(query, densify(segments), scaling)


def native_read(query, segments, scaling):
    return page_entry.page_read(query, segments, scaling)


def measure(query, segments, repeats: int, clock) -> tuple[float, float, float]:
    """(native median ms, torch median ms, largest |difference| of the outputs), interleaved, timed by ``clock``."""
    scaling = DIM ** -0.5
    out_n, _ = native_read(query, segments, scaling)
    out_t, _ = torch_read(query, segments, scaling)
    times = {"native": [], "torch": []}
    for _ in range(repeats):
        for name, read in (("native", native_read), ("torch", torch_read)):
            began = clock()
            read(query, segments, scaling)
            times[name].append(1e3 * (clock() - began))
    return statistics.median(times["native"]), statistics.median(times["torch"]), float((out_n - out_t).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hot", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: the process's CPU time (time.process_time; at 1 thread it leaves out the time a "
                             "loaded machine gives to other processes); wall: time.perf_counter")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, Q_HEADS, 1, DIM, generator=gen)
    hot = KVSegment(torch.randn(1, KV_HEADS, args.hot, DIM, generator=gen),
                    torch.randn(1, KV_HEADS, args.hot, DIM, generator=gen), None)
    third = args.tokens // 3 // PAGE * PAGE
    cases = [(f"{bits}-bit pages only", [hot, page_segment(gen, bits, args.tokens)]) for bits in (8, 4, 3, 2)]
    cases.append(("ladder mix 8/4/3", [hot, page_segment(gen, 8, args.tokens - 2 * third), page_segment(gen, 4, third),
                                       page_segment(gen, 3, third)]))
    print(f"one layer's read: {Q_HEADS} query heads, {KV_HEADS} KV heads, head dim {DIM}, batch 1, hot tier "
          f"{args.hot} tokens fp32 + {args.tokens} tokens of packed pages; {args.threads} thread(s), "
          f"median of {args.repeats} interleaved runs, {args.clock} time")
    print(f"{'case':22s} {'native ms':>10s} {'torch ms':>10s} {'torch/native':>13s} {'max |diff|':>11s}")
    for name, segments in cases:
        fast, slow, diff = measure(query, segments, args.repeats, clock)
        print(f"{name:22s} {fast:10.3f} {slow:10.3f} {slow / fast:12.2f}x {diff:11.2e}")


if __name__ == "__main__":
    main()
