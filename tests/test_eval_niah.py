"""NIAH grid: both protocols run, are scored, and are exact with the full cache; heatmap written."""

import torch

from confkv.data import make_niah_sample, score_niah
from confkv.eval.niah import NiahConfig, budgets_for_bytes, full_kv_bytes, plot_niah, run_niah_batch, run_niah_grid, write_niah
from confkv.config import StoreConfig
from confkv.models import tiny_model, tiny_tokenizer


def test_grid_both_protocols_scores_and_heatmap(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    config = NiahConfig(lengths=(120, 160), depths=(0.0, 1.0), trials=1, policies=("full", "streaming", "confkv"),
                        chunk=64, max_new_tokens=3, extra_params={"protect": 4})
    result = run_niah_grid(model, tok, config, progress=False)
    assert len(result.records) == 2 * 2 * 1 * 3 * 2
    assert {r.protocol for r in result.records} == {"query-aware", "streaming"}
    for r in result.records:
        assert r.correct == score_niah(r.generated, r.answer)
    # budget: 25% of the longest context's full KV bytes, converted per policy
    assert result.budget_bytes[120] == 0.25 * full_kv_bytes(model, 160)
    assert result.budgets["streaming@120"]["budget"] == 40
    assert result.budgets["confkv@160"]["n_low"] == 40 and result.budgets["confkv@160"]["n_high"] == 20
    # evicting policies hold about the budget when answering; full holds everything
    for r in result.records:
        if r.policy == "full":
            assert r.kept_at_answer == r.length
        else:
            assert r.kept_at_answer <= 40 + 1
    grid = result.grid("full", "streaming")
    assert len(grid) == 2 and len(grid[0]) == 2
    paths = write_niah(result, tmp_path)
    png = plot_niah(result, tmp_path / "niah_heatmap.png")
    assert all(p.exists() for p in paths) and png.stat().st_size > 1000
    assert len((tmp_path / "niah.csv").read_text().splitlines()) == len(result.records) + 1


def test_full_cache_both_protocols_equal_plain_generate():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    samples = [make_niah_sample(tok, context_tokens=150, depth=d, trial=0) for d in (0.2, 0.8)]
    ids = torch.cat([s.input_ids for s in samples])
    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4,
                               pad_token_id=tok.pad_token_id)
    expected = tok.batch_decode(plain[:, ids.shape[1]:], skip_special_tokens=True)
    for protocol in ("query-aware", "streaming"):
        outs = run_niah_batch(model, tok, samples, "full", {}, protocol, store=StoreConfig(), chunk=48,
                              max_new_tokens=4)
        assert [o[0] for o in outs] == expected


def test_budgets_for_bytes_int8_grows_budget():
    model = tiny_model("llama")
    target = full_kv_bytes(model, 400) * 0.25
    fp = budgets_for_bytes(model, ["window", "full"], target, 400)
    q = budgets_for_bytes(model, ["window"], target, 400, store=StoreConfig(kv_int8=True, fp_window=16))
    assert fp["window"]["budget"] == 100 and fp["full"] == {}
    assert q["window"]["budget"] > 100
