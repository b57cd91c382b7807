"""The fused native layer calls alone: SmolLM2-135M in bfloat16 with INT8 weights, the 30 layers' two calls
(norm + q/k/v + rotary; o + norm + MLP) on a fixed input, no store. Prints ms per pass over the 30 layers
(best and median of 5 x 20 passes) for the q/k/v calls alone (their 17 MB of weights may stay in the
last-level cache), the MLP calls alone, and both interleaved as in a decode step (106 MB from memory):
the weights' streaming rate without the rest of the step. Used for A/B runs of kernels.c's GEMV settings
(run the variants alternately; this machine's bandwidth drifts by 2x within minutes).

    .venv/bin/python benchmarks/native_layer_loop.py [--threads 2] [--activation-bits 16|8]
"""
import argparse
import timeit

import torch

from confkv.hf.lean import LeanDecoder
from confkv.hf.weights import quantize_linear_weights
from confkv.models import load_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--activation-bits", type=int, default=16, choices=(16, 8),
                        help="16: weight-only INT8 (W8A16); 8: int8 activation blocks too (W8A8)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model("smollm2", dtype=torch.bfloat16)
    quantize_linear_weights(model, activation_bits=args.activation_bits)
    hidden = torch.randn(1, 1, 576).bfloat16()
    fused = LeanDecoder(model)._fused_layers(hidden)
    if fused is None:
        raise SystemExit("the fused native layer calls are unavailable (native kernels off or no INT8 weights)")
    kernels = [entry[0] for entry in fused]
    cos, sin = torch.randn(1, 1, 64).bfloat16(), torch.randn(1, 1, 64).bfloat16()
    attention = torch.randn(1, 1, 576).bfloat16()

    def qkv():
        for k in kernels:
            k.attention_inputs(hidden, cos, sin)

    def mlp():
        for k in kernels:
            k.mlp(attention, hidden)

    def both():
        for k in kernels:
            k.attention_inputs(hidden, cos, sin)
            k.mlp(attention, hidden)

    for label, fn in (("q/k/v calls x30", qkv), ("MLP calls x30", mlp), ("both, interleaved x30", both)):
        fn()
        times = sorted(timeit.timeit(fn, number=20) / 20 * 1e3 for _ in range(5))
        print(f"threads {args.threads}: {label}: {times[0]:.2f} ms (median {times[2]:.2f})")


if __name__ == "__main__":
    main()
