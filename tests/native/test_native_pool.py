"""The worker pool of the native kernels: every chunk of a call runs once, before the call returns.

CI once saw one and two threads give different logits through the fused layers: a worker that had just
finished the last call's chunks could claim a chunk of the next call (under the old tag) while the caller was
arming it, run it twice and let the caller return before the chunk was written. pool_stress.c widens that
window to make the race certain rather than rare."""

import subprocess
from pathlib import Path

import pytest

from confkv.native import loader


def test_every_chunk_of_every_call_runs_exactly_once(tmp_path):
    try:
        cc = loader.compiler()
    except loader.NativeBuildError as error:
        pytest.skip(str(error))
    source = Path(__file__).with_name("pool_stress.c")
    binary = tmp_path / "pool_stress"
    # the pool of the kernels' source ($CONFKV_NATIVE_SOURCE: a mutated copy, benchmarks/mutate_native.py)
    subprocess.run([cc, "-O2", "-std=c99", "-pthread", "-Werror=implicit-function-declaration",
                    f"-I{loader.PARTS.parent}", str(source), "-o", str(binary), "-lm"], check=True)
    run = subprocess.run([str(binary), "1000"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "0 of 1000 calls wrong"
