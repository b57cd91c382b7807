"""How far bf16 runs sit from the float32 model before anything is evicted: the mean absolute difference of the
per-token loss over the first 40 tokens of pydoc-topics (the memory target's floor keeps every one of them), for
transformers' ``DynamicCache`` in bf16 and for the recorded ``confkv ppl`` runs named on the command line.

Usage: ``PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bf16_drift.py results/memory/ppl/A.json [B.json ...]``
(results/memory/README.md, "The rule's runs (stop 40)").
"""
import json
import sys

import torch
from transformers import DynamicCache

from confkv.data.corpora import corpus_tokens
from confkv.models import load_model

TOKENS = 40


def losses(model, ids: torch.Tensor) -> list[float]:
    """Per-token loss of ``ids`` [1, TOKENS + 1] fed one token at a time through a DynamicCache."""
    cache, out = DynamicCache(), []
    with torch.no_grad():
        for t in range(TOKENS):
            logits = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[0, -1].float()
            out.append(float(torch.logsumexp(logits, -1) - logits[ids[0, t + 1]]))
    return out


def distance(nll: list[float], reference: list[float]) -> float:
    return sum(abs(a - b) for a, b in zip(nll[:TOKENS], reference)) / TOKENS


def main(paths: list[str]) -> int:
    torch.set_num_threads(1)
    bf16, tokenizer = load_model("smollm2", dtype=torch.bfloat16)
    ids = corpus_tokens(tokenizer, "pydoc-topics", TOKENS + 1)
    reference = losses(load_model("smollm2", dtype=torch.float32)[0], ids)
    print(f"DynamicCache, bf16: {distance(losses(bf16, ids), reference):.4f} nats a token from float32")
    for path in paths:
        with open(path) as file:
            print(f"{path}: {distance(json.load(file)['nll'], reference):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
