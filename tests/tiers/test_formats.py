"""Cold-page formats (confkv.tiers): rotation, outliers, codebooks, the format interface in the tier.

References are independent of the code under test: float64 dense attention, error bounds
worked out from the stored scales, byte counts summed over the tensors actually held.

Each test was seen to fail with a bug put in by hand (then removed):

- rotation / fwht tests: ``HadamardRotation.inverse`` multiplying by the forward matrix; ``fwht``
  without its ``1/sqrt(n)``.
- error-bound test: ``torch.floor`` for ``torch.round`` in ``KiviFormat._quantize``; codebook
  ``nearest`` splitting at the upper level instead of the midpoint; ``prerope`` decode without the
  re-rotation.
- outlier round trip: the outlier score without ``abs`` (negative outliers missed).
- bytes tests: an outlier entry counted as 3 bytes; the codebooks counted as 0 bytes (and, in
  tests/eval/quality/test_sweep.py, left out of the sweep's bytes model).
- rung move: ``put_pages`` encoding with the positions reversed.
- every-backend read: the decode fallback removed (``_page_segment``), or ``paged`` set True for
  every format.
- RoPE tests: ``Rope.unrotate`` with the forward sign; the cache not passing its rope down.
- codebook fit: no Lloyd iterations (even levels returned).
- folded read: the output not un-rotated; the open page not rotated; the query not rotated.
- 3-bit lookup (tests/tiers/test_cold.py round trip): the two 12-bit halves swapped.
"""

from __future__ import annotations

import pytest
import torch

from confkv.tiers import lowbit
from confkv.tiers.cold import ColdTier
from confkv.config import ALL_PAGES, ColdConfig
from confkv.errors import ConfigError
from confkv.tiers import codebook, outliers
from confkv.tiers.formats import KIVI_STORAGE, build_format, parse_format
from confkv.tiers.hadamard import HadamardRotation, fwht, hadamard_matrix
from confkv.tiers.prerope import Rope

pytestmark = pytest.mark.usefixtures("one_thread")

FORMATS = ["kivi", "hadamard", "outliers", "codebook", "prerope", "hadamard+outliers+codebook+prerope", "clip",
           "hadamard+clip", "outliers+codebook"]  # the last: outliers' corrections against a codebook, entry by entry
#: a rotary embedding of head_dim 32 (theta 10,000, as Llama's)
ROPE = Rope(1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32)))
FP16_EPS = 2.0 ** -11  # float16 relative rounding (round to nearest)
#: formats with per-channel key widths (their bounds: tests/tiers/test_channel_bits.py)
CHANNEL_FORMATS = ["channel_bits", "hadamard+outliers+channel_bits", "prerope+channel_bits"]


def _pages(seed: int, batch=1, heads=2, count=3, page=16, dim=32, spikes=True):
    """Keys with outlier channels and a few stray entries, values plain; [B, H, N, P, D] float32."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, count, page, dim, generator=gen) + 0.5
    keys[..., 3] *= 8  # an outlier channel (what per-channel keys and rotations are for)
    values = torch.randn(batch, heads, count, page, dim, generator=gen)
    if spikes:
        keys[..., 5, 7] = 25.0
        values[..., 2, 11] = -30.0
    valid = torch.ones(batch, heads, count, page, dtype=torch.bool)
    positions = torch.arange(count * page).reshape(1, 1, count, page).expand(batch, heads, count, page)
    return keys, values, valid, positions


# ------------------------------------------------------------------ rotation

def test_fwht_is_the_orthonormal_hadamard_matrix_and_its_own_inverse():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h = torch.tensor([[1.0]], dtype=torch.float64)
    for _ in range(6):  # Sylvester's construction, written out
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / 8.0
    assert torch.allclose(fwht(x), x @ h, atol=1e-12)
    assert torch.allclose(hadamard_matrix(64, torch.float64), h, atol=1e-12)
    assert torch.allclose(fwht(fwht(x)), x, atol=1e-12)


@pytest.mark.parametrize("head_dim", [64, 48])  # 48: blocks of 16
def test_rotation_leaves_scores_and_outputs_unchanged(head_dim):
    """Unquantized: rotated keys and queries give the same scores; rotated then un-rotated values the same output."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, head_dim, generator=gen)
    k = torch.randn(2, 3, 40, head_dim, generator=gen) * 3
    v = torch.randn(2, 3, 40, head_dim, generator=gen)
    rotation = HadamardRotation(head_dim, seed=7)
    scores = (q.double() @ k.double().transpose(-1, -2))
    rotated_scores = rotation.forward(q) @ rotation.forward(k).transpose(-1, -2)
    assert (rotated_scores.double() - scores).abs().max() < 1e-5 * scores.abs().max()
    probs = scores.softmax(-1)
    out = probs @ v.double()
    rotated_out = rotation.inverse(probs.float() @ rotation.forward(v))  # attention over rotated values, un-rotated
    assert (rotated_out.double() - out).abs().max() < 1e-5
    # both implementations of the rotation agree, and each inverse undoes its forward
    assert torch.allclose(rotation.forward_fwht(k), rotation.forward(k), atol=1e-5)
    assert torch.allclose(rotation.inverse_fwht(rotation.forward_fwht(k)), k, atol=1e-5)
    assert torch.allclose(rotation.inverse(rotation.forward(v)), v, atol=1e-5)


