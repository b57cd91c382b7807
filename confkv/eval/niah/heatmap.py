"""The NIAH heatmap: needle depth x context length, accuracy colour, per policy and protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from confkv.eval.niah.records import NiahResult


def plot_niah(result: NiahResult | dict[str, Any], path: str | Path) -> Path:
    """Heatmaps: rows = protocols, columns = policies; depth (y) x context length (x), accuracy colour."""
    from confkv.eval.plots import plt

    data = result.to_dict() if isinstance(result, NiahResult) else result
    config = data["config"]
    protocols, policies = config["protocols"], config["policies"]
    lengths, depths = config["lengths"], config["depths"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(protocols), len(policies), squeeze=False,
                             figsize=(1.2 + 0.9 * len(lengths) * len(policies), 0.9 + 0.55 * len(depths) * len(protocols)))
    for i, protocol in enumerate(protocols):
        for j, policy in enumerate(policies):
            ax = axes[i][j]
            grid = data["grids"][f"{policy}/{protocol}"]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for y, row in enumerate(grid):
                for x, value in enumerate(row):
                    ax.text(x, y, "-" if value != value else f"{value:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [str(v) for v in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
            acc = data["summary"][f"{policy}/{protocol}"]
            ax.set_title(f"{policy} / {protocol}\nacc {acc:.2f}", fontsize=8)
            if j == 0:
                ax.set_ylabel("needle depth")
            if i == len(protocols) - 1:
                ax.set_xlabel("context tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

