"""One streaming-perplexity run of a cold-tier page format on a bf16 model, written as JSON.

`confkv ppl` has no dtype flag; this loads the model in the dtype asked and calls
:func:`confkv.eval.quality.ppl.streaming_ppl` with the policy's parameters, so every row of
results/lowbit/ is one command of this script::

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/lowbit_ppl.py --policy kivi --param bits=3 \
        --param group_size=64 --param page_size=64 --param budget=32 --param format=hadamard \
        --corpus pydoc-topics --tokens 2048 --out results/lowbit/pydoc_hadamard_3.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--policy", default="kivi")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--corpus", default="pydoc-topics")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from confkv.data import corpus_tokens
    from confkv.eval.quality.ppl import streaming_ppl
    from confkv.models import load_model

    params = dict(p.split("=", 1) for p in args.param)
    params = {k: _value(v) for k, v in params.items()}
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    ids = corpus_tokens(tokenizer, args.corpus, args.tokens, offset=args.offset)
    start = time.time()
    result = streaming_ppl(model, ids, args.policy, progress=False, **params)
    import confkv

    row = {**result.summary(), "confkv": confkv.__file__, "model": args.model, "dtype": args.dtype, "corpus": args.corpus,
           "tokens_fed": args.tokens, "offset": args.offset, "wall_seconds": time.time() - start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