def test_rotation_spreads_an_outlier_channel():
    x = torch.zeros(64)
    x[3] = 8.0
    rotated = HadamardRotation(64).forward(x)
    assert torch.allclose(rotated.abs(), torch.full((64,), 1.0))  # 8 / sqrt(64) in every channel


# ------------------------------------------------------------------ encode / decode error bounds

def _level_distance(levels: torch.Tensor, top: int) -> float:
    """The farthest any u in [0, top] lies from its nearest level: half the widest gap, or an end."""
    gaps = (levels[1:] - levels[:-1]) / 2
    return float(max(levels[0].item(), top - levels[-1].item(), gaps.max().item()))


def _element_bounds(fmt, data, which: str, shape, basis=None) -> torch.Tensor:
    """Worked-out bound on |x - x_hat| of each entry, in the basis the format quantizes in.

    With the stored float16 minimum m and scale s of the entry's group (s = (max - min) / (L - 1)
    rounded to float16): an entry inside [m, m + (L - 1) s] lands within s * (distance to the
    nearest level) of its decode; the float16 rounding of m (at most 2^-11 |min|) and of s (at most
    2^-11 of (L - 1) s, at the top of the range) can put the range's ends up to that far outside.
    With ``clip`` the range may leave a group's extremes outside: such an entry decodes to the nearer end,
    so its bound adds its distance beyond that end (``basis``: the entries in the quantized basis).
    """
    bits = fmt.widths[which]  # keys and values may have their own widths (``value_bits``)
    top = (1 << bits) - 1
    levels = fmt.levels[which] if fmt.levels[which] is not None else codebook.even_levels(bits)
    reach = _level_distance(levels, top)
    scale, minimum = data[f"{which}_scale"].float(), data[f"{which}_min"].float()
    *lead, page, dim = shape
    if which == "key":  # [.., P / G, D] per channel and group of tokens
        scale = scale.repeat_interleave(fmt.group_size, dim=-2)
        minimum = minimum.repeat_interleave(fmt.group_size, dim=-2)
    else:  # [.., P, D / Gv] per token and group of channels
        vgroup = min(fmt.group_size, dim)
        scale, minimum = scale.repeat_interleave(vgroup, dim=-1), minimum.repeat_interleave(vgroup, dim=-1)
    slack = 1.01 * FP16_EPS * (top * scale + minimum.abs()) + 1e-6
    bound = scale * reach + slack
    if "clip" in fmt.techniques:
        bound = bound + (minimum - basis).clamp_min(0) + (basis - (minimum + top * scale)).clamp_min(0)
    return bound


@pytest.mark.parametrize("bits,value_bits", [(2, None), (3, None), (4, None), (4, 2), (2, 4)])
@pytest.mark.parametrize("name", FORMATS)
def test_encode_decode_stays_within_the_worked_out_bound(name, bits, value_bits):
    keys, values, valid, positions = _pages(bits)
    fmt = build_format(bits, 8, 32, torch.bfloat16, name, outlier_fraction=2 / (16 * 32), rope=ROPE,
                       value_bits=value_bits)
    data = fmt.encode(keys, values, valid, positions)
    decoded_keys, decoded_values = fmt.decode(data, positions)
    basis = dict(zip(("key", "value"), fmt._basis(keys, values, positions)))
    for which, original, decoded in (("key", keys, decoded_keys), ("value", values, decoded_values)):
        bound = _element_bounds(fmt, data, which, original.shape, basis[which])
        turned = fmt.rotation is not None or (which == "key" and fmt.rope is not None)
        if not turned:  # entry by entry
            error = (decoded - original).abs()
            if "outliers" in fmt.techniques:  # kept apart: exact up to the float16 rounding of their corrections
                flat = original.reshape(*original.shape[:3], -1)
                index = data[f"{which}_outlier_index"].long()
                kept = flat.gather(-1, index)
                got = decoded.reshape(*decoded.shape[:3], -1).gather(-1, index)
                correction = data[f"{which}_outlier_value"].float()
                assert ((got - kept).abs() <= FP16_EPS * correction.abs() + 2.0 ** -22 * kept.abs() + 1e-7).all()
            assert (error <= bound).all(), float((error - bound).max())
        else:  # the rotations are orthogonal: a token's L2 error is that of its rotated vector
            error = (decoded - original).norm(dim=-1)
            assert (error <= bound.norm(dim=-1) * 1.0001 + 1e-5).all()
    # and the bound is not vacuous: the decode is close on average
    assert (decoded_keys - keys).abs().mean() < 0.6 * keys.std()


