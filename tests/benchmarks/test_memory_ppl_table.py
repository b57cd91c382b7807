"""benchmarks/memory_ppl_table.py: perplexity of each prefix from `confkv ppl --out` files."""

import importlib.util
import json
import math
from pathlib import Path

from confkv import presets

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_ppl_table.py"
spec = importlib.util.spec_from_file_location("memory_ppl_table", SCRIPT)
memory_ppl_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory_ppl_table)


def _write(path: Path, policy: str, params: dict, nll: list[float], preset: str | None = "now") -> Path:
    """A ppl file; ``preset="now"``: today's signature of the preset ``policy`` names (as ``confkv ppl`` writes)."""
    summary = {"policy": policy, "params": params, "corpus": "text", "dtype": "bfloat16",
               "preset": presets.preset_signature(policy) if preset == "now" else preset}
    path.write_text(json.dumps({"summary": summary, "nll": nll, "trace": {"kv_bytes": [[100]] * len(nll)}}))
    return path


def test_prefixes_against_full_and_twins_told_apart_by_file(tmp_path):
    full = _write(tmp_path / "full.json", "full", {}, [1.0] * 1023)
    before = _write(tmp_path / "before.json", "tiered", {"memory": 0.25}, [1.1] * 1023)
    after = _write(tmp_path / "after.json", "tiered", {"memory": 0.25}, [1.05] * 1023)
    text = memory_ppl_table.tables(memory_ppl_table.load([full, before, after]))
    rows = [line for line in text.splitlines() if line.startswith("| tiered")]
    assert len(rows) == 2 and any("[before]" in r for r in rows) and any("[after]" in r for r in rows)
    expected = f"{math.exp(1.1):.3f} ({(math.exp(0.1) - 1) * 100:+.1f}%)"
    assert expected in next(r for r in rows if "[before]" in r)
    alone = memory_ppl_table.tables(memory_ppl_table.load([full, after]))  # no twin: no file name
    assert "| tiered | memory=0.25 |" in alone


def test_the_mean_rise_of_each_setting_over_its_texts_and_prefixes(tmp_path):
    runs = []
    for corpus, rise in (("a", 0.1), ("b", 0.3)):
        for policy, params, nll in (("full", {}, 1.0), ("tiered", {"memory": 0.25}, 1.0 + rise)):
            path = tmp_path / f"{corpus}_{policy}.json"
            summary = {"policy": policy, "params": params, "corpus": corpus, "dtype": "bfloat16",
                       "preset": presets.preset_signature(policy)}
            path.write_text(json.dumps({"summary": summary, "nll": [nll] * 2047,
                                        "trace": {"kv_bytes": [[100]] * 2047}}))
            runs.append(path)
    text = memory_ppl_table.mean_table(memory_ppl_table.load(runs))
    expected = ((math.exp(0.1) - 1) + (math.exp(0.3) - 1)) / 2 * 100  # two prefixes per text, the same rise
    assert f"| tiered | memory=0.25 | {expected:+.2f}% | 4 |" in text


def test_a_preset_run_under_other_defaults_is_marked_earlier(tmp_path):
    """A run of a preset without today's signature (an older file, or other defaults) is not today's preset; runs
    with their own parameters are named by them; policies that are not presets are never marked."""
    full = _write(tmp_path / "full.json", "full", {}, [1.0] * 1023)
    old = _write(tmp_path / "old.json", "tiered", {"memory": 0.25}, [1.1] * 1023, preset=None)
    now = _write(tmp_path / "now.json", "tiered", {"memory": 0.125}, [1.2] * 1023)
    own = _write(tmp_path / "own.json", "tiered", {"memory": 0.25, "format": "kivi+hadamard"}, [1.05] * 1023,
                 preset=None)
    h2o = _write(tmp_path / "h2o.json", "h2o", {"memory": 0.25}, [1.3] * 1023, preset=None)
    text = memory_ppl_table.tables(memory_ppl_table.load([full, old, now, own, h2o]))
    assert "| tiered (earlier preset) | memory=0.25 |" in text
    assert "| tiered | memory=0.125 |" in text
    assert "| tiered (format=kivi+hadamard) | memory=0.25 |" in text
    assert "| h2o | memory=0.25 |" in text


