"""Sweep: analytic memory matching (checked against measured traces) and crash-safe resume."""

import json

import numpy as np
import pytest
import torch

from confkv.config import StoreConfig
from confkv.eval.ppl import streaming_ppl
from confkv.errors import ConfKVError
from confkv.eval.sweep import (BytesModel, SweepConfig, append_row, load_rows, match_budget, plan_sweep,
                               reference_bytes, row_key, run_sweep, simulate_kv_bytes)
from confkv.models import tiny_model, tiny_tokenizer
from confkv.policies import make_policy


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("name,params,int8,slack", [
    ("window", {"budget": 24}, False, 0),
    ("streaming", {"budget": 21}, False, 0),
    ("confkv", {"n_high": 20, "n_low": 40, "tau": 0.02, "protect": 4}, False, 0),
    ("h2o", {"budget": 40, "protect": 4}, True, 0),
    ("confkv-l", {"n_high": 30, "n_low": 40, "tau": 0.02, "protect": 4, "min_layer_budget": 14}, True, 0),
    ("full", {}, True, 0),
    ("window", {"budget": 24}, False, 5),
    ("streaming", {"budget": 21, "sinks": 2}, True, 3),
    ("confkv", {"n_high": 20, "n_low": 40, "tau": 0.02, "protect": 4}, False, 6),
    ("confkv", {"n_high": 20, "n_low": 40, "tau": 0.02, "protect": 4}, True, 6),
    ("confkv-r", {"budget": 24, "protect": 4, "bits": 2, "page_size": 8, "group_size": 8}, False, 0),
    ("confkv-r", {"budget": 30, "protect": 4, "bits": 3, "page_size": 8, "group_size": 4, "cold_budget": 40, "k": 3}, True, 4),
    ("kivi", {"budget": 16, "bits": 4, "page_size": 16, "group_size": 16}, False, 0),
    ("quest", {"budget": 20, "k": 2, "page_size": 4, "group_size": 4}, False, 0),
    # page formats: outlier values and indices per page, a codebook per layer (confkv.tiers)
    ("kivi", {"budget": 16, "bits": 2, "page_size": 16, "group_size": 16, "format": "outliers",
              "outlier_fraction": 0.02}, False, 0),
    ("confkv-r", {"budget": 24, "protect": 4, "bits": 3, "page_size": 8, "group_size": 8,
                  "format": "hadamard+outliers+codebook", "outlier_fraction": 0.05}, False, 0),
])
def test_simulated_bytes_equal_measured_trace(model, name, params, int8, slack):
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(0))
    store = StoreConfig(kv_int8=int8, fp_window=8, move_block=8, evict_slack=slack)
    result = streaming_ppl(model, ids, name, store=store, progress=False, **params)
    measured = np.array(result.trace.total_kv_bytes(), dtype=float)
    predicted = simulate_kv_bytes(make_policy(name, **params), BytesModel.for_model(model), len(measured), store,
                                  result.trace.confidences(0))
    np.testing.assert_array_equal(measured, predicted)


def test_matching_picks_the_right_budgets(model):
    bm = BytesModel.for_model(model)
    assert bm.fp_bytes == 2 * 2 * 16 * 4 and bm.int8_bytes == 2 * (2 * 16 + 2 * 4)
    steps = 200
    target = reference_bytes(bm, 64, steps, "peak")
    assert target == 64 * bm.fp_bytes * 2
    for name in ("window", "streaming", "h2o", "tova", "random", "confkv-fixed"):
        params, predicted = match_budget(name, target, bm, steps, stat="peak")
        assert params == {"budget": 64} and predicted == target
    params, _ = match_budget("confkv", target, bm, steps, stat="peak", extra={"protect": 8})
    assert params["n_low"] == 64 and params["n_high"] == 32
    # INT8: the old region costs int8 bytes, so the budget grows; the prediction stays under the target
    store = StoreConfig(kv_int8=True, fp_window=16)
    params, predicted = match_budget("window", target, bm, steps, stat="peak", store=store)
    b = params["budget"]
    assert b > 64 and predicted <= target
    # largest such budget (the peak is set by the FP window growing to fp_window + move_block - 1 tokens)
    assert simulate_kv_bytes(make_policy("window", budget=b + 1), bm, steps, store).max() > target
    # mean matching of a gated policy: always confident -> n_high carries the memory
    mean_target = reference_bytes(bm, 64, steps, "mean")
    params, predicted = match_budget("confkv", mean_target, bm, steps, stat="mean", confidences=[1.0] * steps,
                                     extra={"protect": 8})
    assert params["n_high"] in (64, 65) and predicted <= mean_target
    with pytest.raises(Exception):
        match_budget("confkv", 10.0, bm, steps, stat="peak")