def test_plain_kivi_pages_are_lowbits_own():
    """Format "kivi" stores exactly what confkv.tiers.lowbit makes (the packed Triton read depends on it)."""
    keys, values, valid, positions = _pages(0)
    valid[0, 0, 1, 5:] = False
    data = build_format(3, 8, 32, torch.bfloat16, "kivi").encode(keys, values, valid, positions)
    qk, qv = lowbit.quantize_keys(keys, valid, 3, 8), lowbit.quantize_values(values, 3, 8)
    expected = dict(key_codes=qk.codes, key_scale=qk.scale, key_min=qk.minimum,
                    value_codes=qv.codes, value_scale=qv.scale, value_min=qv.minimum)
    assert set(data) == set(KIVI_STORAGE)
    for name in KIVI_STORAGE:
        assert torch.equal(data[name], expected[name])


def test_codebook_levels_lower_the_error_of_even_levels_on_their_samples():
    u = (torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 0.6 + 1.5).clamp(0, 3)
    levels = codebook.fit_levels(u, 2)
    even = codebook.even_levels(2)
    err = (u - levels[codebook.nearest(u, levels)]).pow(2).mean()
    err_even = (u - even[codebook.nearest(u, even)]).pow(2).mean()
    assert err < 0.9 * err_even
    assert torch.all(levels[1:] > levels[:-1])


def test_codebook_decodes_through_its_lookup_table_as_through_the_levels():
    for bits in (2, 3, 4):
        keys, values, valid, positions = _pages(bits)
        fmt = build_format(bits, 8, 32, torch.float32, "codebook")
        data = fmt.encode(keys, values, valid, positions)
        decoded_keys, _ = fmt.decode(data, positions)
        codes = lowbit.unpack(data["key_codes"], bits, 32)
        by_hand = (fmt.levels["key"][codes].reshape(1, 2, 3, 2, 8, 32) * data["key_scale"].float().unsqueeze(-2)
                   + data["key_min"].float().unsqueeze(-2)).reshape(keys.shape)
        assert torch.allclose(decoded_keys, by_hand, atol=1e-5)


# ------------------------------------------------------------------ outliers

def test_outlier_indices_round_trip_to_the_planted_entries():
    """Planted extreme entries (one positive, one negative per page and tensor) are the ones kept, at their
    flat index (token * D + channel), and come back exactly up to the float16 rounding of their corrections
    (entry less decode: at most 2^-11 of |correction| < 52 here, the rest of each group lying a few units from 0)."""
    keys, values, valid, positions = _pages(3, spikes=False)
    keys[..., 9, 4] = 40.0
    keys[..., 2, 30] = -40.0
    values[..., 0, 17] = -50.0
    values[..., 15, 1] = 50.0
    fmt = build_format(2, 8, 32, torch.float32, "outliers", outlier_fraction=2 / (16 * 32))
    data = fmt.encode(keys, values, valid, positions)
    assert data["key_outlier_index"].dtype == outliers.INDEX_DTYPE and data["key_outlier_index"].shape == (1, 2, 3, 2)
    for which, planted in (("key", {9 * 32 + 4, 2 * 32 + 30}), ("value", {0 * 32 + 17, 15 * 32 + 1})):
        for page in data[f"{which}_outlier_index"].reshape(-1, 2).tolist():
            assert set(page) == planted
    decoded_keys, decoded_values = fmt.decode(data, positions)
    near = FP16_EPS * 52  # |correction| <= |entry| + the far end of its group's range (a few units)
    assert ((decoded_keys[..., 9, 4] - 40.0).abs() <= near).all()
    assert ((decoded_keys[..., 2, 30] + 40.0).abs() <= near).all()
    assert ((decoded_values[..., 0, 17] + 50.0).abs() <= near).all()
    assert ((decoded_values[..., 15, 1] - 50.0).abs() <= near).all()
    # without them the groups' ranges shrink: the rest decodes closer than plain KIVI's
    plain = build_format(2, 8, 32, torch.float32, "kivi")
    plain_keys, _ = plain.decode(plain.encode(keys, values, valid, positions), positions)
    rest = torch.ones_like(keys, dtype=torch.bool)
    rest[..., 9, 4] = rest[..., 2, 30] = False
    assert (decoded_keys - keys)[rest].abs().mean() < (plain_keys - keys)[rest].abs().mean()


