"""Perplexity at 1K / 2K / 4K / 8K tokens from `confkv ppl --out` JSON files, as a Markdown table (no model run).

A streaming run under a memory target is the same run, step for step, as a shorter one over its
first tokens (the target depends only on the current length), so one run of N tokens gives the
perplexity of every prefix: the table shows each prefix length the run covers. Rows: one per
file (policy, target; the file's name where two files ran the same setting); the full-KV file of the same corpus and dtype is the reference
(``confkv ppl --policy full``, or ``benchmarks/full_ppl_forward.py``'s forward passes: ``method=forward``, no
trace, so no peak-KV share). Usage::

    .venv/bin/python benchmarks/memory_ppl_table.py results/memory/ppl/*.json
    .venv/bin/python benchmarks/memory_ppl_table.py --mean results/memory/ppl/*_4k.json   # mean rise per setting
    .venv/bin/python benchmarks/memory_ppl_table.py --by-position results/memory/ppl/*_4k.json   # where the rise lies

``--mean`` adds, per setting (policy, parameters, target), the mean of its rises over full KV across every
text and prefix it has, with the count of points, so settings are compared on the same points.

``--held-at 401,1001`` adds, per run, what a layer holds at the steps that had seen those positions (from the
trace: hot tokens, tokens on each rung, their sum, and the share of the target the cache used).

``--by-position`` adds, per text, the perplexity rise over full KV of the tokens in each band of positions
(0-127, 128-255, ..., doubling): where in a run the loss lies (a per-step target is strictest early).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

PREFIXES = (1024, 2048, 4096, 8192)


def _target(summary: dict) -> str:
    params = summary.get("params") or {}
    if "memory" in params:
        return f"memory={params['memory']:g}"
    if "max_kv_bytes" in params:
        return f"max_kv_bytes={params['max_kv_bytes']:,}"
    return "none"


def load(paths: list[Path]) -> list[dict]:
    runs = []
    for path in paths:
        data = json.loads(path.read_text())
        summary = data["summary"]
        kv = [sum(step) for step in data["trace"]["kv_bytes"]]
        params = {k: v for k, v in (summary.get("params") or {}).items() if k not in ("memory", "max_kv_bytes")}
        if summary.get("method"):  # a full-KV reference from forward passes (benchmarks/full_ppl_forward.py): no trace
            params["method"] = summary["method"]
        if summary.get("kv_int8"):  # the store's INT8 hot tier (--int8), with its FP window where the file says it
            params["int8"] = True
            if summary.get("fp_window") is not None:
                params["fp_window"] = summary["fp_window"]
        trace = data["trace"]
        runs.append({"trace": trace, "path": path.name, "policy": summary["policy"] or "tiered", "corpus": summary["corpus"],
                     "dtype": summary.get("dtype", "float32"), "target": _target(summary), "params": params,
                     "preset": summary.get("preset"), "nll": data["nll"], "kv": kv})
    return runs


def _ppl(nll: list[float], n: int) -> float:
    return math.exp(sum(nll[:n - 1]) / (n - 1))


def _name(run: dict) -> str:
    """The row's name: the policy, then its own parameters (``--param``), or ``(earlier preset)`` for a preset's run
    made under other defaults than today's (runs written before ``confkv ppl`` recorded the signature count so)."""
    from confkv.presets import preset_signature  # noqa: PLC0415

    if run["params"]:
        return run["policy"] + " (" + ", ".join(f"{k}={v}" for k, v in sorted(run["params"].items())) + ")"
    now = preset_signature(run["policy"])
    return run["policy"] + (" (earlier preset)" if now is not None and run.get("preset") != now else "")


def _rises(runs: list[dict]) -> dict[tuple[str, str], list[float]]:
    """Per (setting name, target): the % rise over full KV of every (text, prefix) the setting's runs cover."""
    out: dict[tuple[str, str], list[float]] = {}
    for corpus, dtype in sorted({(r["corpus"], r["dtype"]) for r in runs}):
        group = [r for r in runs if (r["corpus"], r["dtype"]) == (corpus, dtype)]
        full = next((r for r in group if r["policy"] == "full"), None)
        if full is None:
            continue
        for r in group:
            if r is full:
                continue
            for p in PREFIXES:
                if len(r["nll"]) >= p - 1 and len(full["nll"]) >= p - 1:
                    out.setdefault((_name(r), r["target"]), []).append(
                        (_ppl(r["nll"], p) / _ppl(full["nll"], p) - 1) * 100)
    return out


def mean_table(runs: list[dict]) -> str:
    """One row per setting: its mean % rise over full KV and the number of (text, prefix) points."""
    lines = ["| policy | target | mean rise | points |", "|---|---|---|---|"]
    for (name, target), values in sorted(_rises(runs).items()):
        lines.append(f"| {name} | {target} | {sum(values) / len(values):+.2f}% | {len(values)} |")
    return "\n".join(lines)