def test_plan_uses_peak_match(model):
    config = SweepConfig(policies=("full", "window", "confkv"), reference_windows=(48,), tokens=120,
                         model="tiny", policy_params={"confkv": {"protect": 8}})
    runs = plan_sweep(model, config)
    assert [(r.policy, r.params) for r in runs] == [("full", {}), ("window", {"budget": 48}),
                                                    ("confkv", {"protect": 8, "n_low": 48, "n_high": 24})]


def test_resume_after_kill_no_duplicates_no_losses(model, tmp_path):
    tok = tiny_tokenizer()
    config = SweepConfig(policies=("full", "window", "streaming", "confkv"), reference_windows=(24,),
                         tokens=50, model="tiny", match="mean", policy_params={"confkv": {"protect": 4}})
    out = tmp_path / "rows.jsonl"
    partial = run_sweep(config, out, model=model, tokenizer=tok, progress=False, stop_after=2)
    assert len(partial) == 2 and len(load_rows(out)) == 2
    # a kill in the middle of writing the third row leaves a torn line
    with open(out, "a") as handle:
        handle.write('{"policy": "streaming", "ppl": 1.')
    rows = run_sweep(config, out, model=model, tokenizer=tok, progress=False)
    on_disk = load_rows(out)
    assert len(rows) == 4 and len(on_disk) == 4
    assert len({row_key(r) for r in on_disk}) == 4
    assert [r["policy"] for r in on_disk] == ["full", "window", "streaming", "confkv"]
    assert out.read_text().endswith("\n") and all(json.loads(l) for l in out.read_text().splitlines())
    # the measured memory verifies the analytic match
    for r in on_disk:
        if r["policy"] in ("window", "streaming"):
            assert r["mean_kv_bytes"] == pytest.approx(r["predicted_bytes"])
            assert r["match_error"] <= 1e-9
    # rerun: nothing new
    again = run_sweep(config, out, model=model, tokenizer=tok, progress=False)
    assert len(load_rows(out)) == 4 and [r["ppl"] for r in again] == [r["ppl"] for r in rows]


def test_append_row_is_one_line(tmp_path):
    path = tmp_path / "x.jsonl"
    append_row(path, {"a": 1})
    append_row(path, {"a": 2})
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n'


def test_gap_closure_fractions():
    from confkv.eval.sweep import gap_closed, gap_table

    base = {"model": "m", "corpus": "c", "tokens": 10, "offset": 0, "match": "mean"}
    rows = [dict(base, policy="full", ppl=10.0, reference_window=0),
            dict(base, policy="window", ppl=20.0, reference_window=256),
            dict(base, policy="streaming", ppl=14.0, reference_window=256),
            dict(base, policy="confkv", ppl=13.0, reference_window=256),
            dict(base, policy="confkv", ppl=12.0, reference_window=256, kv_int8=True),
            dict(base, policy="confkv", ppl=11.0, reference_window=512)]  # no window/streaming at 512: skipped
    gaps = gap_table(rows)
    by = {(g["policy"], g["kv_int8"]): g for g in gaps}
    assert set(by) == {("window", False), ("streaming", False), ("confkv", False), ("confkv", True)}
    assert by[("confkv", False)]["drop_vs_window"] == 7.0
    assert by[("confkv", False)]["window_gap_closed"] == pytest.approx(0.7)
    assert by[("confkv", False)]["streaming_gap_closed"] == pytest.approx(0.25)
    assert by[("confkv", True)]["streaming_gap_closed"] == pytest.approx(0.5)
    assert by[("window", False)]["streaming_gap_closed"] == pytest.approx(-1.5)
    assert gap_closed(12.0, 10.0, 10.0) != gap_closed(12.0, 10.0, 10.0)  # no gap: NaN


def test_int8_pyramid_gets_a_floor_that_holds_the_fp_window(model):
    bm = BytesModel.for_model(model)
    store = StoreConfig(kv_int8=True, fp_window=80)
    target = reference_bytes(bm, 256, 300, "peak")
    params, predicted = match_budget("confkv-l", target, bm, 300, stat="peak", store=store)
    assert params["min_layer_budget"] == 80 + 4 + 1 and predicted <= target  # above the default floor of 64
    params, _ = match_budget("confkv-l", target, bm, 300, stat="peak", store=store, extra={"min_layer_budget": 90})
    assert params["min_layer_budget"] == 90  # an explicit floor is kept


def test_no_valid_budget_is_a_clear_error(model):
    bm = BytesModel.for_model(model)
    with pytest.raises(ConfKVError, match="no budget up to .* is valid"):
        match_budget("confkv-l", 1e9, bm, 100, store=StoreConfig(kv_int8=True, fp_window=64),
                     extra={"min_layer_budget": 8}, max_tokens=256)


