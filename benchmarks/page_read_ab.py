"""A/B timing of the native packed-page read: this checkout's kernels against another source tree's (e.g. an
earlier commit's ``confkv/native``), both loaded in one process and called interleaved on the same read.

The read: SmolLM2-135M's layer (9 query heads, 3 KV heads, head dim 64), batch 1, one query, a hot tier of
``--hot`` float32 tokens plus ``--tokens`` tokens of sealed pages (64 a page, group 64) at each bit width alone
and as the ladder's mix (a third each at 8, 4 and 3 bits), as ``benchmarks/native_page_read.py`` builds it.
Wall-clock medians over ``--repeats`` interleaved calls at each of ``--threads``; the ratio is the figure.

    git worktree add /tmp/before <commit>    # or any directory holding kernels.c and c/
    python benchmarks/page_read_ab.py --before /tmp/before/confkv/native --threads 1 2 --repeats 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from native_page_read import DIM, KV_HEADS, page_segment  # noqa: E402

from confkv.attention.segments import KVSegment  # noqa: E402
from confkv.native import loader  # noqa: E402
from confkv.native import pages as native_pages  # noqa: E402


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
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    libs = {"before": build_from(args.before), "after": loader.library()}
    gen = torch.Generator().manual_seed(0)
    hot = KVSegment(torch.randn(1, KV_HEADS, args.hot, DIM, generator=gen),
                    torch.randn(1, KV_HEADS, args.hot, DIM, generator=gen), None)
    query = torch.randn(1, 9, 1, DIM, generator=gen)
    cases = {f"{bits}-bit pages only": [hot, page_segment(gen, bits, args.tokens)] for bits in (8, 4, 3, 2)}
    third = args.tokens // 3 // 64 * 64
    cases["ladder mix 8/4/3"] = [hot, page_segment(gen, 8, third), page_segment(gen, 4, third),
                                 page_segment(gen, 3, args.tokens - 2 * third)]
    print(f"one layer's read: 9 query heads, {KV_HEADS} KV heads, head dim {DIM}, batch 1, hot tier {args.hot} "
          f"tokens fp32 + {args.tokens} tokens of packed pages; wall-clock median of {args.repeats} interleaved calls")
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
                    outs[label] = native_pages.page_read(query, segments, DIM ** -0.5)[0]
                    times[label].append(time.perf_counter() - began)
            before, after = (1e3 * statistics.median(times[k]) for k in ("before", "after"))
            diff = float((outs["before"] - outs["after"]).abs().max())
            print(f"{name:<22}{threads:>8}{before:>11.3f}{after:>10.3f}{before / after:>13.2f}x{diff:>12.2e}")
    loader._state["lib"] = libs["after"]


if __name__ == "__main__":
    main()
