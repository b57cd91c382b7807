"""Which entries a page keeps apart as outliers (confkv.tiers.outliers, confkv.tiers.clipping.misses).

A tensor whose range is clipped (``clip``, codes of at most 3 bits) keeps apart the entries its clipped range
(searched once, with every entry) decodes worst; any other tensor the entries farthest from their group's mean in
units of its spread. The references are
worked out here: each group's clipped range from :func:`clipped_range` (its own tests: tests/tiers/test_clipping.py),
decoded by hand in float64 with float16 ends as stored; the spread score from the group's mean and standard
deviation. The pages are built so that the two picks differ.

Each test was seen to fail with a bug put in by hand (then removed): the spread pick for clipped tensors too (the
pick before stop 73); the clipped error for 4-bit tensors too, and for per-channel-width keys; the error under the
min / max range instead of the clipped one; padding rows counted in the error's range; the range searched again
without the outliers.
"""

from __future__ import annotations

import pytest
import torch

from confkv.tiers.clipping import clipped_ends, clipped_range, misses
from confkv.tiers.formats import build_format

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE, DIM, GROUP = 16, 32, 8  # values: groups of 8 channels a token; keys: groups of 8 tokens a channel


def _misses_by_hand(x: torch.Tensor, mask: torch.Tensor, bits: int) -> torch.Tensor:
    """|x - decode(x)| (float64), groups on the last axis of x [..., n], under the clipped range of the mask entries."""
    bottom = x.masked_fill(~mask, float("inf")).amin(-1, keepdim=True)
    top = x.masked_fill(~mask, float("-inf")).amax(-1, keepdim=True)
    low, high = clipped_range(x, mask, -1, bottom, top, bits)
    levels = (1 << bits) - 1
    minimum = low.half().double()
    scale = ((high.double() - minimum) / levels).half().double()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x.double() - minimum) / safe).clamp(0, levels)
    return (minimum + codes * scale - x.double()).abs()


def _spread_by_hand(x: torch.Tensor) -> torch.Tensor:
    """|x - mean| / std (population) for groups on the last axis of x [..., n], every entry valid."""
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    return (x - mean).abs() / (x.var(-1, unbiased=False, keepdim=True).sqrt() + 1e-6)


def _two_kinds_of_group(seed: int) -> torch.Tensor:
    """[1, 1, 1, PAGE, DIM] values whose most outlying entries by spread lie in tight groups (a small stray entry)
    and whose worst-decoded entries lie in wide groups (four levels over a wide range miss by more)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(PAGE, DIM, generator=gen) * 0.01  # tight groups
    x[:, :GROUP] = torch.randn(PAGE, GROUP, generator=gen)  # each token's first group wide
    x[3, 9] = 0.2  # a stray entry of a tight group: far in units of its spread, small in absolute terms
    x[11, 20] = -0.2
    return x.reshape(1, 1, 1, PAGE, DIM)


def _worst_values(values: torch.Tensor, bits: int, count: int = 2) -> set[int]:
    """The flat indices (token * DIM + channel) of the ``count`` values their clipped ranges decode worst."""
    grouped = values.reshape(PAGE, DIM // GROUP, GROUP)
    worst = _misses_by_hand(grouped, torch.ones_like(grouped, dtype=torch.bool), bits).reshape(-1)
    return set(worst.topk(count).indices.tolist())


@pytest.mark.parametrize("bits", [2, 3])
def test_misses_are_each_entrys_error_under_its_groups_clipped_range(bits):
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(40, 16, generator=gen) * torch.rand(40, 1, generator=gen) * 3
    x[::5, 7] += 15.0  # groups with one far entry
    mask = torch.rand(40, 16, generator=gen) > 0.25
    mask[:, 0] = True
    x[~mask] += 100.0  # entries outside the mask would widen the range if they counted
    bottom, top = clipped_ends(x, mask, -1, bits)
    got = misses(x, bottom, top, bits)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), _misses_by_hand(x, mask, bits), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 3])
def test_a_clipped_tensor_keeps_apart_the_entries_its_clipped_range_decodes_worst(bits):
    values = _two_kinds_of_group(0)
    keys = torch.randn(1, 1, 1, PAGE, DIM, generator=torch.Generator().manual_seed(1))
    valid = torch.ones(1, 1, 1, PAGE, dtype=torch.bool)
    fmt = build_format(bits, GROUP, DIM, torch.float32, "outliers+clip", outlier_fraction=2 / (PAGE * DIM))
    data = fmt.encode(keys, values, valid)
    expected = _worst_values(values, bits)
    assert all(index % DIM < GROUP for index in expected)  # in the wide groups
    grouped = values.reshape(PAGE, DIM // GROUP, GROUP)
    assert set(_spread_by_hand(grouped).reshape(-1).topk(2).indices.tolist()) == {3 * DIM + 9, 11 * DIM + 20}
    assert set(data["value_outlier_index"].reshape(-1).tolist()) == expected
    # the range is the one searched with every entry, the outliers among them (not searched again without them)
    grouped = values.reshape(1, 1, 1, PAGE, DIM // GROUP, GROUP)
    everything = torch.ones_like(grouped, dtype=torch.bool)
    bottom, top = clipped_ends(grouped, everything, -1, bits)
    assert torch.equal(data["value_min"], bottom.half().squeeze(-1))
    kept = everything.reshape(1, 1, 1, -1).clone()
    kept[..., list(expected)] = False
    again = clipped_ends(grouped, kept.reshape(grouped.shape), -1, bits)[0].half().squeeze(-1)
    assert not torch.equal(again, bottom.half().squeeze(-1))  # a search without them would differ


def _keys_of_two_kinds(seed: int) -> torch.Tensor:
    """[1, 1, 1, PAGE, DIM] keys built as :func:`_two_kinds_of_group`'s values, with groups over tokens: tight
    channels with a small stray entry, and wide channels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(PAGE, DIM, generator=gen) * 0.01
    x[:, :4] = torch.randn(PAGE, 4, generator=gen)  # wide channels
    x[3, 9] = 0.2  # strays of tight channels
    x[13, 20] = -0.2
    return x.reshape(1, 1, 1, PAGE, DIM)


