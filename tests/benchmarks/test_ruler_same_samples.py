"""benchmarks/ruler_same_samples.py: every row averaged over the same samples, a missing sample refused."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ruler_same_samples.py"
spec = importlib.util.spec_from_file_location("ruler_same_samples", SCRIPT)
ruler_same_samples = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ruler_same_samples)


def _write(folder: Path, records: list[tuple]) -> Path:
    folder.mkdir()
    path = folder / "ruler.jsonl"
    path.write_text("".join(json.dumps({"policy": p, "kv_fraction": f, "task": t, "index": i, "score": s,
                                        "length": 4096}) + "\n" for p, f, t, i, s in records))
    return path


def test_rows_average_only_the_given_samples_and_a_missing_one_is_refused(tmp_path):
    a = _write(tmp_path / "a", [("tiered", 0.25, "vt", 0, 1.0), ("tiered", 0.25, "vt", 1, 0.5),
                                ("tiered", 0.25, "vt", 2, 0.0),  # a third sample the other row lacks
                                ("tiered", 0.25, "cwe", 0, 0.2), ("tiered", 0.25, "cwe", 1, 0.4)])
    b = _write(tmp_path / "b", [("tiered", 0.25, "vt", 0, 0.0), ("tiered", 0.25, "vt", 1, 1.0),
                                ("tiered", 0.25, "cwe", 0, 0.6), ("tiered", 0.25, "cwe", 1, 0.6)])
    tasks, rows = ruler_same_samples.same_sample_rows([a, b], [0, 1])
    assert tasks == ["vt", "cwe"]
    got = {label: (means, average) for label, means, average in rows}
    assert got["a: tiered at 0.25"] == (pytest.approx([75.0, 30.0]), pytest.approx(52.5))
    assert got["b: tiered at 0.25"] == (pytest.approx([50.0, 60.0]), pytest.approx(55.0))
    with pytest.raises(SystemExit, match="a tiered 0.25: task cwe lacks samples \\[2\\]"):
        ruler_same_samples.same_sample_rows([a, b], [0, 1, 2])


def test_fractions_keep_only_the_memory_targets_asked(tmp_path):
    """A grid at two targets: the row at 0.125 lacks a sample, so it must be left out with ``fractions``, not refused."""
    a = _write(tmp_path / "a", [("tiered", 0.25, "vt", 0, 1.0), ("tiered", 0.25, "vt", 1, 0.5),
                                ("tiered", 0.125, "vt", 0, 0.0), ("full", 1.0, "vt", 0, 1.0), ("full", 1.0, "vt", 1, 1.0)])
    _, rows = ruler_same_samples.same_sample_rows([a], [0, 1], fractions=[1.0, 0.25])
    assert {label: average for label, _, average in rows} == {"a: tiered at 0.25": pytest.approx(75.0),
                                                               "a: full at 1": pytest.approx(100.0)}
    with pytest.raises(SystemExit, match="tiered 0.125: task vt lacks samples \\[1\\]"):
        ruler_same_samples.same_sample_rows([a], [0, 1])
