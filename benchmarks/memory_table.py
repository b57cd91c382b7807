"""Perplexity under memory targets, as Markdown tables (no model run).

Reads ``confkv sweep --memory ...`` JSONL files (rows carry ``params.memory``): one table per
(corpus, tokens, dtype), one row per policy or preset and its non-target parameters, one column
pair per memory fraction: perplexity and its distance to full KV. Also the largest share of the
step's target any step held (<= 100% by construction) and, for ladders, the tokens per bit width
at the last step (all layers). Usage::

    .venv/bin/python benchmarks/memory_table.py results/memory/tune_pydoc.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LABELS = {"full": "full KV", "streaming": "StreamingLLM", "h2o": "H2O", "tova": "TOVA", "window": "window",
          "confkv": "CONF-KV ranking (paper)", "confkv-fixed": "CONF-KV ranking, no gate",
          "tiered": "**tiered (preset)**", "kivi-4": "KIVI 4-bit", "kivi-2": "KIVI 2-bit"}


def label(row: dict) -> str:
    extra = {k: v for k, v in row["params"].items() if k != "memory"}
    name = LABELS.get(row["policy"], row["policy"]) + ("+INT8" if row.get("kv_int8") else "")
    return name + (" (" + ", ".join(f"{k}={v}" for k, v in sorted(extra.items())) + ")" if extra else "")


def tables(rows: list[dict]) -> str:
    out = []
    groups = sorted({(r["corpus"], r["tokens"], r.get("dtype") or "float32") for r in rows})
    for corpus, tokens, dtype in groups:
        group = [r for r in rows if (r["corpus"], r["tokens"], r.get("dtype") or "float32") == (corpus, tokens, dtype)]
        full = next((r for r in group if r["policy"] == "full"), None)
        fractions = sorted({r["params"]["memory"] for r in group if "memory" in r["params"]}, reverse=True)
        out.append(f"**{corpus}, {tokens:,} tokens, {dtype}**" + (f" (full KV: PPL {full['ppl']:.3f})" if full else ""))
        out.append("")
        head = "| policy | " + " | ".join(f"PPL @ {f:.1%} | vs full" for f in fractions) + " | max share of target | tokens per rung (last step) |"
        out += [head, "|" + "---|" * (1 + 2 * len(fractions) + 2)]
        names = []
        for r in group:
            if r["policy"] != "full" and label(r) not in names:
                names.append(label(r))
        for name in names:
            cells, shares, rungs = [], [], []
            for f in fractions:
                r = next((x for x in group if label(x) == name and x["params"].get("memory") == f), None)
                if r is None:
                    cells += ["", ""]
                    continue
                delta = f"{(r['ppl'] / full['ppl'] - 1) * 100:+.1f}%" if full else ""
                cells += [f"{r['ppl']:.3f}", delta]
                if r.get("max_target_share") is not None:
                    shares.append(r["max_target_share"])
                if r.get("final_rung_tokens"):
                    rungs.append(f"{f:g}: {r['final_rung_tokens']}")
            share = f"{max(shares):.1%}" if shares else ""
            out.append(f"| {name} | " + " | ".join(cells) + f" | {share} | {'; '.join(rungs)} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.files for line in path.read_text().splitlines() if line.strip()]
    print(tables([r for r in rows if "memory" in r["params"] or r["policy"] == "full"]))


if __name__ == "__main__":
    main()
