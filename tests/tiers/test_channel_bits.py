"""Per-channel key widths (confkv.tiers.channel_bits) and the ``channel_bits`` page format.

References are independent of the code under test: an exhaustive search over every allocation, the
quantizers' levels written out by hand, bits counted one by one.

Each test was seen to fail with a bug put in by hand (then removed):

- exhaustive optimum: the multiplier's bisection keeping the side that does not fit.
- the bits left: no step after the multiplier; the steps ranked by error removed per step, not per bit; the
  gains measured from width 0 instead of the channel's width.
- quantizer levels: width 1 split at its lower level instead of the mean; width 0 the group's minimum.
- KIVI equality / bound: the scale divided by 2**w instead of 2**w - 1.
- packing round trip: a channel's bits written most significant first; a code's second byte never read.
- a page's errors: the entries not kept (padding, outliers) summed in.
- format: keys rotated with the values under ``hadamard``; the values not clipped under ``clip``; every page given the first page's widths; the widths
  left out of the page's bytes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from confkv.config import ColdConfig
from confkv.errors import ConfigError
from confkv.tiers import channel_bits, lowbit
from confkv.tiers.formats import build_format

pytestmark = pytest.mark.usefixtures("one_thread")

FP16_EPS = 2.0 ** -11


def _brute_force(errors: torch.Tensor, bits: int) -> float:
    """The least total error of any widths 0..MAX_WIDTH with at most ``bits * D`` bits (one head)."""
    dim = errors.shape[0]
    best = float("inf")
    for widths in itertools.product(range(channel_bits.MAX_WIDTH + 1), repeat=dim):
        if sum(widths) <= bits * dim:
            best = min(best, sum(float(errors[c, w]) for c, w in enumerate(widths)))
    return best


@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_allocation_is_the_exhaustive_optimum_when_each_bit_removes_less_than_the_last(seed, bits):
    """Errors falling by a fixed ratio a bit (a uniform quantizer's 4**-w, each channel its own scale): the
    allocation spends exactly the budget and reaches the least total error of all allocations."""
    gen = torch.Generator().manual_seed(seed)
    dim = 4
    scales = torch.rand(dim, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-2, 3, (dim,), generator=gen).double()
    ratio = 0.15 + 0.2 * torch.rand(dim, generator=gen, dtype=torch.float64)
    errors = (scales[:, None] * ratio[:, None] ** torch.arange(channel_bits.MAX_WIDTH + 1))[None]
    best = _brute_force(errors[0], bits)
    for widths in (channel_bits.allocate(errors, bits * dim), channel_bits.lagrangian_widths(errors, bits * dim)):
        assert widths.shape == (1, dim) and int(widths.sum()) == bits * dim  # the multiplier alone spends it all
        got = sum(float(errors[0, c, int(w)]) for c, w in enumerate(widths[0]))
        assert got == pytest.approx(best, rel=1e-12)


def test_the_bits_the_multiplier_leaves_go_step_by_step_to_the_most_error_removed_per_bit():
    """A 3-bit jump (channel 0) that does not fit a 2-bit budget stops the multiplier at nothing; the two bits
    left go first to channel 1's step (1.0 per bit), then to nothing: channel 2's 2-bit jump (0.8 per bit, 1.6
    in one step) no longer fits and channel 1 has nothing more to remove."""
    errors = torch.tensor([[[100.0, 200, 200, 0, 0, 0, 0, 0, 0],
                            [1.0, 0, 0, 0, 0, 0, 0, 0, 0],
                            [1.6, 1.7, 0, 0, 0, 0, 0, 0, 0]]])
    assert channel_bits.lagrangian_widths(errors, 2).tolist() == [[0, 0, 0]]
    assert channel_bits.allocate(errors, 2).tolist() == [[0, 1, 0]]


def _bisected_widths(errors: torch.Tensor, budget: int, steps: int) -> torch.Tensor:
    """The first stage as stop 68 searched it: ``lambda`` bisected ``steps`` times in [0, max error + 1]."""
    errors = errors.double()
    cost = torch.arange(errors.shape[-1], dtype=torch.float64)
    low = torch.zeros(errors.shape[:-2], dtype=torch.float64)
    high = errors.amax((-1, -2)) + 1.0
    for _ in range(steps):
        middle = (low + high) / 2
        fits = (errors + middle[..., None, None] * cost).argmin(-1).sum(-1) <= budget
        high, low = torch.where(fits, middle, high), torch.where(fits, low, middle)
    return (errors + high[..., None, None] * cost).argmin(-1)


def _pages_errors(seed: int, dim: int) -> torch.Tensor:
    """Per-channel errors of real quantizers on random pages (channels of spreads over four orders of magnitude;
    every other seed rounded keys, so that errors tie), or, every third seed, errors drawn at random (neither
    falling nor convex)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, 2, 1, 32, dim, generator=gen) * torch.rand(dim, generator=gen) ** 3 * 5
    if seed % 2:
        keys = keys.round()
    errors = channel_bits.page_width_errors(keys, torch.rand(keys.shape, generator=gen) > 0.1)
    return torch.rand(errors.shape, generator=gen, dtype=torch.float64) if seed % 3 == 2 else errors


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dim", [8, 64])
def test_the_worked_out_multiplier_is_the_least_that_fits(seed, dim):
    """The first stage works the least fitting ``lambda`` out from the widths' slopes: the widths a bisection of
    200 steps finds (beyond float64's resolution), for every budget from nothing to every width at 8 bits; and the
    allocation is the one stop 68's 40-step bisection and the same second stage gave, whose stored pages the
    quality figures of results/lowbit/ and results/memory/ come from."""
    errors = _pages_errors(seed, dim)
    for budget in (0, 1, dim - 1, 2 * dim, 3 * dim + 1, 8 * dim, 9 * dim):
        widths = channel_bits.lagrangian_widths(errors, budget)
        assert (widths.sum(-1) <= budget).all()
        assert torch.equal(widths, _bisected_widths(errors, budget, 200))
        original = channel_bits.lagrangian_widths
        try:
            channel_bits.lagrangian_widths = lambda e, b: _bisected_widths(e, b, 40)
            before = channel_bits.allocate(errors, budget)
        finally:
            channel_bits.lagrangian_widths = original
        assert torch.equal(channel_bits.allocate(errors, budget), before)


