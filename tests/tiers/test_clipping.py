"""Clipped ranges (confkv.tiers.clipping; format technique ``clip``): each group's range by least squared error.

The references are worked out here: the squared error of a range is recomputed from scratch (float64, the float16
ends as stored), and the min / max range is each group's own extremes.

Each test was seen to fail with a bug put in by hand (then removed): a candidate taken when its error is up to
1.5x the best's; the error summed without the mask; the low end moved away from the middle (``middle - ratio *
...``); ``clip`` counted as a storage technique (``STORAGE_NEUTRAL`` emptied); the format computing the clipped
range and quantizing to the extremes anyway; a non-negative ``axis`` not moved past the pairs' leading dimension
(or moved the wrong way); the ratios made in float32 for bfloat16 extremes (the last two found by mutmut).
"""

from __future__ import annotations

import pytest
import torch

from confkv.tiers import lowbit
from confkv.tiers.clipping import RATIOS, _squared_error, clipped_range
from confkv.tiers.formats import KIVI_STORAGE, build_format

pytestmark = pytest.mark.usefixtures("one_thread")


def _error(x: torch.Tensor, mask: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-group squared error (float64) of quantizing x [groups, n] to [low, high] with float16 ends as stored."""
    top = (1 << bits) - 1
    minimum = low.half().double()
    scale = ((high.double() - minimum) / top).half().double()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x.double() - minimum) / safe).clamp(0, top)
    return ((minimum + codes * scale - x.double()).square() * mask).sum(-1, keepdim=True)


def _extremes(x, mask):
    return (x.masked_fill(~mask, float("inf")).amin(-1, keepdim=True),
            x.masked_fill(~mask, float("-inf")).amax(-1, keepdim=True))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_the_range_stays_inside_the_extremes_and_never_costs_more_than_min_max(bits, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 64, generator=gen) * torch.rand(200, 1, generator=gen) * 4
    x[::7, 3] += 20 * torch.randn(x[::7].shape[0], generator=gen)  # some groups with one far entry
    mask = torch.rand(200, 64, generator=gen) > 0.2
    mask[:, 0] = True
    bottom, top = _extremes(x, mask)
    low, high = clipped_range(x, mask, -1, bottom, top, bits)
    assert (low >= bottom).all() and (high <= top).all() and (low <= high).all()
    chosen, min_max = _error(x, mask, low, high, bits), _error(x, mask, bottom, top, bits)
    assert (chosen <= min_max * (1 + 1e-6) + 1e-9).all()
    # and it is the best pair of the grid, worked out here pair by pair
    middle = (bottom + top) / 2
    best = torch.stack([_error(x, mask, middle + a * (bottom - middle), middle + b * (top - middle), bits)
                        for a in RATIOS for b in RATIOS]).amin(0)
    torch.testing.assert_close(chosen, best, rtol=1e-5, atol=1e-9)


def test_a_far_entry_is_clipped_at_two_bits_and_an_even_group_is_left_alone():
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(1, 64, generator=gen)
    spread[0, 10] = 12.0  # one far entry: four levels over its span would leave the rest one level or two
    even = torch.arange(4.0).repeat(16)[None]  # exactly the four levels of its own min / max range
    x = torch.cat([spread, even])
    mask = torch.ones_like(x, dtype=torch.bool)
    bottom, top = _extremes(x, mask)
    low, high = clipped_range(x, mask, -1, bottom, top, 2)
    assert high[0] < top[0]
    assert _error(x[:1], mask[:1], low[:1], high[:1], 2) < 0.8 * _error(x[:1], mask[:1], bottom[:1], top[:1], 2)
    assert low[1] == bottom[1] and high[1] == top[1]  # min / max is exact there: a tie keeps the extremes


def test_entries_outside_the_mask_do_not_count():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=gen)
    mask = torch.ones_like(x, dtype=torch.bool)
    widened = x.clone()
    widened[:, 5] = 1000.0
    masked = mask.clone()
    masked[:, 5] = False
    bottom, top = _extremes(widened, masked)
    low, high = clipped_range(widened, masked, -1, bottom, top, 2)
    x_without, mask_without = x[:, torch.arange(64) != 5], mask[:, torch.arange(64) != 5]
    low_ref, high_ref = clipped_range(x_without, mask_without, -1, *_extremes(x_without, mask_without), 2)
    torch.testing.assert_close(low, low_ref)
    torch.testing.assert_close(high, high_ref)


@pytest.mark.parametrize("name,paged,paged_when_rotated",
                         [("clip", True, False), ("hadamard+clip", False, True), ("outliers+clip", True, False),
                          ("codebook+clip", False, False)])
def test_clip_stores_kivi_pages_and_reads_as_the_format_without_it(name, paged, paged_when_rotated):
    fmt = build_format(2, 8, 32, torch.bfloat16, name)
    assert (fmt.paged, fmt.paged_when_rotated) == (paged, paged_when_rotated)
    if (paged or paged_when_rotated) and "outliers" not in name:
        assert fmt.storage == KIVI_STORAGE
    plain = build_format(2, 8, 32, torch.bfloat16, name.replace("+clip", "").replace("clip", "kivi"))
    assert fmt.page_nbytes(2, 32, 16) == plain.page_nbytes(2, 32, 16)


def test_clipped_pages_decode_closer_than_min_max_pages_at_two_bits():
    """On near-Gaussian rotated keys and values with a few far entries, the format's reconstruction error drops."""
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 2, 4, 16, 32, generator=gen)
    values = torch.randn(1, 2, 4, 16, 32, generator=gen)
    keys[..., 3, 5] = 9.0
    valid = torch.ones(1, 2, 4, 16, dtype=torch.bool)
    errors = {}
    for name in ("hadamard", "hadamard+clip"):
        fmt = build_format(2, 8, 32, torch.bfloat16, name)
        decoded_keys, decoded_values = fmt.decode(fmt.encode(keys, values, valid))
        errors[name] = float((decoded_keys - keys).square().sum() + (decoded_values - values).square().sum())
    assert errors["hadamard+clip"] < 0.9 * errors["hadamard"]