def test_simulated_resident_bytes_of_an_offloaded_cold_tier_equal_the_trace(model, tmp_path):
    """Offloaded: RAM holds the hot tier, the open page and the sealed pages' digests only."""
    params = {"budget": 24, "protect": 4, "bits": 4, "page_size": 8, "group_size": 8, "offload": True,
              "offload_dir": str(tmp_path)}
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(1))
    result = streaming_ppl(model, ids, "confkv-r", store=StoreConfig(), progress=False, **params)
    total = np.array(result.trace.total_kv_bytes(), dtype=float)
    resident = np.array([int(s.kv_bytes.sum()) - s.offloaded_bytes for s in result.trace.steps], dtype=float)
    policy, bm = make_policy("confkv-r", **params), BytesModel.for_model(model)
    np.testing.assert_array_equal(simulate_kv_bytes(policy, bm, len(total), StoreConfig()), total)
    np.testing.assert_array_equal(simulate_kv_bytes(policy, bm, len(total), StoreConfig(), resident=True), resident)
    assert resident[-1] < total[-1]  # sealed pages' codes and scales left RAM
    assert result.trace.peak_resident_bytes() == resident.max() < result.trace.peak_kv_bytes()


def test_an_offloaded_cold_tier_is_matched_on_resident_bytes(model, tmp_path):
    bm = BytesModel.for_model(model)
    steps = 200
    target = reference_bytes(bm, 128, steps, "peak")
    extra = {"protect": 4, "bits": 4, "page_size": 8, "group_size": 8}
    in_ram, _ = match_budget("confkv-r", target, bm, steps, extra=extra)
    offloaded, predicted = match_budget("confkv-r", target, bm, steps, extra={**extra, "offload": True,
                                                                              "offload_dir": str(tmp_path)},
                                        resident=True)
    assert offloaded["budget"] > in_ram["budget"]  # the pages' codes are not in RAM: more hot tokens fit
    assert predicted <= target


def test_a_fixed_hot_budget_gets_its_cold_budget_matched(model):
    """``budget`` fixed in the extra parameters: the bytes the hot tier leaves go to cold pages."""
    bm = BytesModel.for_model(model)
    steps = 400
    target = reference_bytes(bm, 128, steps, "peak")
    extra = {"budget": 24, "protect": 4, "bits": 4, "page_size": 8, "group_size": 8, "k": 2}
    params, predicted = match_budget("confkv-r", target, bm, steps, extra=extra)
    assert params["budget"] == 24 and params["cold_budget"] < steps  # the hot tier untouched, the cold one bounded

    def peak(cold_budget):
        policy = make_policy("confkv-r", **{**extra, "cold_budget": cold_budget})
        return simulate_kv_bytes(policy, bm, steps, StoreConfig()).max()
    assert predicted == peak(params["cold_budget"]) <= target < peak(params["cold_budget"] + 8)
    # 4-bit pages hold more tokens than the 128-token FP window they are matched to
    assert params["budget"] + params["cold_budget"] > 128
    # the cold budget fixed instead: the hot budget is searched, as before
    hot_extra = {**{k: v for k, v in extra.items() if k != "budget"}, "cold_budget": 64}
    hot, _ = match_budget("confkv-r", target, bm, steps, extra=hot_extra)
    assert hot["cold_budget"] == 64 and hot["budget"] > 24


def test_sweeps_of_other_texts_and_dtypes_keep_their_own_trace_files(model, tmp_path):
    """One traces folder for several sweeps: names carry the corpus and dtype unless they are the defaults."""
    tok = tiny_tokenizer()
    traces, out = tmp_path / "traces", tmp_path / "rows.jsonl"
    base = dict(policies=("window",), reference_windows=(24,), tokens=40, model="tiny")
    for corpus in ("pydoc-topics", "stdlib-docs"):
        run_sweep(SweepConfig(**base, corpus=corpus), out, model=model, tokenizer=tok, progress=False,
                  traces_dir=traces)
    names = sorted(p.name for p in traces.iterdir())
    assert names == ["stdlib-docs_window_int8-0_ref-24_budget24.json", "window_int8-0_ref-24_budget24.json"]
    rows = load_rows(out)
    for row in rows:  # each row points at its own trace, whose summary is that row's
        summary = json.loads(open(row["trace_file"]).read())["summary"]
        assert summary["corpus"] == row["corpus"] and summary["ppl"] == row["ppl"]
    from confkv.eval.sweep import _trace_name
    assert _trace_name(rows[0], SweepConfig(**base, dtype="bfloat16")) == "bfloat16_window_int8-0_ref-24_budget24.json"
