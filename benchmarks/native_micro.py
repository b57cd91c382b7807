"""Micro-benchmark: the native kernels (confkv.native) against the torch code they replace, on
SmolLM2-135M's decode shapes, interleaved in one process, at 1 and 2 torch threads (the native
kernels are single-threaded). Prints per-call medians (us) and torch / native.

- read: 1 query, 9 query heads over 3 KV heads, head dim 64, an old region of L - 128 slots and
  an FP window of 128, with the mass (confkv.attention.mass_read.mass_read vs confkv.native.mass_read);
- RMSNorm: [1, 1, 576] bfloat16 (transformers' LlamaRMSNorm module vs confkv.native.rms_norm);
- rotary: q [1, 9, 1, 64] and k [1, 3, 1, 64] bfloat16 (the lean decoder's torch lines vs confkv.native.rotary);
- INT8 GEMV: bfloat16 activations [M, K] times an int8 weight [N, K] with a per-row scale, on the
  SmolLM2 projection shapes (q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536, the LM head
  49152x576), M = 1 and 4 (torch._weight_int8pack_mm vs confkv.native.Int8Projection, prepared once
  as Int8Linear holds it; it splits N over torch's thread count); the last column is the native kernel's weight bytes per second;
- sweep: a decode step's 211 projections one after another, each with its own weight (135 MB);
- confidence: confkv.confidence on logits [1, 49152] bfloat16 with the native kernels off (the torch
  code) vs on (confkv.native.confidence_terms);
- w8a8: the "torch" column is the native W8A16 GEMV (Int8Projection), the "native" one the W8A8 GEMV
  (activation_bits=8: int8 activation blocks, VNNI), on the gate/up, down and LM head shapes, M = 1.

    nice -n 0 .venv/bin/python benchmarks/native_micro.py [--repeats 200] [--block 5] [--kernels gemv sweep] [--spin-us 50]

Ratios (torch / native) come from one process, interleaved in blocks of --block calls, so a loaded machine slows both sides alike;
the absolute times are only as quiet as the machine.
"""
import argparse
import statistics
import time

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from confkv import native
from confkv.attention import KVSegment
from confkv.attention.mass_read import mass_read
from confkv.hf.lean import _rotate_half


#: (name, N, K): SmolLM2-135M's projections, output features x input features
GEMV_SHAPES = [("q/o", 576, 576), ("k/v", 192, 576), ("gate/up", 1536, 576), ("down", 576, 1536),
               ("lm_head", 49152, 576)]


def gemv_cases():
    gen = torch.Generator().manual_seed(0)
    for label, n, k in GEMV_SHAPES:
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        scale = (torch.rand(n, generator=gen) / 100).to(torch.bfloat16)
        for rows in (1, 4):
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            projection = native.Int8Projection(weight, scale)  # prepared once, as Int8Linear does
            yield (f"gemv {label} {n}x{k} M={rows}", lambda x=x, w=weight, s=scale: torch._weight_int8pack_mm(x, w, s),
                   lambda x=x, p=projection: p(x), n * k)


def sweep_case():
    """One decode step's 211 projections (30 layers x q, k, v, o, gate, up, down + the LM head, each
    its own weight: 135 MB, far past the caches), M = 1, bfloat16."""
    gen = torch.Generator().manual_seed(1)
    layer = [GEMV_SHAPES[0], GEMV_SHAPES[1], GEMV_SHAPES[1], GEMV_SHAPES[0], GEMV_SHAPES[2], GEMV_SHAPES[2],
             GEMV_SHAPES[3]]
    shapes = [(n, k) for _ in range(30) for _, n, k in layer] + [GEMV_SHAPES[4][1:]]
    weights = [(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
                (torch.rand(n, generator=gen) / 100).to(torch.bfloat16)) for n, k in shapes]
    inputs = {k: torch.randn(1, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}

    projections = [native.Int8Projection(w, s) for w, s in weights]

    def run_torch():
        for w, s in weights:
            torch._weight_int8pack_mm(inputs[w.shape[1]], w, s)

    def run_native():
        for p in projections:
            p(inputs[p.inputs])

    yield "sweep: 211 projections, 135 MB", run_torch, run_native, sum(w.numel() for w, _ in weights)


def confidence_case():
    from confkv.confidence import confidence
    from confkv.native import loader

    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16) * 4

    def torch_code():
        with loader.disabled():
            return confidence(logits)

    yield "confidence V=49152 bf16", torch_code, lambda: confidence(logits), 0


