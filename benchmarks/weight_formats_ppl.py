"""Perplexity of the linear-weight formats (``--dtype`` of ``confkv bench``) on the same tokens: streaming, one
token a step through the full cache, so that the decode GEMV each format uses is what is measured (its prefill-free
per-token path). Prints a Markdown table (ratio to the first dtype given) and writes the records as JSON.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python benchmarks/weight_formats_ppl.py --model smollm2 \\
        --corpus pydoc-topics stdlib-docs --tokens 2048 --dtypes bfloat16 bfloat16-w8 bfloat16-w4a8 \\
        --out results/bench/w4a8/ppl_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from confkv.data import corpus_tokens
from confkv.eval.bench.dtypes import DTYPES, models_by_dtype
from confkv.eval.quality.ppl import streaming_ppl
from confkv.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", nargs="+", default=["pydoc-topics"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "bfloat16-w8", "bfloat16-w4a8"],
                        choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    records = json.loads(args.out.read_text()) if args.out.exists() else []
    done = {(r["corpus"], r["dtype"]) for r in records}
    models, tokenizer = models_by_dtype(args.dtypes, args.model, None, None, load_model)
    for corpus in args.corpus:
        ids = corpus_tokens(tokenizer, corpus, args.tokens)
        for dtype in args.dtypes:
            if (corpus, dtype) in done:
                continue
            start = time.perf_counter()
            result = streaming_ppl(models[dtype], ids, "full", progress=False)
            records.append({"model": args.model, "corpus": corpus, "dtype": dtype, "tokens": result.tokens,
                            "ppl": result.ppl, "seconds": time.perf_counter() - start})
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(records, indent=1))  # resumable: a rerun computes only what is missing
            print(f"{corpus} {dtype}: {result.ppl:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    base = args.dtypes[0]
    print(f"\n| text ({args.model}, {args.tokens} tokens, streaming, full cache) | "
          + " | ".join(args.dtypes) + " |")
    print("|---|" + "---:|" * len(args.dtypes))
    for corpus in args.corpus:
        ppl = {r["dtype"]: r["ppl"] for r in records if r["corpus"] == corpus}
        cells = [f"{ppl[d]:.4f}" + ("" if d == base else f" ({ppl[d] / ppl[base] - 1:+.2%})") for d in args.dtypes]
        print(f"| {corpus} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
