"""A/B timing of the native packed-page read: this checkout's kernels against another source tree's (e.g. an
earlier commit's ``confkv/native``), both loaded in one process and called interleaved on the same read.

The read: one layer of SmolLM2-135M (``--shape smollm2``: 9 query heads, 3 KV heads, head dim 64) or of
Qwen2.5-1.5B (``--shape qwen``: 12 query heads, 2 KV heads, head dim 128), batch 1, one query, a hot tier of
``--hot`` float32 tokens plus ``--tokens`` tokens of sealed pages (64 a page, group 64) at each bit width alone
and as the ladder's mix (a third each at 8, 4 and 3 bits), as ``benchmarks/native_page_read.py`` builds it, and the
hot tier alone (the dense read);
``--rotated``: the pages marked as coded in a Hadamard rotation, as the memory preset's are (the kernel then
turns the query into their basis and their share of the output back). Wall-clock medians over ``--repeats``
interleaved calls at each of ``--threads``; the ratio is the figure.

    git worktree add /tmp/before <commit>    # or any directory holding kernels.c and c/
    python benchmarks/page_read_ab.py --before /tmp/before/confkv/native --threads 1 2 --repeats 200
    python benchmarks/page_read_ab.py --before /tmp/before/confkv/native --shape qwen --rotated --tokens 8192
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from native_page_read import page_segment  # noqa: E402

from confkv.attention.segments import KVSegment  # noqa: E402
from confkv.native import loader  # noqa: E402
from confkv.native import page_entry  # noqa: E402
from confkv.tiers.hadamard import shared_rotation  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "qwen": (12, 2, 128)}  #: query heads, KV heads, head dim


def build_from(directory: Path):
    """The kernels of ``directory`` (kernels.c and c/), built with this checkout's flags, loaded."""
    saved_source, saved_parts = loader.SOURCE, loader.PARTS
    loader.SOURCE, loader.PARTS = directory / "kernels.c", directory / "c"
    try:
        return loader.load(loader.build())
    finally:
        loader.SOURCE, loader.PARTS = saved_source, saved_parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a directory holding kernels.c and c/")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hot", type=int, default=512)
    parser.add_argument("--hot-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the hot tier's dtype (the memory preset's is the model's: bfloat16 in the bench)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--rotated", action="store_true", help="pages coded in a Hadamard rotation (the preset's)")
    args = parser.parse_args()
    q_heads, kv_heads, dim = SHAPES[args.shape]
    rotation = shared_rotation(dim) if args.rotated else None
    libs = {"before": build_from(args.before), "after": loader.library()}
    gen = torch.Generator().manual_seed(0)
    hot_dtype = getattr(torch, args.hot_dtype)
    hot = KVSegment(torch.randn(1, kv_heads, args.hot, dim, generator=gen).to(hot_dtype),
                    torch.randn(1, kv_heads, args.hot, dim, generator=gen).to(hot_dtype), None)
    query = torch.randn(1, q_heads, 1, dim, generator=gen)

    def pages(bits: int, tokens: int):
        return page_segment(gen, bits, tokens, kv_heads, dim, rotation)

    cases = {f"{bits}-bit pages only": [hot, pages(bits, args.tokens)] for bits in (8, 4, 3, 2)}
    third = args.tokens // 3 // 64 * 64
    cases["ladder mix 8/4/3"] = [hot, pages(8, third), pages(4, third), pages(3, args.tokens - 2 * third)]
    cases["hot tier only"] = [hot]  # the dense read alone (c/mass_read.c's loops)
    print(f"one layer's read ({args.shape}): {q_heads} query heads, {kv_heads} KV heads, head dim {dim}, batch 1, "
          f"hot tier {args.hot} tokens {args.hot_dtype} + {args.tokens} tokens of packed pages"
          f"{' in a Hadamard rotation' if args.rotated else ''}; wall-clock median of {args.repeats} interleaved calls")
    print(f"{'case':<22}{'threads':>8}{'before ms':>11}{'after ms':>10}{'before/after':>14}{'max |diff|':>12}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, segments in cases.items():
            times = {"before": [], "after": []}
            outs = {}
            for _ in range(args.repeats):
                for label, lib in libs.items():
                    loader._state["lib"] = lib
                    began = time.perf_counter()
                    outs[label] = page_entry.page_read(query, segments, dim ** -0.5)[0]
                    times[label].append(time.perf_counter() - began)
            before, after = (1e3 * statistics.median(times[k]) for k in ("before", "after"))
            diff = float((outs["before"] - outs["after"]).abs().max())
            print(f"{name:<22}{threads:>8}{before:>11.3f}{after:>10.3f}{before / after:>13.2f}x{diff:>12.2e}")
    loader._state["lib"] = libs["after"]


if __name__ == "__main__":
    main()
