"""PNG plots of results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from confkv.display import budget_for_plot, budget_from_json, is_unlimited  # noqa: E402
from confkv.trace import MemoryTrace  # noqa: E402


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

    from confkv.trace import StepRecord

    trace = MemoryTrace()
    for seen, conf, budget, kept, kv in zip(data["seen"], data["confidence"], data["budget"], data["kept"],
                                            data["kv_bytes"]):
        trace.record(StepRecord(confidence=torch.tensor(conf, dtype=torch.float32),
                                budget=torch.tensor(budget_from_json(budget), dtype=torch.int64),
                                kept=torch.tensor(kept, dtype=torch.int64),
                                kv_bytes=torch.tensor(kv, dtype=torch.int64), seen=int(seen)))
    return trace


def plot_pareto(rows: list[dict], path: str | Path, title: str = "", memory: str = "mean_kv_bytes") -> Path:
    """Perplexity against KV memory (MB), one marker per run, one colour per policy, Pareto front drawn.

    ``rows`` are sweep rows (``policy``, ``kv_int8``, ``ppl`` and ``memory`` keys).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    names = sorted({r["policy"] for r in rows})
    cmap = plt.get_cmap("tab10")
    for i, name in enumerate(names):
        for int8, marker in ((False, "o"), (True, "^")):
            pts = sorted((r[memory] / 1e6, r["ppl"]) for r in rows if r["policy"] == name and bool(r.get("kv_int8")) == int8)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker=marker, ls="-" if len(pts) > 1 else "", color=cmap(i % 10), ms=6,
                        label=f"{name}{' +INT8' if int8 else ''}")
    front, best = [], float("inf")
    for x, y in sorted((r[memory] / 1e6, r["ppl"]) for r in rows):
        if y < best:
            front.append((x, y))
            best = y
    if len(front) > 1:
        xs, ys = zip(*front)
        ax.step(xs, ys, where="post", color="black", lw=0.8, ls=":", label="Pareto front")
    ax.set_xlabel(f"{'mean' if memory.startswith('mean') else 'peak'} KV memory (MB, all layers)")
    ax.set_ylabel("streaming perplexity")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
