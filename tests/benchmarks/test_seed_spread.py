"""benchmarks/seed_spread.py: each text's rise over full KV at every rotation seed, its mean and its worst.

Each test was seen to fail with a bug put in by hand (then removed): the worst taken as the lowest rise; full KV's
NLLs taken over the whole reference instead of the run's prefix; the seed of a run without ``rotation_seed`` left
out instead of 0; a flat full run of another token count taken as the reference. (The mean of the rises is the rise
of the mean perplexity, the reference being common: no bug.)
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "seed_spread.py"
spec = importlib.util.spec_from_file_location("seed_spread", SCRIPT)
seed_spread = importlib.util.module_from_spec(spec)
spec.loader.exec_module(seed_spread)


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_rises_mean_and_worst_against_the_full_runs_prefix(tmp_path):
    # full KV over 4 predictions: NLLs log 10 twice then log 40 twice -> over the runs' 2 predictions, 10 exactly
    full = _write(tmp_path / "full.json", {"summary": {"policy": "full", "corpus": "t", "tokens": 4, "ppl": 20.0},
                                           "nll": [math.log(10)] * 2 + [math.log(40)] * 2})
    runs = [_write(tmp_path / "a.json", {"policy": "tiered", "corpus": "t", "tokens": 2, "ppl": 10.1, "params": {}}),
            _write(tmp_path / "b.json", {"summary": {"policy": "tiered", "corpus": "t", "tokens": 2, "ppl": 10.5,
                                                     "params": {"rotation_seed": 3}}, "nll": []}),
            _write(tmp_path / "c.json", {"policy": "tiered", "corpus": "t", "tokens": 2, "ppl": 9.9,
                                         "params": {"rotation_seed": 1}})]
    table = seed_spread.spread_table([seed_spread.load_run(p) for p in runs], [full])
    header, _, row = table.splitlines()
    assert header == "| text | full KV | seed 0 | seed 1 | seed 3 | mean | worst |"
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:5] == ["t", "10.000", "10.100 (+1.00%)", "9.900 (-1.00%)", "10.500 (+5.00%)"]
    assert cells[5:] == ["**+1.67%**", "+5.00%"]


def test_a_flat_full_row_of_the_runs_token_count_is_the_reference_and_missing_ones_are_named(tmp_path):
    rows = [{"policy": "full", "corpus": "t", "dtype": "bfloat16", "tokens": 2048, "ppl": 8.0},
            {"policy": "full", "corpus": "t", "dtype": "bfloat16", "tokens": 1024, "ppl": 9.0}]
    archive = tmp_path / "ppl_t.jsonl"
    archive.write_text("\n".join(json.dumps(r) for r in rows))
    run = {"corpus": "t", "seed": 0, "tokens": 2047, "ppl": 8.4, "file": "x.json"}
    assert "8.000 | 8.400 (+5.00%)" in seed_spread.spread_table([run], [archive])
    flat = _write(tmp_path / "u_full.json", {"policy": "full", "corpus": "u", "tokens": 2047, "ppl": 7.0})
    longer = _write(tmp_path / "u_full_4k.json", {"policy": "full", "corpus": "u", "tokens": 4095, "ppl": 6.0})
    assert "| u | 7.000 | 7.700 (+10.00%)" in seed_spread.spread_table([{**run, "corpus": "u", "ppl": 7.7}],
                                                                         [longer, flat])
    with pytest.raises(SystemExit, match="u: no full-KV run"):
        seed_spread.spread_table([{**run, "corpus": "u"}], [archive])
    with pytest.raises(SystemExit, match="two runs of t at seed 0"):
        seed_spread.spread_table([run, {**run, "file": "y.json"}], [archive])
