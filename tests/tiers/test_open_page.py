"""The ladder's open page in INT8 or 4 bits per token and KV head (``Storage(open_bits=8 / 4)``,
:mod:`confkv.tiers.cold_read`, :mod:`confkv.tiers.open_nibbles`): its error bound, its bytes, the pages it seals, the read, and what it buys under a
memory target.

The 4-bit tests were each seen to fail with a bug put in by hand (then removed): the rotation not undone on decode,
or not applied on encode; a byte's two codes read in swapped halves; a 4-bit slot priced at D bytes; a page sealed
from 4-bit slots reshaped by the codes' width; the ladder pricing an open slot by the codes' width."""

from __future__ import annotations

import pytest
import torch

from confkv.config import ColdConfig
from confkv.errors import ConfigError
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from confkv.tiers import cold_read as open_page
from confkv.tiers.cold import ColdTier
from confkv.tiers.ladder import LadderTier
from confkv.tiers.storage import Storage
from decode_stream import native_and_torch_reads

pytestmark = pytest.mark.usefixtures("one_thread")
_MODELS: dict[str, torch.nn.Module] = {}


def _model(arch: str = "llama") -> torch.nn.Module:
    if arch not in _MODELS:
        _MODELS[arch] = tiny_model(arch, seed=3, asymmetric=True)
    return _MODELS[arch]


