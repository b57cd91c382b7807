"""Where prefill time goes on this CPU: the kernels a prefill chunk could use, in GFLOP/s, one run.

Issue 35 asks prefill to be as fast as the machine allows (it is most of a long grid's time). This prints, for
one prefill chunk's shapes (``--model``'s projection and attention sizes, ``--chunk`` queries, ``--context`` keys),
the throughput of each candidate kernel, measured in one process (best of ``--repeats``), then (``--prefill N``)
a real chunked prefill of N tokens under ``memory=0.25`` and full KV with the attention read's share of it::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/prefill_kernels.py --model qwen2.5-coder-1.5b --prefill 2048

Kernels: a projection ([chunk, hidden] x [hidden, intermediate]) in bfloat16 (torch / oneDNN), float32, with
INT8 weights (``torch._weight_int8pack_mm``, the prefill path of ``--dtype bfloat16-w8``) and int8 x int8
(``torch._int_mm``, what a W8A8 prefill could use); the attention read of one chunk (GQA, causal mask on the
chunk) by the block-wise float32 read (confkv's prefill read before stop 46), by the native prefill read
(confkv/native/c/prefill.c, the read plan's ``native_prefill``: bfloat16 products by ``vdpbf16ps``, float32 sums)
and by torch's fused CPU flash kernel with the mask. ``--prefill`` times each cache twice in one process: with the
native prefill read and without it (the plan's choice before it existed), so their ratio is one run's.
"""

from __future__ import annotations

import argparse
import time

import torch

from confkv.attention import read_plan
from confkv.attention.blockwise import blockwise_attention
from confkv.attention.segments import KVSegment
from confkv.native import prefill as native_prefill
from confkv.native.loader import library

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def projection_rows(chunk: int, hidden: int, inner: int, repeats: int) -> list[tuple[str, float]]:
    """(kernel, GFLOP/s) of one [chunk, hidden] x [hidden, inner] projection."""
    x, w = torch.randn(chunk, hidden).bfloat16(), torch.randn(inner, hidden).bfloat16()
    w8 = torch.randint(-127, 128, (inner, hidden), dtype=torch.int8)
    scale = torch.rand(inner).bfloat16()
    x8, w8t = torch.randint(-127, 128, (chunk, hidden), dtype=torch.int8), w8.t().contiguous()
    xf, wf = x.float(), w.float()
    flop = 2 * chunk * hidden * inner
    kernels = [("bfloat16 (torch.nn.functional.linear)", lambda: torch.nn.functional.linear(x, w)),
               ("float32", lambda: torch.nn.functional.linear(xf, wf)),
               ("INT8 weights (_weight_int8pack_mm)", lambda: torch._weight_int8pack_mm(x, w8, scale)),
               ("int8 x int8 (_int_mm)", lambda: torch._int_mm(x8, w8t))]
    return [(name, flop / best_seconds(fn, repeats) / 1e9) for name, fn in kernels]


def attention_reads(chunk: int, context: int, kv_heads: int, group: int, head_dim: int) -> dict:
    """{read: a function returning its output [1, Hq, chunk, D]} for one chunk of ``chunk`` queries over ``context``
    keys, the chunk's own keys causal (the same random operands for every read)."""
    query = torch.randn(1, kv_heads * group, chunk, head_dim).bfloat16()
    keys, values = torch.randn(1, kv_heads, context, head_dim).bfloat16(), torch.randn(1, kv_heads, context, head_dim).bfloat16()
    visible = (torch.arange(context)[None, :] <= torch.arange(context - chunk, context)[:, None])[None, None]
    scaling = head_dim ** -0.5
    segments = [KVSegment(keys, values, visible)]
    reads = {"block-wise float32 read, mass": lambda: blockwise_attention(query, segments, scaling, need_mass=True)[0],
             "block-wise float32 read, no mass": lambda: blockwise_attention(query, segments, scaling, need_mass=False)[0]}
    if library() is not None:
        reads["native prefill read, mass"] = lambda: native_prefill.prefill_read(query, segments, scaling, True)[0]
        reads["native prefill read, no mass"] = lambda: native_prefill.prefill_read(query, segments, scaling, False)[0]
    if _FLASH is not None:
        additive = torch.zeros(visible.shape, dtype=query.dtype).masked_fill(~visible, float("-inf"))
        additive = additive.expand(1, kv_heads, chunk, context).unsqueeze(2).expand(
            1, kv_heads, group, chunk, context).reshape(1, kv_heads, group * chunk, context)
        grouped = query.reshape(1, kv_heads, group * chunk, head_dim)
        reads["torch's fused CPU flash kernel, masked, no mass"] = lambda: _FLASH(
            grouped, keys, values, 0.0, False, attn_mask=additive, scale=scaling)[0].reshape(query.shape)
    return reads


