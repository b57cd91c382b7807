"""What sealing a page costs in each page format: one layer's page encoded, timed interleaved (issue 31).

A step of the KIVI policy seals a page per layer once every ``page_size`` steps; the decode-step bench (``confkv
bench``) times a few steps and reports medians, so the seal's cost rarely shows there. This times it alone: one
page of SmolLM2-135M's layer (3 KV heads, head dim 64, 64 tokens, group 64; keys and values Gaussian, a few key
channels 4x wider, as benchmarks/page_format_read.py builds them) encoded by the format's own code
(``PageFormat.encode``), the specs called in turn for ``--repeats`` rounds. Each spec is ``BITS[/VALUE_BITS][:FORMAT]``
(``confkv bench --kivi``'s). Printed: the median ms a page, the median ratio to the first spec's time in the same
round, and the share of a decode step it comes to when every one of ``--layers`` layers seals a page every 64 steps
(``ms x layers / 64``)::

    PYTHONPATH=. python benchmarks/page_encode_time.py --specs 4 4/2:hadamard+outliers+clip --repeats 50
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from page_format_read import DIM, KV_HEADS, PAGE, gaussian_pages, spec_format  # benchmarks/, the script's folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", nargs="+", default=["4", "4/2:hadamard+outliers+clip"])
    parser.add_argument("--outlier-fraction", type=float, default=0.01)
    parser.add_argument("--layers", type=int, default=30, help="layers sealing a page together (SmolLM2: 30)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    page = gaussian_pages(1)
    formats = {spec: spec_format(spec, args.outlier_fraction) for spec in args.specs}
    for fmt in formats.values():  # warm up (and fit any codebook on the page)
        fmt.encode(*page)
    times: dict[str, list[float]] = {spec: [] for spec in args.specs}
    for _ in range(args.repeats):
        for spec, fmt in formats.items():
            start = time.perf_counter()
            fmt.encode(*page)
            times[spec].append(time.perf_counter() - start)
    first = times[args.specs[0]]
    print(f"{args.threads} thread(s), one page of {KV_HEADS} KV heads x {PAGE} tokens x {DIM}, {args.repeats} rounds; "
          f"a step's share: x {args.layers} layers / {PAGE} steps")
    for spec in args.specs:
        ms = statistics.median(times[spec]) * 1e3
        ratio = statistics.median(t / f for t, f in zip(times[spec], first))
        print(f"  {spec:32s} {ms:7.3f} ms a page   {ratio:6.2f}x {args.specs[0]}   "
              f"{ms * args.layers / PAGE:6.3f} ms a step")


if __name__ == "__main__":
    main()
