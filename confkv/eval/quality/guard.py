"""Degradation guard: CONF-KV's streaming perplexity on a fixed 512-token text, against a record.

A refactor of the cache (store, eviction, attention read, quantisation, gate) that changes
which tokens are kept or how they are read changes the streaming perplexity; this module
runs fixed cases and :func:`compare` checks them against ``results/reference/guard.json``
(written by ``python -m confkv.eval.quality.guard``, see :func:`main`; the exact command is stored
with each case).

Cases:

- ``tiny-fp`` / ``tiny-int8``: a tiny random Llama (``tiny_model("llama", seed=0,
  initializer_range=0.2)``: large init so that attention is peaked and the loss depends on
  which tokens are kept) on the first 512 bytes of the pydoc topics text, byte-level ids.
  A random model's perplexity is still a deterministic quality fingerprint: full-precision
  arithmetic is reproducible, so the tolerance is tight (``rel_tol`` 1e-4: float reordering
  in an optimised kernel moves it by ~1e-6, a changed eviction by ~1e-3 and more).
  In the default test suite.
- ``smollm2``: the real SmolLM2-135M on its first 512 tokens of the same text; tolerance 1%
  (the issue's bar). Integration test.

The token ids are stored in the reference file, so the guard does not depend on the corpus
or tokenizer version. Each case also records the full-KV perplexity (one plain forward pass):
if *that* moved, the model or transformers changed, not the cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from confkv.config import StoreConfig

TOKENS = 512


@dataclass(frozen=True)
class GuardCase:
    name: str
    model: str  # "tiny-llama" or a load_model name
    policy: str
    params: dict[str, Any]
    store: dict[str, Any] = field(default_factory=dict)
    rel_tol: float = 1e-4


TINY_MODEL = {"arch": "llama", "seed": 0, "initializer_range": 0.2}
_TINY_PARAMS = {"n_high": 48, "n_low": 96, "tau": 0.18, "protect": 8, "sinks": 4}

CASES: dict[str, GuardCase] = {
    "tiny-fp": GuardCase("tiny-fp", "tiny-llama", "confkv", _TINY_PARAMS),
    "tiny-int8": GuardCase("tiny-int8", "tiny-llama", "confkv", _TINY_PARAMS,
                           store={"kv_int8": True, "fp_window": 16, "move_block": 8}),
    "smollm2": GuardCase("smollm2", "smollm2", "confkv",
                         {"n_high": 64, "n_low": 128, "tau": 0.6, "smoothing": 0.95},
                         store={"kv_int8": True, "fp_window": 32}, rel_tol=0.01),
}


def load_case_model(case: GuardCase) -> tuple[Any, Any]:
    if case.model == "tiny-llama":
        from confkv.models import tiny_model, tiny_tokenizer

        spec = dict(TINY_MODEL)
        return tiny_model(spec.pop("arch"), **spec), tiny_tokenizer()
    from confkv.models import load_model

    return load_model(case.model)


def case_ids(tokenizer: Any, corpus: str = "pydoc-topics") -> torch.Tensor:
    from confkv.data import corpus_tokens

    return corpus_tokens(tokenizer, corpus, TOKENS)


@torch.no_grad()
def run_case(case: GuardCase, model: Any, ids: torch.Tensor) -> dict[str, Any]:
    """Streaming PPL of ``case`` on ``ids`` [1, 512], with the full-KV PPL and the memory summary."""
    from confkv.eval.quality.ppl import streaming_ppl

    logits = model(ids).logits[0, :-1].float()
    full = math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))
    result = streaming_ppl(model, ids, case.policy, store=StoreConfig(**case.store), progress=False, **case.params)
    trace = result.trace
    budgets = [int(s.budget[0]) for s in trace.steps]
    return {"ppl": result.ppl, "ppl_full_kv": full, "peak_kv_bytes": trace.peak_kv_bytes(),
            "mean_kv_bytes": trace.mean_kv_bytes(),
            "mean_kept_tokens": sum(trace.kept_tokens(0)) / len(trace),
            "budget_switches": sum(1 for a, b in zip(budgets, budgets[1:]) if a != b)}


def compare(recorded: dict[str, Any], measured: dict[str, Any], rel_tol: float) -> list[str]:
    """Human-readable problems (empty when within tolerance)."""
    problems = []
    for key in ("ppl", "ppl_full_kv"):
        want, got = recorded[key], measured[key]
        if not math.isfinite(got) or abs(got / want - 1) > rel_tol:
            what = "the model or transformers changed" if key == "ppl_full_kv" else "the cache's quality changed"
            problems.append(f"{key}: recorded {want:.6f}, measured {got:.6f} ({got / want - 1:+.3%}, "
                            f"tolerance {rel_tol:.2%}): {what}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Record (or re-record) the reference: ``results/reference/guard.json``.

    Usage::

        OMP_NUM_THREADS=1 .venv/bin/python -m confkv.eval.quality.guard                 # tiny cases only
        OMP_NUM_THREADS=1 .venv/bin/python -m confkv.eval.quality.guard --cases tiny-fp tiny-int8 smollm2

    Only the cases named are re-recorded; the others are kept as they are in the file.
    Re-record only after a change whose effect on quality is intended and understood, and
    say so in the commit. The exact command, versions and date are stored with each case.
    """
    parser = argparse.ArgumentParser(prog="python -m confkv.eval.quality.guard", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["tiny-fp", "tiny-int8"], choices=sorted(CASES))
    parser.add_argument("--out", type=Path, default=Path("results") / "reference" / "guard.json")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    data = json.loads(args.out.read_text()) if args.out.exists() else {"cases": {}}
    arguments = sys.argv[1:] if argv is None else argv
    command = (f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} .venv/bin/python "
               f"-m confkv.eval.quality.guard {' '.join(arguments)}").strip()
    for name in args.cases:
        case = CASES[name]
        model, tokenizer = load_case_model(case)
        ids = case_ids(tokenizer)
        started = time.perf_counter()
        measured = run_case(case, model, ids)
        entry = {"model": case.model, "policy": case.policy, "params": case.params, "store": case.store,
                 "rel_tol": case.rel_tol, **measured, "seconds": round(time.perf_counter() - started, 1),
                 "corpus": "pydoc-topics (first 512 tokens)", "ids": " ".join(map(str, ids[0].tolist())),
                 "command": command, "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                              "python": platform.python_version()}}
        if case.model == "tiny-llama":
            entry["tiny_model"] = TINY_MODEL
        data["cases"][name] = entry
        print(f"{name:10s} ppl {measured['ppl']:.6f}  full-KV ppl {measured['ppl_full_kv']:.6f}  "
              f"peak KV {measured['peak_kv_bytes']}  mean kept {measured['mean_kept_tokens']:.1f}  "
              f"switches {measured['budget_switches']}  {entry['seconds']}s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data["regenerate"] = "OMP_NUM_THREADS=1 .venv/bin/python -m confkv.eval.quality.guard --cases <names>"
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