def test_outlier_count_and_bytes():
    fmt = build_format(2, 16, 64, torch.bfloat16, "outliers", outlier_fraction=0.01)
    assert fmt.outliers_per_page(64) == 41  # round(0.01 * 64 * 64)
    plain = build_format(2, 16, 64, torch.bfloat16, "kivi")
    # per page and head: 41 keys + 41 values, each a float16 value and an int16 index
    assert fmt.page_nbytes(3, 64, 64) - plain.page_nbytes(3, 64, 64) == 3 * 2 * 41 * 4


# ------------------------------------------------------------------ the format in the cold tier

def _tier(name: str, bits: int, read_all: bool = True, **extra) -> ColdTier:
    k = ALL_PAGES if read_all else 2
    return ColdTier(ColdConfig(bits=bits, page_size=16, group_size=8, k_high=k, k_low=k, format=name,
                               outlier_fraction=2 / (16 * 32), **extra), rope=ROPE)


def _held_bytes(tier: ColdTier) -> int:
    """Bytes of the tensors the tier actually holds as KV: open page, each sealed page's storage and
    digest (the first num_pages of every non-metadata tensor), and the format's codebooks."""
    held = tier.open["keys"].nbytes + tier.open["values"].nbytes
    for name, tensor in tier.pages.items():
        if name in ("positions", "valid", "heat", "sealed_at", "confidence", "attention"):
            continue
        held += tensor.narrow(2, 0, tier.num_pages).nbytes
    for levels in getattr(tier.format, "levels", {}).values():
        if levels is not None:
            held += levels.nbytes
    layout = getattr(tier.format, "channel_layout", None)
    return held + (layout.widths.nbytes if layout is not None else 0)


@pytest.mark.parametrize("read_all", [True, False])
@pytest.mark.parametrize("name", FORMATS + CHANNEL_FORMATS)
def test_kv_bytes_are_the_tensors_held(name, read_all):
    keys, values, _, positions = _pages(5, count=4)
    tier = _tier(name, 3, read_all)
    tokens = keys.reshape(1, 2, 64, 32)
    tier.demote(tokens[:, :, :40], values.reshape(1, 2, 64, 32)[:, :, :40], positions.reshape(1, 2, 64)[:, :, :40],
                torch.ones(1, 40, dtype=torch.bool))
    assert tier.num_pages == 2 and tier.open_length == 8
    assert tier.kv_bytes() == _held_bytes(tier)
    assert set(tier.format.storage) <= set(tier.pages)


@pytest.mark.parametrize("name", ["codebook", "prerope", "hadamard+outliers+codebook", "prerope+channel_bits"])
def test_a_format_pages_read_through_the_decode_on_every_backend(name):
    """Pages of formats other than KIVI codes (maybe rotated, maybe with outliers) reach the read decoded (also
    when a backend asks for packed pages)."""
    keys, values, _, positions = _pages(6, count=4)
    tier = _tier(name, 4)
    tier.demote(keys.reshape(1, 2, 64, 32), values.reshape(1, 2, 64, 32), positions.reshape(1, 2, 64),
                torch.ones(1, 64, dtype=torch.bool))
    query = torch.randn(1, 4, 1, 32)
    for paged in (False, True):
        segments = tier.segments(query, torch.tensor([ALL_PAGES]), paged=paged)
        (segment,) = segments
        expected_keys, expected_values = tier.format.decode(
            {n: tier.pages[n][:, :, :4] for n in tier.format.storage}, tier.pages["positions"][:, :, :4])
        assert torch.equal(segment.keys, expected_keys.reshape(1, 2, 64, 32))
        assert torch.equal(segment.values, expected_values.reshape(1, 2, 64, 32))
        assert (segment.keys - keys.reshape(1, 2, 64, 32)).abs().max() < 0.5 * keys.abs().max()


