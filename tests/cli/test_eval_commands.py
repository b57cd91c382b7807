"""CLI smoke tests: every evaluation subcommand on a tiny local model loaded by path."""

import json

import pytest

from confkv.cli import main
from confkv.models import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def test_ppl_builtin_file_and_unreachable_hub(model_dir, tmp_path, capsys):
    out, plot = tmp_path / "ppl.json", tmp_path / "ppl.png"
    assert main(["ppl", "--model", model_dir, "--policy", "window", "--param", "budget=16", "--param", "protect=0",
                 "--tokens", "40", "--out", str(out), "--plot", str(plot)]) == 0
    data = json.loads(out.read_text())
    assert data["summary"]["tokens"] == 39 and len(data["trace"]["kv_bytes"]) == 39 and plot.exists()
    assert "preset" not in data["summary"]  # a registry policy, not a preset
    preset_out = tmp_path / "preset.json"
    assert main(["ppl", "--model", model_dir, "--memory", "0.5", "--tokens", "40", "--out", str(preset_out)]) == 0
    from confkv.presets import preset_signature

    assert json.loads(preset_out.read_text())["summary"]["preset"] == preset_signature("tiered")  # the default's
    text = tmp_path / "corpus.txt"
    text.write_text("A short text about caches. " * 20)
    assert main(["ppl", "--model", model_dir, "--policy", "full", "--corpus", str(text), "--tokens", "30"]) == 0
    assert main(["ppl", "--model", model_dir, "--corpus", "hf:no-such-user/no-such-dataset", "--tokens", "30"]) == 2
    assert "error" in capsys.readouterr().err


def test_ppl_records_the_store_an_int8_hot_tier_runs_with_and_refuses_a_second_int8_before_loading(
        model_dir, tmp_path, capsys):
    """``--policy tiered-int8``: the summary says what the cache ran with (INT8 past an FP window of 8, from the
    first step over the target), not the command's store flags; ``--int8`` beside it fails before any model loads."""
    from unittest import mock

    out = tmp_path / "int8.json"
    assert main(["ppl", "--model", model_dir, "--policy", "tiered-int8", "--memory", "0.25", "--tokens", "120",
                 "--out", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert (summary["kv_int8"], summary["fp_window"], summary["int8_from"]) == (True, 8, "over_budget")
    capsys.readouterr()
    with mock.patch("confkv.models.load_model", side_effect=AssertionError("loaded a model before checking")):
        assert main(["ppl", "--model", model_dir, "--policy", "tiered-int8", "--int8", "--tokens", "40"]) == 2
    assert "error: hot_int8_window: the storage keeps its hot tier in INT8" in capsys.readouterr().err


def test_ppl_log_has_no_bar_spam_and_says_unlimited(model_dir, tmp_path, capsys):
    """stderr is not a terminal under capsys: no carriage-return redraws (ours or transformers'
    loading bar), a few plain lines; the full cache's budget reads 'unlimited', never 2**62."""
    out, plot = tmp_path / "full.json", tmp_path / "full.png"
    assert main(["ppl", "--model", model_dir, "--policy", "full", "--tokens", "300", "--out", str(out),
                 "--plot", str(plot)]) == 0
    printed = capsys.readouterr()
    assert "\r" not in printed.err and len(printed.err.splitlines()) <= 6, printed.err
    assert "budgets used: [unlimited]" in printed.out
    assert "4611686018427387904" not in printed.out + printed.err + out.read_text()
    assert json.loads(out.read_text())["trace"]["budget"][0] == ["unlimited"]

def test_probe_cli(model_dir, tmp_path):
    assert main(["probe", "--model", model_dir, "--tokens", "70", "--k", "4,8", "--start", "20", "--n-boot", "50",
                 "--out-dir", str(tmp_path), "--no-progress"]) == 0
    data = json.loads((tmp_path / "probe.json").read_text())
    assert [r["summary"]["k"] for r in data["results"]] == [4, 8]
    assert (tmp_path / "probe.png").exists() and (tmp_path / "probe.csv").exists()


def test_niah_cli(model_dir, tmp_path):
    assert main(["niah", "--model", model_dir, "--lengths", "150", "--depths", "0.5", "--policies", "full,streaming",
                 "--max-new-tokens", "2", "--chunk", "64", "--out-dir", str(tmp_path), "--no-progress"]) == 0
    data = json.loads((tmp_path / "niah.json").read_text())
    assert len(data["records"]) == 4 and (tmp_path / "niah_heatmap.png").exists()


def test_sweep_and_report_cli(model_dir, tmp_path):
    out = tmp_path / "sweep" / "rows.jsonl"
    args = ["sweep", "--model", model_dir, "--policies", "full,window,confkv", "--memory", "0.5",
            "--tokens", "30", "--param", "confkv:protect=2", "--out", str(out), "--traces-dir",
            str(tmp_path / "sweep" / "traces"), "--no-progress"]
    assert main(args) == 0
    assert len(out.read_text().splitlines()) == 3
    assert main(args) == 0  # resumed: nothing added
    assert len(out.read_text().splitlines()) == 3
    assert main(["report", str(tmp_path), "--html"]) == 0
    page = (tmp_path / "REPORT.md").read_text()
    assert "Perplexity at matched KV memory" in page and "![" in page
    assert (tmp_path / "REPORT.html").exists()
