"""An endless stream under a byte cap: ``max_kv_bytes`` held at the end of every step, over tens of thousands
of tokens (issue "ask for memory, get the best cache", "Endless stream").

Feeds a text token by token through a cache built with ``ConfKVCache.for_model(model, preset,
max_kv_bytes=N)`` and records, at every step: the cache's exact bytes (``kv_bytes()``), the cap,
and the tokens held on each rung of the cold ladder (all layers, summed), plus the hot tokens.
The trace is drained after every step (a stream that never ends must not grow its trace).
Writes ``stream.json`` (the per-step arrays and a summary), ``stream.png`` (bytes against step,
and tokens per bit width against step) and exits 1 if any step's bytes exceeded the cap.

Usage (the recorded run, ``results/memory/stream/``)::

    OMP_NUM_THREADS=1 .venv/bin/python -m confkv.eval.quality.stream --model gemma3-270m --tokens 32000 \\
        --max-kv-bytes 12000000 --out results/memory/stream
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _text_ids(tokenizer, corpora: list[str], tokens: int) -> torch.Tensor:
    """[1, tokens] from the corpora, one after another (each tokenized whole)."""
    from confkv.data import load_corpus

    parts, have = [], 0
    for name in corpora:
        ids = tokenizer(load_corpus(name), add_special_tokens=False, return_tensors="pt").input_ids
        parts.append(ids)
        have += ids.shape[1]
        if have >= tokens:
            break
    ids = torch.cat(parts, dim=1)
    if ids.shape[1] < tokens:
        raise SystemExit(f"the corpora {corpora} hold {ids.shape[1]} tokens; ask for at most that many")
    return ids[:, :tokens]


def run_stream(model, tokenizer, *, tokens: int, max_kv_bytes: int, preset: str = "tiered",
               corpora: tuple[str, ...] = ("pydoc-topics", "stdlib-docs", "idle-docs"), progress: bool = True,
               **params) -> dict:
    """Stream ``tokens`` tokens; per-step arrays (bytes, cap, hot tokens, tokens per rung) and a summary."""
    from confkv.hf import ConfKVCache
    from confkv.progress import progress as show_progress

    ids = _text_ids(tokenizer, list(corpora), tokens)
    cache = ConfKVCache.for_model(model, preset, max_kv_bytes=max_kv_bytes, trace_limit=1, **params)
    ladder = cache.storage.ladder
    kv = np.zeros(tokens, dtype=np.int64)
    hot = np.zeros(tokens, dtype=np.int64)
    rungs = np.zeros((tokens, len(ladder)), dtype=np.int64)
    nll = np.zeros(tokens - 1, dtype=np.float64)
    started = time.perf_counter()
    with torch.no_grad():
        for t in show_progress(range(tokens), desc=f"stream {preset}", enabled=progress):
            logits = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1].float()
            if t + 1 < tokens:
                nll[t] = float(torch.logsumexp(logits, -1) - logits[ids[0, t + 1]])
            step = cache.trace.steps[-1]
            kv[t] = int(step.kv_bytes.sum())
            hot[t] = int(sum(int(layer.store.kept_counts().sum()) for i, layer in enumerate(cache.layers)
                             if i in cache.managed))
            rungs[t] = step.rung_tokens if step.rung_tokens else 0
    seconds = time.perf_counter() - started
    over = int((kv > max_kv_bytes).sum())
    per_k = [float(np.exp(nll[i:i + 1000].mean())) for i in range(0, len(nll), 1000)]
    return {"summary": {"tokens": tokens, "max_kv_bytes": max_kv_bytes, "preset": preset, "params": params,
                        "ladder": list(ladder), "steps_over_cap": over, "peak_kv_bytes": int(kv.max()),
                        "final_kv_bytes": int(kv[-1]), "seconds": seconds, "ppl_per_1k_tokens": per_k,
                        "managed_layers": len(cache.managed), "layers": len(cache.layers)},
            "kv_bytes": kv.tolist(), "hot_tokens": hot.tolist(), "rung_tokens": rungs.tolist()}


def plot_stream(data: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data["summary"]
    steps = np.arange(1, len(data["kv_bytes"]) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    top.plot(steps, np.array(data["kv_bytes"]) / 1e6, lw=1, label="KV bytes held (all layers, all tiers)")
    top.axhline(summary["max_kv_bytes"] / 1e6, color="red", ls="--", lw=1, label="max_kv_bytes")
    top.set_ylabel("MB")
    top.legend(loc="lower right")
    top.set_title(f"{summary['preset']} under max_kv_bytes={summary['max_kv_bytes']:,} "
                  f"({summary['steps_over_cap']} steps over the cap)")
    rungs = np.array(data["rung_tokens"])
    bottom.plot(steps, np.array(data["hot_tokens"]), lw=1, label="hot (model dtype)")
    for j, bits in enumerate(summary["ladder"]):
        bottom.plot(steps, rungs[:, j], lw=1, label=f"{bits}-bit pages" + (" (+ open page)" if j == 0 else ""))
    bottom.set_ylabel("tokens held (managed layers, summed)")
    bottom.set_xlabel("step (tokens fed)")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--tokens", type=int, default=32000)
    parser.add_argument("--max-kv-bytes", type=int, required=True)
    parser.add_argument("--preset", default="tiered")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("results/memory/stream"))
    args = parser.parse_args(argv)
    from confkv.models import load_model

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    data = run_stream(model, tokenizer, tokens=args.tokens, max_kv_bytes=args.max_kv_bytes, preset=args.preset,
                      progress=not args.no_progress)
    data["summary"]["command"] = "python -m confkv.eval.quality.stream " + " ".join(argv if argv is not None else sys.argv[1:])
    data["summary"]["model"], data["summary"]["dtype"] = args.model, args.dtype
    (args.out / "stream.json").write_text(json.dumps(data))
    plot_stream(data, args.out / "stream.png")
    print(json.dumps(data["summary"], indent=1))
    return 0 if data["summary"]["steps_over_cap"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
