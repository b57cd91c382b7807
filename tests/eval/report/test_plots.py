"""Plots keep their point readable: one panel per memory size; NIAH protocols side by side per policy;
no axis stretched by the unlimited-budget sentinel."""

import json

import pytest

from confkv.cli import main
from confkv.eval.niah import plot_niah
from confkv.eval.report.plots import plot_ppl_at_memory, plot_trace, plt
from confkv.policies import UNLIMITED

from test_display import trace_with_budgets


@pytest.fixture
def saved_axes(monkeypatch):
    """The axes of every figure saved during the test."""
    axes = []
    original = plt.Figure.savefig

    def savefig(fig, *args, **kwargs):
        axes.append(fig.axes)
        return original(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", savefig)
    return axes


def _row(policy, ppl, window, mb, int8=False):
    return {"policy": policy, "ppl": ppl, "reference_window": window, "match": "mean", "kv_int8": int8,
            "mean_kv_bytes": mb * 1e6, "peak_kv_bytes": mb * 1e6}


def test_ppl_at_memory_one_panel_per_memory_size_outlier_does_not_stretch(tmp_path, saved_axes):
    rows = [_row("full", 11.9, 0, 47.2), _row("window", 24.2, 256, 11.1), _row("streaming", 14.1, 256, 11.1),
            _row("tova", 13.1, 256, 11.1), _row("confkv", 12.5, 256, 11.1, int8=True),
            _row("window", 18.9, 512, 20.6), _row("h2o", 11.8 + 0.5, 512, 20.6), _row("tova", 12.4, 512, 20.6)]
    plot_ppl_at_memory(rows, tmp_path / "p.png")
    panels = saved_axes[0]
    assert [ax.get_title() for ax in panels] == ["memory of a 512-token FP window (mean-matched)",
                                                 "memory of a 256-token FP window (mean-matched)"]
    low, high = panels[1].get_xlim()
    assert low < 11.9 and high < 17, (low, high)  # 12.5 vs 14.1 spans a good part of the axis, not the window's 24
    labels = [t.get_text() for t in panels[1].get_yticklabels()]
    assert labels[-1].startswith("confkv +INT8") and "11.1 MB" in labels[-1]  # best on top
    assert any("24.20 (off scale)" == t.get_text() for t in panels[1].texts)


def test_niah_heatmap_rows_are_policies_columns_protocols(tmp_path, saved_axes):
    policies, protocols = ["full", "window", "confkv"], ["query-aware", "streaming"]
    keys = [f"{p}/{q}" for p in policies for q in protocols]
    data = {"config": {"protocols": protocols, "policies": policies, "lengths": [1024, 2048], "depths": [0.0, 1.0]},
            "grids": {k: [[1.0, 0.0], [1.0, 1.0]] for k in keys}, "summary": {k: 0.75 for k in keys}}
    data["summary"]["window/streaming"] = float("nan")
    (tmp_path / "niah.json").write_text(json.dumps(data))
    assert main(["niah", "--out-dir", str(tmp_path), "--replot"]) == 0  # no model is loaded
    assert (tmp_path / "niah_heatmap.png").exists()
    panels = [ax for ax in saved_axes[0] if ax.get_label() != "<colorbar>"]
    assert len(panels) == len(policies) * len(protocols)
    titles = [ax.get_title() for ax in panels]
    assert titles[:2] == ["query-aware: acc 0.75", "streaming: acc 0.75"]  # one policy's two protocols in one row
    assert titles[3] == "streaming: not run"
    assert [panels[2 * i].get_ylabel().split("\n")[0] for i in range(3)] == policies
    plot_niah(data, tmp_path / "again.png")


def test_trace_plot_axis_is_not_stretched_by_the_sentinel(tmp_path, saved_axes):
    plot_trace(trace_with_budgets([UNLIMITED] * 20), tmp_path / "full.png")
    tokens_axis = saved_axes[0][1]
    assert tokens_axis.get_ylim()[1] < 100  # kept tokens go to 20; the sentinel would put it at 4.6e18
    assert [t.get_text() for t in tokens_axis.get_legend().get_texts()][1] == "budget: unlimited"