def test_a_width_that_does_not_lower_the_error_is_jumped_over():
    """A channel whose 1-bit error is above its 0-bit error goes from 0 straight to 2 bits when that pays."""
    errors = torch.tensor([[[1.0, 1.5, 0.05, 0.04, 0.03, 0.02, 0.01, 0.005, 0.0],
                            [1e-6, 1e-7, 1e-8, 1e-9, 1e-10, 1e-11, 1e-12, 1e-13, 0.0]]], dtype=torch.float64)
    widths = channel_bits.allocate(errors, 2)
    assert widths.tolist() == [[2, 0]]


def test_widths_never_exceed_the_budget_per_head():
    gen = torch.Generator().manual_seed(3)
    errors = torch.rand(2, 3, 16, channel_bits.MAX_WIDTH + 1, generator=gen).sort(-1, descending=True).values
    errors[..., 1] = errors[..., 0] * 1.5  # width 1 never pays
    for budget in (0, 1, 17, 32, 48, 64, 127, 128, 200):
        widths = channel_bits.allocate(errors, budget)
        assert widths.shape == (2, 3, 16) and (widths.sum(-1) <= budget).all()
        assert widths.min() >= 0 and widths.max() <= 8


def _group(seed: int = 0, count: int = 64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, count, 1, generator=gen) * 3 + 1  # one channel's group of tokens (axis 1)
    return x, torch.ones_like(x, dtype=torch.bool)