def _tokens(batch: int, heads: int, length: int, dim: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Random tokens with an outlier channel (channel 3 x 20), one all-zero token and one tiny one."""
    x = torch.randn(batch, heads, length, dim, generator=torch.Generator().manual_seed(seed))
    x[..., 3] *= 20
    x[:, :, 1] = 0.0
    x[:, :, 2] *= 1e-6
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_slots_decode_within_their_bound(dtype):
    """Each channel comes back within ``scale / 2`` (the rounding) plus what the float16 rounding of ``scale`` moves
    the largest entry (``|max|x| - 127 scale|``, where the clamp may cut), plus the output dtype's own rounding."""
    keys, values = _tokens(2, 3, 40, 16, seed=1, dtype=dtype), _tokens(2, 3, 40, 16, seed=2, dtype=dtype)
    stored = open_page.encode_open(keys, values, dtype, 8)
    assert stored["keys"].dtype == stored["values"].dtype == torch.int8
    assert stored["key_scale"].shape == (2, 3, 40) and stored["key_scale"].dtype == torch.float16
    out = open_page.decoded_open(stored, dtype)
    for name, original, back in (("key_scale", keys, out[0]), ("value_scale", values, out[1])):
        assert back.dtype == dtype and back.shape == original.shape
        x = original.float()
        assert torch.equal(stored[name], (x.abs().amax(-1) / 127).to(torch.float16))  # the largest entry maps to 127
        scale = stored[name].float()[..., None]
        amax = x.abs().amax(-1, keepdim=True)
        bound = scale / 2 + (amax - 127 * scale).abs() + x.abs() * torch.finfo(dtype).eps + 1e-12
        error = (back.float() - x).abs()
        assert bool((error <= bound).all()), float((error - bound).max())
        assert bool((back[:, :, 1] == 0).all())  # an all-zero token stays zero (no division by a zero scale)
        assert float(error.max()) > 0  # INT8 is not exact on these tokens: the codes are really 8-bit


def test_a_16_bit_open_page_is_the_model_dtype_untouched():
    keys, values = _tokens(1, 2, 5, 8, dtype=torch.bfloat16), _tokens(1, 2, 5, 8, seed=4, dtype=torch.bfloat16)
    stored = open_page.encode_open(keys, values, torch.bfloat16, 16)
    assert set(stored) == {"keys", "values"} and torch.equal(stored["keys"], keys)
    assert open_page.decoded_open(stored, torch.bfloat16)[1] is stored["values"]


def _tier(open_bits: int, page: int = 8) -> ColdTier:
    return ColdTier(ColdConfig(bits=4, page_size=page, group_size=page, k_high="all", k_low="all",
                               open_bits=open_bits))


def _demote(tier: ColdTier, keys, values, start: int = 0, valid=None) -> None:
    batch, heads, length, _ = keys.shape
    positions = torch.arange(start, start + length).expand(batch, heads, length)
    tier.demote(keys, values, positions, torch.ones(batch, length, dtype=torch.bool) if valid is None else valid)


def test_an_int8_open_page_costs_its_codes_and_scales():
    """``2 * H * (D + 2)`` bytes a slot and sequence (codes of keys and values, a float16 scale each), ``2 * H *
    (D / 2 + 2)`` at 4 bits, against ``4 * H * D`` in bfloat16; what the tier counts is what its tensors hold."""
    batch, heads, dim, length = 2, 3, 16, 5
    counted = {}
    for bits in (16, 8, 4):
        tier = _tier(bits)
        _demote(tier, _tokens(batch, heads, length, dim, dtype=torch.bfloat16),
                _tokens(batch, heads, length, dim, seed=5, dtype=torch.bfloat16))
        held = sum(t.nbytes for name, t in tier.open.items() if name in ("keys", "values", "key_scale", "value_scale"))
        assert tier.kv_bytes() == held == batch * length * open_page.open_slot_bytes(heads, dim, 2, bits)
        counted[bits] = held
    assert counted[16] == batch * length * 4 * heads * dim and counted[8] == batch * length * 2 * heads * (dim + 2)
    assert counted[4] == batch * length * 2 * heads * (dim // 2 + 2)  # two codes a byte


@pytest.mark.parametrize("bits", [8, 4])
def test_a_page_sealed_from_int8_slots_is_the_page_of_their_decoded_tokens(bits):
    """A page that fills is decoded and quantized at its rung's bits: the same page as a 16-bit open page fed the
    decoded tokens (codes, scales, positions, validity), so INT8 (or 4 bits) adds only its own rounding."""
    keys, values = _tokens(2, 3, 8, 16, seed=6), _tokens(2, 3, 8, 16, seed=7)
    int8 = _tier(bits)
    _demote(int8, keys[:, :, :3], values[:, :, :3])
    _demote(int8, keys[:, :, 3:], values[:, :, 3:], start=3)
    decoded = open_page.decoded_open(open_page.encode_open(keys, values, torch.float32, bits), torch.float32)
    plain = _tier(16)
    _demote(plain, *decoded)
    assert int8.num_pages == plain.num_pages == 1 and int8.open_length == plain.open_length == 0
    for name, tensor in plain.pages.items():
        if name not in ("sealed_at", "heat"):
            assert torch.equal(int8.pages[name][:, :, :1], tensor[:, :, :1]), name


@pytest.mark.parametrize("bits", [8, 4])
def test_left_aligned_slots_keep_their_own_scales(bits):
    """Padding slots of one sequence are squeezed out: every kept slot decodes to its own token (its scale moved
    with its codes), in order."""
    keys, values = _tokens(2, 2, 6, 8, seed=8), _tokens(2, 2, 6, 8, seed=9)
    valid = torch.tensor([[True] * 6, [False, True, False, True, True, False]])
    tier = _tier(bits)
    _demote(tier, keys, values, valid=valid)
    assert tier.open_length == 6 and tier.open["valid"][1].tolist() == [True, True, True, False, False, False]
    kept_keys, _ = open_page.decoded_open(tier.open, torch.float32)
    expected = open_page.decoded_open(open_page.encode_open(keys, values, torch.float32, bits), torch.float32)[0]
    torch.testing.assert_close(kept_keys[1, :, :3], expected[1, :, [1, 3, 4]], rtol=0, atol=0)
    assert tier.open["positions"][1, 0, :3].tolist() == [1, 3, 4]


@pytest.mark.parametrize("bits", [8, 4])
def test_the_read_takes_the_open_page_decoded(bits):
    """The open page's read segment is its decoded tokens in the model's dtype; the bytes read are its codes and
    scales."""
    keys, values = _tokens(1, 2, 5, 16, seed=10), _tokens(1, 2, 5, 16, seed=11)
    tier = _tier(bits)
    _demote(tier, keys, values)
    (segment,) = tier.segments(torch.zeros(1, 2, 1, 16), torch.tensor([0]))
    expected = open_page.decoded_open(tier.open, torch.float32)
    assert torch.equal(segment.keys, expected[0]) and torch.equal(segment.values, expected[1])
    assert tier.bytes_read == tier.kv_bytes()


def test_an_int8_open_page_loses_slots_where_a_16_bit_one_would_be_sealed():
    """With no sealed page left, an open page is sealed early only when its tokens cost more than a bottom page:
    5 INT8 slots (5 x 108 bytes: 3 heads of 16 channels) cost less than a 3-bit page of 8 (672 bytes with its scales
    and minima) and lose their oldest slot; the same 5 slots in bfloat16 (5 x 192) cost more and are sealed."""
    sealed = {}
    for bits in (16, 8):
        ladder = LadderTier(Storage(ladder=(8, 3), page_size=8, group_size=8, open_bits=bits))
        ladder.demote(_tokens(1, 3, 5, 16, dtype=torch.bfloat16), _tokens(1, 3, 5, 16, seed=3, dtype=torch.bfloat16),
                      torch.arange(5).expand(1, 3, 5), torch.ones(1, 5, dtype=torch.bool))
        bottom = ladder._batch_page_bytes(1)
        assert (5 * open_page.open_slot_bytes(3, 16, 2, bits) > bottom) == (bits == 16)
        ladder.fit(ladder.kv_bytes() - 1, torch.bfloat16)
        sealed[bits] = (ladder.rungs[-1].num_pages, ladder.top.open_length)
    assert sealed[16] == (1, 0)  # sealed, then stepped down to the bottom
    assert sealed[8] == (0, 4)  # one slot (108 bytes) was enough


def test_under_a_target_an_int8_open_page_holds_more_tokens():
    """What the option is for: early in a stream the open page is most of the target, and in INT8 fewer sealed
    pages are dropped to pay for it (the same hot tier)."""
    model = _model()
    ids = torch.randint(0, 250, (1, 200), generator=torch.Generator().manual_seed(2))
    held = {}
    for bits in (16, 8):
        cache = ConfKVCache.for_model(model, "tiered", memory=0.25, page_size=16, group_size=16, open_bits=bits)
        rung_tokens = []
        with torch.no_grad():
            for t in range(200):
                model(ids[:, t:t + 1], cache=cache, use_cache=True)
                record = cache.trace.steps[-1]
                assert int(record.kv_bytes.sum()) <= record.target_bytes
                rung_tokens.append(sum(record.rung_tokens))
        held[bits] = sum(rung_tokens)
        if bits == 8:
            assert any(cache.layers[i].store.cold.top.open["keys"].dtype == torch.int8 for i in cache.managed)
    assert held[8] > 1.2 * held[16], held


@pytest.mark.parametrize("bits", [8, 4])
def test_an_int8_open_page_stays_on_the_native_read(bits):
    """The open page is handed to the read decoded, beside the packed pages: no decode step leaves the native
    path, and the logits are the block-wise torch read's."""
    ids = torch.randint(0, 250, (1, 260), generator=torch.Generator().manual_seed(0))
    logits, fallbacks, caches = native_and_torch_reads(_model(), ids, 128, policy="tiered", memory=0.25,
                                                       open_bits=bits, page_size=16, group_size=16)
    assert all(sum(cache.trace.steps[-1].rung_tokens) > 0 for cache in caches.values())
    assert fallbacks["auto"] == {} and fallbacks["torch"]
    torch.testing.assert_close(logits["auto"], logits["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("value", [2, 32, True, "8"])
def test_another_open_width_is_refused_by_name(value):
    for make in (lambda: Storage(open_bits=value), lambda: ColdConfig(open_bits=value)):
        with pytest.raises(ConfigError, match=r"^open_bits: must be 16 \(the model's dtype\), 8 \(INT8 per token\) or 4 "
                                              rf"\(4 bits per token, rotated\), got {value!r}$"):
            make()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_4_bit_slots_decode_within_their_bound_in_the_rotated_basis(dtype):
    """In the basis they are coded in (each token's channels turned by the head's Hadamard rotation), each channel
    comes back within ``scale / 2`` plus what the float16 rounding of ``scale = max |y| / 7`` moves the largest
    entry, plus the rounding of the output dtype (turned into that basis: a ``sqrt(D)``-wide bound); the codes are
    4-bit (two a byte, each in [1, 15]), and an all-zero token stays zero."""
    from confkv.tiers.hadamard import shared_rotation

    keys, values = _tokens(2, 3, 40, 16, seed=12, dtype=dtype), _tokens(2, 3, 40, 16, seed=13, dtype=dtype)
    stored = open_page.encode_open(keys, values, dtype, 4)
    assert stored["keys"].dtype == torch.uint8 and stored["keys"].shape == (2, 3, 40, 8)
    nibbles = torch.stack([stored["keys"] & 15, stored["keys"] >> 4])
    assert int(nibbles[:, :, :, 3:].min()) >= 1 and int(nibbles.max()) <= 15
    rotation = shared_rotation(16)
    for name, original, back in zip(("key_scale", "value_scale"), (keys, values), open_page.decoded_open(stored, dtype)):
        assert back.dtype == dtype and back.shape == original.shape
        y, got = rotation.forward(original.float()), rotation.forward(back.float())
        scale = stored[name].float()[..., None]
        assert torch.equal(stored[name], (y.abs().amax(-1) / 7).to(torch.float16))
        amax = y.abs().amax(-1, keepdim=True)
        dtype_bound = 4 * original.float().abs().amax(-1, keepdim=True) * torch.finfo(dtype).eps
        bound = scale / 2 + (amax - 7 * scale).abs() + dtype_bound + 1e-6
        assert bool(((got - y).abs() <= bound).all()), float(((got - y).abs() - bound).max())
        assert bool((back[:, :, 1] == 0).all())


def test_the_rotation_spreads_an_outlier_channel_over_the_4_bit_codes():
    """What the rotation is for: tokens with one channel 20x the others lose far less in the rotated basis than
    in their own at the same 4 bits (each token's scale is set by its largest entry)."""
    keys = _tokens(1, 3, 64, 64, seed=14)[:, :, 3:]  # the outlier channel, no zero or tiny token
    back, _ = open_page.decoded_open(open_page.encode_open(keys, keys, torch.float32, 4), torch.float32)
    scale = keys.abs().amax(-1, keepdim=True) / 7
    plain = (keys / scale).round().clamp(-7, 7) * scale  # the same quantizer, unrotated
    rotated_error, plain_error = ((back - keys) ** 2).mean(), ((plain - keys) ** 2).mean()
    assert rotated_error < 0.5 * plain_error, (float(rotated_error), float(plain_error))


def test_a_4_bit_open_page_needs_an_even_head_dim():
    keys = torch.randn(1, 1, 2, 5)
    with pytest.raises(ValueError, match="head_dim 5 is odd"):
        open_page.encode_open(keys, keys, torch.float32, 4)


def test_under_a_target_a_4_bit_open_page_holds_more_tokens_than_an_int8_one():
    """About half the INT8 open page's bytes: early in a stream, fewer sealed pages are dropped to pay for it."""
    model = _model()
    ids = torch.randint(0, 250, (1, 200), generator=torch.Generator().manual_seed(2))
    held = {}
    for bits in (8, 4):
        cache = ConfKVCache.for_model(model, "tiered", memory=0.25, page_size=16, group_size=16, open_bits=bits)
        total = 0
        with torch.no_grad():
            for t in range(200):
                model(ids[:, t:t + 1], cache=cache, use_cache=True)
                record = cache.trace.steps[-1]
                assert int(record.kv_bytes.sum()) <= record.target_bytes
                total += sum(record.rung_tokens)
        held[bits] = total
    assert held[4] > 1.1 * held[8], held


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_the_ladder_prices_an_open_slot_at_what_it_holds(bits):
    """The ladder decides whether to seal the open page early or drop its oldest slots from the price of one slot
    (all sequences): the bytes the open page's slots hold, at every width (its codes are D / 2 wide at 4 bits)."""
    ladder = LadderTier(Storage(ladder=(8, 4), page_size=16, group_size=16, open_bits=bits))
    keys, values = _tokens(2, 3, 11, 16, seed=15), _tokens(2, 3, 11, 16, seed=16)
    ladder.demote(keys, values, torch.arange(11).expand(2, 3, 11), torch.ones(2, 11, dtype=torch.bool))
    top = ladder.top
    assert top.num_pages == 0 and top.open_length == 11
    assert ladder._open_slot_bytes() * 11 == open_page.open_nbytes(top.open) == ladder.kv_bytes()