def position_bands(length: int, first: int = 128) -> list[tuple[int, int]]:
    """[(start, end)) bands of predicted-token indices covering ``length``: [0, first), then doubling."""
    bands, start, end = [], 0, first
    while start < length:
        bands.append((start, min(end, length)))
        start, end = end, end * 2
    return bands


def position_table(runs: list[dict]) -> str:
    """Per text, one row per run: the % perplexity rise over full KV of the tokens in each band of positions."""
    out = []
    for corpus, dtype in sorted({(r["corpus"], r["dtype"]) for r in runs}):
        group = [r for r in runs if (r["corpus"], r["dtype"]) == (corpus, dtype)]
        full = next((r for r in group if r["policy"] == "full"), None)
        if full is None:
            continue
        bands = position_bands(max(len(r["nll"]) for r in group if r is not full))
        out += [f"**{corpus}, {dtype}: rise over full KV by position**", "",
                "| policy | target | " + " | ".join(f"{a}-{b - 1}" for a, b in bands) + " |",
                "|---|---|" + "---|" * len(bands)]
        for r in sorted(group, key=lambda r: (r["target"], r["policy"], r["path"])):
            if r is full:
                continue
            cells = []
            for a, b in bands:
                n = min(b, len(r["nll"]), len(full["nll"])) - a
                rise = math.exp((sum(r["nll"][a:a + n]) - sum(full["nll"][a:a + n])) / n) - 1 if n > 0 else None
                cells.append("" if rise is None else f"{rise * 100:+.1f}%")
            out.append(f"| {_name(r)} [{Path(r['path']).stem}] | {r['target']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def held_table(runs: list[dict], seen: list[int]) -> str:
    """Per run and step (the first that had seen each of ``seen`` positions): per layer (mean over layers, first
    sequence), the hot tokens, the tokens on each rung of the ladder, their sum, and the bytes over the target."""
    lines = ["| run | seen | hot | per rung | held | bytes / target |", "|---|---|---|---|---|---|"]
    for r in runs:
        trace = r["trace"]
        if not trace.get("target_bytes") or trace["target_bytes"][0] is None:
            continue
        for want in seen:
            step = next((i for i, n in enumerate(trace["seen"]) if n >= want), None)
            if step is None:
                continue
            layers = len(trace["kept"][step])
            hot = sum(row[0] for row in trace["kept"][step]) / layers
            rungs = [t / layers for t in trace["rung_tokens"][step]]
            share = sum(trace["kv_bytes"][step]) / trace["target_bytes"][step]
            lines.append(f"| {Path(r['path']).stem} | {trace['seen'][step]} | {hot:.0f} | "
                         f"{' / '.join(f'{t:.0f}' for t in rungs)} | {hot + sum(rungs):.0f} | {share:.0%} |")
    return "\n".join(lines)


def tables(runs: list[dict]) -> str:
    out = []
    for corpus, dtype in sorted({(r["corpus"], r["dtype"]) for r in runs}):
        group = [r for r in runs if (r["corpus"], r["dtype"]) == (corpus, dtype)]
        full = next((r for r in group if r["policy"] == "full"), None)
        prefixes = [p for p in PREFIXES if full is None or len(full["nll"]) >= p - 1]
        out += [f"**{corpus}, {dtype}**", "",
                "| policy | target | " + " | ".join(f"PPL @ {p // 1024}K" for p in prefixes) + " | peak KV / full's peak |",
                "|---|---|" + "---|" * len(prefixes) + "---|"]
        for r in sorted(group, key=lambda r: (r["policy"] != "full", r["target"], r["policy"])):
            cells = []
            for p in prefixes:
                if len(r["nll"]) < p - 1:
                    cells.append("")
                    continue
                value = _ppl(r["nll"], p)
                delta = "" if full is None or r is full else f" ({(value / _ppl(full['nll'], p) - 1) * 100:+.1f}%)"
                cells.append(f"{value:.3f}{delta}")
            share = "" if full is None or not r["kv"] or not full["kv"] else \
                f"{max(r['kv']) / max(full['kv'][:len(r['kv'])]):.1%}"
            name = _name(r)
            twins = [o for o in group if (o["policy"], o["params"], o["target"]) == (r["policy"], r["params"], r["target"])]
            if len(twins) > 1:  # the same setting run on different code: the file tells them apart
                name += f" [{Path(r['path']).stem}]"
            out.append(f"| {name} | {r['target']} | " + " | ".join(cells) + f" | {share} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--mean", action="store_true", help="also the mean rise per setting over its points")
    parser.add_argument("--by-position", action="store_true", help="also the rise in each band of positions")
    parser.add_argument("--held-at", help="also what a layer holds at these positions (comma-separated)")
    args = parser.parse_args()
    runs = load(args.files)
    print(tables(runs))
    if args.mean:
        print(mean_table(runs))
    if args.by_position:
        print(position_table(runs))
    if args.held_at:
        print(held_table(runs, [int(n) for n in args.held_at.split(",")]))


if __name__ == "__main__":
    main()
