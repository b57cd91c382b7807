"""benchmarks/weight_formats_gemv.py: a short run prints one row per format and thread count, with the bytes each
format reads (4-bit blocks: 5 bits a weight with their scales and minima; INT8: 8 bits and a scale a row)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from confkv import native

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "weight_formats_gemv.py"
spec = importlib.util.spec_from_file_location("weight_formats_gemv", SCRIPT)
weight_formats_gemv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(weight_formats_gemv)


@pytest.mark.skipif(not native.available(), reason="no C compiler: the native kernels are off")
def test_a_short_run_prints_each_format_with_its_bytes(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["weight_formats_gemv.py", "--shape", "smollm2", "--layers", "1", "--threads", "1",
                                      "--rounds", "1"])
    weight_formats_gemv.main()
    rows = re.findall(r"^\s+1\s+(w8|w8a8|w4a8)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", capsys.readouterr().out, re.M)
    assert [r[0] for r in rows] == ["w8", "w8a8", "w4a8"]
    weights = sum(i * o for i, o in weight_formats_gemv.layer_shapes("smollm2"))
    megabytes = {name: int(mb) for name, mb, *_ in rows}
    assert megabytes["w8"] == megabytes["w8a8"] == round(weights / 1e6)  # + a scale a row: under a megabyte
    # 576-wide rows padded to 640 columns for the 4-bit lines: 5 bits a weight of the padded rows
    padded = sum(-(-i // 128) * 128 * o for i, o in weight_formats_gemv.layer_shapes("smollm2"))
    assert megabytes["w4a8"] == round(padded * 5 / 8 / 1e6)
    assert float(rows[0][4]) == 1.0
