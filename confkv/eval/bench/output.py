"""``confkv bench`` output: the text tables, the latency plot, ``bench.json``/``bench.txt``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value else "-"


def format_latency_rows(context: int, rows: dict[str, Any]) -> str:
    """One context's latency table: a row per configuration and dtype (and llama.cpp), with
    ``x dyn`` (that dtype's DynamicCache time / this time) and, when the llama.cpp row ran,
    ``x llama`` (llama.cpp's time / this time)."""
    named = {name: r for name, r in rows.items() if not name.startswith("_")}
    peer = any(r.get("speedup_vs_llamacpp") for r in named.values())
    lines = [f"context {context}  (load {rows.get('_load')}, RSS {rows['_rss_bytes'] / 2**20:.0f} MiB)",
             f"  {'config':32s} {'dtype':>8s} {'median ms':>9s} {'p10-p90 ms':>15s} {'x dyn':>6s} "
             + (f"{'x llama':>7s} " if peer else "") + f"{'floor ms':>8s} {'kept':>6s} {'KV MB':>8s}"]
    for name, r in named.items():
        llama = f"{_ratio(r.get('speedup_vs_llamacpp')):>7s} " if peer else ""
        lines.append(f"  {name:32s} {r.get('dtype', 'float32'):>8s} {r['median_ms']:9.1f} "
                     f"{r['p10_ms']:7.1f}-{r['p90_ms']:<7.1f} {_ratio(r.get('speedup_vs_dynamic')):>6s} {llama}"
                     f"{r['floor_ms']:8.1f} {r['kept_tokens']:6.0f} {r['kv_bytes'] / 1e6:8.1f}")
    return "\n".join(lines)


def format_throughput_rows(batch: int, rows: dict[str, Any]) -> str:
    lines = [f"batch {batch}  (load {rows.get('_load')}, RSS {rows['_rss_bytes'] / 2**20:.0f} MiB)",
             f"  {'config':32s} {'step ms':>8s} {'tok/s':>7s} {'x dyn':>6s} {'KV MB':>8s}"]
    for name, r in rows.items():
        if name.startswith("_"):
            continue
        speed = _ratio(r.get("speedup_vs_dynamic"))
        lines.append(f"  {name:32s} {r['median_ms']:8.1f} {r['tokens_per_s']:7.2f} {speed:>6s} "
                     f"{r['kv_bytes'] / 1e6:8.1f}")
    return "\n".join(lines)


def format_breakdown(name: str, b: dict[str, Any]) -> str:
    lines = [f"breakdown of one {name} step: {b['step_ms']:.1f} ms; policy work (confidence, gate, EMA, ranking, "
             f"compaction, quantization, eviction/ageing bookkeeping) {b['policy_work_ms']:.2f} ms = "
             f"{100 * b['policy_work_fraction']:.1f}%; all confkv overhead (also FP-window append, positions/masks, "
             f"trace; not the attention read) {b['cache_overhead_ms']:.2f} ms = "
             f"{100 * b['cache_overhead_fraction']:.1f}%"]
    for section, ms in b["sections_ms"].items():
        lines.append(f"  {section:28s} {ms:8.2f} ms  {100 * ms / b['step_ms']:5.1f}%")
    left = b.get("left_native") or {}
    steps = b.get("steps", 0)
    if left:
        lines.append(f"  reads that left the native path over {steps} steps (one read per layer and step), by reason:")
        for reason, count in sorted(left.items(), key=lambda item: -item[1]):
            lines.append(f"    {count:6d}  {reason}")
    else:
        lines.append(f"  reads that left the native path over {steps} steps: none")
    return "\n".join(lines)


def plot_latency(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    contexts = result["contexts"]
    # every row that ran at every context (configurations x dtypes, llama.cpp)
    names = [n for n in result["latency"][str(contexts[0])] if not n.startswith("_")
             and all(n in result["latency"][str(c)] for c in contexts)]
    for name in names:
        ys = [result["latency"][str(c)][name]["median_ms"] for c in contexts]
        reference = name.split("@")[0] in ("dynamic", "llama.cpp")
        ax.plot(contexts, ys, marker="o", label=name, linestyle="--" if reference else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step latency, median (ms)")
    dtypes = ", ".join(result.get("dtypes", ["float32"]))
    ax.set_title(f"{result['model']} on CPU ({result['threads']} thread(s), {dtypes}), budget {result['budget']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out_dir: Path, text: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
    (out_dir / "bench.txt").write_text(text)
    plot_latency(result, out_dir / "latency_vs_context.png")
