"""W8A8: the projections' inputs quantised to int8 in blocks of 32 (``quantize_linear_weights(...,
activation_bits=8)``), the decode GEMV summing integer products (kernels.c, AVX-512 VNNI or the portable
loop), against the torch reference (the quantised numbers times the INT8 weight in float32)."""

import pytest
import torch

from confkv import native
from confkv.hf.weights import Int8Linear, quantize_linear_weights
from confkv.models import tiny_model
from confkv.native import loader

pytestmark = [pytest.mark.skipif(not native.available(), reason="no C compiler: the native kernels are off"),
              pytest.mark.usefixtures("nan_filled_empty")]  # buffers to be overwritten start as NaN


def test_activation_blocks_by_hand():
    x = torch.tensor([[0.0] * 31 + [127.0] + [1.0, -2.0, 0.5] + [0.0] * 29 + [3.0, 0.25]])  # 66 values: 3 blocks
    got = native.quantize_activation_blocks(x)
    assert torch.equal(got[0, :32], x[0, :32])  # block 0: scale 1, integers stay
    s1 = 2.0 / 127  # block 1: max |x| 2
    expected = [round(v / s1) * s1 for v in (1.0, -2.0, 0.5)]
    torch.testing.assert_close(got[0, 32:35], torch.tensor(expected), rtol=1e-6, atol=0)
    assert got[0, 35:64].abs().sum() == 0
    s2 = 3.0 / 127  # block 2 (2 values): max 3
    torch.testing.assert_close(got[0, 64:], torch.tensor([3.0, round(0.25 / s2) * s2]), rtol=1e-6, atol=0)
    assert torch.equal(native.quantize_activation_blocks(torch.zeros(2, 40)), torch.zeros(2, 40))


def _reference(x, weight, scale, bias):
    out = (native.quantize_activation_blocks(x) @ weight.float().T * scale.float()).to(x.dtype)
    return out if bias is None else out + bias


def _assert_float32_close(got, x, weight, scale, bias):
    """``got`` [rows, out] float32 against the exact result of its quantised operands (float64), within the rounding
    of the GEMV's float32 arithmetic. Every kernel sums the integer products of at least 4 neighbouring columns
    exactly (the portable loop a block of 32; AVX-512 VNNI 4 a lane, the lanes then scaled and summed in float32),
    so what is left is at most n = K / 4 + 3 roundings over the K / 4 terms (each group's integer sum times its
    block's activation scale, summed, times the weight scale, plus the bias; Higham, Accuracy and Stability of
    Numerical Algorithms, 3.1: gamma_n * sum |term|, gamma_n = n u / (1 - n u), u = 2^-24), plus one rounding of each
    quantised activation (``quantize_activation_blocks`` gives code * scale in float32). The torch reference's own
    float32 sum of K products in its BLAS order is not the yardstick (a fixed 1e-5 against it missed by 2e-5 on one
    machine for an output whose terms cancel); a wrong block, code or scale misses this by orders of magnitude."""
    u = 2.0 ** -24
    quantised = native.quantize_activation_blocks(x).double()  # [rows, width]
    weights = weight.double()  # [out, width]
    width = weight.shape[1]
    groups = -(-width // 4)
    padded = torch.nn.functional.pad(quantised, (0, groups * 4 - width)).view(-1, groups, 4)
    group_sums = torch.einsum("rgi,ogi->rog", padded, torch.nn.functional.pad(weights, (0, groups * 4 - width))
                              .view(-1, groups, 4))  # [rows, out, groups]
    exact = group_sums.sum(-1) * scale.double()
    n = groups + 3
    gamma = n * u / (1 - n * u)
    bound = (gamma * group_sums.abs().sum(-1) + u * (quantised.abs() @ weights.abs().T)) * scale.double().abs()
    if bias is not None:
        exact = exact + bias.double()
        bound = bound + u * bias.double().abs()
    bound = bound + u * exact.abs()  # the output's own rounding to float32
    assert got.dtype == torch.float32
    miss = (got.double() - exact).abs() - bound
    assert bool((miss <= 0).all()), float(miss.max())


@pytest.mark.parametrize("width", [64, 576, 100, 40, 130, 97, 127, 80])  # multiples of 64, of 32, neither; a last
# block of one column; one short of a multiple of 64 (the quantised row padded by one zero); a multiple of 16, not
# of 32 (the widened row has no zero padding past it)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a8_gemv_equals_the_reference(width, rows, dtype, with_bias):
    gen = torch.Generator().manual_seed(width * 10 + rows)
    weight = torch.randint(-127, 128, (37, width), dtype=torch.int8, generator=gen)
    scale = (torch.rand(37, generator=gen) * 0.02 + 1e-3).to(dtype)
    bias = torch.randn(37, generator=gen).to(dtype) if with_bias else None
    x = (torch.randn(rows, width, generator=gen) * torch.rand(1, width, generator=gen) * 4).to(dtype)
    x[0, :7] = 0.0  # a partly zero block
    x[-1, 32:64] = 0.0  # a whole zero block (scale 0: its codes are 0, not x / 0)
    got = native.Int8Projection(weight, scale, bias, activation_bits=8)(x)
    # integer sums are exact; the blocks' float32 sum in another order: within a rounding of the output
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, _reference(x, weight, scale, bias), rtol=1e-2, atol=1e-2)
    else:
        _assert_float32_close(got, x, weight, scale, bias)
    w8a16 = native.Int8Projection(weight, scale, bias)(x)
    assert not torch.equal(got, w8a16)  # the activations were quantised