@pytest.mark.parametrize("name", ["hadamard", "hadamard+clip"])
def test_hadamard_pages_reach_a_packed_read_packed_with_their_rotation(name):
    """``kivi+hadamard`` pages are KIVI codes of rotated keys / values: a backend that takes packed pages gets
    them packed, carrying the rotation (the native read turns the query); decoded, they are the format's decode.
    ``clip`` changes only which codes are chosen: its pages go the same way."""
    from confkv.attention.segments import PagedSegment

    keys, values, _, positions = _pages(6, count=4)
    tier = _tier(name, 4)
    tier.demote(keys.reshape(1, 2, 64, 32), values.reshape(1, 2, 64, 32), positions.reshape(1, 2, 64),
                torch.ones(1, 64, dtype=torch.bool))
    query = torch.randn(1, 4, 1, 32)
    expected_keys, expected_values = tier.format.decode({n: tier.pages[n][:, :, :4] for n in tier.format.storage})
    (dense,) = tier.segments(query, torch.tensor([ALL_PAGES]), paged=False)
    (packed,) = tier.segments(query, torch.tensor([ALL_PAGES]), paged=True)
    assert isinstance(packed, PagedSegment) and packed.rotation is tier.format.rotation
    for segment in (dense, packed.to_dense()):
        torch.testing.assert_close(segment.keys, expected_keys.reshape(1, 2, 64, 32), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(segment.values, expected_values.reshape(1, 2, 64, 32), atol=1e-5, rtol=1e-5)
    (rotated,) = tier.segments(query, torch.tensor([ALL_PAGES]), paged=True, rotated=True)
    assert rotated.rotation is None  # a read in the rotated basis takes the codes as they are


@pytest.mark.parametrize("name", ["channel_bits", "hadamard+outliers+channel_bits"])
def test_pages_at_per_channel_widths_reach_a_packed_read_packed_with_their_widths(name):
    """``channel_bits`` pages go to a packed read still packed, their key widths with them, and with ``hadamard``
    the rotation of their values (the native read leaves the query unturned for their keys, which are not
    rotated); decoded, they are the format's decode. No rotation is folded into a read of them."""
    from confkv.attention.segments import PagedSegment

    keys, values, _, positions = _pages(6, count=4)
    tier = _tier(name, 4)
    tier.demote(keys.reshape(1, 2, 64, 32), values.reshape(1, 2, 64, 32), positions.reshape(1, 2, 64),
                torch.ones(1, 64, dtype=torch.bool))
    expected_keys, expected_values = tier.format.decode({n: tier.pages[n][:, :, :4] for n in tier.format.storage})
    (packed,) = tier.segments(torch.randn(1, 4, 1, 32), torch.tensor([ALL_PAGES]), paged=True)
    assert isinstance(packed, PagedSegment) and packed.key_widths is tier.pages["key_widths"]
    assert packed.rotation is tier.format.rotation and tier.read_rotation(turns_pages=False) is None
    dense = packed.to_dense()
    torch.testing.assert_close(dense.keys, expected_keys.reshape(1, 2, 64, 32), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense.values, expected_values.reshape(1, 2, 64, 32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
def test_pages_taken_from_a_rung_are_put_into_a_rung_of_fewer_bits(name):
    keys, values, _, positions = _pages(7, count=4)
    high, low = _tier(name, 4), _tier(name, 2)
    high.demote(keys.reshape(1, 2, 64, 32), values.reshape(1, 2, 64, 32), positions.reshape(1, 2, 64),
                torch.ones(1, 64, dtype=torch.bool))
    index = torch.tensor([[[1, 3], [0, 2]]])
    taken = high.take_pages(index)
    assert taken["keys"].shape == (1, 2, 2, 16, 32)
    low.put_pages(taken, torch.bfloat16)
    assert high.num_pages == 2 and low.num_pages == 2
    assert torch.equal(low.pages["positions"][:, :, :2], taken["positions"])
    assert low.kv_bytes() == _held_bytes(low) and high.kv_bytes() == _held_bytes(high)
    live = {n: t.narrow(2, 0, 2) for n, t in low.pages.items()}
    got_keys, got_values = low._dequantized(live, torch.tensor([[[0, 1], [0, 1]]]))
    # the 2-bit pages decode near the 4-bit pages they were made from (within the 2-bit bound)
    data = {n: live[n] for n in low.format.storage}
    basis = dict(zip(("key", "value"), low.format._basis(taken["keys"], taken["values"], taken["positions"])))
    if low.format.rotation is None and low.format.rope is None:
        assert ((got_keys - taken["keys"]).abs()
                <= _element_bounds(low.format, data, "key", got_keys.shape, basis["key"])).all()
        assert ((got_values - taken["values"]).abs()
                <= _element_bounds(low.format, data, "value", got_values.shape, basis["value"])).all()
    else:
        bound = _element_bounds(low.format, data, "key", got_keys.shape, basis["key"]).norm(dim=-1)
        assert ((got_keys - taken["keys"]).norm(dim=-1) <= bound * 1.0001 + 1e-5).all()


def test_unknown_format_is_a_config_error_naming_the_known_ones():
    with pytest.raises(ConfigError, match="format: unknown part.*'hadamard'.*'outliers'.*'codebook'"):
        ColdConfig(format="hadamrd")
    with pytest.raises(ConfigError, match="outlier_fraction"):
        ColdConfig(format="outliers", outlier_fraction=0.5)
    assert parse_format("hadamard+kivi+codebook") == frozenset({"hadamard", "codebook"})
    assert build_format(3, 8, 32, torch.bfloat16, "codebook+hadamard").name == "kivi+hadamard+codebook"
    assert build_format(16, 8, 32, torch.bfloat16, "hadamard").name == "fp16"


def test_format_flags_reach_the_policy():
    from confkv.policies import make_policy

    policy = make_policy("kivi", bits=3, format="hadamard+codebook", outlier_fraction=0.02, value_bits=2)
    assert policy.cold.format == "hadamard+codebook" and policy.cold.outlier_fraction == 0.02
    assert policy.cold.value_bits == 2


# ------------------------------------------------------------------ keys and values at two widths

@pytest.mark.parametrize("name", FORMATS)
def test_two_widths_store_keys_as_the_key_width_and_values_as_the_value_width(name):
    """4-bit keys with 2-bit values: the keys' storage and decode are the 4-bit format's, the values' the 2-bit
    format's, to the bit (outliers are picked and codebooks fitted per tensor, so nothing is shared)."""
    keys, values, valid, positions = _pages(11)
    mixed, four, two = (build_format(bits, 8, 32, torch.bfloat16, name, outlier_fraction=2 / (16 * 32), rope=ROPE,
                                     value_bits=value_bits) for bits, value_bits in ((4, 2), (4, None), (2, None)))
    data = {fmt: fmt.encode(keys, values, valid, positions) for fmt in (mixed, four, two)}
    for stored in data[mixed]:
        reference = data[four] if stored.startswith("key") else data[two]
        assert torch.equal(data[mixed][stored], reference[stored]), stored
    mixed_keys, mixed_values = mixed.decode(data[mixed], positions)
    assert torch.equal(mixed_keys, four.decode(data[four], positions)[0])
    assert torch.equal(mixed_values, two.decode(data[two], positions)[1])


@pytest.mark.parametrize("name", ["kivi", "outliers", "codebook", "hadamard+outliers+clip"])
def test_two_widths_cost_what_one_width_between_them_costs_and_kv_bytes_are_the_tensors_held(name):
    """Side bytes (scales, minima, outliers) do not depend on the width, so 4-bit keys with 2-bit values cost a
    3-bit page; the tier's bytes are the tensors it holds (and the codebooks: 16 key levels, 4 value levels)."""
    mixed = build_format(4, 8, 32, torch.bfloat16, name, outlier_fraction=0.01, value_bits=2)
    even = build_format(3, 8, 32, torch.bfloat16, name, outlier_fraction=0.01)
    assert mixed.page_nbytes(3, 32, 16) == even.page_nbytes(3, 32, 16)
    keys, values, _, positions = _pages(5, count=4)
    tier = _tier(name, 4, value_bits=2)
    tier.demote(keys.reshape(1, 2, 64, 32)[:, :, :40], values.reshape(1, 2, 64, 32)[:, :, :40],
                positions.reshape(1, 2, 64)[:, :, :40], torch.ones(1, 40, dtype=torch.bool))
    assert tier.kv_bytes() == _held_bytes(tier)
    if name == "codebook":
        assert tier.format.layer_nbytes() == (16 + 4) * 4


@pytest.mark.parametrize("name, value_bits", [("kivi", 2), ("hadamard", 2), ("outliers", None),
                                               ("hadamard+outliers+clip", 2)])
def test_pages_of_two_widths_or_with_outliers_reach_a_packed_read_packed(name, value_bits):
    """Pages of two widths and pages with outliers are carried as they are (the native page read takes them): the
    value codes' width and the four outlier tensors ride on the PagedSegment, which decodes (the torch read) to
    the format's own decode; a read that does not take packed pages gets that decode."""
    from confkv.attention.segments import OUTLIER_STORAGE, PagedSegment

    keys, values, _, positions = _pages(6, count=4)
    tier = _tier(name, 4, value_bits=value_bits)
    tier.demote(keys.reshape(1, 2, 64, 32), values.reshape(1, 2, 64, 32), positions.reshape(1, 2, 64),
                torch.ones(1, 64, dtype=torch.bool))
    expected_keys, expected_values = tier.format.decode(
        {n: tier.pages[n][:, :, :4] for n in tier.format.storage}, tier.pages["positions"][:, :, :4])
    (packed,) = tier.segments(torch.randn(1, 4, 1, 32), torch.tensor([ALL_PAGES]), paged=True)
    assert isinstance(packed, PagedSegment) and packed.widths == (4, value_bits or 4)
    assert packed.has_outliers == ("outliers" in name)
    if packed.has_outliers:
        assert all(getattr(packed, n) is tier.pages[n] for n in OUTLIER_STORAGE)
    (dense,) = tier.segments(torch.randn(1, 4, 1, 32), torch.tensor([ALL_PAGES]), paged=False)
    for segment in (packed.to_dense(), dense):
        torch.testing.assert_close(segment.keys, expected_keys.reshape(1, 2, 64, 32), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(segment.values, expected_values.reshape(1, 2, 64, 32), atol=1e-5, rtol=1e-5)


def test_a_value_width_is_checked_and_named():
    with pytest.raises(ConfigError, match="value_bits: must be None .* one of 2, 3, 4, 8, got 5"):
        ColdConfig(bits=4, value_bits=5)
    with pytest.raises(ConfigError, match="value_bits: must be None"):
        ColdConfig(bits=4, value_bits=True)
    with pytest.raises(ConfigError, match="value_bits: applies to quantized pages only"):
        ColdConfig(bits=16, value_bits=2)
    assert ColdConfig(bits=4, value_bits=2).value_bits == 2


# ------------------------------------------------------------------ pre-RoPE keys

def test_rope_is_the_models_and_its_inverse_gives_the_pre_rope_keys():
    """On a tiny Llama: Rope.from_model rotates as the model does, and un-rotating the cached (post-RoPE)
    keys gives the key projection's output, the pre-RoPE keys (within 1e-5, float32)."""
    from confkv.models import tiny_model

    model = tiny_model("llama")
    rope = Rope.from_model(model)
    attention = model.model.layers[0].self_attn
    hidden = torch.randn(1, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    pre = attention.k_proj(hidden).reshape(1, 7, heads, dim).transpose(1, 2)  # [1, H, 7, D]
    positions = torch.arange(20, 27)[None]
    cos, sin = model.model.rotary_emb(pre, positions)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    _, post = apply_rotary_pos_emb(pre, pre, cos, sin)
    per_head = positions[:, None, :].expand(1, heads, 7)
    assert (rope.rotate(pre, per_head) - post).abs().max() < 1e-5
    assert (rope.unrotate(post, per_head) - pre).abs().max() < 1e-5


def test_pre_rope_path_equals_the_post_rope_path_unquantized():
    """Without quantization error the pre-RoPE path is the identity: keys constant per channel before RoPE
    (a zero per-channel range: exact codes) come back exactly at every position, while post-RoPE KIVI sees
    them turned and cannot; values are untouched by it."""
    pre = torch.randn(1, 2, 1, 1, 32, generator=torch.Generator().manual_seed(2)).expand(1, 2, 3, 16, 32)
    positions = torch.arange(48).reshape(1, 1, 3, 16).expand(1, 2, 3, 16)
    post = ROPE.rotate(pre, positions)
    values = torch.randn(1, 2, 3, 16, 32)
    valid = torch.ones(1, 2, 3, 16, dtype=torch.bool)
    with_rope = build_format(4, 16, 32, torch.float32, "prerope", rope=ROPE)
    keys, decoded_values = with_rope.decode(with_rope.encode(post, values, valid, positions), positions)
    exact = post.abs().max() * 2 ** -10  # the float16 minimum of each (zero-range) group
    assert (keys - post).abs().max() < exact
    plain = build_format(4, 16, 32, torch.float32, "kivi")
    plain_keys, plain_values = plain.decode(plain.encode(post, values, valid, positions), positions)
    assert (plain_keys - post).abs().max() > 10 * exact
    assert torch.equal(decoded_values, plain_values)


def test_prerope_without_the_models_rotary_parameters_is_refused():
    fmt = build_format(3, 8, 32, torch.float32, "prerope")  # sizes need no rope
    assert fmt.page_nbytes(2, 32, 16) == build_format(3, 8, 32, torch.float32, "kivi").page_nbytes(2, 32, 16)
    keys, values, valid, positions = _pages(0)
    with pytest.raises(ValueError, match="prerope.*rotary"):
        fmt.encode(keys, values, valid, positions)


def test_a_cache_built_for_a_model_passes_its_rope_to_the_cold_tiers():
    from confkv.hf import ConfKVCache
    from confkv.models import tiny_model

    model = tiny_model("llama")
    cache = ConfKVCache.for_model(model, "kivi", bits=4, format="prerope", page_size=8, group_size=8, budget=8)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    store = cache.layers[0].store
    assert store.cold.rope is not None and store.cold.num_pages > 0
    assert store.cold.format.name == "kivi+prerope"


# ------------------------------------------------------------------ the rotation folded into the read

def _run_tiny(fold: bool, name: str = "hadamard+outliers+codebook", **params):
    from confkv.hf import ConfKVCache
    from confkv.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama").float()
    cache = ConfKVCache.for_model(model, "kivi", bits=3, format=name, page_size=8, group_size=8, budget=8, **params)
    for layer in cache.layers:
        if layer.store.cold is not None:
            layer.store.cold.fold_rotation = fold
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(1))
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids[:, :40], cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        for t in range(40, 48):  # decode steps: every page read each step
            logits.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.cat(logits), cache


@pytest.mark.parametrize("name", ["hadamard", "hadamard+outliers+codebook"])
def test_a_read_in_the_rotated_basis_equals_the_read_of_pages_rotated_back(name):
    """The rotation folded into the query and output (pages left rotated) gives the read that decodes every
    page back to the original basis (fp32, within 1e-5 of the logits' scale)."""
    folded, cache = _run_tiny(True, name)
    plain, _ = _run_tiny(False, name)
    assert cache.layers[0].store.cold.num_pages >= 3
    assert cache.layers[0].store.cold.read_rotation() is not None
    assert (folded - plain).abs().max() <= 1e-5 * plain.abs().max()


def test_no_rotation_is_folded_for_formats_without_one_or_with_pre_rope_keys():
    for name in ("kivi", "outliers+codebook", "hadamard+prerope"):
        _, cache = _run_tiny(True, name)
        assert cache.layers[0].store.cold.read_rotation() is None


def _run_ladder(name: str, fold: bool = True, backend: str = "auto"):
    """Decode steps of the tiered preset's ladder (fp32 asymmetric tiny Llama, head_dim 32) under a memory
    target with page format ``name``; returns the step logits, the cache and the reads that left the native
    path. At 35% of the bytes every rung holds pages at the end."""
    from confkv import profiling
    from confkv.config import StoreConfig
    from confkv.hf import ConfKVCache
    from confkv.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama", asymmetric=True, head_dim=32).float()
    cache = ConfKVCache.for_model(model, "tiered", memory=0.35, page_size=8, group_size=8, format=name,
                                  store=StoreConfig(read_backend=backend))
    ids = torch.randint(3, 200, (1, 200), generator=torch.Generator().manual_seed(1))
    logits = []
    with torch.no_grad():
        model(input_ids=ids[:, :64], cache=cache, use_cache=True)
        for layer in cache.layers:
            for rung in layer.store.cold.rungs:
                rung.fold_rotation = fold
        profiling.reset_fallbacks()
        for t in range(64, 200):
            logits.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.cat(logits), cache, dict(profiling.FALLBACKS)


def test_a_ladder_of_rotated_pages_reads_them_in_one_basis_three_ways():
    """A ``kivi+hadamard`` ladder stores KIVI codes of rotated keys / values on every rung, all in one rotation.
    The native read takes them packed, turning the query into their basis and their share of the output back;
    the torch read folds the rotation into the query, the hot tier and the output; without folding, every page
    is decoded back. All three give the same logits (fp32, within 1e-5 of their scale); the native one never
    leaves the native read."""
    from confkv import native

    packed, cache, fallbacks = _run_ladder("hadamard")
    folded, folded_cache, _ = _run_ladder("hadamard", backend="torch")
    plain, _, _ = _run_ladder("hadamard", fold=False, backend="torch")
    cold = cache.layers[0].store.cold
    assert [rung.num_pages > 0 for rung in cold.rungs[1:]] == [True] * (len(cold.rungs) - 1)  # pages stepped down
    assert folded_cache.layers[0].store.cold.read_rotation() is not None
    assert all(rung.format.rotation is cold.rungs[0].format.rotation for rung in cold.rungs)  # one shared object
    for other in (folded, packed):
        assert (other - plain).abs().max() <= 1e-5 * plain.abs().max()
    if native.available():
        assert cold.read_rotation(turns_pages=True) is None  # the pages carry their rotation
        assert fallbacks == {}  # the packed page read took every step


def test_a_ladder_folds_no_rotation_for_formats_that_cannot_stay_rotated():
    for name in ("kivi", "outliers", "hadamard+prerope"):
        _, cache, _ = _run_ladder(name)
        assert cache.layers[0].store.cold.read_rotation() is None
