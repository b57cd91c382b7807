"""The native INT8 GEMV (confkv.native.int8_linear / Int8Projection, kernels.c's worker pool) against
the exact product and torch._weight_int8pack_mm, and Int8Linear's dispatch between it and torch."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from confkv import native
from confkv.hf.weights import Int8Linear
from confkv.native import loader
from thread_counts import torch_threads

needs_native = pytest.mark.skipif(not native.available(), reason="native kernels unavailable (no C compiler or "
                                  "CONFKV_NATIVE=0; see the warning)")
# buffers the kernels must overwrite (torch.empty, empty_like, new_empty) start as NaN in every test here
pytestmark = pytest.mark.usefixtures("nan_filled_empty")

#: (N, K): odd sizes (no multiple of 8 / 16 rows or columns) and SmolLM2-like ones
SHAPES = [(37, 53), (13, 16), (579, 576), (64, 1536), (200, 97)]


def _operands(rows, outputs, inputs, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inputs, generator=gen).to(dtype)
    weight = torch.randint(-127, 128, (outputs, inputs), dtype=torch.int8, generator=gen)
    scale = (torch.rand(outputs, generator=gen) / 50 + 1e-3).to(dtype)
    return x, weight, scale


def _check(got, x, weight, scale, bias=None):
    """got [M, N] within float32 summation order of the exact product (then one rounding to got.dtype,
    then + bias rounded again): |got - exact| <= K * 2^-24 * (|x| @ |w|^T) * |s| + one rounding each."""
    exact = (x.double() @ weight.double().T) * scale.double()
    order = x.shape[1] * 2.0 ** -24 * (x.double().abs() @ weight.double().abs().T) * scale.double().abs()
    unit = 2.0 ** -8 if got.dtype == torch.bfloat16 else 2.0 ** -24  # half an ulp, relative
    if bias is not None:
        order = order + exact.abs() * unit  # the rounding of the product before the bias add
        exact = exact + bias.double()
    bound = 1.01 * order + exact.abs() * unit + 1e-30
    err = (got.double() - exact).abs()
    assert got.dtype == x.dtype and got.shape == exact.shape
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3f}"


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_gemv_equals_the_exact_product_to_float32_summation_order(dtype, rows, shape):
    x, weight, scale = _operands(rows, *shape, dtype)
    _check(native.int8_linear(x, weight, scale), x, weight, scale)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_agrees_with_torch_int8pack_mm_where_torch_is_right(dtype):
    """torch's kernel meets the same bound (same contract: scale after the sum, one rounding), and
    in bfloat16 the two agree on nearly every element (they differ only at rounding ties of the sum)."""
    x, weight, scale = _operands(3, 579, 576, dtype, seed=1)
    ours, theirs = native.int8_linear(x, weight, scale), torch._weight_int8pack_mm(x, weight, scale)
    _check(theirs, x, weight, scale)
    _check(ours, x, weight, scale)
    if dtype == torch.bfloat16:
        assert float((ours == theirs).float().mean()) > 0.97


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_split_the_rows_and_give_the_same_bits(threads):
    """Each output element is one thread's sum in one order, so any thread count gives the same bits."""
    x, weight, scale = _operands(2, 579, 576, torch.bfloat16, seed=2)
    with torch_threads(1):
        single = native.int8_linear(x, weight, scale)
        torch.set_num_threads(threads)
        split = native.int8_linear(x, weight, scale)
        assert threads == 1 or native.gemv_settings() >= threads - 1  # the workers ran
    assert torch.equal(single, split)


@needs_native
def test_sleeping_workers_wake_for_each_call():
    """spin 0: every call finds the worker asleep on the condition variable (the wake-up path)."""
    x, weight, scale = _operands(1, 300, 576, torch.float32, seed=3)
    reference = native.int8_linear(x, weight, scale)
    native.gemv_settings(spin_us=0)
    try:
        with torch_threads(2):
            for _ in range(50):
                assert torch.equal(native.int8_linear(x, weight, scale), reference)
    finally:
        native.gemv_settings(spin_us=50)


