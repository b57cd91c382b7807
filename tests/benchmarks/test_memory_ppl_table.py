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