def test_the_rise_in_each_band_of_positions_against_full(tmp_path):
    """Bands 0-127, 128-255, 256-511 of a 300-token run; each band's rise is its own tokens' mean loss gap."""
    full = _write(tmp_path / "full.json", "full", {}, [1.0] * 300)
    nll = [1.5] * 128 + [1.0] * 128 + [1.2] * 44  # a rise only in the first band and the last
    run = _write(tmp_path / "run.json", "tiered", {"memory": 0.25}, nll)
    assert memory_ppl_table.position_bands(300) == [(0, 128), (128, 256), (256, 300)]
    text = memory_ppl_table.position_table(memory_ppl_table.load([full, run]))
    row = next(line for line in text.splitlines() if line.startswith("| tiered"))
    cells = [c.strip() for c in row.split("|")[3:-1]]
    assert cells == [f"{(math.exp(0.5) - 1) * 100:+.1f}%", "+0.0%", f"{(math.exp(0.2) - 1) * 100:+.1f}%"]
    assert "| 0-127 | 128-255 | 256-299 |" in text


def test_a_run_with_the_int8_hot_tier_is_named_by_it(tmp_path):
    """``confkv ppl --int8`` records ``kv_int8`` (and, since stop 43, ``fp_window``) in the summary, not among the
    parameters: the row still says it, so it is not taken for the preset itself."""
    full = _write(tmp_path / "full.json", "full", {}, [1.0] * 1023)
    runs = []
    for name, extra in (("old", {"kv_int8": True}), ("new", {"kv_int8": True, "fp_window": 8}), ("plain", {})):
        path = _write(tmp_path / f"{name}.json", "tiered", {"memory": 0.25}, [1.1] * 1023)
        data = json.loads(path.read_text())
        data["summary"].update(extra)
        path.write_text(json.dumps(data))
        runs.append(path)
    text = memory_ppl_table.tables(memory_ppl_table.load([full, *runs]))
    assert "| tiered (int8=True) | memory=0.25 |" in text
    assert "| tiered (fp_window=8, int8=True) | memory=0.25 |" in text
    assert "| tiered | memory=0.25 |" in text


def test_what_a_layer_holds_at_a_step_from_the_trace(tmp_path):
    """Two layers, one sequence: at the step that had seen 3 positions, hot 4 and 6 (mean 5), rungs 10 and 2 slots
    summed over the layers (5 and 1 a layer), 11 held, 300 of 400 target bytes."""
    path = _write(tmp_path / "run.json", "tiered", {"memory": 0.25}, [1.0] * 3)
    data = json.loads(path.read_text())
    data["trace"] = {"seen": [1, 2, 3], "kept": [[[1], [1]], [[2], [2]], [[4], [6]]],
                     "rung_tokens": [[0, 0], [0, 0], [10, 2]], "kv_bytes": [[10, 10], [20, 20], [100, 200]],
                     "target_bytes": [400, 400, 400]}
    path.write_text(json.dumps(data))
    text = memory_ppl_table.held_table(memory_ppl_table.load([path]), [3, 99])
    assert "| run | 3 | 5 | 5 / 1 | 11 | 75% |" in text
    assert len(text.splitlines()) == 3  # header, rule, one row: no step had seen 99 positions


def test_a_forward_pass_reference_without_a_trace_is_the_full_row(tmp_path):
    """benchmarks/full_ppl_forward.py writes a full-KV file with ``method: forward`` and no trace steps: it is the
    reference (rises against it), named for its method, with no peak-KV share."""
    full = tmp_path / "full.json"
    full.write_text(json.dumps({"summary": {"policy": "full", "params": {}, "method": "forward", "corpus": "text",
                                            "dtype": "bfloat16"}, "nll": [1.0] * 2047, "trace": {"kv_bytes": []}}))
    preset = _write(tmp_path / "preset.json", "tiered", {"memory": 0.25}, [1.1] * 2047)
    text = memory_ppl_table.tables(memory_ppl_table.load([full, preset]))
    assert "| full (method=forward) | none | 2.718 | 2.718 |  |" in text
    rise = (math.exp(1.1) / math.e - 1) * 100
    assert f"3.004 (+{rise:.1f}%)" in text and text.count("%)") == 2
