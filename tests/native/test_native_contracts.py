"""Exact contracts of the native kernels (issue 30, point 3): where a kernel promises torch's roundings the
result is compared bit for bit, on inputs whose sums are exact in any order; the paths for rows wider than
a fast path are reached; every output buffer starts as NaN (the ``nan_filled_empty`` fixture), so a slot the
kernel forgets to write fails the test instead of passing on leftover zeros."""

from __future__ import annotations

import pytest
import torch

from confkv import native
from confkv.attention import KVSegment
from confkv.attention.mass_read import mass_read
from confkv.native import loader
from confkv.native.layer import LayerKernels
from thread_counts import torch_threads

pytestmark = [pytest.mark.skipif(not native.available(), reason="native kernels unavailable"),
              pytest.mark.usefixtures("nan_filled_empty")]

DTYPES = [torch.float32, torch.bfloat16]


def _integer_operands(rows: int, outputs: int, inputs: int, dtype: torch.dtype, seed: int, bias: bool):
    """x [rows, inputs]: integers times 2^-j, j in {0, 1, 2} drawn per row and block of 32 (each block holding
    a +-127 * 2^-j, so that W8A8's block scale is 2^-j exactly and differs between rows and blocks), an int8
    weight [outputs, inputs], a scale [outputs] and optionally a bias [outputs] with full mantissas: every
    partial sum is a multiple of 1/4 below 2^22, exact in float32 in any order, so the kernel's output is
    fixed to the bit by its roundings alone."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (rows, inputs), generator=gen).float()
    x[:, ::32] = 127.0 * torch.where(torch.rand(rows, (inputs + 31) // 32, generator=gen) < 0.5, -1.0, 1.0)
    exponents = torch.randint(0, 3, (rows, (inputs + 31) // 32), generator=gen)  # random: no pattern across rows
    x = x * 2.0 ** -exponents.repeat_interleave(32, dim=1)[:, :inputs]  # W8A8 block scales 1, 1/2 or 1/4
    weight = torch.randint(-127, 128, (outputs, inputs), dtype=torch.int8, generator=gen)
    scale = (torch.rand(outputs, generator=gen) / 300 + 1e-4).to(dtype)
    shift = (torch.randn(outputs, generator=gen) * 3).to(dtype) if bias else None
    return x.to(dtype), weight, scale, shift


def _contract(x, weight, scale, bias):
    """torch's lines the GEMV promises: the float32 sum times the scale, one rounding to x.dtype, then + bias
    (torch's add: rounded again) -> [M, N]."""
    total = (x.double() @ weight.double().T).float()  # exact: integers below 2^24
    out = (total * scale.float()).to(x.dtype)
    return out if bias is None else out + bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("activation_bits", [16, 8])
def test_gemv_rounds_as_torch_bit_for_bit(dtype, bias, rows, activation_bits):
    """The product's rounding and the bias's second rounding, exactly, for every row count (the register
    blocks of 1-4 activation rows, 8 / 4 / single output rows) and a ragged width (53: a masked tail)."""
    for outputs, inputs in ((37, 53), (21, 96), (9, 576)):
        x, weight, scale, shift = _integer_operands(rows, outputs, inputs, dtype, seed=rows + inputs, bias=bias)
        projection = native.Int8Projection(weight, scale, shift, activation_bits=activation_bits)
        got = projection(x)
        assert got.dtype == dtype and torch.equal(got, _contract(x, weight, scale, shift)), (outputs, inputs)
        if activation_bits == 16:
            assert torch.equal(native.int8_linear(x, weight, scale, shift), got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_portable_gemv_loops_round_as_torch_bit_for_bit(dtype, tmp_path, monkeypatch):
    """The same contract on a build without AVX-512 (the plain C loops, W8A16 and W8A8), with and without bias."""
    portable = loader.build(tmp_path, loader.default_flags() + ["-mno-avx512f"])
    monkeypatch.setitem(loader._state, "lib", loader.load(portable))
    for bias in (False, True):
        for rows, (outputs, inputs) in ((1, (37, 53)), (3, (12, 80)), (4, (5, 64))):
            x, weight, scale, shift = _integer_operands(rows, outputs, inputs, dtype, seed=rows, bias=bias)
            for bits in (16, 8):
                got = native.Int8Projection(weight, scale, shift, activation_bits=bits)(x)
                assert torch.equal(got, _contract(x, weight, scale, shift)), (bias, rows, bits)


def _layer_operands(dtype: torch.dtype, hidden: int = 40, heads: int = 4, kv_heads: int = 2, dim: int = 16,
                    inner: int = 72, seed: int = 0, activation_bits: int = 16):
    """Random INT8 projections (with biases), norm weights (not 1) for one Llama layer whose head_dim * heads
    (64) != hidden (40); returns (LayerKernels, the Int8Projections q, k, v, o, gate, up, down, the norms).
    ``activation_bits`` 8: W8A8 projections (each input quantised once for all of its products)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(heads * dim, hidden), (kv_heads * dim, hidden), (kv_heads * dim, hidden), (hidden, heads * dim),
              (inner, hidden), (inner, hidden), (hidden, inner)]
    projections = []
    for outputs, inputs in shapes:
        weight = torch.randint(-127, 128, (outputs, inputs), dtype=torch.int8, generator=gen)
        scale = (torch.rand(outputs, generator=gen) / 100 + 1e-3).to(dtype)
        bias = (torch.randn(outputs, generator=gen) * 0.1).to(dtype)
        projections.append(native.Int8Projection(weight, scale, bias, activation_bits=activation_bits))
    norms = [((torch.rand(hidden, generator=gen) + 0.5).to(dtype), 1e-5) for _ in range(2)]
    if not LayerKernels.supports(tuple(projections), *norms, dim):
        pytest.skip("the fused layer does not take bfloat16 here (torch's sum order not reproduced)")
    return LayerKernels(*projections, *norms, dim), projections, norms


def _rms_norm(x, weight, eps):
    """LlamaRMSNorm's lines: [..., n] -> [..., n]."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_mlp_rounds_each_step_as_the_torch_lines(dtype):
    """LayerKernels.mlp against the per-op lines with the same GEMV: h = x + o(a); n = norm(h);
    x + down(silu(gate(n)) * up(n)), every op rounded to the dtype. SiLU's exp is libm's in C and Sleef's in
    torch (at most a float32 ulp or two apart), which flips a bfloat16 rounding at about 1 element in 10^4:
    in bfloat16 nearly every output element must be bit-equal (a dropped or extra rounding changes a large
    share); float32 outputs keep those ulps (close to 1e-5)."""
    kernels, (q, k, v, o, gate, up, down), norms = _layer_operands(dtype)
    gen = torch.Generator().manual_seed(1)
    equal = total = 0
    for batch in (1, 2, 4):
        hidden = torch.randn(batch, 1, 40, generator=gen).to(dtype)
        attention = torch.randn(batch, 1, 64, generator=gen).to(dtype)
        h = hidden + o(attention)
        n = _rms_norm(h, *norms[1])
        want = h + down(torch.nn.functional.silu(gate(n)) * up(n))
        got = kernels.mlp(attention, hidden)
        assert got.shape == want.shape and not got.isnan().any()
        torch.testing.assert_close(got, want, **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else
                                                  {"rtol": 2e-2, "atol": 2e-2}))
        equal += int((got == want).sum())
        total += want.numel()
    if dtype == torch.bfloat16:
        assert equal >= 0.98 * total, f"{total - equal} of {total} elements differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation_bits", [16, 8])