@needs_native
def test_concurrent_callers_each_get_their_own_product():
    """Two Python threads (ctypes releases the GIL): one owns the pool, the other computes alone."""
    operands = [_operands(1, 400, 576, torch.bfloat16, seed=s) for s in (4, 5)]
    expected = [native.int8_linear(*o) for o in operands]
    failures = []

    def run(i):
        for _ in range(100):
            if not torch.equal(native.int8_linear(*operands[i]), expected[i]):
                failures.append(i)

    with torch_threads(2):
        workers = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
    assert not failures and not any(w.is_alive() for w in workers)


@needs_native
def test_nan_and_inf_in_the_input_propagate_as_in_torch():
    x, weight, scale = _operands(3, 40, 64, torch.float32, seed=6)
    weight[:, 7] = 1
    weight[5, 7] = 0
    x[0, 3] = float("nan")
    x[1, 7] = float("inf")  # times weight[5, 7] == 0: NaN in row 1, column 5; +-inf elsewhere
    got, want = native.int8_linear(x, weight, scale), torch._weight_int8pack_mm(x, weight, scale)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert got[0].isnan().all() and got[1, 5].isnan() and got[1].isinf().sum() == 39 and got[2].isfinite().all()
    assert torch.equal(got[1].isinf(), weight[:, 7] != 0)
    bf = native.int8_linear(x.bfloat16(), weight, scale.bfloat16())
    assert torch.equal(bf.isnan(), got.isnan()) and torch.equal(bf.isinf(), got.isinf())