def test_weights_of_minus_128_are_multiplied_as_they_are():
    """The whole int8 range: -128 is no code ``quantize_linear_weights`` writes (it clamps to +-127), but a weight
    handed to ``Int8Projection`` may hold it, and a kernel that takes |w| as a byte (AVX2) must read it as 128, not
    as -128 negated."""
    gen = torch.Generator().manual_seed(128)
    weight = torch.randint(-128, 128, (24, 96), dtype=torch.int8, generator=gen)
    weight[:, :8] = -128
    scale = torch.rand(24, generator=gen) * 0.02 + 1e-3
    x = torch.randn(2, 96, generator=gen)
    got = native.Int8Projection(weight, scale, None, activation_bits=8)(x)
    _assert_float32_close(got, x, weight, scale, None)


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
@pytest.mark.parametrize("flag", ["-mno-avx512f", "-mno-avx2"])
def test_the_portable_w8a8_loops_equal_the_reference(tmp_path, monkeypatch, flag):
    """A build without AVX-512 (so without VNNI) runs the AVX2 byte products where the CPU has AVX2; one without
    AVX2 as well runs the portable integer loop. Widths: a multiple of 64, neither of 32 nor 64, and a last block
    of one column (the AVX2 loop's copied tail)."""
    path = loader.build(tmp_path, loader.default_flags() + [flag])
    monkeypatch.setitem(loader._state, "lib", loader.load(path))
    gen = torch.Generator().manual_seed(3)
    for width in (576, 100, 97):  # 97: a last activation block of one column
        weight = torch.randint(-127, 128, (20, width), dtype=torch.int8, generator=gen)
        scale = torch.rand(20, generator=gen) * 0.02 + 1e-3
        x = torch.randn(3, width, generator=gen)
        got = native.Int8Projection(weight, scale, None, activation_bits=8)(x)
        _assert_float32_close(got, x, weight, scale, None)


def test_int8_linear_prefill_and_decode_compute_the_same_numbers():
    model = tiny_model("llama", num_hidden_layers=2).to(torch.bfloat16)
    assert quantize_linear_weights(model, activation_bits=8) > 0
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.activation_bits == 8 for m in layers) and "activation_bits=8" in repr(layers[0])
    linear = layers[0]
    x = torch.randn(3, linear.in_features).bfloat16()
    decode = linear(x)  # 3 rows: the native GEMV
    prefill = linear.torch_forward(x)  # the torch code of prefill chunks
    torch.testing.assert_close(decode, prefill, rtol=1e-2, atol=1e-2)
    with loader.disabled():
        torch.testing.assert_close(linear(x), prefill, rtol=0, atol=0)


def test_fused_layers_equal_the_per_op_w8a8_path():
    from confkv.config import StoreConfig
    from confkv.hf import ConfKVCache, prefill
    from confkv.hf.lean import LeanDecoder

    model = tiny_model("llama", num_hidden_layers=3).to(torch.bfloat16)
    quantize_linear_weights(model, activation_bits=8)
    ids = torch.randint(1, 250, (1, 30), generator=torch.Generator().manual_seed(4))
    outputs = []
    for fuse in (True, False):
        cache = ConfKVCache.for_model(model, "streaming", store=StoreConfig(), budget=16)
        prefill(model, cache, ids[:, :20], chunk=8)
        decoder = LeanDecoder(model)
        decoder.fuse_layers = fuse
        assert (decoder._fused_layers(torch.zeros(1, 1, 64, dtype=torch.bfloat16)) is not None) == fuse
        outputs.append(torch.stack([decoder(ids[:, t:t + 1], cache) for t in range(20, 30)]))
    # one quantisation of each input for all of its projections, the same GEMV: the same numbers
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-2, atol=1e-2)
    assert torch.equal(outputs[0].argmax(-1), outputs[1].argmax(-1))


def test_bad_activation_bits_name_the_choices():
    linear = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match="activation_bits must be 16 .* or 8"):
        Int8Linear(linear, torch.bfloat16, activation_bits=4)
    model = tiny_model("llama", num_hidden_layers=1).to(torch.bfloat16)
    with pytest.raises(ValueError, match="activation_bits must be 16"):
        quantize_linear_weights(model, activation_bits=12)
    weight = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="activation_bits must be 16"):
        native.Int8Projection(weight, torch.ones(4), None, activation_bits=32)
