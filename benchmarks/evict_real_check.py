"""The hot tier's eviction in one C call against the torch path on the real model: SmolLM2 in bfloat16 under the
memory preset (memory=0.25), a prefill of 512 tokens of a text, then 512 decode steps through the lean decoder, once
with the C call and once with the torch path alone; prints whether the logits are identical, the bytes held, the
perplexity of the decoded tokens under each, and how many of the first run's evictions the C call took or declined.

    .venv/bin/python benchmarks/evict_real_check.py [--corpus stdlib-docs] [--memory 0.25]
"""
import argparse

import torch

from confkv.data.corpora import load_corpus
from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder
from confkv.models import load_model
from confkv.store import hot_tier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="stdlib-docs")
    parser.add_argument("--memory", type=float, default=0.25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2", dtype=torch.bfloat16)
    decoder = LeanDecoder(model)
    ids = torch.tensor([tokenizer.encode(load_corpus(args.corpus))[:1024]])
    real = hot_tier.split_by_rank

    calls = {"taken": 0, "declined": 0}

    def counted(*args, **kwargs):
        split = real(*args, **kwargs)
        calls["taken" if split is not None else "declined"] += 1
        return split

    def run(native: bool):
        hot_tier.split_by_rank = counted if native else (lambda *a, **k: None)
        try:
            cache = ConfKVCache.for_model(model, memory=args.memory)
            with torch.no_grad():
                prefill(model, cache, ids[:, :512], chunk=128)
            logits = torch.stack([decoder(ids[:, t:t + 1], cache) for t in range(512, 1024)]).float()
        finally:
            hot_tier.split_by_rank = real
        nll = torch.nn.functional.cross_entropy(logits[:-1, 0], ids[0, 513:1024])
        return logits, cache.kv_bytes(), float(nll.exp())

    (a, bytes_a, ppl_a), (b, bytes_b, ppl_b) = run(True), run(False)
    print(f"identical logits: {torch.equal(a, b)}; bytes {bytes_a} / {bytes_b}; perplexity of the 511 decoded tokens "
          f"{ppl_a:.6f} (C call) / {ppl_b:.6f} (torch path); evictions (prefill and decode, all layers): "
          f"{calls['taken']} by the C call, {calls['declined']} declined to the torch path")


if __name__ == "__main__":
    main()
