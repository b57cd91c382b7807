"""The encode of one ``channel_bits`` page, its first stage worked out against stop 68's bisection, interleaved.

One page of SmolLM2's shape (3 KV heads x 64 tokens x 64 channels, keys with channels of spreads 0.1-5), format
``hadamard+channel_bits`` at 2 bits, 1 thread: ``PageFormat.encode`` with :func:`confkv.tiers.channel_bits.lagrangian_widths`
(the least fitting multiplier worked out from the widths' slopes) and with the 40-step bisection it replaced
(``tests/tiers/test_channel_bits.py``'s ``_bisected_widths``, which the tests hold it equal to), alternating, the
medians and the median of the per-round ratios printed::

    PYTHONPATH=. .venv/bin/python benchmarks/channel_bits_encode_ab.py --rounds 60
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

from confkv.tiers import channel_bits
from confkv.tiers.formats import build_format

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "tiers"))
from test_channel_bits import _bisected_widths  # noqa: E402  (the test's oracle, stop 68's first stage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 3, 1, 64, 64, generator=gen) * torch.linspace(0.1, 5, 64)
    values = torch.randn(1, 3, 1, 64, 64, generator=gen)
    valid = torch.ones(1, 3, 1, 64, dtype=torch.bool)
    fmt = build_format(2, 64, 64, torch.bfloat16, "hadamard+channel_bits")
    worked_out = channel_bits.lagrangian_widths
    stages = {"worked out": worked_out, "bisected (stop 68)": lambda e, b: _bisected_widths(e, b, 40)}
    times: dict[str, list[float]] = {name: [] for name in stages}
    try:
        for _ in range(args.rounds):
            for name, stage in stages.items():
                channel_bits.lagrangian_widths = stage
                start = time.perf_counter()
                fmt.encode(keys, values, valid, None)
                times[name].append(time.perf_counter() - start)
    finally:
        channel_bits.lagrangian_widths = worked_out
    for name, spans in times.items():
        print(f"{name:20s} {statistics.median(spans) * 1e3:6.2f} ms a page (3 KV heads)")
    first, second = times.values()
    print(f"ratio {statistics.median(a / b for a, b in zip(first, second)):.2f}")


if __name__ == "__main__":
    main()
