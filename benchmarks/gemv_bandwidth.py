"""Read bandwidth of the native INT8 GEMV on one large weight (393,216 x 576 int8, 226 MB: out of every
cache), with bfloat16 activations (W8A16) and with int8 activation blocks (W8A8), against torch's int64 sum over
the same bytes, at 1 and 2 threads; the same weight in 4 bits (W4A8: its codes, scales and minima, 0.63 of the INT8
bytes); and the time of a SmolLM2-sized LM head (49,152 x 576). Medians of 15 calls.

    .venv/bin/python benchmarks/gemv_bandwidth.py
"""
import statistics
import time

import torch

from confkv import native
from confkv.hf.int4_blocks import pack_int4_blocks
from confkv.native.int4 import Int4Projection


def _median_seconds(call, repeats: int = 15) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    gen = torch.Generator().manual_seed(0)
    head = torch.randint(-127, 127, (49152, 576), dtype=torch.int8, generator=gen)
    big = torch.randint(-127, 127, (8 * 49152, 576), dtype=torch.int8, generator=gen)
    x = torch.randn(1, 576, generator=gen).to(torch.bfloat16)
    head_gemv = native.Int8Projection(head, torch.rand(head.shape[0], generator=gen).to(torch.bfloat16) + 0.5)
    big_scale = torch.rand(big.shape[0], generator=gen).to(torch.bfloat16) + 0.5
    big_gemv = native.Int8Projection(big, big_scale)
    big_a8 = native.Int8Projection(big, big_scale, None, activation_bits=8)
    words = big.view(torch.int64)
    codes, w4_scale, w4_minimum = pack_int4_blocks(torch.randn(big.shape, generator=gen))
    w4 = Int4Projection(codes, w4_scale, w4_minimum, None, torch.bfloat16, big.shape[1])
    w4_bytes = sum(t.numel() * t.element_size() for t in (codes, w4_scale, w4_minimum))
    for threads in (1, 2):
        torch.set_num_threads(threads)
        gemv = big.numel() / _median_seconds(lambda: big_gemv(x)) / 1e9
        a8 = big.numel() / _median_seconds(lambda: big_a8(x)) / 1e9
        four = w4_bytes / _median_seconds(lambda: w4(x)) / 1e9
        read = big.numel() / _median_seconds(lambda: words.sum()) / 1e9
        lm_head = _median_seconds(lambda: head_gemv(x)) * 1e3
        print(f"threads {threads}: INT8 GEMV {gemv:.1f} GB/s (W8A8 {a8:.1f}; W4A8 {four:.1f}); "
              f"torch int64 sum {read:.1f} GB/s; "
              f"LM head {lm_head:.2f} ms")


if __name__ == "__main__":
    main()
