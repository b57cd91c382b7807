"""benchmarks/lowbit_table.py: replay rows by format and width, mixed widths in their mean width's column."""

import importlib.util
import json
from pathlib import Path

import torch

from confkv.tiers.formats import build_format

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lowbit_table.py"
spec = importlib.util.spec_from_file_location("lowbit_table", SCRIPT)
lowbit_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lowbit_table)


def _replay(bits, fmt, ppl, value_bits=None, fraction=0.0):
    record = {"bits": bits, "format": fmt, "outlier_fraction": fraction, "sinks": 4, "group_size": 64, "budget": 32,
              "corpus": "pydoc-topics", "proxy_ppl": ppl}
    return record if value_bits is None else {**record, "value_bits": value_bits}


def test_replay_rows_take_every_technique_and_put_two_widths_in_the_mean_width_s_column(tmp_path):
    records = [_replay(16, "kivi", 10.0), _replay(3, "hadamard+clip", 10.2), _replay(4, "hadamard+clip", 10.5, 2),
               _replay(4, "hadamard+outliers+clip", 10.1, 2, 0.01)]
    (tmp_path / "proxy_a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    lines = lowbit_table.proxy(tmp_path)
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| kivi")}
    three_bit = build_format(3, 64, 64, torch.bfloat16, "hadamard+clip").page_nbytes(3, 64, 64) / 64
    assert rows["| kivi+hadamard+clip, sinks=4"] == f"| kivi+hadamard+clip, sinks=4 | - | 10.200 (+2.0%), {three_bit:.0f} B | - |"
    # keys 4 / values 2: the 3-bit column, the bytes of a 3-bit page (side bytes do not depend on the width)
    mixed = "| kivi+hadamard+clip, sinks=4, keys 4 / values 2 bits"
    assert rows[mixed] == f"{mixed} | - | 10.500 (+5.0%), {three_bit:.0f} B | - |"
    outliers = "| kivi+hadamard+outliers+clip (0.01), sinks=4, keys 4 / values 2 bits"
    assert rows[outliers].startswith(f"{outliers} | - | 10.100 (+1.0%), ")
    assert "full KV 10.000" in lines[0]


def test_another_models_replays_get_their_own_table_with_bytes_at_its_kv_shape(tmp_path):
    """A Qwen replay (2 KV heads x 128 channels, float32 compute) beside SmolLM2's: its own table, headed by its
    name and compute, its own full-KV reference, its bytes at its shape; SmolLM2's table first and unchanged.
    Seen failing with the compute left out of the heading, and with the bytes at SmolLM2's shape."""
    qwen = {"model": "qwen2.5-coder-1.5b", "compute": "float32", "kv_heads": 2, "head_dim": 128}
    records = [_replay(16, "kivi", 10.0), _replay(3, "kivi", 10.3), {**_replay(16, "kivi", 4.0), **qwen},
               {**_replay(3, "kivi", 4.2), **qwen}]
    (tmp_path / "proxy_b.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    lines = lowbit_table.proxy(tmp_path)
    heads = [line for line in lines if line.startswith("**")]
    assert heads[0].startswith("**pydoc-topics, replay") and "full KV 10.000" in heads[0]
    assert heads[1].startswith("**qwen2.5-coder-1.5b (float32 compute), pydoc-topics, replay")
    assert "full KV 4.000" in heads[1]
    qwen_bytes = build_format(3, 64, 128, torch.bfloat16, "kivi").page_nbytes(2, 128, 64) / 64
    smol_bytes = build_format(3, 64, 64, torch.bfloat16, "kivi").page_nbytes(3, 64, 64) / 64
    assert qwen_bytes != smol_bytes
    rows = [line for line in lines if line.startswith("| kivi, sinks=4")]
    assert rows == [f"| kivi, sinks=4 | - | 10.300 (+3.0%), {smol_bytes:.0f} B | - |",
                    f"| kivi, sinks=4 | - | 4.200 (+5.0%), {qwen_bytes:.0f} B | - |"]
