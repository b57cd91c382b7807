"""Sweep: every policy at every memory target (held by the cache), crash-safe resume, gap table, trace names."""

import json

import pytest

from confkv.errors import ConfigError
from confkv.eval.quality.sweep import SweepConfig, append_row, load_rows, plan_sweep, row_key, run_sweep
from confkv.models import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_plan_runs_full_once_and_every_other_policy_at_every_memory():
    config = SweepConfig(policies=("full", "window", "confkv"), memory=(0.5, 0.25), tokens=120, model="tiny",
                         policy_params={"confkv": {"protect": 8}, "*": {"tau": 0.6, "budget": 64}})
    runs = plan_sweep(config)
    # '*' gives each policy the keys it takes (window: budget; confkv: tau), a policy's own keys win
    assert [(r.policy, r.params, r.memory) for r in runs] == [
        ("full", {}, None),  # full takes no budget
        ("window", {"budget": 64, "memory": 0.5}, 0.5), ("window", {"budget": 64, "memory": 0.25}, 0.25),
        ("confkv", {"tau": 0.6, "protect": 8, "memory": 0.5}, 0.5),
        ("confkv", {"tau": 0.6, "protect": 8, "memory": 0.25}, 0.25)]
    assert SweepConfig().memory == (0.25, 0.125)
    with pytest.raises(ConfigError, match="tova: unknown parameter|ladder"):
        plan_sweep(SweepConfig(policies=("tova",), policy_params={"tova": {"ladder": [8, 4]}}))


def test_resume_after_kill_no_duplicates_no_losses(model, tmp_path):
    tok = tiny_tokenizer()
    config = SweepConfig(policies=("full", "window", "streaming", "confkv"), memory=(0.5,),
                         tokens=50, model="tiny", policy_params={"confkv": {"protect": 4}})
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
    # every run but full held its target: the measured bytes never above it
    for r in on_disk:
        assert r["memory"] == (None if r["policy"] == "full" else 0.5)
        if r["policy"] != "full":
            assert r["max_target_share"] <= 1.0 and r["final_target_bytes"] > 0
    # rerun: nothing new
    again = run_sweep(config, out, model=model, tokenizer=tok, progress=False)
    assert len(load_rows(out)) == 4 and [r["ppl"] for r in again] == [r["ppl"] for r in rows]


def test_append_row_is_one_line(tmp_path):
    path = tmp_path / "x.jsonl"
    append_row(path, {"a": 1})
    append_row(path, {"a": 2})
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n'


def test_gap_closure_fractions():
    from confkv.eval.quality.sweep import gap_closed, gap_table

    base = {"model": "m", "corpus": "c", "tokens": 10, "offset": 0}
    rows = [dict(base, policy="full", ppl=10.0, memory=None),
            dict(base, policy="window", ppl=20.0, memory=0.25),
            dict(base, policy="streaming", ppl=14.0, memory=0.25),
            dict(base, policy="confkv", ppl=13.0, memory=0.25),
            dict(base, policy="confkv", ppl=12.0, memory=0.25, kv_int8=True),
            dict(base, policy="confkv", ppl=11.0, memory=0.125),  # no window/streaming at 0.125: skipped
            # a row of a sweep made before memory targets: its references are the rows of the same window
            dict(base, policy="window", ppl=30.0, reference_window=256, match="peak"),
            dict(base, policy="streaming", ppl=20.0, reference_window=256, match="peak"),
            dict(base, policy="confkv", ppl=15.0, reference_window=256, match="peak")]
    gaps = gap_table(rows)
    by = {(g["policy"], g["kv_int8"], g["memory_kind"]): g for g in gaps}
    assert set(by) == {("window", False, "memory"), ("streaming", False, "memory"), ("confkv", False, "memory"),
                       ("confkv", True, "memory"), ("window", False, "window"), ("streaming", False, "window"),
                       ("confkv", False, "window")}
    confkv = by[("confkv", False, "memory")]
    assert confkv["memory"] == 0.25 and confkv["drop_vs_window"] == 7.0
    assert confkv["window_gap_closed"] == pytest.approx(0.7)
    assert confkv["streaming_gap_closed"] == pytest.approx(0.25)
    assert by[("confkv", True, "memory")]["streaming_gap_closed"] == pytest.approx(0.5)
    assert by[("window", False, "memory")]["streaming_gap_closed"] == pytest.approx(-1.5)
    assert by[("confkv", False, "window")]["memory"] == 256
    assert by[("confkv", False, "window")]["streaming_gap_closed"] == pytest.approx(0.5)
    assert gap_closed(12.0, 10.0, 10.0) != gap_closed(12.0, 10.0, 10.0)  # no gap: NaN


def test_sweeps_of_other_texts_and_dtypes_keep_their_own_trace_files(model, tmp_path):
    """One traces folder for several sweeps: names carry the corpus and dtype unless they are the defaults."""
    tok = tiny_tokenizer()
    traces, out = tmp_path / "traces", tmp_path / "rows.jsonl"
    base = dict(policies=("window",), memory=(0.5,), tokens=40, model="tiny")
    for corpus in ("pydoc-topics", "stdlib-docs"):
        run_sweep(SweepConfig(**base, corpus=corpus), out, model=model, tokenizer=tok, progress=False,
                  traces_dir=traces)
    names = sorted(p.name for p in traces.iterdir())
    assert names == ["stdlib-docs_window_int8-0_mem-0.5_memory0.5.json", "window_int8-0_mem-0.5_memory0.5.json"]
    rows = load_rows(out)
    for row in rows:  # each row points at its own trace, whose summary is that row's
        summary = json.loads(open(row["trace_file"]).read())["summary"]
        assert summary["corpus"] == row["corpus"] and summary["ppl"] == row["ppl"]
    from confkv.eval.quality.sweep import _trace_name
    assert _trace_name(rows[0], SweepConfig(**base, dtype="bfloat16")) == "bfloat16_window_int8-0_mem-0.5_memory0.5.json"