def test_fused_attention_inputs_equal_the_torch_lines_bit_for_bit(dtype, activation_bits):
    """LayerKernels.attention_inputs: norm, q / k / v with biases, rotary on q and k (head_dim 16 != 40 / 4).
    W8A8: the fused call quantises the normed input once and hands it to all three products, each of which
    must equal its own projection of that input (which quantises it the same way)."""
    kernels, (q, k, v, *_), norms = _layer_operands(dtype, seed=2, activation_bits=activation_bits)
    gen = torch.Generator().manual_seed(3)
    for batch, length in ((1, 1), (3, 1), (2, 2)):
        x = torch.randn(batch, length, 40, generator=gen).to(dtype)
        cos, sin = (torch.randn(batch, length, 16, generator=gen).to(dtype) for _ in range(2))
        got = kernels.attention_inputs(x, cos, sin)
        n = _rms_norm(x, *norms[0])
        shape = (batch, length, -1, 16)
        query, key, value = q(n).view(shape), k(n).view(shape), v(n).view(shape)

        def rotate(t):
            half = torch.cat((-t[..., 8:], t[..., :8]), -1)
            return t * cos[:, :, None] + half * sin[:, :, None]

        for name, g, w in zip("qkv", got, (rotate(query), rotate(key), value)):
            assert g.shape == w.shape and torch.equal(g, w), (name, batch, length)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [272, 40])  # wider than the AVX-512 loops' 256; not a multiple of 16
