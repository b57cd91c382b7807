"""Cross-check of the streaming loop: ``window``/``streaming`` streaming PPL vs one banded-mask pass.

The budget convention is stated once, in docs/USAGE.md ("What a budget counts"): a budget of
N is what a layer holds at the end of every step, so the next token sees itself and the
previous N tokens (``0 <= i - j <= N``); StreamingLLM with S sinks sees itself, the
previous N - S tokens and the first S. One forward pass with that banded causal mask (a
custom 4D float mask, SDPA, on a fresh model load) gives the same perplexity up to float
summation order; the streaming loop through ``ConfKVCache`` must match it (the tests use a
relative 1e-5, which a window one token off fails).

Usage (the recorded run, ~11 min on 2 CPU cores)::

    .venv/bin/python -m confkv.eval.quality.streaming_crosscheck --tokens 2048 --budget 512 \\
        --out results/streaming_crosscheck

``--render-only`` rewrites the ``.md`` from the ``.json`` without running the model.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch


def banded_mask(n: int, band: int, sinks: int = 0) -> torch.Tensor:
    """[1, 1, n, n] float mask: query i sees key j iff j <= i and (i - j <= band or j < sinks).

    ``window`` with budget N is ``band=N``; ``streaming`` with budget N and S sinks is
    ``band=N - S, sinks=S`` (docs/USAGE.md, "What a budget counts").
    """
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
    from confkv.eval.quality.ppl import streaming_ppl  # noqa: PLC0415

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


def describe(model) -> dict:
    """The model facts the page states: class and layer count, dtype, device."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    parameter = next(model.parameters())
    return {"architecture": f"{type(model).__name__}, {layers} layers",
            "dtype": str(parameter.dtype).removeprefix("torch."), "device": parameter.device.type}


def render(record: dict) -> str:
    """The Markdown page of one cross-check ``record`` (as written to the ``.json``)."""
    model = record["model"]
    described = ", ".join(str(record[k]) for k in ("architecture", "dtype", "device") if record.get(k))
    lines = [
        "# Streaming loop vs banded-mask forward pass",
        "",
        f"Command: `{record['command']}` (commit {record['commit']}).",
        "",
        f"Model `{model}`" + (f" ({described})" if described else "") + f", first {record['tokens']} tokens of "
        f"`{record['corpus']}`, {record.get('torch_threads', '?')} torch thread(s). Convention (docs/USAGE.md, \"What a budget "
        "counts\"): a budget of N is what a layer holds at the end of every step. Reference: one forward pass on a "
        "fresh model load (SDPA) with a 4D float mask in which token i sees token j iff 0 <= i - j <= N - S or "
        "j < S (S = 0 for `window`); streaming: token-by-token through `ConfKVCache`.",
        "",
        "| policy | N | sinks S | banded reference PPL | streaming PPL | relative difference |",
        "|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        lines.append(f"| {r['policy']} | {r['params']['budget']} | {r['params'].get('sinks', 0)} | "
                     f"{r['banded_reference_ppl']:.4f} | {r['streaming_ppl']:.4f} | {r['relative_difference']:.2e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", default="pydoc-topics")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--out", default="results/streaming_crosscheck")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 is fastest on a shared 2-core machine: no oversubscription)")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite OUT.md from OUT.json (no model run)")
    args = parser.parse_args()
    out = Path(args.out)
    from confkv.data import corpus_tokens  # noqa: PLC0415
    from confkv.models import load_model  # noqa: PLC0415

    if args.render_only:
        record = json.loads(out.with_suffix(".json").read_text())
        if "command" not in record:  # a record from before these fields: the command its values say
            options = [f"--{k} {record[k]}" for k, default in (("model", "smollm2"), ("corpus", "pydoc-topics"))
                       if record[k] != default]
            record["command"] = " ".join([".venv/bin/python -m confkv.eval.quality.streaming_crosscheck", *options,
                                          f"--tokens {record['tokens']} --budget {record['budget']} --out {args.out}"])
        if "architecture" not in record:
            record = {**record, **describe(load_model(record["model"])[0])}
        out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
        page = render(record)
        out.with_suffix(".md").write_text(page)
        print(page, end="")
        return

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    reference_model, tokenizer = load_model(args.model)  # fresh load, default (sdpa) attention
    streaming_model, _ = load_model(args.model)          # a second copy, switched to confkv attention
    ids = corpus_tokens(tokenizer, args.corpus, args.tokens)
    start = time.time()
    rows = crosscheck(reference_model, streaming_model, ids, args.budget, args.sinks, progress=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"command": " ".join([".venv/bin/python -m confkv.eval.quality.streaming_crosscheck",
                                   *(shlex.quote(a) for a in sys.argv[1:])]),
              "model": args.model, **describe(reference_model),
              "corpus": args.corpus, "tokens": int(ids.shape[1]), "budget": args.budget, "sinks": args.sinks,
              "commit": commit, "torch_threads": torch.get_num_threads(), "seconds": time.time() - start, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    page = render(record)
    out.with_suffix(".md").write_text(page)
    print(page, end="")


if __name__ == "__main__":
    main()
