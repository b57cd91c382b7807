"""PNG plots of results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from confkv.display import budget_for_plot, budget_from_json, is_unlimited  # noqa: E402
from confkv.tiers.planner import MemoryTrace  # noqa: E402


def plot_trace(trace: MemoryTrace, path: str | Path, title: str = "", sequence: int = 0) -> Path:
    """The sawtooth: kept tokens and KV bytes per step, next to the step's confidence."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = list(range(len(trace)))
    fig, axes = plt.subplots(3, 1, figsize=(10, 6.5), sharex=True)
    axes[0].plot(steps, trace.confidences(sequence), lw=0.6, color="tab:purple")
    axes[0].set_ylabel("confidence c")
    axes[0].set_ylim(0, 1)
    axes[1].plot(steps, trace.kept_tokens(sequence), lw=0.8, color="tab:blue", label="kept (mean over layers)")
    budgets = [s.budget[sequence] for s in trace.steps]
    unlimited = any(is_unlimited(b) for b in budgets)  # not drawn (it would stretch the axis to 4.6e18)
    axes[1].plot(steps, [budget_for_plot(b) for b in budgets], lw=0.6, color="tab:orange", ls="--",
                 label="budget: unlimited" if unlimited and all(is_unlimited(b) for b in budgets)
                 else "budget" + (" (not drawn where unlimited)" if unlimited else ""))
    axes[1].set_ylabel("tokens")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[2].plot(steps, [b / 1e6 for b in trace.total_kv_bytes()], lw=0.8, color="tab:green")
    axes[2].set_ylabel("KV MB (all layers)")
    axes[2].set_xlabel("step")
    if title:
        axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def trace_from_dict(data: dict) -> MemoryTrace:
    """Rebuild a :class:`MemoryTrace` from :meth:`MemoryTrace.to_dict` output (e.g. a saved JSON)."""
    import torch

    from confkv.tiers.planner import StepRecord

    trace = MemoryTrace()
    targets = data.get("target_bytes") or [None] * len(data["seen"])  # traces made before memory targets: none
    for seen, conf, budget, kept, kv, target in zip(data["seen"], data["confidence"], data["budget"], data["kept"],
                                                    data["kv_bytes"], targets):
        trace.record(StepRecord(confidence=torch.tensor([float("nan") if c is None else c for c in conf],
                                                        dtype=torch.float32),  # None: not worked out
                                budget=torch.tensor(budget_from_json(budget), dtype=torch.int64),
                                kept=torch.tensor(kept, dtype=torch.int64),
                                kv_bytes=torch.tensor(kv, dtype=torch.int64), seen=int(seen), target_bytes=target))
    return trace


def plot_ppl_at_memory(rows: list[dict], path: str | Path, title: str = "", memory: str = "mean_kv_bytes") -> Path:
    """Perplexity of every policy at matched KV memory: one panel per memory size, policies side by side.

    Memory-matched runs all sit at (almost) the same memory, and full KV needs several times
    more, so a perplexity-vs-memory scatter puts every policy on one vertical line. Here each
    panel is one memory size (``memory`` of the sweep rows; ``reference_window`` and ``match`` of
    rows made before memory targets): one row
    per run, sorted by perplexity (best on top), labelled with its PPL and its ``memory``
    (MB, all layers); full KV is the dashed line, with its own memory. Panels are stacked. The perplexity axis is
    linear and starts at full KV; a run whose excess over full KV is more than 3x the panel's
    median excess (the plain sliding window, typically) is drawn at the right edge with its value,
    so it cannot squeeze the differences the tables discuss into a few pixels.

    ``rows`` are sweep rows (``policy``, ``kv_int8``, ``ppl``, the ``memory`` argument's key, and
    ``memory`` or ``reference_window`` and ``match``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    full = [r for r in rows if r["policy"] == "full" and not r.get("kv_int8")]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r not in full:
            groups.setdefault((r.get("reference_window") or 0, r.get("match") or "", r.get("memory") or 0.0),
                              []).append(r)
    keys = sorted(groups, key=lambda k: (-k[0], k[1], -k[2]))
    names = sorted({r["policy"] for r in rows})
    cmap = plt.get_cmap("tab10")
    sizes = [max(2, len(groups[k])) for k in keys] or [2]
    fig, axes = plt.subplots(len(sizes), 1, figsize=(7.5, 0.8 + sum(0.3 * n + 0.75 for n in sizes)), squeeze=False,
                             gridspec_kw={"height_ratios": sizes})
    for ax, key in zip(axes[:, 0], keys):
        _ppl_panel(ax, sorted(groups[key], key=lambda r: -r["ppl"]), full[0] if full else None, memory, names, cmap)
        window, match, fraction = key
        ax.set_title(f"memory of a {window}-token FP window ({match}-matched)" if window else
                     f"memory target {fraction:.1%} of the full cache's bytes" if fraction else "runs", fontsize=9)
    if not keys:
        axes[0][0].set_axis_off()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ppl_panel(ax, rows: list[dict], full: dict | None, memory: str, names: list[str], cmap) -> None:
    """One memory size: a dot per run at its perplexity, the worst at the bottom; off-scale runs clipped."""
    base = full["ppl"] if full else min(r["ppl"] for r in rows)
    excess = sorted(r["ppl"] - base for r in rows)
    median = excess[(len(excess) - 1) // 2]  # the lower median
    cap = base + 3 * median if median > 0 else max(r["ppl"] for r in rows)
    shown = [min(r["ppl"], cap) for r in rows]
    right = max(shown) + 0.12 * (max(shown) - base or 1)
    for y, (r, x) in enumerate(zip(rows, shown)):
        int8 = bool(r.get("kv_int8"))
        ax.plot([base, x], [y, y], color="0.85", lw=1, zorder=1)
        ax.plot([x], [y], marker=">" if r["ppl"] > cap else ("^" if int8 else "o"), ms=7, zorder=2,
                color=cmap(names.index(r["policy"]) % 10))
        ax.annotate(f"{r['ppl']:.2f}" + (" (off scale)" if r["ppl"] > cap else ""), (x, y), xytext=(6, 0),
                    textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [f"{r['policy']}{' +INT8' if r.get('kv_int8') else ''}  "
                                     f"{r[memory] / 1e6:.1f} MB" for r in rows], fontsize=8)
    if full:
        ax.axvline(base, color="black", ls="--", lw=0.8, label=f"full KV {base:.2f} ({full[memory] / 1e6:.1f} MB)")
        ax.legend(loc="upper right", fontsize=7)
    ax.set_xlim(base - 0.05 * (right - base), right + 0.18 * (right - base))
    ax.set_xlabel(f"streaming perplexity (label: {'mean' if memory.startswith('mean') else 'peak'} KV MB, all layers)",
                  fontsize=8)
    ax.grid(axis="x", alpha=0.3)
