"""The report page: tables and images from sweep rows, NIAH, probe and ppl files."""

import json

import torch

from confkv.eval.niah import NiahConfig, plot_niah, run_niah_grid, write_niah
from confkv.eval.quality.ppl import streaming_ppl
from confkv.eval.quality.probe import plot_probe, probe_confidence_kl
from confkv.eval.report.page import build_report, markdown_to_html
from confkv.eval.quality.sweep import append_row
from confkv.models import tiny_model, tiny_tokenizer


def test_report_page_with_images(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    # sweep rows (one gated run with a saved trace)
    traces = tmp_path / "sweep" / "traces"
    traces.mkdir(parents=True)
    for name, params in (("full", {}), ("window", {"budget": 16}), ("confkv", {"n_high": 8, "n_low": 16, "protect": 2})):
        r = streaming_ppl(model, ids, name, progress=False, **params)
        row = {"task": "ppl", "model": "tiny", "corpus": "x", "tokens": 40, "offset": 0, "policy": name,
               "params": params, "kv_int8": False, "fp_window": None, "reference_window": 16, "match": "peak",
               "ppl": r.ppl, "peak_kv_bytes": r.trace.peak_kv_bytes(), "mean_kv_bytes": r.trace.mean_kv_bytes(),
               "match_error": 0.0}
        if name == "confkv":
            (traces / "c.json").write_text(json.dumps({"trace": r.trace.to_dict()}))
            row["trace_file"] = str(traces / "c.json")
            (tmp_path / "ppl_run.json").write_text(json.dumps({"summary": {**r.summary(), "kv_int8": False},
                                                               "trace": r.trace.to_dict()}))
        append_row(tmp_path / "sweep" / "rows.jsonl", row)
    niah = run_niah_grid(model, tok, NiahConfig(lengths=(160,), depths=(0.5,), policies=("full",),
                                                protocols=("streaming",), max_new_tokens=2, chunk=64), progress=False)
    write_niah(niah, tmp_path / "niah")
    plot_niah(niah, tmp_path / "niah" / "niah_heatmap.png")
    results = probe_confidence_kl(model, ids, k=4, start=10, n_boot=20, progress=False)
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "probe.json").write_text(json.dumps({"meta": {}, "results": [r.to_dict() for r in results]}))
    plot_probe(results, tmp_path / "probe" / "probe.png")

    page = build_report(tmp_path, html=True)
    text = page.read_text()
    for heading in ("Perplexity at matched KV memory", "Single perplexity runs", "Needle in a haystack",
                    "Confidence vs KL shift"):
        assert heading in text
    images = [line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert len(images) >= 6
    for image in images:
        assert (tmp_path / image).exists(), image
    assert (tmp_path / "REPORT.html").read_text().count("<img") == len(images)


def test_markdown_to_html_table():
    out = markdown_to_html("# T\n\n| a | b |\n|---|---|\n| 1 | `x` |\n\n![p](x.png)\n")
    assert "<h1>T</h1>" in out and "<td>1</td>" in out and '<img alt="p" src="x.png"' in out
