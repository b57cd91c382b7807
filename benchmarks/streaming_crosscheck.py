"""Cross-check of the streaming loop: ``window``/``streaming`` streaming PPL vs one banded-mask pass.

A sliding window of N tokens kept after every step means the next token sees itself and
the previous N tokens; StreamingLLM with S sinks sees itself, the previous N - S tokens
and the first S. One forward pass with that banded causal mask (a custom 4D float mask,
SDPA, on a fresh model load) gives the same perplexity exactly; the streaming loop
through ``ConfKVCache`` must match it (the check uses 0.5%).

Usage (the recorded run, ~6 min on 2 CPU cores)::

    .venv/bin/python benchmarks/streaming_crosscheck.py --tokens 2048 --budget 512 \\
        --out results/streaming_crosscheck
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path

import torch


def banded_mask(n: int, band: int, sinks: int = 0) -> torch.Tensor:
    """[1, 1, n, n] float mask: query i sees key j iff j <= i and (i - j <= band or j < sinks)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    visible = (j <= i) & ((i - j <= band) | (j < sinks))
    return torch.zeros(n, n).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]


@torch.no_grad()
def banded_ppl(model, ids: torch.Tensor, band: int, sinks: int = 0) -> float:
    """Perplexity of ids[0, 1:] from one forward pass of ``ids`` [1, N] under :func:`banded_mask`.

    ``model`` must run a standard attention implementation (sdpa/eager), not confkv's.
    """
    logits = model(ids, attention_mask=banded_mask(ids.shape[1], band, sinks)).logits[0].float()
    nll = torch.logsumexp(logits[:-1], -1) - logits[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return math.exp(float(nll.double().mean()))


def crosscheck(reference_model, streaming_model, ids: torch.Tensor, budget: int, sinks: int = 4,
               progress: bool = False) -> list[dict]:
    """Both checks (window, streaming) on ``ids``; one dict per policy."""
    from confkv.eval.ppl import streaming_ppl  # noqa: PLC0415

    rows = []
    for policy, s in (("window", 0), ("streaming", sinks)):
        reference = banded_ppl(reference_model, ids, band=budget - s, sinks=s)
        params = {"budget": budget} if policy == "window" else {"budget": budget, "sinks": s}
        result = streaming_ppl(streaming_model, ids, policy, progress=progress, **params)
        rows.append({"policy": policy, "params": params, "tokens": int(ids.shape[1]),
                     "banded_reference_ppl": reference, "streaming_ppl": result.ppl,
                     "relative_difference": abs(result.ppl - reference) / reference,
                     "seconds": result.seconds})
    return rows


def main() -> None:
    from confkv.data import corpus_tokens  # noqa: PLC0415
    from confkv.models import load_model  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", default="pydoc-topics")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--out", default="results/streaming_crosscheck")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 is fastest on a shared 2-core machine: no oversubscription)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    reference_model, tokenizer = load_model(args.model)  # fresh load, default (sdpa) attention
    streaming_model, _ = load_model(args.model)          # a second copy, switched to confkv attention
    ids = corpus_tokens(tokenizer, args.corpus, args.tokens)
    start = time.time()
    rows = crosscheck(reference_model, streaming_model, ids, args.budget, args.sinks, progress=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"model": args.model, "corpus": args.corpus, "tokens": args.tokens, "budget": args.budget,
              "commit": commit, "torch_threads": torch.get_num_threads(), "seconds": time.time() - start, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# Streaming loop vs banded-mask forward pass",
        "",
        f"Command: `.venv/bin/python benchmarks/streaming_crosscheck.py --tokens {args.tokens} --budget {args.budget} "
        f"--out {args.out}` (commit {commit}).",
        "",
        f"SmolLM2-135M ({args.model}), first {args.tokens} tokens of `{args.corpus}`, fp32, CPU. Reference: one forward "
        "pass on a fresh model load (SDPA) with a 4D float mask in which token i sees token j iff j <= i and "
        "(i - j <= N - S or j < S); streaming: token-by-token through `ConfKVCache`.",
        "",
        "| policy | N | sinks S | banded reference PPL | streaming PPL | relative difference |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['params']['budget']} | {r['params'].get('sinks', 0)} | "
                     f"{r['banded_reference_ppl']:.4f} | {r['streaming_ppl']:.4f} | {r['relative_difference']:.2e} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
