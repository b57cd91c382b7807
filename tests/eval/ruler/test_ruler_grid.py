"""``confkv ruler`` on a tiny random model: records, resume, table, plot, bad input."""

from __future__ import annotations

import json

import pytest

from confkv.cli import main
from confkv.eval.ruler.grid import RulerConfig, ruler_table, run_ruler_grid, summarize
from confkv.errors import ConfigError

ARGS = ["ruler", "--model", "tiny-llama", "--lengths", "1024", "--tasks", "fwe", "--policies",
        "full,tova,streaming+int8", "--memory", "0.25,0.5", "--samples", "2", "--batch", "2", "--chunk", "128",
        "--no-progress"]


def test_grid_writes_records_table_and_plot_and_resumes(tmp_path, capsys):
    out = tmp_path / "ruler"
    assert main(ARGS + ["--out-dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "ruler.jsonl").read_text().splitlines()]
    # 1 task x 2 samples x (full once + 2 policies x 2 fractions)
    assert len(rows) == 2 * 5
    assert {(r["policy"], r["kv_fraction"]) for r in rows} == {
        ("full", 1.0), ("tova", 0.25), ("tova", 0.5), ("streaming+int8", 0.25), ("streaming+int8", 0.5)}
    tova = [r for r in rows if r["policy"] == "tova"]
    assert all(r["params"] == {"memory": r["kv_fraction"]} for r in tova)  # the cache holds the target
    assert max(r["peak_kv_bytes_per_seq"] for r in tova if r["kv_fraction"] == 0.25) < \
        min(r["peak_kv_bytes_per_seq"] for r in tova if r["kv_fraction"] == 0.5)
    table = (out / "ruler.md").read_text()
    assert "| policy | memory | fwe | avg | n |" in table
    assert "| tova | 0.25 |" in table and (out / "ruler.png").stat().st_size > 0
    # a second run computes nothing new
    assert main(ARGS + ["--out-dir", str(out)]) == 0
    assert len((out / "ruler.jsonl").read_text().splitlines()) == len(rows)
    assert main(ARGS + ["--out-dir", str(out), "--collect-only"]) == 0
    assert "| full | 1 |" in capsys.readouterr().out
    # collecting with another run's settings finds nothing: a clear error, not an empty plot
    assert main(ARGS + ["--out-dir", str(out), "--collect-only", "--dtype", "bfloat16"]) != 0
    assert "has no records of this run (model tiny-llama, --dtype bfloat16" in capsys.readouterr().err


def test_table_averages_tasks():
    records = [{"task": t, "length": 4096, "index": i, "policy": p, "kv_fraction": f, "score": s}
               for t, p, f, i, s in [("a", "full", 1.0, 0, 1.0), ("a", "full", 1.0, 1, 0.5), ("b", "full", 1.0, 0, 0.0),
                                     ("a", "tova", 0.25, 0, 0.25), ("b", "tova", 0.25, 0, 0.75)]]
    summary = summarize(records)
    assert summary[(4096, "full", 1.0)]["a"] == pytest.approx(75.0)
    assert summary[(4096, "full", 1.0)]["avg"] == pytest.approx(37.5)
    assert summary[(4096, "tova", 0.25)]["avg"] == pytest.approx(50.0)
    table = ruler_table(records, ["a", "b"])
    assert table.index("| full |") < table.index("| tova |")


@pytest.mark.parametrize("kwargs, named", [({"tasks": ("qa_hotpot",)}, "qa_hotpot"),
                                           ({"policies": ("tovaa",)}, "tovaa"),
                                           ({"memory": (0.0,)}, "--memory"),
                                           ({"memory": ()}, "--memory"),
                                           ({"policies": ("confkv-r",)}, "confkv-r at memory 0.25"),
                                           ({"protocol": "sideways"}, "protocol")])
def test_bad_grid_is_refused_naming_the_field(kwargs, named):
    with pytest.raises((ConfigError, ValueError), match=named):
        RulerConfig(**kwargs)


def test_length_past_the_model_positions_is_refused():
    from confkv.errors import PromptTooLongError
    from confkv.models import tiny_model, tiny_tokenizer

    with pytest.raises(PromptTooLongError):
        run_ruler_grid(tiny_model("llama"), tiny_tokenizer(), RulerConfig(lengths=(4096,), tasks=("fwe",)),
                       progress=False)
