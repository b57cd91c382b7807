"""Perplexity at matched peak KV bytes, tiered store next to the anchors, as a Markdown table (no model run).

Reads `confkv sweep` JSONL files; one table per (file, reference window): every row's
perplexity, its distance to full KV, its peak KV bytes (all tiers: data, scales, digests)
as a share of full KV's, and the cold bytes it read per step. Usage::

    .venv/bin/python benchmarks/tiered_table.py results/archive/tiered/ppl_pydoc.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LABELS = {"full": "full", "window": "window", "streaming": "StreamingLLM", "h2o": "H2O", "tova": "TOVA",
          "confkv": "CONF-KV", "kivi": "KIVI", "quest": "Quest", "confkv-r": "CONF-KV-R"}
SHOWN = ("bits", "group_size", "page_size", "budget", "k", "k_high", "k_low", "cold_budget", "n_high", "n_low",
         "promote")
ALL_PAGES = 2**31  # confkv.config.ALL_PAGES: "read every cold page"


def _value(value: object) -> str:
    return "all" if value == ALL_PAGES else str(value)


def label(row: dict) -> str:
    name = LABELS.get(row["policy"], row["policy"]) + ("+INT8" if row.get("kv_int8") else "")
    params = ", ".join(f"{k}={_value(row['params'][k])}" for k in SHOWN if k in row["params"])
    return f"{name} ({params})" if params else name


def tables(rows: list[dict]) -> str:
    full = {(r.get("corpus"), r.get("dtype") or "float32"): r for r in rows if r["policy"] == "full"}
    out = []
    groups = sorted({(r.get("corpus"), r.get("dtype") or "float32", r["reference_window"]) for r in rows
                     if r["policy"] != "full"})
    for corpus, dtype, window in groups:
        ref = full.get((corpus, dtype))
        if ref is None:
            continue
        members = sorted((r for r in rows if r["policy"] != "full" and r["reference_window"] == window
                          and r.get("corpus") == corpus and (r.get("dtype") or "float32") == dtype),
                         key=lambda r: r["ppl"])
        if not members:
            continue
        target = members[0]["target_bytes"]
        stat = members[0].get("match", "peak")
        out.append(f"**{corpus}, {dtype}, {ref['tokens']:,} tokens, {stat} KV at most {target / ref['peak_kv_bytes']:.1%} "
                   f"of full's peak ({target / 1e6:.2f} MB, the {window}-token window's)**\n")
        out.append("| policy | PPL | vs full | peak KV MB | share of full | cold bytes read / step |")
        out.append("|---|---|---|---|---|---|")
        out.append(f"| full | {ref['ppl']:.3f} | - | {ref['peak_kv_bytes'] / 1e6:.2f} | 100% | - |")
        for r in members:
            read = r.get("mean_cold_bytes_read") or 0.0
            read_text = f"{read / 1e3:.0f} KB" if read else "-"
            out.append(f"| {label(r)} | {r['ppl']:.3f} | {r['ppl'] / ref['ppl'] - 1:+.1%} | "
                       f"{r['peak_kv_bytes'] / 1e6:.2f} | {r['peak_kv_bytes'] / ref['peak_kv_bytes']:.1%} | {read_text} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", type=Path, nargs="+")
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.jsonl for line in path.read_text().splitlines() if line.strip()]
    print(tables(rows))


if __name__ == "__main__":
    main()
