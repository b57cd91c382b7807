"""benchmarks/lowbit_proxy.py's cells: what names one, and which a file already holds (``--out`` resumes).

Each test was seen to fail with a bug put in by hand (then removed): ``compute`` left out of a cell's name; blank
lines read as records; an old record's page size not defaulted to 64.
"""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lowbit_proxy.py"
spec = importlib.util.spec_from_file_location("lowbit_proxy", SCRIPT)
lowbit_proxy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lowbit_proxy)

OLD = {"bits": 3, "format": "hadamard", "outlier_fraction": 0.0, "sinks": 4, "group_size": 64, "budget": 32,
       "corpus": "pydoc-topics", "proxy_ppl": 12.1}  # a record written before model, tokens and page size were


def test_a_record_without_model_tokens_or_page_size_is_smollm2s_cell_at_the_defaults():
    new = {**OLD, "model": "smollm2", "compute": "bfloat16", "tokens": 2048, "page_size": 64, "value_bits": 3}
    assert lowbit_proxy.cell_key(OLD) == lowbit_proxy.cell_key(new)
    for field, other in (("model", "qwen2.5-coder-1.5b"), ("compute", "float32"), ("tokens", 1024),
                         ("page_size", 32), ("value_bits", 2), ("sinks", 0), ("corpus", "idle-docs")):
        assert lowbit_proxy.cell_key({**new, field: other}) != lowbit_proxy.cell_key(new), field


def test_done_cells_are_the_cells_of_every_line_of_the_file(tmp_path):
    path = tmp_path / "grid.jsonl"
    assert lowbit_proxy.done_cells(path) == set()  # no file yet: nothing done
    assert lowbit_proxy.done_cells(None) == set()
    second = {**OLD, "bits": 2}
    path.write_text(json.dumps(OLD) + "\n\n" + json.dumps(second) + "\n")
    assert lowbit_proxy.done_cells(path) == {lowbit_proxy.cell_key(OLD), lowbit_proxy.cell_key(second)}
