"""The worker pool of the native kernels: every chunk of a call runs once, before the call returns; its
workers take chunks while calls run and sleep when none does.

CI once saw one and two threads give different logits through the fused layers: a worker that had just
finished the last call's chunks could claim a chunk of the next call (under the old tag) while the caller was
arming it, run it twice and let the caller return before the chunk was written. pool_stress.c widens that
window to make the race certain rather than rare."""

import re
import subprocess
from pathlib import Path

import pytest

from confkv.native import loader


def built(name: str, tmp_path: Path, *flags: str) -> Path:
    """``tests/native/<name>.c`` compiled (with ``flags``) against the pool of the kernels' source
    ($CONFKV_NATIVE_SOURCE: a mutated copy under benchmarks/mutate_native.py); skips without a C compiler."""
    try:
        cc = loader.compiler()
    except loader.NativeBuildError as error:
        pytest.skip(str(error))
    binary = tmp_path / name
    subprocess.run([cc, "-O2", "-std=c99", "-pthread", "-Werror=implicit-function-declaration", *flags,
                    f"-I{loader.PARTS.parent}", str(Path(__file__).with_name(f"{name}.c")), "-o", str(binary),
                    "-lm"], check=True)
    return binary


@pytest.mark.parametrize("split", ["claimed", "static"])
def test_every_chunk_of_every_call_runs_exactly_once(tmp_path, split):
    """``static``: the split of ThreadSanitizer's build (CONFKV_POOL_STATIC). CI's ThreadSanitizer once saw its
    caller write the next call's task while a worker still read it: a worker outside a 2-thread call, late to
    see it, read the next call's shape while the caller armed it; 312 of 1000 stress calls were wrong then."""
    flags = ["-DCONFKV_POOL_STATIC"] if split == "static" else []
    run = subprocess.run([str(built("pool_stress", tmp_path, *flags)), "1000"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "0 of 1000 calls wrong"


def test_workers_take_chunks_while_calls_run_and_sleep_when_none_does(tmp_path):
    """A worker that never leaves its wait, or one that spins for ever instead of sleeping, gives right answers
    (the caller computes what is left) but wastes the second core; pool_workers.c shows both. The bounds are
    wide: a healthy pool's worker takes chunks in nearly every call and its idle process uses well under a
    millisecond of the 300 ms nap, where a spinning worker takes a core's share of it (tens of ms even on a
    loaded machine)."""
    run = subprocess.run([str(built("pool_workers", tmp_path)), "400"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    helped, calls, idle_ms = re.fullmatch(r"(\d+) of (\d+) calls, ([\d.]+) ms", run.stdout.strip()).groups()
    assert int(calls) == 400
    assert int(helped) >= 10, f"a worker took chunks in only {helped} of 400 calls"
    assert float(idle_ms) < 25.0, f"the idle pool used {idle_ms} ms of CPU in a 300 ms nap: a worker spins"