def attention_rows(chunk: int, context: int, kv_heads: int, group: int, head_dim: int,
                   repeats: int) -> list[tuple[str, float]]:
    """(read, GFLOP/s) of each of :func:`attention_reads`."""
    flop = 4 * kv_heads * group * chunk * context * head_dim
    reads = attention_reads(chunk, context, kv_heads, group, head_dim)
    return [(name, flop / best_seconds(fn, repeats) / 1e9) for name, fn in reads.items()]


def prefill_split(model_name: str, tokens: int, chunk: int) -> list[tuple[str, float, float]]:
    """(cache and read, seconds, attention read seconds) of a chunked prefill of ``tokens`` random tokens, each cache
    with the native prefill read and without it (``read_plan``'s ``native_prefill`` turned down), in one process."""
    from confkv import profiling  # noqa: PLC0415
    from confkv.hf import ConfKVCache, prefill  # noqa: PLC0415
    from confkv.models import load_model  # noqa: PLC0415

    model, _ = load_model(model_name, dtype=torch.bfloat16)
    ids = torch.randint(0, 30000, (1, tokens), generator=torch.Generator().manual_seed(0))
    out = []
    eligible = native_prefill.eligible
    for label, make in (("full", lambda: ConfKVCache.for_model(model, "full")),
                        ("memory=0.25", lambda: ConfKVCache.for_model(model, memory=0.25))):
        for read, allowed in (("native prefill read", eligible), ("without it", lambda *args: False)):
            read_plan.native_prefill.eligible = allowed
            try:
                cache, timers = make(), profiling.Timers()
                began = time.perf_counter()
                with torch.no_grad(), profiling.enabled(timers):
                    prefill(model, cache, ids, chunk=chunk)
                out.append((f"{label}, {read}", time.perf_counter() - began, timers.seconds.get("attention read", 0.0)))
            finally:
                read_plan.native_prefill.eligible = eligible
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="sizes: qwen2.5-coder-1.5b or smollm2")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=0, help="also time a real prefill of this many tokens")
    args = parser.parse_args()
    sizes = {"qwen2.5-coder-1.5b": (1536, 8960, 2, 6, 128), "smollm2": (576, 1536, 3, 3, 64)}
    if args.model not in sizes:
        raise SystemExit(f"--model: one of {sorted(sizes)}, got {args.model!r}")
    hidden, inner, kv_heads, group, head_dim = sizes[args.model]
    print(f"{args.model}: {torch.get_num_threads()} thread(s), chunk {args.chunk}, context {args.context}")
    for name, rate in projection_rows(args.chunk, hidden, inner, args.repeats):
        print(f"  projection  {name:48s} {rate:7.1f} GFLOP/s")
    for name, rate in attention_rows(args.chunk, args.context, kv_heads, group, head_dim, args.repeats):
        print(f"  attention   {name:48s} {rate:7.1f} GFLOP/s")
    if args.prefill:
        for label, seconds, read in prefill_split(args.model, args.prefill, args.chunk):
            print(f"  prefill of {args.prefill} tokens, {label:33s} {seconds:6.1f} s ({args.prefill / seconds:5.1f} tok/s), "
                  f"attention read {read:5.1f} s ({100 * read / seconds:.0f}%)")


if __name__ == "__main__":
    main()