def test_four_bit_codes_keep_min_max():
    """Only 2- and 3-bit codes are clipped (MAX_BITS): at 4 bits the format encodes exactly as without ``clip``."""
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(1, 2, 2, 16, 32, generator=gen), torch.randn(1, 2, 2, 16, 32, generator=gen)
    keys[..., 3, 5] = 9.0
    valid = torch.ones(1, 2, 2, 16, dtype=torch.bool)
    clipped = build_format(4, 8, 32, torch.bfloat16, "hadamard+clip").encode(keys, values, valid)
    plain = build_format(4, 8, 32, torch.bfloat16, "hadamard").encode(keys, values, valid)
    assert clipped.keys() == plain.keys() and all(torch.equal(clipped[n], plain[n]) for n in plain)
    at_three = build_format(3, 8, 32, torch.bfloat16, "hadamard+clip").encode(keys, values, valid)
    assert not torch.equal(at_three["key_min"], build_format(3, 8, 32, torch.bfloat16, "hadamard").encode(
        keys, values, valid)["key_min"])


@pytest.mark.parametrize("axis,negative", [(0, -3), (1, -2), (2, -1)])
def test_a_positive_axis_picks_the_range_its_negative_spelling_picks(axis, negative):
    """The search adds a leading dimension (the pairs), so a non-negative ``axis`` must move up by one."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 7, 8, generator=gen) * 3
    x[1, 2, 3] = 25.0
    mask = torch.rand(6, 7, 8, generator=gen) > 0.1
    bottom, top = (x.masked_fill(~mask, float("inf")).amin(axis, keepdim=True),
                   x.masked_fill(~mask, float("-inf")).amax(axis, keepdim=True))
    low, high = clipped_range(x, mask, axis, bottom, top, 2)
    low_ref, high_ref = clipped_range(x, mask, negative, bottom, top, 2)
    assert low.shape == bottom.shape and torch.equal(low, low_ref) and torch.equal(high, high_ref)
    assert (high < top).any()  # some group is clipped, so a wrong axis would change the pick


def test_the_ends_keep_the_extremes_dtype():
    """bfloat16 extremes give bfloat16 ends, moved by ratios in bfloat16 (not promoted to float32)."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(16, 64, generator=gen) * 3).bfloat16()
    x[:, 7] = 30.0
    mask = torch.ones_like(x, dtype=torch.bool)
    bottom, top = _extremes(x, mask)
    low, high = clipped_range(x, mask, -1, bottom, top, 2)
    assert low.dtype == high.dtype == torch.bfloat16
    middle = (bottom + top) / 2
    candidates = {float(middle[0] + torch.tensor(r, dtype=torch.bfloat16) * (top[0] - middle[0])) for r in RATIOS}
    assert float(high[0]) in candidates


@pytest.mark.parametrize("axis", [-1, -2])
def test_the_search_picks_the_range_a_plain_float32_evaluation_picks_bit_for_bit(axis):
    """The search's errors are worked out in place on one buffer; here the same float32 formula is evaluated plainly,
    operation by operation (``lowbit.levels_in_range``, rounded, then ``(minimum + code * scale - x)**2``, masked,
    summed): each pair's error must equal it bit for bit, and the pair with the least error (the first of equal
    ones) must be the one the search keeps. Groups of 64 entries, some masked out (axis -2: keys' groups of
    tokens), two and three bits. Seen failing with the minimum added after ``x`` is taken off, and with the mask
    skipped (the codes times the scale's reciprocal instead of divided by it passed: the rounding to whole codes
    absorbs it here)."""
    gen = torch.Generator().manual_seed(7)
    shape = (2, 3, 64, 64)
    x = torch.randn(*shape, generator=gen) * torch.rand(*shape[:-2], 1, 1, generator=gen) * 3
    x[..., ::9, 5] += 6.0
    mask = torch.rand(*shape, generator=gen) > 0.15
    for bits in (2, 3):
        bottom, top = _extremes_on(x, mask, axis)
        low, high = clipped_range(x, mask, axis, bottom, top, bits)
        middle = (bottom + top) / 2
        errors, pairs = [], []
        for a in RATIOS:
            for b in RATIOS:
                lo = bottom if a == 1.0 else middle + a * (bottom - middle)
                hi = top if b == 1.0 else middle + b * (top - middle)
                scale, minimum = lowbit.scale_and_minimum(lo, hi, bits)
                codes = torch.round(lowbit.levels_in_range(x, scale, minimum, bits))
                error = (minimum.float() + codes * scale.float() - x).square()
                errors.append(error.masked_fill(~mask, 0.0).sum(dim=axis, keepdim=True))
                pairs.append((lo, hi))
                assert torch.equal(_squared_error(x, mask, axis, lo, hi, bits), errors[-1]), (bits, a, b)
        best = torch.stack(errors).argmin(0)
        want_low = torch.stack([p[0] for p in pairs]).gather(0, best.unsqueeze(0)).squeeze(0)
        want_high = torch.stack([p[1] for p in pairs]).gather(0, best.unsqueeze(0)).squeeze(0)
        assert torch.equal(low, want_low) and torch.equal(high, want_high), bits


def _extremes_on(x, mask, axis):
    return (x.masked_fill(~mask, float("inf")).amin(axis, keepdim=True),
            x.masked_fill(~mask, float("-inf")).amax(axis, keepdim=True))
