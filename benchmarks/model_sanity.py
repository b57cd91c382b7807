"""Load a bundled model by name and greedy-answer one short chat question: a sanity check.

Prints (and writes as JSON with ``--out``) the load time (the first load converts the
GGUF into the cache, later ones read the cache), the cache entry's size on disk, the
process's peak RSS (``ru_maxrss``, this process only), the parameter dtype and the
answer generated with the tokenizer's chat template. Usage::

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/model_sanity.py qwen2.5-coder-1.5b \\
        --out results/models/qwen2.5-coder-1.5b_sanity.json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from confkv.models import bundled_model_name, cache_root, load_model  # noqa: E402

QUESTION = "Write a Python function that returns the square of a number."


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a bundled model name, e.g. qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="default: the model's own default (load_model(dtype=None))")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)

    key = bundled_model_name(args.model)
    entry = cache_root() / key if key else None
    cached_before = bool(entry and (entry / "config.json").is_file())
    start = time.perf_counter()
    model, tok = load_model(args.model, dtype=None if args.dtype is None else getattr(torch, args.dtype))
    load_s = time.perf_counter() - start

    messages = [{"role": "user", "content": args.question}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    gen_s = time.perf_counter() - start
    prompt_len = ids["input_ids"].shape[1]
    report = {
        "model": args.model,
        "model_type": model.config.model_type,
        "layers": model.config.num_hidden_layers,
        "kv_heads": model.config.num_key_value_heads,
        "dtype": str(next(model.parameters()).dtype),
        "params": sum(p.numel() for p in model.parameters()),
        "cached_before": cached_before,
        "load_s": round(load_s, 1),
        "cache_bytes": _dir_bytes(entry) if entry and entry.is_dir() else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "prompt_tokens": prompt_len,
        "generate_s": round(gen_s, 1),
        "question": args.question,
        "answer": tok.decode(out[0, prompt_len:], skip_special_tokens=True),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
