"""The endless-stream run (confkv/eval/quality/stream.py) on a tiny model: the cap held at every step, the plot written."""

import pytest

from confkv.eval.quality.stream import plot_stream, run_stream
from confkv.models import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_stream_under_a_cap_never_exceeds_it_and_plots(tmp_path):
    model = tiny_model("gemma3", seed=1)
    data = run_stream(model, tiny_tokenizer(), tokens=400, max_kv_bytes=24_000, progress=False,
                      page_size=16, group_size=16)
    summary = data["summary"]
    assert summary["steps_over_cap"] == 0 and summary["peak_kv_bytes"] <= 24_000
    assert max(data["kv_bytes"]) == summary["peak_kv_bytes"] and len(data["kv_bytes"]) == 400
    assert sum(data["rung_tokens"][-1][1:]) > 0  # pages stepped below the top rung
    assert plot_stream(data, tmp_path / "s.png").stat().st_size > 1000
