"""benchmarks/prefill_kernels.py times reads that compute the same attention (else its rates compare nothing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("prefill_kernels", ROOT / "benchmarks" / "prefill_kernels.py")
prefill_kernels = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("prefill_kernels", prefill_kernels)
_spec.loader.exec_module(prefill_kernels)


def test_every_timed_attention_read_gives_the_same_output():
    torch.manual_seed(0)
    reads = prefill_kernels.attention_reads(chunk=8, context=24, kv_heads=2, group=3, head_dim=16)
    outputs = {name: read().float() for name, read in reads.items()}
    reference = outputs.pop("block-wise float32 read, mass")
    assert outputs  # at least the read without the mass
    for name, out in outputs.items():
        assert out.shape == reference.shape == (1, 6, 8, 16), name
        torch.testing.assert_close(out, reference, atol=2e-2, rtol=2e-2, msg=name)  # bfloat16 outputs


def test_the_projection_rates_are_measured_for_each_kernel():
    rows = prefill_kernels.projection_rows(chunk=4, hidden=32, inner=16, repeats=1)
    assert [name for name, _ in rows][0].startswith("bfloat16") and len(rows) == 4
    assert all(rate > 0 for _, rate in rows)
