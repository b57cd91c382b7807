"""One setting's perplexity at several rotation seeds: each text's rise over full KV per seed, its mean and worst.

A run at a per-token target moves by tenths of a point for changes that only reorder float operations, so one run
of one rotation says little against a bar of 1%. The Hadamard rotation's seed (``rotation_seed``) gives equally good
rotations; this prints, per text, the rise at each seed, their mean and the worst (results/lowbit/README.md, "One
rotation or another"; results/memory/README.md, "The 12.5% cap at five rotation seeds").

Runs are the JSON files of ``benchmarks/lowbit_ppl.py`` (flat) or ``confkv ppl`` (a ``summary`` and the ``nll``
list); the seed is the run's ``rotation_seed`` parameter (0 when not given). Full KV, per text, comes from
``--full`` files: ``confkv ppl --policy full`` JSON (its first ``tokens`` NLLs, the run's own prefix), a flat
full run of the same token count, or a ``.jsonl`` of flat runs (its ``policy: full`` bfloat16 rows of the run's
token count)::

    .venv/bin/python benchmarks/seed_spread.py results/lowbit/seeds/*.json \
        --full results/archive/tiered/ppl_*.jsonl results/lowbit/idle_full.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path


def load_run(path: Path) -> dict:
    """{corpus, seed, tokens, ppl} of one run's file (either layout)."""
    data = json.loads(path.read_text())
    flat = data.get("summary", data)
    return {"corpus": flat["corpus"], "seed": int(flat.get("params", {}).get("rotation_seed", 0)),
            "tokens": int(flat["tokens"]), "ppl": float(flat["ppl"]), "file": path.name}


def full_ppl(paths: list[Path], corpus: str, tokens: int) -> float | None:
    """Full KV's perplexity of ``corpus`` over ``tokens`` predictions, from the first file that has it."""
    for path in paths:
        if path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                row = json.loads(line)
                if (row.get("policy") == "full" and row.get("corpus") == corpus and row.get("dtype") == "bfloat16"
                        and row.get("tokens") == tokens + 1):
                    return float(row["ppl"])
            continue
        data = json.loads(path.read_text())
        summary = data.get("summary", data)
        if summary.get("policy") != "full" or summary.get("corpus") != corpus:
            continue
        if len(data.get("nll", [])) >= tokens:
            return math.exp(sum(data["nll"][:tokens]) / tokens)
        if summary.get("tokens") == tokens:  # a flat run of the same prefix (benchmarks/lowbit_ppl.py)
            return float(summary["ppl"])
    return None


def spread_table(runs: list[dict], full_files: list[Path]) -> str:
    """Markdown: one row per text, the % rise over full KV at each seed, the mean of those rises and the worst."""
    by_corpus: dict[str, dict[int, dict]] = defaultdict(dict)
    for run in runs:
        if run["seed"] in by_corpus[run["corpus"]]:
            raise SystemExit(f"two runs of {run['corpus']} at seed {run['seed']}: "
                             f"{by_corpus[run['corpus']][run['seed']]['file']} and {run['file']}; pass one")
        by_corpus[run["corpus"]][run["seed"]] = run
    seeds = sorted({seed for group in by_corpus.values() for seed in group})
    out = ["| text | full KV | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | worst |",
           "|---|---|" + "---|" * len(seeds) + "---|---|"]
    for corpus in sorted(by_corpus):
        group = by_corpus[corpus]
        tokens = {run["tokens"] for run in group.values()}
        if len(tokens) != 1:
            raise SystemExit(f"{corpus}: runs over different token counts {sorted(tokens)}")
        full = full_ppl(full_files, corpus, tokens.pop())
        if full is None:
            raise SystemExit(f"{corpus}: no full-KV run among --full; pass the confkv ppl --policy full file")
        rises = {seed: 100 * (run["ppl"] / full - 1) for seed, run in group.items()}
        cells = [f"{group[s]['ppl']:.3f} ({rises[s]:+.2f}%)" if s in group else "-" for s in seeds]
        mean, worst = sum(rises.values()) / len(rises), max(rises.values())
        out.append(f"| {corpus} | {full:.3f} | " + " | ".join(cells) + f" | **{mean:+.2f}%** | {worst:+.2f}% |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--full", nargs="+", type=Path, required=True, help="full-KV references (see the docstring)")
    args = parser.parse_args()
    print(spread_table([load_run(p) for p in args.runs], args.full))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
