"""Is a llama.cpp q4_0 / q8_0 cache filled from a float16 prefill (``confkv bench --llamacpp-fill f16``) the
same cache, for a decode step, as one llama.cpp prefilled itself? Three sessions over the same text in one
process: ``native`` (llama.cpp's own prefill with the quantized cache, flash attention), ``f16-fill`` (a
float16 prefill converted to the block format and loaded) and ``f16`` (llama.cpp's float16 cache, for scale).
After prefilling each to ``--context`` tokens, each decodes the text's next ``--steps`` tokens, the sessions
interleaved step by step. Printed per context: the largest logit difference between ``f16-fill`` and
``native`` (and, for scale, between ``native`` and ``f16`` and between ``f16-fill`` and ``f16``), how often
their top tokens agree, and the median step time of each session with the ratio ``f16-fill / native``.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/llamacpp_fill_check.py --model smollm2 --context 2048 8192 \\
        --kv q4_0 --threads 2 --steps 24

Needs ``llama-cpp-python`` (``pip install "confkv[llamacpp]"``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np

import llama_cpp
from confkv.data import load_corpus
from confkv.eval.bench.llamacpp import gguf_source
from confkv.eval.bench.llamacpp_worker import LlamaSession


def logits(session: LlamaSession) -> np.ndarray:
    """The last evaluated token's logits (llama.cpp's own buffer, copied)."""
    pointer = llama_cpp.llama_get_logits_ith(session.llama.ctx, -1)
    return np.ctypeslib.as_array(pointer, shape=(session.llama.n_vocab(),)).astype(np.float64)


def check(gguf: str, text: str, context: int, kv: str, threads: int, steps: int, n_batch: int) -> None:
    n_ctx = context + steps + 8
    sessions = {"native": LlamaSession(llama_cpp, gguf, text, n_ctx, threads, n_batch, kv_type=kv),
                "f16-fill": LlamaSession(llama_cpp, gguf, text, n_ctx, threads, n_batch, kv_type=kv, fill="f16"),
                "f16": LlamaSession(llama_cpp, gguf, text, n_ctx, threads, n_batch)}
    for name, session in sessions.items():
        start = time.perf_counter()
        session.feed_to(context)
        print(f"[fill-check] {kv} context {context}: {name} prefilled in {time.perf_counter() - start:.1f} s",
              flush=True)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    fill_gap, f16_gap, fill_f16_gap, agree, agree_f16 = [], [], [], 0, 0
    for _ in range(steps):
        for name, session in sessions.items():
            times[name].append(session.step())
        native, filled, f16 = (logits(sessions[n]) for n in ("native", "f16-fill", "f16"))
        fill_gap.append(float(np.abs(filled - native).max()))
        f16_gap.append(float(np.abs(f16 - native).max()))
        fill_f16_gap.append(float(np.abs(filled - f16).max()))
        agree += int(filled.argmax() == native.argmax())
        agree_f16 += int(f16.argmax() == native.argmax())
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"[fill-check] {kv} context {context}, {steps} steps: max |logit f16-fill - native| "
          f"{max(fill_gap):.3f} (median over steps {statistics.median(fill_gap):.3f}); "
          f"max |logit f16 - native| {max(f16_gap):.3f} (median {statistics.median(f16_gap):.3f}); "
          f"max |logit f16-fill - f16| {max(fill_f16_gap):.3f} (median {statistics.median(fill_f16_gap):.3f}); "
          f"top token f16-fill = native at {agree} of {steps} steps (f16 = native at {agree_f16})", flush=True)
    print(f"[fill-check] {kv} context {context}: median step ms native {medians['native']:.2f}, "
          f"f16-fill {medians['f16-fill']:.2f}, f16 {medians['f16']:.2f}; "
          f"f16-fill / native {medians['f16-fill'] / medians['native']:.3f}", flush=True)
    for session in sessions.values():
        session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a bundled model name or a .gguf path")
    parser.add_argument("--context", type=int, nargs="+", default=[2048])
    parser.add_argument("--kv", choices=["q4_0", "q8_0"], default="q4_0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--corpus", default="pydoc-topics")
    args = parser.parse_args()
    source = gguf_source(args.model)
    if source is None:
        raise SystemExit(f"no GGUF file for {args.model!r}: name a bundled model or a .gguf path")
    text = load_corpus(args.corpus)
    with contextlib.ExitStack() as stack:
        gguf = str(stack.enter_context(source))
        for context in args.context:
            check(gguf, text, context, args.kv, args.threads, args.steps, args.n_batch)


if __name__ == "__main__":
    main()
