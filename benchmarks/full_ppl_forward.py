"""Full-KV perplexity in chunked forward passes, the reference row of a long streaming-perplexity table.

``confkv ppl --policy full`` feeds one token a step, as every policy's run does; with nothing evicted, each
prediction sees every earlier token, which is what a forward pass over the text computes too (transformers'
``DynamicCache``, chunks of ``--chunk`` tokens). Only the kernels differ (a chunk's attention and matrix
products instead of a decode step's), so the per-token NLL agree to the model dtype's rounding, and the pass costs
an 8K prefill (minutes) instead of 8,191 decode steps (about an hour on one core for Qwen2.5-1.5B).

``--check FILE`` compares the result with a ``confkv ppl --policy full --out FILE`` run of the same text over its
tokens: the largest NLL difference and the perplexity ratio on that prefix, printed and saved, so the reference's
method is measured, not assumed. The output is ``confkv ppl --out``'s shape (``summary``, ``nll``, a ``trace`` with
no steps), its summary saying ``"method": "forward"``, for ``benchmarks/memory_ppl_table.py``.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/full_ppl_forward.py --model qwen2.5-coder-1.5b --dtype bfloat16 \\
        --corpus pydoc-topics --tokens 8192 --check results/qwen/ppl/pydoc-topics_full_2k.json \\
        --out results/qwen/ppl/pydoc-topics_full_8k_forward.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch


def forward_nll(model: torch.nn.Module, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """[N-1] float64 NLL of tokens 1..N-1 of ``ids`` [1, N] (logits in float32), the text fed ``chunk`` tokens a pass
    over a ``DynamicCache``."""
    from transformers import DynamicCache  # noqa: PLC0415

    cache = DynamicCache()
    steps = ids.shape[1] - 1
    nll = torch.empty(steps, dtype=torch.float64)
    with torch.no_grad():
        for start in range(0, steps, chunk):
            end = min(start + chunk, steps)
            logits = model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True).logits[0].float()
            targets = ids[0, start + 1:end + 1]
            nll[start:end] = (torch.logsumexp(logits, -1) - logits.gather(-1, targets[:, None])[:, 0]).double()
    return nll


def compare(nll: torch.Tensor, per_token: dict) -> dict:
    """How the forward pass's NLL agree with a per-token run's over the tokens both have."""
    other = torch.tensor(per_token["nll"], dtype=torch.float64)
    n = min(len(other), len(nll))
    diff = (nll[:n] - other[:n]).abs()
    ratio = math.exp(float(nll[:n].mean() - other[:n].mean()))
    return {"tokens": n, "max_abs_nll_diff": float(diff.max()), "mean_abs_nll_diff": float(diff.mean()),
            "ppl_forward": math.exp(float(nll[:n].mean())), "ppl_per_token": math.exp(float(other[:n].mean())),
            "ppl_ratio": ratio}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--corpus", default="pydoc-topics")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--check", type=Path, help="a `confkv ppl --policy full --out` JSON of the same text")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.chunk < 1:
        parser.error(f"--chunk must be >= 1, got {args.chunk}")
    check = json.loads(args.check.read_text()) if args.check else None
    if check is not None:
        s = check["summary"]
        if s.get("policy") != "full" or s.get("corpus") != args.corpus or s.get("dtype", "float32") != args.dtype:
            parser.error(f"--check {args.check}: a full-KV run of {s.get('corpus')!r} in {s.get('dtype')!r}, "
                         f"not of {args.corpus!r} in {args.dtype!r}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)

    from confkv.data import corpus_tokens  # noqa: PLC0415
    from confkv.eval.ray.grid import ModelSpec  # noqa: PLC0415
    from confkv.hf.generate import check_prompt_length  # noqa: PLC0415

    model, tokenizer = ModelSpec(args.model, args.dtype)()
    ids = corpus_tokens(tokenizer, args.corpus, args.tokens, offset=args.offset)
    check_prompt_length(model, ids.shape[1])
    began = time.perf_counter()
    nll = forward_nll(model, ids, args.chunk)
    seconds = time.perf_counter() - began
    summary = {"policy": "full", "params": {}, "method": "forward", "chunk": args.chunk, "tokens": int(nll.numel()),
               "ppl": math.exp(float(nll.mean())), "seconds": seconds, "model": args.model, "corpus": args.corpus,
               "dtype": args.dtype, "offset": args.offset}
    if check is not None:
        summary["check"] = {"file": str(args.check), **compare(nll, check)}
    args.out.write_text(json.dumps({"summary": summary, "interrupted": False, "trace": {"kv_bytes": []},
                                    "nll": nll.tolist()}) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
