"""benchmarks/memory_ppl_table.py: perplexity of each prefix from `confkv ppl --out` files."""

import importlib.util
import json
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_ppl_table.py"
spec = importlib.util.spec_from_file_location("memory_ppl_table", SCRIPT)
memory_ppl_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory_ppl_table)


def _write(path: Path, policy: str, params: dict, nll: list[float]) -> Path:
    summary = {"policy": policy, "params": params, "corpus": "text", "dtype": "bfloat16"}
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
            summary = {"policy": policy, "params": params, "corpus": corpus, "dtype": "bfloat16"}
            path.write_text(json.dumps({"summary": summary, "nll": [nll] * 2047,
                                        "trace": {"kv_bytes": [[100]] * 2047}}))
            runs.append(path)
    text = memory_ppl_table.mean_table(memory_ppl_table.load(runs))
    expected = ((math.exp(0.1) - 1) + (math.exp(0.3) - 1)) / 2 * 100  # two prefixes per text, the same rise
    assert f"| tiered | memory=0.25 | {expected:+.2f}% | 4 |" in text