def _spread_pick_of_keys(keys: torch.Tensor, count: int) -> set[int]:
    """The flat indices (token * DIM + channel) of the ``count`` keys farthest from their group's mean."""
    by_channel = keys.reshape(PAGE // GROUP, GROUP, DIM).transpose(1, 2)  # [token group, channel, token]
    score = _spread_by_hand(by_channel).transpose(1, 2).reshape(-1)  # back to token * DIM + channel
    return set(score.topk(count).indices.tolist())


def test_a_tensor_not_clipped_keeps_apart_the_entries_farthest_from_its_groups_mean():
    """Keys at 4 bits (never clipped) keep the spread pick beside values at 2 bits (clipped) in the same page; and
    without ``clip`` keys and values both keep it."""
    keys, values = _keys_of_two_kinds(3), _two_kinds_of_group(0)
    valid = torch.ones(1, 1, 1, PAGE, dtype=torch.bool)
    spread_keys = _spread_pick_of_keys(keys, 2)
    assert spread_keys == {3 * DIM + 9, 13 * DIM + 20}  # the tight channels' strays
    grouped = values.reshape(PAGE, DIM // GROUP, GROUP)
    spread_values = set(_spread_by_hand(grouped).reshape(-1).topk(2).indices.tolist())
    count = 2 / (PAGE * DIM)
    mixed = build_format(4, GROUP, DIM, torch.float32, "outliers+clip", outlier_fraction=count, value_bits=2)
    data = mixed.encode(keys, values, valid)
    assert set(data["key_outlier_index"].reshape(-1).tolist()) == spread_keys
    assert set(data["value_outlier_index"].reshape(-1).tolist()) == _worst_values(values, 2)  # clipped: worst
    plain = build_format(2, GROUP, DIM, torch.float32, "outliers", outlier_fraction=count)
    data = plain.encode(keys, values, valid)
    assert set(data["key_outlier_index"].reshape(-1).tolist()) == spread_keys
    assert set(data["value_outlier_index"].reshape(-1).tolist()) == spread_values


def test_padding_rows_are_never_picked_and_leave_the_clipped_ranges_alone():
    """A page's padding rows (invalid tokens) hold huge keys: no outlier is taken from them, and the keys picked are
    those of the valid rows alone."""
    keys, values = _keys_of_two_kinds(4), _two_kinds_of_group(5)
    valid = torch.ones(1, 1, 1, PAGE, dtype=torch.bool)
    valid[..., 14:] = False
    keys[..., 14:, :] = 1000.0
    fmt = build_format(2, GROUP, DIM, torch.float32, "outliers+clip", outlier_fraction=2 / (PAGE * DIM))
    data = fmt.encode(keys, values, valid)
    by_channel = keys.reshape(PAGE // GROUP, GROUP, DIM).transpose(1, 2)
    mask = valid.reshape(PAGE // GROUP, 1, GROUP).expand_as(by_channel)
    worst = _misses_by_hand(by_channel, mask, 2).masked_fill(~mask, -1.0).transpose(1, 2).reshape(-1)
    picked = set(data["key_outlier_index"].reshape(-1).tolist())
    assert picked == set(worst.topk(2).indices.tolist())
    assert all(index // DIM < 14 for index in picked)


def test_per_channel_width_keys_keep_the_spread_pick_beside_clipped_values():
    """With ``channel_bits`` the keys' widths set their levels (``clip`` clips the values' ranges only), so their
    outliers are picked by spread even at 2 bits, while the values' are picked by the clipped range's error."""
    keys, values = _keys_of_two_kinds(3), _two_kinds_of_group(0)
    valid = torch.ones(1, 1, 1, PAGE, dtype=torch.bool)
    fmt = build_format(2, GROUP, DIM, torch.float32, "outliers+clip+channel_bits", outlier_fraction=2 / (PAGE * DIM))
    data = fmt.encode(keys, values, valid)
    assert set(data["key_outlier_index"].reshape(-1).tolist()) == _spread_pick_of_keys(keys, 2)
    assert set(data["value_outlier_index"].reshape(-1).tolist()) == _worst_values(values, 2)
