"""Gap closure at matched KV memory, from results already on disk (no model run).

For every perplexity result with a reference window W (the memory of a W-token
full-precision sliding window): PPL, PPL drop vs ``window`` at W, and the share of the
window-to-full and StreamingLLM-to-full perplexity gaps it closes
(:func:`confkv.eval.quality.sweep.gap_closed`: 100% = full KV, 0% = no better than the baseline).

Sources: ``results/policies_512.json`` (confkv/eval/quality/policy_table.py; its ``label`` names the
row) and every sweep JSONL given (``confkv sweep``). Usage (writes results/gap_closure.md)::

    .venv/bin/python benchmarks/gap_closure.py --policy-table results/policies_512.json \\
        --sweeps results/sweep/ppl_mean.jsonl results/sweep_stdlib/ppl_mean.jsonl --out results/gap_closure.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confkv.eval.quality.sweep import gap_closed, load_rows  # noqa: E402


def rows_from_policy_table(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    out = []
    for row in data["rows"]:
        out.append({"source": path.name, "corpus": data["corpus"], "tokens": data["tokens"], "window": data["window"],
                    "label": row["label"], "policy": row["policy"], "kv_int8": bool(row.get("kv_int8")),
                    "ppl": row["ppl"], "peak": row["peak_kv_bytes"], "mean": row["mean_kv_bytes"],
                    "matched": row.get("matched", "")})
    return out


def rows_from_sweep(path: Path) -> list[dict]:
    out = []
    for row in load_rows(path):
        if "ppl" not in row or "policy" not in row:
            continue
        label = row["policy"] + ("+int8" if row.get("kv_int8") else "")
        out.append({"source": f"{path.parent.name}/{path.name}", "corpus": row["corpus"], "tokens": row["tokens"],
                    "window": row.get("reference_window") or 0, "label": label, "policy": row["policy"],
                    "kv_int8": bool(row.get("kv_int8")), "ppl": row["ppl"], "peak": row["peak_kv_bytes"],
                    "mean": row["mean_kv_bytes"], "matched": row.get("match", "")})
    return out


def table(rows: list[dict]) -> list[str]:
    lines = []
    groups: dict[tuple, list[dict]] = {}
    fulls = {(r["source"], r["corpus"]): r["ppl"] for r in rows if r["label"] == "full"}
    for r in rows:
        if r["window"] and r["label"] != "full":
            groups.setdefault((r["source"], r["corpus"], r["tokens"], r["window"]), []).append(r)
    for (source, corpus, tokens, window), group in sorted(groups.items(), key=lambda kv: (kv[0][1], -kv[0][3])):
        refs = {r["label"]: r["ppl"] for r in group}
        full = fulls.get((source, corpus))
        if full is None or "window" not in refs or "streaming" not in refs:
            lines += [f"{corpus}, W={window} ({source}): missing full/window/streaming rows; skipped", ""]
            continue
        lines += [f"### {corpus}, {tokens} tokens, memory of a {window}-token window (`{source}`)", "",
                  f"full KV {full:.3f}, window {refs['window']:.3f}, StreamingLLM {refs['streaming']:.3f}", "",
                  "| row | PPL | peak MB | mean MB | matched on | drop vs window | window-to-full gap closed | "
                  "streaming-to-full gap closed |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(group, key=lambda r: r["ppl"]):
            matched = r["matched"] if r["label"] not in ("window",) else "reference"
            lines.append(f"| {r['label']} | {r['ppl']:.3f} | {r['peak'] / 1e6:.2f} | {r['mean'] / 1e6:.2f} | {matched} | "
                         f"{refs['window'] - r['ppl']:+.3f} | "
                         f"{100 * gap_closed(r['ppl'], refs['window'], full):.1f}% | "
                         f"{100 * gap_closed(r['ppl'], refs['streaming'], full):.1f}% |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy-table", type=Path, action="append", default=[])
    parser.add_argument("--sweeps", type=Path, nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [r for p in args.policy_table for r in rows_from_policy_table(p)]
    rows += [r for p in args.sweeps if p.exists() for r in rows_from_sweep(p)]
    text = "\n".join(["# Gap closure at matched KV memory", "",
                      "Command: `.venv/bin/python benchmarks/gap_closure.py " + " ".join(sys.argv[1:]) + "`", "",
                      "Gap closed = (PPL(baseline) - PPL) / (PPL(baseline) - PPL(full)); 100% = as good as full KV, "
                      "0% = no better than the baseline, negative = worse. Baselines at the same memory: `window`, "
                      "StreamingLLM (`streaming`). Matching (peak or mean bytes) as in each source file.", ""]
                     + table(rows))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
