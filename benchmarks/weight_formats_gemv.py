"""The decode step's projections alone, per linear-weight format: every projection of a decoder (random weights of
a model's shapes, ``--layers`` layers) applied once to one bfloat16 token, the formats interleaved round by round;
medians per format, the bytes each reads (codes, scales, minima) and the rate, and the ratio to the first format.
The projections are all of a step's weight reads but the LM head's.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/weight_formats_gemv.py --shape qwen --threads 1 2 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from confkv.hf.weights import Int4Linear, Int8Linear

#: per model: (hidden, query width, key / value width, MLP width, layers)
SHAPES = {"qwen": (1536, 1536, 256, 8960, 28), "smollm2": (576, 576, 192, 1536, 30)}
FORMATS = {"w8": lambda lin: Int8Linear(lin, torch.bfloat16),
           "w8a8": lambda lin: Int8Linear(lin, torch.bfloat16, activation_bits=8),
           "w4a8": lambda lin: Int4Linear(lin, torch.bfloat16)}


def layer_shapes(shape: str) -> list[tuple[int, int]]:
    """(in, out) of one layer's seven projections: q, k, v, o, gate, up, down."""
    hidden, q, kv, mlp, _ = SHAPES[shape]
    return [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, mlp), (hidden, mlp), (mlp, hidden)]


def build(shape: str, layers: int, formats: list[str]) -> dict[str, list[nn.Module]]:
    gen = torch.Generator().manual_seed(0)
    built: dict[str, list[nn.Module]] = {name: [] for name in formats}
    for _ in range(layers):
        for inputs, outputs in layer_shapes(shape):
            linear = nn.Linear(inputs, outputs, bias=False)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(outputs, inputs, generator=gen) * inputs ** -0.5)
            for name in formats:
                built[name].append(FORMATS[name](linear))
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen")
    parser.add_argument("--layers", type=int, default=None, help="default: the model's")
    parser.add_argument("--formats", nargs="+", choices=sorted(FORMATS), default=["w8", "w8a8", "w4a8"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    layers = args.layers or SHAPES[args.shape][4]
    built = build(args.shape, layers, args.formats)
    nbytes = {name: sum(b.numel() * b.element_size() for m in mods for b in m.buffers()) for name, mods in built.items()}
    inputs = sorted({i for i, _ in layer_shapes(args.shape)})
    print(f"{args.shape}: {layers} layers x 7 projections, one bfloat16 token; median of {args.rounds} interleaved rounds")
    print(f"{'threads':>7} {'format':>6} {'MB read':>8} {'ms':>7} {'GB/s':>6} {'x ' + args.formats[0]:>8}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {name: [] for name in built}
        for _ in range(args.rounds + 1):  # the first round warms up
            x = {k: torch.randn(1, k).to(torch.bfloat16) for k in inputs}
            for name, mods in built.items():
                start = time.perf_counter()
                for m in mods:
                    m(x[m.in_features])
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t[1:]) for name, t in times.items()}
        first = medians[args.formats[0]]
        for name, seconds in medians.items():
            print(f"{threads:>7} {name:>6} {nbytes[name] / 1e6:>8.0f} {seconds * 1e3:>7.1f} "
                  f"{nbytes[name] / seconds / 1e9:>6.1f} {first / seconds:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