def test_mass_read_rows_wider_than_the_fast_path(dtype, dim):
    """Head dims the AVX-512 score and weighted-sum loops do not take (D > 256 or D % 16) run the generic C loops."""
    gen = torch.Generator().manual_seed(dim)
    segments = [KVSegment(torch.randn(2, 2, n, dim, generator=gen).to(dtype),
                          torch.randn(2, 2, n, dim, generator=gen).to(dtype), None) for n in (9, 0, 30)]
    query = (torch.randn(2, 6, 2, dim, generator=gen) / dim ** 0.25).to(dtype)
    out, mass = native.mass_read(query, segments, dim ** -0.5)
    ref_out, ref_mass = mass_read(query, segments, dim ** -0.5)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, ref_out, **tolerance)
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_rms_norm_rows_wider_than_the_torch_order_sum():
    """Rows wider than MAX_EXACT_WIDTH: float32 sums in double precision (close to torch, not its order);
    bfloat16 returns None (the torch code), as torch splits such sums over threads."""
    width = native.MAX_EXACT_WIDTH + 40
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, width, generator=gen) * 3
    weight = torch.rand(width, generator=gen) + 0.5
    got = native.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, _rms_norm(x, weight, 1e-5), rtol=2e-6, atol=1e-6)
    assert native.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-5) is None


@pytest.mark.parametrize("lanes", [0, 17])
def test_torch_order_sum_outside_the_vector_widths_is_a_plain_sum(lanes):
    """lanes 0 (no torch order matched) or past 16: the double-precision sum of every element."""
    lib = loader.library()
    row = torch.arange(1.0, 1001.0)
    assert lib.confkv_torch_order_sum(row.data_ptr(), 1000, lanes) == 500500.0
    assert lib.confkv_torch_order_sum(row.data_ptr(), 1, lanes) == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rounds_every_product_and_the_sum(dtype):
    """x * cos + rotate_half(x) * sin with each product and the sum rounded, on a head dim not a power of 2."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 5, 24, generator=gen).to(dtype)
    cos, sin = (torch.randn(2, 3, 24, generator=gen).to(dtype) for _ in range(2))
    got, _ = native.rotary(x, x[:, :, :1], cos, sin)
    half = torch.cat((-x[..., 12:], x[..., :12]), -1)
    assert torch.equal(got, x * cos[:, :, None] + half * sin[:, :, None])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [5, 9])
def test_the_gemv_entry_point_takes_more_rows_than_a_decode_step(dtype, rows):
    """confkv_int8_gemv / confkv_int8_linear take any number of activation rows (the Python wrappers stop at
    MAX_GEMV_ROWS): rows past 4 run as further groups of up to 4 (rows_from), W8A16 and W8A8, each bit for bit
    as torch's lines."""
    lib = loader.library()
    for bias in (False, True):
        x, weight, scale, shift = _integer_operands(rows, 19, 70, dtype, seed=rows, bias=bias)
        out = torch.empty(rows, 19, dtype=dtype)
        code = native._CODES[dtype]
        status = lib.confkv_int8_gemv(x.data_ptr(), code, x.stride(0), rows, 70, weight.data_ptr(), 19,
                                      scale.data_ptr(), code, shift.data_ptr() if bias else None, code if bias else 0,
                                      out.data_ptr(), code, 1)
        assert status == 0 and torch.equal(out, _contract(x, weight, scale, shift)), bias
        projection = native.Int8Projection(weight, scale, shift, activation_bits=8)  # W8A8: its per-row blocks too
        out = torch.empty(rows, 19, dtype=dtype)
        assert lib.confkv_int8_linear(projection._plan, x.data_ptr(), code, 70, rows, out.data_ptr(), 1) == 0
        assert torch.equal(out, _contract(x, weight, scale, shift)), ("W8A8", bias)


_MIN_PARALLEL_SCRIPT = r"""
import sys, torch
from confkv import native
torch.set_num_threads(2)
x, w, s = torch.ones(1, 16), torch.ones(16, 16, dtype=torch.int8), torch.ones(16)
if sys.argv[1] == "0":
    native.gemv_settings(min_parallel=0)  # every product, however small, split over the pool
want = torch.full((1, 16), 16.0)
assert torch.equal(native.int8_linear(x, w, s), want)
print(native.gemv_settings())
"""


