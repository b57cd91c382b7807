"""The confidence/KL probe: batched masked pass equals literal eviction; statistics are sane."""

import numpy as np
import pytest
import torch

from confkv.eval.quality.probe import (bootstrap_ci, pearson, plot_probe, probe_confidence_kl, reference_evicted_logits,
                               spearman)
from confkv.models import tiny_model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batched_probe_matches_literal_eviction(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(1))
    (result,) = probe_confidence_kl(model, ids, k=5, start=12, block=32, n_boot=50, progress=False)
    assert result.positions.tolist() == list(range(12, 89))
    for t in (12, 31, 32, 60, 88):
        i = int((result.positions == t).nonzero()[0, 0])
        ev = torch.log_softmax(reference_evicted_logits(model, ids, t, 5), -1)
        with torch.no_grad():
            full = torch.log_softmax(model(ids[:, : t + 1]).logits[0, -1].float(), -1)
        kl = float((full.exp() * (full - ev)).sum())
        assert abs(kl - float(result.kl[i])) < 1e-4
        assert abs(float(-full[ids[0, t + 1]]) - float(result.nll_full[i])) < 1e-4


def test_probe_stats_stride_and_plot(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(2))
    results = probe_confidence_kl(model, ids, k=[2, 8], start=20, stride=3, block=25, n_boot=200, progress=False)
    assert [r.k for r in results] == [2, 8]
    for r in results:
        assert r.positions.tolist() == list(range(20, 79, 3))
        assert (r.kl >= 0).all() and ((r.confidence >= 0) & (r.confidence <= 1)).all()
        s = r.summary()
        assert -1 <= s["pearson_r"] <= 1
        lo, hi = s["pearson_ci95"]
        assert lo <= hi
    path = plot_probe(results, tmp_path / "probe.png")
    assert path.stat().st_size > 1000
    assert model.config._attn_implementation != "confkv"  # restored


def test_statistics():
    rng = np.random.default_rng(0)
    x = rng.normal(size=400)
    y = -0.8 * x + 0.3 * rng.normal(size=400)
    r = pearson(x, y)
    assert r == pytest.approx(np.corrcoef(x, y)[0, 1])
    lo, hi = bootstrap_ci(x, y, n_boot=300)
    assert lo <= r <= hi and lo < hi < 0
    lo_b, hi_b = bootstrap_ci(x, y, n_boot=300, block_len=20)
    assert lo_b <= hi_b
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 2, 4], [4, 3, 3, 1]) == pytest.approx(-1.0)


def test_probe_rejects_bad_arguments():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 40))
    with pytest.raises(ValueError):
        probe_confidence_kl(model, ids, k=0, progress=False)
    with pytest.raises(ValueError):
        probe_confidence_kl(model, ids, k=8, start=3, progress=False)


def _keep_recent_reference(model, ids, t: int, recent: int, sinks: int) -> torch.Tensor:
    """Literal: full KV of 0..t-1, keep slots < sinks and t-recent..t-1 only, feed token t at position t."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = DynamicCache()
        model(input_ids=ids[:, :t], cache=full, use_cache=True)
        keep = sorted(set(range(min(sinks, t))) | set(range(max(t - recent, 0), t)))
        kept = DynamicCache()
        for i, layer in enumerate(full.layers):
            kept.update(layer.keys[:, :, keep], layer.values[:, :, keep], i)
        mask = torch.ones(1, 1, 1, len(keep) + 1, dtype=torch.bool)
        out = model(input_ids=ids[:, t:t + 1], cache=kept, use_cache=True, position_ids=torch.tensor([[t]]),
                    attention_mask=mask)
    return out.logits[0, -1].float()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_keep_recent_reading_matches_literal_eviction(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    (result,) = probe_confidence_kl(model, ids, k=10, start=30, block=32, n_boot=50, progress=False,
                                    keep_recent=True, sinks=3)
    assert result.mode == "keep-recent" and result.summary()["sinks"] == 3
    for t in (30, 45, 64, 88):
        i = int((result.positions == t).nonzero()[0, 0])
        ev = torch.log_softmax(_keep_recent_reference(model, ids, t, 10, 3), -1)
        with torch.no_grad():
            full = torch.log_softmax(model(ids[:, : t + 1]).logits[0, -1].float(), -1)
        kl = float((full.exp() * (full - ev)).sum())
        assert abs(kl - float(result.kl[i])) < 1e-4, (t, kl, float(result.kl[i]))


def test_kl_by_confidence_quintile():
    from confkv.eval.quality.probe import quintile_table

    conf = np.arange(10, dtype=float) / 10  # 0.0 .. 0.9
    kl = np.array([5, 1, 4, 4, 3, 3, 2, 2, 100, 0], dtype=float)
    rows = quintile_table(conf[::-1].copy(), kl[::-1].copy())  # input order must not matter
    assert [r["steps"] for r in rows] == [2] * 5
    assert [r["median_kl"] for r in rows] == [3.0, 4.0, 3.0, 2.0, 50.0]
    assert [r["mean_kl"] for r in rows] == [3.0, 4.0, 3.0, 2.0, 50.0]
    assert rows[0]["confidence_max"] == pytest.approx(0.1) and rows[-1]["confidence_min"] == pytest.approx(0.8)
