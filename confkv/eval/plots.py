"""PNG plots of results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
    axes[1].plot(steps, [float(s.budget[sequence]) for s in trace.steps], lw=0.6, color="tab:orange", ls="--",
                 label="budget")
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