def test_width_zero_is_the_mean_of_the_valid_entries_and_width_one_the_mean_plus_or_minus_its_deviation():
    x, valid = _group()
    valid[0, :5] = False  # left padding: not measured
    codes, scale, low = channel_bits.quantize_groups(x, valid, torch.tensor(0), 1)
    mean = x[valid].mean()
    assert float(scale) == 0 and (codes == 0).all()
    assert float(low) == pytest.approx(float(mean.half()), abs=0)
    codes, scale, low = channel_bits.quantize_groups(x, valid, torch.tensor(1), 1)
    spread = (x[valid] - mean).abs().mean()
    decoded = channel_bits.dequantize_groups(codes, scale, low)
    torch.testing.assert_close(decoded, torch.where(x > mean, mean + spread, mean - spread), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("width", [2, 3, 4, 8])
def test_widths_two_and_up_are_kivis_levels_and_stay_within_half_a_step(width):
    x, valid = _group(1)
    codes, scale, low = channel_bits.quantize_groups(x, valid, torch.tensor(width), 1)
    kivi_codes, kivi_scale, kivi_low = lowbit._asymmetric(x, valid, 1, width)
    assert torch.equal(codes, kivi_codes) and torch.equal(scale, kivi_scale) and torch.equal(low, kivi_low)
    # the worked-out bound: half a step, plus the float16 rounding of the minimum and of the top of the range
    bound = scale.float() / 2 + 1.01 * FP16_EPS * ((2 ** width - 1) * scale.float() + low.float().abs()) + 1e-6
    assert ((channel_bits.dequantize_groups(codes, scale, low) - x).abs() <= bound).all()


@pytest.mark.parametrize("width", [0, 1, 3, 8])
def test_a_pages_errors_are_each_widths_squared_error_over_the_kept_entries(width):
    gen = torch.Generator().manual_seed(width)
    grouped = torch.randn(2, 3, 4, 2, 8, 16, generator=gen) * torch.logspace(-1, 1, 16)  # [B, H, N, G, group, D]
    kept = torch.rand(grouped.shape, generator=gen) > 0.1
    errors = channel_bits.page_width_errors(grouped, kept)
    assert errors.shape == (2, 3, 4, 16, channel_bits.MAX_WIDTH + 1)
    codes, scale, low = channel_bits.quantize_groups(grouped, kept, torch.tensor(width), -2)
    squared = (channel_bits.dequantize_groups(codes, scale, low) - grouped) ** 2 * kept
    torch.testing.assert_close(errors[..., width], squared.sum((3, 4)))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_pack_channel_after_channel_and_unpack(bits):
    """A page's codes: each channel's tokens in a run of its width's bits, the channels one after the other."""
    gen = torch.Generator().manual_seed(bits)
    dim, width_bytes = 16, bits * 2
    widths = torch.zeros(2, 2, 3, dim, dtype=torch.int64)  # [B, H, N, D]: each page its own
    widths[...] = bits
    widths[0, 0, 0] = torch.tensor([8, 0, 1, 2, 3, 4, 5, 6, 0, 0, 0, 1, 2, 2, 0, 0]) * bits // 4
    widths[1, 1, 2] = torch.tensor([7, 7, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 0])
    assert (widths.sum(-1) <= 8 * width_bytes).all()
    top = (2 ** widths[:, :, :, None, :]).expand(2, 2, 3, 4, dim)
    codes = (torch.rand(top.shape, generator=gen) * top).floor().long()  # [B, H, N, P, D], below 2**width
    packed = channel_bits.pack(codes, widths, width_bytes)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 2, 3, 4, width_bytes)
    assert torch.equal(channel_bits.unpack(packed, widths), codes.float())
    used = 4 * int(widths[1, 1, 2].sum())  # that page leaves bits unused: they are 0
    assert used < 4 * 8 * width_bytes
    page_bits = (packed[1, 1, 2].long().flatten()[..., None] >> torch.arange(8)) & 1
    assert (page_bits.flatten()[used:] == 0).all()
    # bit by bit: least significant first, the page's 4 codes of a channel after each other, channel after channel
    for page in ((0, 0, 0), (0, 1, 1), (1, 1, 2)):
        expected, at = 0, 0
        for c in range(dim):
            for t in range(4):
                expected |= int(codes[page][t, c]) << at
                at += int(widths[page][c])
        assert int.from_bytes(bytes(packed[page].flatten().tolist()), "little") == expected


# ------------------------------------------------------------------ the page format


