"""INT8 rows in one C call (``c/int8_rows.c`` through :func:`confkv.native.pages.quantize_int8_rows` and
:func:`~confkv.native.pages.decode_int8_rows`): the codes, scales and
decoded rows of the torch code, bit for bit, for the hot tier's rule (:mod:`confkv.quant`) and the open page's
(:mod:`confkv.tiers.cold_read`), over ordinary, tiny, huge, zero and float16-subnormal rows; a NaN or an
infinity hands the call back to torch; nothing is taken without the library."""

from __future__ import annotations

import pytest
import torch

from confkv import native, quant
from confkv.native import loader
from confkv.native.pages import decode_int8_rows, quantize_int8_rows
from confkv.tiers import cold_read

pytestmark = pytest.mark.skipif(not native.available(), reason="the call needs the library")


def _rows(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[2, 3, 40, 64]: rows of every magnitude, some all zero, some with one outlier, some float16-subnormal scales."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 40, 64, generator=gen)
    magnitude = 10.0 ** torch.randint(-9, 5, (2, 3, 40, 1), generator=gen).float()
    x = x * magnitude
    x[0, 0, :3] = 0.0
    x[1, 2, 5, 7] = 3e4
    x[1, 1, 8:12] *= 1e-3  # absmax / 127 below float16's smallest normal
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.is_floating_point()
                                                                       else a, b.view(torch.uint8)
                                                                       if b.is_floating_point() else b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_hot_tiers_codes_scales_and_decoded_rows_are_torchs(dtype, seed):
    keys, values = _rows(dtype, seed), _rows(dtype, seed + 10)
    channel_scale = quant.key_channel_scale(keys.float())
    with loader.disabled():  # torch's own code
        want_keys, want_key_scale = quant.quantize_keys(keys, channel_scale)
        want_values, want_value_scale = quant.quantize_values(values)
        decoded = {out: (quant.dequantize_keys(want_keys, want_key_scale, channel_scale, out),
                         quant.dequantize_values(want_values, want_value_scale, out))
                   for out in (torch.float32, torch.bfloat16)}
    got_keys, got_key_scale = quantize_int8_rows(keys, channel_scale)
    got_values, got_value_scale = quantize_int8_rows(values)
    assert _same(got_keys, want_keys) and _same(got_key_scale, want_key_scale)
    assert _same(got_values, want_values) and _same(got_value_scale, want_value_scale)
    for out, (want_decoded_keys, want_decoded_values) in decoded.items():
        assert _same(decode_int8_rows(want_keys, want_key_scale, out, channel_scale), want_decoded_keys)
        assert _same(decode_int8_rows(want_values, want_value_scale, out), want_decoded_values)
    # quant.py's functions take the call (the values above), and hand back to torch for a NaN
    assert _same(quant.quantize_keys(keys, channel_scale)[0], want_keys)
    assert _same(quant.dequantize_values(want_values, want_value_scale, dtype), decoded[torch.float32][1].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_open_pages_codes_scales_and_decoded_rows_are_torchs(dtype, seed):
    keys, values = _rows(dtype, seed), _rows(dtype, seed + 20)
    with loader.disabled():  # torch's own code
        want = cold_read.encode_open(keys, values, dtype, 8)
        want_keys, want_values = cold_read.decoded_open(want, dtype)
    got = cold_read.encode_open(keys, values, dtype, 8)  # the call, through the open page's own function
    assert all(_same(got[name], want[name]) for name in want)
    assert all(_same(a, b) for a, b in zip(cold_read.decoded_open(got, dtype), (want_keys, want_values)))
    got_keys, got_key_scale = quantize_int8_rows(keys, half_scales=True)
    got_values, got_value_scale = quantize_int8_rows(values, half_scales=True)
    assert got_key_scale.dtype == torch.float16
    assert _same(got_keys, want["keys"]) and _same(got_key_scale, want["key_scale"])
    assert _same(got_values, want["values"]) and _same(got_value_scale, want["value_scale"])
    assert _same(decode_int8_rows(want["keys"], want["key_scale"], dtype), want_keys)
    assert _same(decode_int8_rows(want["values"], want["value_scale"], dtype), want_values)


def test_every_float16_scale_is_torchs_rounding():
    """Every magnitude the open page's scales can take, across float16's subnormals, normals and its overflow."""
    x = torch.zeros(1, 1, 4000, 2)
    x[0, 0, :, 0] = torch.logspace(-12, 7, 4000) * 127  # scale = absmax / 127 from 1e-12 to 1e7
    x[0, 0, ::3, 0] *= -1
    ties = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 2 ** -20 * (1 + 2 ** -11), 2 ** -24 * 1.5, 2 ** -24 * 2.5])
    x[0, 0, :5, 0] = ties * 127  # exactly halfway between two float16 values: to the even one
    got = quantize_int8_rows(x, half_scales=True)[1]
    want = (x.abs().amax(-1) / 127.0).to(torch.float16)
    assert _same(got, want)


def test_rows_too_small_for_a_scale_code_to_zero_as_torchs():
    """float32 subnormal rows whose absmax / 127 underflows to a zero scale: torch divides them by 1 (codes 0), where
    a division by the zero scale would give +-127."""
    x = torch.full((1, 2, 3, 8), 1e-44)
    x[0, 1, 1] = -2e-44
    x[0, 0, 2, :4] = 0.0
    with loader.disabled():
        want = quant.quantize_values(x), quant.quantize_keys(x, torch.ones(1, 2, 8))
    assert bool((want[0][1] == 0).all()) and bool((want[0][0] == 0).all())
    got = quantize_int8_rows(x), quantize_int8_rows(x, torch.ones(1, 2, 8))
    for (got_codes, got_scales), (want_codes, want_scales) in zip(got, want):
        assert _same(got_codes, want_codes) and _same(got_scales, want_scales)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_an_infinity_is_left_to_torch(bad):
    x = torch.randn(1, 2, 5, 8)
    x[0, 1, 3, 2] = bad
    assert quantize_int8_rows(x) is None and quantize_int8_rows(x, half_scales=True) is None
    with loader.disabled():
        want = quant.quantize_values(x)
    got = quant.quantize_values(x)  # torch's code, all the same
    assert _same(got[0], want[0]) and _same(got[1], want[1])


def test_nothing_is_taken_without_the_library_or_in_another_dtype():
    x = torch.randn(1, 2, 5, 8)
    assert quantize_int8_rows(x.half()) is None
    assert quantize_int8_rows(x, divisor=torch.ones(1, 2, 7)) is None  # the wrong shape
    assert decode_int8_rows(torch.zeros(1, 2, 5, 8, dtype=torch.int8), torch.ones(1, 2, 4), torch.float32) is None
    with loader.disabled():
        assert quantize_int8_rows(x) is None
        assert decode_int8_rows(torch.zeros(1, 2, 5, 8, dtype=torch.int8), torch.ones(1, 2, 5), torch.float32) is None
