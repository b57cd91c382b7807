"""The NIAH heatmap: needle depth x context length, accuracy colour, per policy and protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from confkv.eval.niah.records import NiahResult


def plot_niah(result: NiahResult | dict[str, Any], path: str | Path) -> Path:
    """Heatmaps in a grid: one row per policy, one column per protocol, so a policy's protocols sit side by side.

    Each panel: needle depth (y) x context length (x), accuracy as colour and number; its
    title gives the protocol and the policy's accuracy over the panel. One colour bar.
    """
    from confkv.eval.report.plots import plt

    data = result.to_dict() if isinstance(result, NiahResult) else result
    config = data["config"]
    protocols, policies = config["protocols"], config["policies"]
    lengths, depths = config["lengths"], config["depths"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    panel_w, panel_h = 0.75 * len(lengths) + 0.9, 0.32 * len(depths) + 0.75
    fig, axes = plt.subplots(len(policies), len(protocols), squeeze=False,
                             figsize=(0.9 + panel_w * len(protocols), 0.5 + panel_h * len(policies)))
    image = None
    for i, policy in enumerate(policies):
        for j, protocol in enumerate(protocols):
            ax = axes[i][j]
            grid = data["grids"][f"{policy}/{protocol}"]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for y, row in enumerate(grid):
                for x, value in enumerate(row):
                    ax.text(x, y, "-" if value != value else f"{value:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [str(v) for v in lengths] if i == len(policies) - 1 else [],
                          fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths] if j == 0 else [], fontsize=7)
            acc = data["summary"][f"{policy}/{protocol}"]
            ax.set_title(f"{protocol}: not run" if acc != acc else f"{protocol}: acc {acc:.2f}", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"{policy}\nneedle depth", fontsize=9)
            if i == len(policies) - 1:
                ax.set_xlabel("context tokens", fontsize=8)
    fig.tight_layout()
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="accuracy", pad=0.02)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