def w8a8_cases():
    gen = torch.Generator().manual_seed(3)
    for label, n, k in (GEMV_SHAPES[2], GEMV_SHAPES[3], GEMV_SHAPES[4]):
        weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        scale = (torch.rand(n, generator=gen) / 100).to(torch.bfloat16)
        x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
        w8a16, w8a8 = native.Int8Projection(weight, scale), native.Int8Projection(weight, scale, activation_bits=8)
        yield (f"w8a16 vs w8a8 {label} {n}x{k}", lambda x=x, p=w8a16: p(x), lambda x=x, p=w8a8: p(x), n * k)


def cases(kernels):
    if "confidence" in kernels:
        yield from confidence_case()
    if "w8a8" in kernels:
        yield from w8a8_cases()
    if "sweep" in kernels:
        yield from sweep_case()
    if "gemv" in kernels:
        yield from gemv_cases()
    if not {"read", "rmsnorm", "rotary"} & set(kernels):
        return
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for length in (700, 1100):
            segs = [KVSegment(*(torch.randn(1, 3, n, 64, generator=gen).to(dtype) for _ in range(2)), None)
                    for n in (length - 128, 128)]
            q = torch.randn(1, 9, 1, 64, generator=gen).to(dtype)
            yield (f"read {str(dtype)[6:]} L={length}", lambda q=q, s=segs: mass_read(q, s, 0.125),
                   lambda q=q, s=segs: native.mass_read(q, s, 0.125), 0)
    norm = LlamaRMSNorm(576, 1e-5).to(torch.bfloat16)
    x = torch.randn(1, 1, 576, generator=gen).to(torch.bfloat16)
    yield "RMSNorm [1,1,576] bf16", lambda: norm(x), lambda: native.rms_norm(x, norm.weight, 1e-5), 0
    q, k = (torch.randn(1, 1, h, 64, generator=gen).to(torch.bfloat16) for h in (9, 3))  # [B, q, H, D]
    cos, sin = (torch.randn(1, 1, 64, generator=gen).to(torch.bfloat16) for _ in range(2))  # [B, q, D]

    def torch_rotary():
        query, key, c, s = q.transpose(1, 2), k.transpose(1, 2), cos[:, None], sin[:, None]
        return query * c + _rotate_half(query) * s, key * c + _rotate_half(key) * s

    yield "rotary q+k bf16", torch_rotary, lambda: native.rotary(q, k, cos, sin), 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--kernels", nargs="+", default=["read", "rmsnorm", "rotary", "gemv", "sweep"],
                        choices=["read", "rmsnorm", "rotary", "gemv", "sweep", "confidence", "w8a8"])
    parser.add_argument("--block", type=int, default=5, help="timed calls per side in a row")
    parser.add_argument("--spin-us", type=float, default=None,
                        help="the GEMV workers' spin before they sleep (default: the library's, 50 us)")
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("the native kernels are unavailable (see the warning above)")
    if args.spin_us is not None:
        native.gemv_settings(spin_us=args.spin_us)
    print(f"{'case':34s} {'threads':>7s} {'torch us':>9s} {'native us':>10s} {'ratio':>6s} {'native GB/s':>11s}")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, reference, fast, weight_bytes in cases(args.kernels):
            times = {"torch": [], "native": []}
            for _ in range(max(args.repeats // args.block, 3)):  # interleaved A/B, in blocks of calls
                for key, fn in (("torch", reference), ("native", fast)):
                    fn()  # the first call after a switch is not timed (the other side's threads still spin)
                    for _ in range(args.block):
                        start = time.perf_counter()
                        fn()
                        times[key].append(time.perf_counter() - start)
            med = {key: statistics.median(v) * 1e6 for key, v in times.items()}
            rate = f"{weight_bytes / med['native'] / 1e3:11.1f}" if weight_bytes else f"{'':11s}"
            print(f"{name:34s} {threads:7d} {med['torch']:9.1f} {med['native']:10.1f} "
                  f"{med['torch'] / med['native']:6.2f} {rate}", flush=True)


if __name__ == "__main__":
    main()