def _skewed_pages(seed: int, batch=1, heads=2, count=3, page=16, dim=32):
    """Keys whose channels differ in spread by three orders of magnitude; values plain. [B, H, N, P, D]."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-2, 1, dim)[torch.randperm(dim, generator=gen)]
    keys = torch.randn(batch, heads, count, page, dim, generator=gen) * spread + 0.3
    values = torch.randn(batch, heads, count, page, dim, generator=gen)
    valid = torch.ones(batch, heads, count, page, dtype=torch.bool)
    return keys, values, valid


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_channel_bits_pages_cost_kivis_bytes_and_err_less_on_uneven_channels(bits):
    keys, values, valid = _skewed_pages(bits)
    plain = build_format(bits, 8, 32, torch.bfloat16, "kivi")
    fmt = build_format(bits, 8, 32, torch.bfloat16, "channel_bits")
    data = fmt.encode(keys, values, valid, None)
    per_page = sum(t[0, :, 0].nbytes for t in data.values())
    assert per_page == fmt.page_nbytes(2, 32, 16) == plain.page_nbytes(2, 32, 16)
    assert data["key_widths"][0, :, 0].nbytes == 2 * 32 and fmt.layer_nbytes() == 0
    assert (data["key_widths"].long().sum(-1) <= 8 * data["key_codes"].shape[-1]).all()
    decoded_keys, decoded_values = fmt.decode(data, None)
    plain_keys, plain_values = plain.decode(plain.encode(keys, values, valid, None), None)
    assert torch.equal(decoded_values, plain_values)  # values: KIVI's own
    assert ((decoded_keys - keys) ** 2).mean() < 0.5 * ((plain_keys - keys) ** 2).mean()


def test_each_key_entry_decodes_within_its_channels_bound():
    keys, values, valid = _skewed_pages(9)
    fmt = build_format(3, 8, 32, torch.bfloat16, "channel_bits")
    data = fmt.encode(keys, values, valid, None)
    decoded, _ = fmt.decode(data, None)
    widths = data["key_widths"].long()[:, :, :, None, :]  # [B, H, N, 1, D]
    scale = data["key_scale"].float().repeat_interleave(8, dim=-2)
    low = data["key_min"].float().repeat_interleave(8, dim=-2)
    grouped = keys.reshape(1, 2, 3, 2, 8, 32)
    span = (grouped.amax(-2, keepdim=True) - grouped.amin(-2, keepdim=True)).expand_as(grouped).reshape(keys.shape)
    # widths 2+: half a step and float16 slack; widths 0 and 1: never farther than the group's own span
    fine = scale / 2 + 1.01 * FP16_EPS * ((2 ** widths - 1) * scale + low.abs()) + 1e-6
    bound = torch.where(widths >= 2, fine, span * 1.001 + 1e-6)
    assert ((decoded - keys).abs() <= bound).all()
    assert (widths == 0).any() and (widths >= 4).any()  # the test sees both ends


@pytest.mark.parametrize("extra", ["", "+clip"])
def test_with_hadamard_the_values_turn_and_the_keys_do_not(extra):
    """... and with ``clip`` the values' ranges are clipped (as ``hadamard+clip`` clips them), the keys' are not."""
    keys, values, valid = _skewed_pages(4)
    fmt = build_format(2, 8, 32, torch.bfloat16, "hadamard+channel_bits" + extra)
    rotated = build_format(2, 8, 32, torch.bfloat16, "hadamard" + extra)
    unrotated = build_format(2, 8, 32, torch.bfloat16, "channel_bits")
    data = fmt.encode(keys, values, valid, None)
    got_keys, got_values = fmt.decode(data, None)
    want_keys, _ = unrotated.decode(unrotated.encode(keys, values, valid, None), None)
    _, want_values = rotated.decode(rotated.encode(keys, values, valid, None), None)
    assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)
    # no rotation folded into a read (the keys have none); the pages go to the native read packed, values rotated
    assert fmt.read_rotation is None and not fmt.paged and fmt.paged_when_rotated


def test_each_page_has_its_own_widths():
    keys, values, valid = _skewed_pages(5)
    keys[:, :, 1] = keys[:, :, 0].flip(-1)  # the second page: the first with its channels reversed
    fmt = build_format(2, 8, 32, torch.bfloat16, "channel_bits")
    widths = fmt.encode(keys, values, valid, None)["key_widths"].long()
    assert torch.equal(widths[:, :, 1], widths[:, :, 0].flip(-1))
    assert not torch.equal(widths[:, :, 1], widths[:, :, 0])


def test_pages_too_short_for_their_widths_and_clashing_techniques_are_refused():
    keys, values, valid = _skewed_pages(6, page=4, dim=32)
    with pytest.raises(ValueError, match="pages of more than 4 tokens"):
        build_format(2, 4, 32, torch.bfloat16, "channel_bits").encode(keys, values, valid, None)
    with pytest.raises(ConfigError, match="'channel_bits'.*'codebook'.*drop one"):
        ColdConfig(format="codebook+channel_bits")
    assert ColdConfig(format="hadamard+outliers+channel_bits").format == "hadamard+outliers+channel_bits"