@needs_native
@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
@pytest.mark.parametrize("flag", ["-mno-avx512f", "-mno-avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_portable_loops_equal_the_exact_product(dtype, flag, tmp_path, monkeypatch):
    """A build without AVX-512 runs the AVX2 blocks where the CPU has AVX2 (53 columns: a partial last 16), one
    without AVX2 as well the plain C loop (and either, its pool)."""
    path = loader.build(tmp_path, loader.default_flags() + [flag])
    monkeypatch.setitem(loader._state, "lib", loader.load(path))
    for threads in (1, 2):
        with torch_threads(threads):
            for rows, shape in ((1, (37, 53)), (4, (579, 576)), (2, (64, 1536))):
                x, weight, scale = _operands(rows, *shape, dtype, seed=7)
                _check(native.int8_linear(x, weight, scale), x, weight, scale)


@needs_native
def test_unsupported_inputs_return_none():
    x, weight, scale = _operands(5, 16, 32, torch.float32)
    assert native.int8_linear(x, weight, scale) is None  # more rows than a decode step
    assert native.int8_linear(x[:2].half(), weight, scale) is None
    assert native.int8_linear(x[:2], weight.float(), scale) is None
    assert native.int8_linear(x[:2], weight, scale[:3]) is None
    projection = native.Int8Projection(weight, scale)
    assert projection(x[:2].bfloat16()) is None and projection(x) is None and projection(x[:, :8]) is None


def _layer(inputs, outputs, bias, dtype, seed=8):
    torch.manual_seed(seed)
    linear = nn.Linear(inputs, outputs, bias=bias)
    if bias:
        nn.init.normal_(linear.bias)
    return Int8Linear(linear.to(dtype), dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_takes_the_native_gemv_for_decode_rows(dtype, bias):
    layer = _layer(96, 75, bias, dtype)
    x = torch.randn(2, 1, 96).to(dtype)
    got = layer(x)
    assert layer._native[1] is not None and got.shape == (2, 1, 75)
    _check(got.reshape(2, 75), x.reshape(2, 96), layer.weight_int8, layer.scale, layer.bias)
    torch.testing.assert_close(got.reshape(2, 75), layer.torch_forward(x.reshape(2, 96)),
                               **({"rtol": 0.016, "atol": 0.02} if dtype == torch.bfloat16 else {}))
    long = torch.randn(1, 5, 96).to(dtype)  # a prefill chunk: torch's kernel, exactly
    assert torch.equal(layer(long), layer.torch_forward(long.reshape(5, 96)).reshape(1, 5, 75))


@needs_native
def test_int8_linear_prepares_again_when_its_tensors_change():
    layer = _layer(64, 32, True, torch.bfloat16)
    x = torch.randn(1, 64).bfloat16()
    first = layer(x)
    layer.bias = nn.Parameter(layer.bias.detach() + 1, requires_grad=False)  # a new tensor: a new plan
    shifted = layer(x)
    torch.testing.assert_close(shifted.float(), (first.float() + 1), rtol=0.02, atol=0.05)
    clone = copy.deepcopy(layer)  # its own tensors, its own plan
    with torch.no_grad():
        layer.scale.mul_(2)  # in place: the plan still points at it
    torch.testing.assert_close(clone(x), shifted)
    assert not torch.equal(layer(x), shifted)
    layer.to(torch.float32)  # .to(): the plan is dropped with the old tensors
    assert layer._native is None or layer._native[1] is None or layer._native[1].dtype == torch.float32


def test_int8_linear_runs_torch_without_the_library(monkeypatch):
    monkeypatch.setitem(loader._state, "lib", None)
    layer = _layer(64, 33, True, torch.bfloat16)
    x = torch.randn(1, 1, 64).bfloat16()
    prepared = []
    real = layer._projection
    monkeypatch.setattr(layer, "_projection", lambda: prepared.append(1) or real())
    assert torch.equal(layer(x), layer.torch_forward(x.reshape(1, 64)).reshape(1, 1, 33))
    assert torch.equal(layer(x), layer.torch_forward(x.reshape(1, 64)).reshape(1, 1, 33))
    assert layer._native == (None, None) and prepared == [1]  # found unavailable once, not on every call
    with pytest.raises(TypeError, match="bfloat16 activations"):
        layer(x.float())


def test_confkv_native_0_switches_the_gemv_off(monkeypatch):
    monkeypatch.setattr(loader, "_state", {})
    monkeypatch.setenv("CONFKV_NATIVE", "0")
    layer = _layer(64, 33, False, torch.float32)
    x = torch.randn(1, 64)
    assert torch.equal(layer(x), torch._weight_int8pack_mm(x, layer.weight_int8, layer.scale))
    assert layer._native == (None, None) and native.int8_linear(x, layer.weight_int8, layer.scale) is None


def test_torch_fallback_is_right_for_widths_torch_reads_past():
    """torch's bfloat16 int8pack_mm reads past rows whose width is not a multiple of 16: the fallback
    multiplies by the dequantized weight instead."""
    layer = _layer(37, 20, False, torch.bfloat16)
    x = torch.randn(3, 37).bfloat16()
    _check(layer.torch_forward(x), x, layer.weight_int8, layer.scale)


_FORK_SCRIPT = r"""
import os, signal, torch
from confkv import native
torch.set_num_threads(2)
gen = torch.Generator().manual_seed(0)
x = torch.randn(1, 576, generator=gen)
w = torch.randint(-127, 128, (600, 576), dtype=torch.int8, generator=gen)
s = torch.rand(600, generator=gen) / 100
want = native.int8_linear(x, w, s)
assert native.gemv_settings() >= 1, "no worker started"
pid = os.fork()
if pid == 0:
    signal.alarm(20)  # a deadlock ends the child with SIGALRM
    ok = native.gemv_settings() == 0 and all(torch.equal(native.int8_linear(x, w, s), want) for _ in range(20))
    os._exit(0 if ok and native.gemv_settings() >= 1 else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
assert torch.equal(native.int8_linear(x, w, s), want)
print("ok")
"""


@needs_native
def test_a_forked_child_starts_its_own_workers_and_the_process_exits():
    """fork() after the pool ran: the child has no workers (pthread_atfork) and starts new ones; the
    parent keeps working; both exit (no join on spinning or sleeping workers)."""
    done = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2], env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
