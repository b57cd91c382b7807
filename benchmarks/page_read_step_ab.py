"""A/B of the native page read inside the memory preset's whole decode step: one process, one cache, the page read
served by this checkout's kernels or by another source tree's (e.g. an earlier commit's ``confkv/native``) in
interleaved blocks of steps; every other kernel is this checkout's. Prints the median step of each and their ratio.

The cache is the preset (``memory=0.25``) through the lean decoder with INT8 weights (W8A8), prefilled with ``N``
random tokens; both variants step the same cache in turn, fed the same kind of random tokens, so the store's state
grows alike for both. Wall clock; the ratio is the figure (the machine's load moves both alike).

    mkdir -p /tmp/before/c && git show <commit>:confkv/native/kernels.c > /tmp/before/kernels.c && \\
      for f in $(git ls-tree --name-only <commit> confkv/native/c/); do git show <commit>:$f > /tmp/before/c/$(basename $f); done
    OMP_NUM_THREADS=2 python benchmarks/page_read_step_ab.py 8192 --before /tmp/before --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from page_read_ab import build_from  # noqa: E402
from preset_step_profile import prefilled_preset  # noqa: E402

from confkv.native import loader  # noqa: E402
from confkv.native import pages as native_pages  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int, help="prefill length")
    parser.add_argument("--before", type=Path, required=True, help="a directory holding kernels.c and c/")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8, help="blocks of steps per variant")
    parser.add_argument("--steps", type=int, default=6, help="steps a block (the first one of each block not timed)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    libraries = {"before": build_from(args.before), "after": loader.library()}
    serving = {"lib": libraries["after"]}
    own_read = native_pages._read

    def switched_read(lib, *rest):  # PageReader calls the module's _read at each step: the page read's library here
        return own_read(serving["lib"], *rest)

    native_pages._read = switched_read
    decoder, cache, ids, position = prefilled_preset(args.model, args.tokens, 2 * args.blocks * args.steps, warm=4)
    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(args.blocks):
        for name in ("before", "after"):
            serving["lib"] = libraries[name]
            for step in range(args.steps):
                began = time.perf_counter()
                decoder(ids[:, position:position + 1], cache)
                if step:  # the first step of a block warms the other library's code
                    times[name].append(1e3 * (time.perf_counter() - began))
                position += 1
    native_pages._read = own_read
    before, after = (statistics.median(times[k]) for k in ("before", "after"))
    print(f"{args.model}, the preset (memory=0.25) through the lean decoder, W8A8, {args.tokens} tokens prefilled, "
          f"{args.threads} thread(s); {args.blocks} interleaved blocks of {args.steps - 1} timed steps each")
    print(f"median step ms: page read of {args.before}: {before:.2f}; this checkout's: {after:.2f}; "
          f"before / after {before / after:.3f}x")


if __name__ == "__main__":
    main()
