"""INT8 store vs full precision, no eviction, on the real model (issue 3).

Runs the full-precision confkv cache and the INT8 one (FP window W) side by side,
token by token over the same text, and reports streaming perplexity of both, the
mean per-token KL(full || int8) of the next-token distributions, and the KV bytes.

    .venv/bin/python -m confkv.eval.quality.int8 --tokens 2048 --fp-window 128 --out results/int8_quality

``--render-only`` rewrites the ``.md`` from the ``.json`` without running the model.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

from confkv import StoreConfig
from confkv.data import corpus_tokens
from confkv.hf import ConfKVCache
from confkv.models import load_model
from confkv.progress import progress
from confkv.quant import channel_scale_bytes, fp_bytes_per_token, int8_bytes_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", default="pydoc-topics")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--fp-window", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("results/int8_quality"))
    parser.add_argument("--render-only", action="store_true", help="rewrite OUT.md from OUT.json (no model run)")
    args = parser.parse_args()
    if args.render_only:
        result = json.loads(Path(f"{args.out}.json").read_text())
        if any(key not in result for key in DESCRIPTION):  # a record from before these fields: describe the model
            model, _ = load_model(result["model"])
            result = {**describe(model), **result}
            Path(f"{args.out}.json").write_text(json.dumps(result, indent=2))
        page = render(result)
        Path(f"{args.out}.md").write_text(page)
        print(page, end="")
        return

    model, tokenizer = load_model(args.model)
    ids = corpus_tokens(tokenizer, args.corpus, args.tokens)
    fp_cache = ConfKVCache.for_model(model, "full")
    int8_cache = ConfKVCache.for_model(model, "full", store=StoreConfig(kv_int8=True, fp_window=args.fp_window))
    nll = {"fp": [], "int8": []}
    kl = []
    start = time.perf_counter()
    with torch.no_grad():
        for t in progress(range(ids.shape[1] - 1), desc="fp vs int8"):
            step = ids[:, t:t + 1]
            logp_fp = model(step, cache=fp_cache, use_cache=True).logits[0, -1].float().log_softmax(-1)
            logp_q = model(step, cache=int8_cache, use_cache=True).logits[0, -1].float().log_softmax(-1)
            target = ids[0, t + 1]
            nll["fp"].append(-float(logp_fp[target]))
            nll["int8"].append(-float(logp_q[target]))
            kl.append(float((logp_fp.exp() * (logp_fp - logp_q)).sum()))
    seconds = time.perf_counter() - start

    from confkv.hf.support import text_config  # noqa: PLC0415

    config = text_config(model.config)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    parameter = next(model.parameters())
    dtype = parameter.dtype
    n = ids.shape[1] - 1
    fp_bytes, int8_bytes = fp_cache.kv_bytes(), int8_cache.kv_bytes()
    stores = [layer.store for layer in int8_cache.layers]
    # each layer on its own: a sliding-window layer (Gemma-3) stays in full precision
    expected_int8 = sum(s.old.length * (int8_bytes_per_token(heads, dim) if s.int8 else fp_bytes_per_token(heads, dim, dtype))
                        + s.recent.length * fp_bytes_per_token(heads, dim, dtype)
                        + (channel_scale_bytes(heads, dim) if s.channel_scale is not None else 0) for s in stores)
    managed = stores[int8_cache.managed[0]]
    ppl_fp, ppl_q = math.exp(sum(nll["fp"]) / n), math.exp(sum(nll["int8"]) / n)
    result = {
        "command": " ".join([".venv/bin/python -m confkv.eval.quality.int8", *(shlex.quote(a) for a in sys.argv[1:])]),
        "model": args.model, **describe(model), "corpus": args.corpus, "tokens": n, "fp_window": args.fp_window,
        "ppl_fp": ppl_fp, "ppl_int8": ppl_q, "ppl_rise_percent": 100 * (ppl_q / ppl_fp - 1),
        "mean_kl_full_int8": sum(kl) / n, "max_kl_full_int8": max(kl),
        "kv_bytes_fp": fp_bytes, "kv_bytes_int8": int8_bytes, "kv_bytes_int8_expected": expected_int8,
        "bytes_ratio_fp_over_int8": fp_bytes / int8_bytes,
        "int8_tokens_per_layer": managed.old.length, "fp_tokens_per_layer": managed.recent.length,
        "bytes_per_token_layer": {"fp32": fp_bytes_per_token(heads, dim, torch.float32),
                                  "fp16": fp_bytes_per_token(heads, dim, torch.float16),
                                  "int8_with_scales": int8_bytes_per_token(heads, dim)},
        "seconds": seconds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=2))
    page = render(result)
    Path(f"{args.out}.md").write_text(page)
    print(page, end="")


DESCRIPTION = ("architecture", "layers", "int8_layers", "dtype", "device")


def describe(model: torch.nn.Module) -> dict:
    """The model facts the page states: class, layers, layers an INT8 store quantizes, dtype, device."""
    from confkv.hf.support import layer_layout  # noqa: PLC0415

    layout = layer_layout(model.config)
    parameter = next(model.parameters())
    return {"architecture": type(model).__name__, "layers": len(layout.sliding_windows),
            "int8_layers": len(layout.managed), "dtype": str(parameter.dtype).removeprefix("torch."),
            "device": parameter.device.type}


def render(result: dict) -> str:
    """The Markdown page of one run (``result`` as written to the ``.json``)."""
    per_token = result["bytes_per_token_layer"]
    dtype, device = result.get("dtype", "dtype not recorded"), result.get("device", "device not recorded")
    lines = [
        "# INT8 KV store vs full precision (no eviction)", "",
        f"Command: `{result['command']}`", "",
        f"Model `{result['model']}` ({result.get('architecture', 'architecture not recorded')}, "
        f"{result.get('int8_layers', '?')} of {result.get('layers', '?')} layers stored in INT8), {result['tokens']} "
        f"tokens of `{result['corpus']}`, token-by-token streaming, FP window W = {result['fp_window']}.", "",
        "| cache | streaming PPL | KV bytes (all layers, end) |", "|---|---|---|",
        f"| full precision ({dtype} on {device}) | {result['ppl_fp']:.4f} | {result['kv_bytes_fp']:,} |",
        f"| INT8 + FP window | {result['ppl_int8']:.4f} | {result['kv_bytes_int8']:,} |", "",
        f"- PPL rise: {result['ppl_rise_percent']:+.3f}% (target: at most +1%)",
        f"- mean per-token KL(full || int8): {result['mean_kl_full_int8']:.2e} nats (max {result['max_kl_full_int8']:.2e})",
        f"- KV bytes: {result['bytes_ratio_fp_over_int8']:.2f}x smaller; accounted bytes equal the expected "
        f"{result['kv_bytes_int8_expected']:,} (INT8 data + fp32 per-token scales + per-layer channel scales + "
        f"{dtype} FP window): {'yes' if result['kv_bytes_int8_expected'] == result['kv_bytes_int8'] else 'NO'}",
        f"- per token and layer: fp32 {per_token['fp32']} B, fp16 {per_token['fp16']} B, INT8 with scales "
        f"{per_token['int8_with_scales']} B (so the INT8 region is {per_token['fp16'] / per_token['int8_with_scales']:.1f}x "
        f"smaller than fp16 and {per_token['fp32'] / per_token['int8_with_scales']:.1f}x smaller than fp32)",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
