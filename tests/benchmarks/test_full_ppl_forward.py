"""benchmarks/full_ppl_forward.py: full-KV perplexity in chunked forward passes equals the per-token run's."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from confkv.eval.quality.ppl import streaming_ppl
from confkv.models import tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "full_ppl_forward.py"
spec = importlib.util.spec_from_file_location("full_ppl_forward", SCRIPT)
full_ppl_forward = importlib.util.module_from_spec(spec)
spec.loader.exec_module(full_ppl_forward)


def test_a_chunked_forward_pass_gives_the_per_token_runs_nll():
    """Nothing is evicted under full KV, so each token's NLL is the same whether the text goes one token a step
    through confkv's cache or in chunks (a ragged last one) through transformers' ``DynamicCache``: float32,
    to float32 rounding."""
    model = tiny_model("llama")
    ids = torch.randint(0, 250, (1, 83), generator=torch.Generator().manual_seed(0))
    per_token = streaming_ppl(model, ids, "full", progress=False)
    for chunk in (1, 16, 100):
        forward = full_ppl_forward.forward_nll(model, ids, chunk)
        assert forward.shape == per_token.nll.shape
        torch.testing.assert_close(forward, per_token.nll, atol=2e-5, rtol=0)


def test_the_check_reports_how_far_the_two_methods_are_apart():
    nll = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    got = full_ppl_forward.compare(nll, {"nll": [1.0, 2.5, 3.0, 9.0]})
    assert got["tokens"] == 3 and got["max_abs_nll_diff"] == 0.5
    assert abs(got["ppl_ratio"] - math.exp(-0.5 / 3)) < 1e-12


def test_a_check_file_of_another_text_is_refused(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"summary": {"policy": "full", "corpus": "stdlib-docs", "dtype": "bfloat16"},
                                 "nll": [1.0]}))
    with pytest.raises(SystemExit) as exit_:
        full_ppl_forward.main(["--corpus", "pydoc-topics", "--dtype", "bfloat16", "--check", str(other),
                               "--out", str(tmp_path / "out.json")])
    assert exit_.value.code == 2
    assert "a full-KV run of 'stdlib-docs'" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
