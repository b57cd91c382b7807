"""Rebuild the tables of results/lowbit/README.md from the run files there.

    python benchmarks/lowbit_table.py [results/lowbit]

* streaming runs (``*.json``, one per run of benchmarks/lowbit_ppl.py): per corpus, a row per
  page format (and sinks setting), a column per bit width: perplexity and its change against
  the corpus's ``full`` run;
* tuning replays (``proxy_*.jsonl``, benchmarks/lowbit_proxy.py): the same layout, proxy perplexity.

Bytes per cold token are the format's own count (``PageFormat.page_nbytes`` / page size, one layer, the
model's KV heads x channels: SmolLM2's 3 x 64 unless a replay's record names others), every side byte
included, digest excluded (the KIVI policy's pages carry none); bf16 is 768 bytes for SmolLM2, 1,024 for
Qwen2.5-1.5B (2 x 128). Replays of another model than SmolLM2 get tables of their own, headed by its name.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from confkv.tiers.formats import TECHNIQUES, build_format, canonical_name, parse_format

BF16_BYTES = 2 * 3 * 64 * 2


def cold_bytes(fmt: str, bits: int, group: int, page: int, fraction: float, value_bits: int | None = None,
               kv_heads: int = 3, head_dim: int = 64) -> float:
    return build_format(bits, group, head_dim, torch.bfloat16, fmt, fraction,
                        value_bits=value_bits).page_nbytes(kv_heads, head_dim, page) / page


def _label(fmt: str, sinks: int, fraction: float, widths: str = "") -> str:
    name = canonical_name(parse_format(fmt))
    if "outliers" in name:
        name += f" ({fraction:g})"
    return name + (f", sinks={sinks}" if sinks else "") + widths


def _widths(record: dict) -> tuple[int, str, int | None]:
    """(the column's bits, the label's suffix, the values' width or None) of a record: keys and values
    at different widths (``value_bits``) go in the column of their mean width, named in the label."""
    bits, value_bits = record["bits"], record.get("value_bits", record["bits"])
    if value_bits == bits:
        return bits, "", None
    return (bits + value_bits) // 2, f", keys {bits} / values {value_bits} bits", value_bits


def _order(label: str) -> tuple:
    """kivi first, then one technique at a time, then combinations; sinks after their format."""
    name = label.split(",")[0].split(" ")[0]
    rest = label[len(name):]
    parts = name.split("+")[1:]
    return (len(parts), [TECHNIQUE_ORDER.index(p) for p in parts], "sinks" in rest, rest)


TECHNIQUE_ORDER = TECHNIQUES  # the formats' own order, so a new technique cannot break the table


def _cell(ppl: float, full: float | None, nbytes: float) -> str:
    change = f" ({100 * (ppl / full - 1):+.1f}%)" if full else ""
    return f"{ppl:.3f}{change}, {nbytes:.0f} B"


def streaming(folder: Path) -> list[str]:
    rows: dict[str, dict] = defaultdict(dict)
    full: dict[str, float] = {}
    for path in sorted(folder.glob("*.json")):
        run = json.loads(path.read_text())
        if run.get("interrupted"):
            continue
        corpus = run["corpus"]
        if run["policy"] == "full":
            full[corpus] = run["ppl"]
            continue
        p = run["params"]
        fmt, bits = p.get("format", "kivi"), p["bits"]
        fraction, sinks = p.get("outlier_fraction", 0.01), p.get("sinks", 0)
        column, suffix, value_bits = _widths({"bits": bits, "value_bits": p.get("value_bits") or bits})
        label = _label(fmt, sinks, fraction, suffix)
        rows[corpus][(label, column)] = (run["ppl"], cold_bytes(fmt, bits, p["group_size"], p["page_size"], fraction,
                                                                value_bits), path.name)
    source = {corpus: "this folder" for corpus in full}
    for path in sorted(folder.parent.glob("archive/tiered/ppl_*.jsonl")):  # full-KV runs of the same setting elsewhere
        for line in path.read_text().splitlines():
            run = json.loads(line)
            if (run.get("policy") == "full" and run.get("dtype") == "bfloat16" and run.get("tokens") == 2048
                    and run.get("corpus") not in full):
                full[run["corpus"]] = run["ppl"]
                source[run["corpus"]] = str(path)
    out = []
    for corpus in sorted(rows):
        out += [f"**{corpus}** (streaming, 2,048 tokens; full KV: {full.get(corpus, float('nan')):.3f}, "
                f"from {source.get(corpus, '-')})", "",
                "| format | 2 bits | 3 bits | 4 bits |", "|---|---|---|---|"]
        labels = sorted({label for label, _ in rows[corpus]}, key=_order)
        for label in labels:
            cells = []
            for bits in (2, 3, 4):
                hit = rows[corpus].get((label, bits))
                cells.append(_cell(hit[0], full.get(corpus), hit[1]) if hit else "-")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def proxy(folder: Path) -> list[str]:
    rows: dict[tuple, dict] = defaultdict(dict)
    full: dict[tuple[str, str], float] = {}
    for path in sorted(folder.glob("proxy_*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            model, corpus = r.get("model", "smollm2"), r.get("corpus", "pydoc-topics")
            if r.get("compute", "bfloat16") != "bfloat16":
                model += f" ({r['compute']} compute)"
            if r["bits"] == 16:
                full[model, corpus] = r["proxy_ppl"]
                continue
            key = (model, corpus, r.get("budget", 32), r.get("group_size", 64))
            column, suffix, value_bits = _widths(r)
            label = _label(r["format"], r.get("sinks", 0), r["outlier_fraction"], suffix)
            nbytes = cold_bytes(r["format"], r["bits"], r.get("group_size", 64), r.get("page_size", 64),
                                r["outlier_fraction"] or 0.01, value_bits, r.get("kv_heads", 3), r.get("head_dim", 64))
            rows[key][(label, column)] = (r["proxy_ppl"], nbytes)
    out = []
    for (model, corpus, budget, group), cells_by in sorted(rows.items(), key=lambda item: (item[0][0] != "smollm2",
                                                                                        item[0])):
        reference = full.get((model, corpus))
        shown = f"{reference:.3f}" if reference else "not run"
        named = "" if model == "smollm2" else f"{model}, "
        out += [f"**{named}{corpus}, replay (benchmarks/lowbit_proxy.py), FP window {budget}, group {group}; "
                f"full KV {shown}**", "", "| format | 2 bits | 3 bits | 4 bits |", "|---|---|---|---|"]
        labels = sorted({label for label, _ in cells_by}, key=_order)
        for label in labels:
            cells = []
            for bits in (2, 3, 4):
                hit = cells_by.get((label, bits))
                cells.append(_cell(hit[0], reference, hit[1]) if hit else "-")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def main() -> int:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "results/lowbit")
    print("\n".join(streaming(folder) + proxy(folder)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