def test_min_parallel_zero_splits_even_the_smallest_product():
    """gemv_settings(min_parallel=0) is a setting like any other (not 'keep'): a 16 x 16 product then starts
    the pool's one worker (2 threads: the caller and one worker, no more); by default it runs on the caller
    alone. In fresh processes (workers outlive a call)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    def workers(setting: str) -> int:
        done = subprocess.run([sys.executable, "-c", _MIN_PARALLEL_SCRIPT, setting], capture_output=True, text=True,
                              timeout=120, cwd=Path(__file__).resolve().parents[2], env={**os.environ})
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    assert workers("default") == 0 and workers("0") == 1  # 2 threads: the caller and exactly one worker


@pytest.mark.parametrize("lanes", [1, 8, 16])
def test_torch_order_sum_at_every_vector_width_sums_each_element_once(lanes):
    """torch_order_sum at each width it supports (this machine's torch matches one of them; the others run on
    other CPUs): within float32 rounding of the exact sum, on lengths with leftover vectors and a scalar tail."""
    lib = loader.library()
    gen = torch.Generator().manual_seed(lanes)
    for n in (5, 37, 100, 1000, 3000, 5001, 16384):
        row = torch.rand(n, generator=gen) + 0.5  # positive: a double-counted or lost element moves the sum by >= 0.5
        got = lib.confkv_torch_order_sum(row.data_ptr(), n, lanes)
        exact = float(row.double().sum())
        assert abs(got - exact) <= n * 2.0 ** -23 * exact, (n, got, exact)


def _cascade_sum_reference(row: torch.Tensor, lanes: int) -> float:
    """torch's float32 sum of a contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp: ``lanes``-wide vectors,
    four interleaved accumulators, cascaded over four levels of 2^power steps, leftovers, then the scalar tail
    and the lanes one by one), in torch float32 ops: each lane's additions are independent, so adding whole
    [ILP, lanes] blocks at once keeps every rounding. Checked against ``torch.sum`` at the width this machine's
    torch uses, then used for the widths it does not."""
    n = row.numel()
    lanes = 1 if n < lanes else lanes
    levels = ilp = 4
    vectors = n // lanes
    size = vectors // ilp
    power = max((size - 1).bit_length() // levels if size > 1 else 0, 4)
    step, mask = 1 << power, (1 << power) - 1
    acc = torch.zeros(levels, ilp, lanes)
    blocks = row[: size * ilp * lanes].view(size, ilp, lanes)
    i = 0
    while i + step <= size:
        for _ in range(step):
            acc[0] += blocks[i]
            i += 1
        for level in range(1, levels):
            acc[level] += acc[level - 1]
            acc[level - 1] = 0.0
            if i & (mask << (level * power)):
                break
    for j in range(i, size):
        acc[0] += blocks[j]
    for level in range(1, levels):
        acc[0] += acc[level]
    for v in range(size * ilp, vectors):
        acc[0, 0] += row[v * lanes:(v + 1) * lanes]
    for k in range(1, ilp):
        acc[0, 0] += acc[0, k]
    total = torch.zeros((), dtype=torch.float32)
    for t in range(vectors * lanes, n):
        total += row[t]
    for lane in range(lanes):
        total += acc[0, 0, lane]
    return total.item()


_ORDER_LENGTHS = (1, 5, 12, 37, 100, 513, 1000, 3000, 5001, 16384, 70_001)


def test_the_cascade_reference_is_torch_sum_at_this_machines_width():
    lanes = native._sum_lanes(loader.library())
    if not lanes:
        pytest.skip("torch's float sum order is not reproduced on this torch build")
    gen = torch.Generator().manual_seed(11)
    with torch_threads(1):  # torch splits very long rows over its threads
        for n in _ORDER_LENGTHS:
            row = torch.randn(n, generator=gen).pow(2)
            assert _cascade_sum_reference(row, lanes) == row.sum().item(), n


@pytest.mark.parametrize("lanes", [1, 8, 16])
def test_torch_order_sum_is_the_cascade_bit_for_bit_at_every_width(lanes):
    """Every width the kernel supports, bit for bit against the reference (within rounding, as the test above
    asks, a plain sum would pass too): a width this machine's torch does not use is still torch's order on
    the CPUs that use it."""
    lib = loader.library()
    gen = torch.Generator().manual_seed(100 + lanes)
    for n in _ORDER_LENGTHS:
        row = torch.randn(n, generator=gen).pow(2)
        assert lib.confkv_torch_order_sum(row.data_ptr(), n, lanes) == _cascade_sum_reference(row, lanes), (n, lanes)


def test_the_softmax_exp_keeps_its_smallest_weight_and_drops_below_it():
    """The kernels' exp of ``x - max`` gives 0 below -87.3 and exp(x) from -87.3 up (the smallest normal float
    range): a key scoring exactly -87.3 under the best keeps its weight (1.19e-38, torch's too), one a little
    lower gets 0. Read through the native mass read, one query, three keys, fp32."""
    low = torch.tensor(-87.3, dtype=torch.float32)
    query = torch.zeros(1, 1, 1, 16)
    query[..., 0] = 1.0
    keys = torch.zeros(1, 1, 3, 16)
    keys[0, 0, 1, 0] = low
    keys[0, 0, 2, 0] = torch.nextafter(low, torch.tensor(-100.0))  # one float below the cut
    values = torch.zeros(1, 1, 3, 16)
    values[0, 0, 1, 0] = 1.0  # the output's channel 0 is key 1's weight alone
    out, masses = native.mass_read(query, [KVSegment(keys, values, None)], 1.0)
    weight = float(masses[0][0, 0, 1])
    assert weight == pytest.approx(float(torch.exp(low)), rel=1e-5) and weight > 0.0
    assert float(masses[0][0, 0, 2]) == 0.0
    assert float(out[0, 0, 0, 0]) == pytest.approx(float(torch.exp(low)), rel=1e-5)
