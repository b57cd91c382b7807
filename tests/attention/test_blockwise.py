"""Block-wise online-softmax read == dense softmax attention over the dequantized cache."""

from __future__ import annotations
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from confkv.attention import KVSegment, attention_read, blockwise_attention
from confkv.attention.blockwise import dense_attention_reference
from confkv.quant import key_channel_scale, quantize_keys, quantize_values
from segment_cases import attention_cases, make_segment


FAST = settings(max_examples=40, deadline=None)


def assert_matches_reference(query, segments, out, mass, softcap=None, atol=2e-5):
    scaling = query.shape[-1] ** -0.5
    ref_out, ref_mass = dense_attention_reference(query, segments, scaling, softcap)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=1e-4)
    if mass is not None:
        assert len(mass) == len(segments)
        for got, want, segment in zip(mass, ref_mass, segments):
            assert got.shape == (query.shape[0], segment.keys.shape[1], segment.length)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)


@FAST
@given(case=attention_cases(), block_size=st.sampled_from([1, 2, 3, 5, 8, 1024]), softcap=st.sampled_from([None, 5.0]))
def test_blockwise_matches_dense(case, block_size, softcap):
    query, segments = case
    scaling = query.shape[-1] ** -0.5
    out, mass = blockwise_attention(query, segments, scaling, block_size, softcap=softcap)
    assert_matches_reference(query, segments, out, mass, softcap)
    out_no_mass, none = blockwise_attention(query, segments, scaling, block_size, softcap=softcap, need_mass=False)
    assert none is None
    torch.testing.assert_close(out_no_mass, out, atol=1e-6, rtol=1e-6)


@FAST
@given(case=attention_cases(), block_size=st.integers(1, 4), tile_size=st.integers(1, 9))
def test_small_tiles_exercise_online_rescaling(case, block_size, tile_size):
    """Many tiles per segment: the running max / sum / output rescaling path."""
    query, segments = case
    out, mass = blockwise_attention(query, segments, query.shape[-1] ** -0.5, block_size, tile_size=tile_size)
    assert_matches_reference(query, segments, out, mass)


def test_fully_masked_rows_are_zero_not_nan():
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(2, 4, 3, 8, generator=gen)
    seg_a = make_segment(gen, 2, 2, 6, 8, 3, int8=True, mask_kind="none")
    seg_b = make_segment(gen, 2, 2, 4, 8, 3, int8=False, mask_kind="none")
    hide = torch.ones(2, 2, 3, 6, dtype=torch.bool)
    hide[1, 0, 2] = False  # batch 1, kv head 0, query 2 sees nothing in a ...
    seg_a.visible = hide
    seg_b.visible = torch.ones(2, 2, 3, 4, dtype=torch.bool)
    seg_b.visible[1, 0, 2] = False  # ... nor in b
    for block_size in (1, 4, 1024):
        out, mass = blockwise_attention(query, [seg_a, seg_b], 8**-0.5, block_size)
        assert torch.isfinite(out).all()
        assert torch.equal(out[1, 0:2, 2], torch.zeros(2, 8))  # query heads 0,1 read kv head 0
        assert (out[1, 0:2, 1].abs() > 0).any()
        assert_matches_reference(query, [seg_a, seg_b], out, mass)
        # each (batch, kv head) receives Q units of mass, minus one for the blind query
        totals = mass[0].sum(-1) + mass[1].sum(-1)
        expected = torch.full((2, 2), 3.0)
        expected[1, 0] = 2.0
        torch.testing.assert_close(totals, expected)


def test_everything_empty_or_hidden():
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(1, 2, 1, 4, generator=gen)
    empty = make_segment(gen, 1, 1, 0, 4, 1, int8=True, mask_kind="none")
    hidden = make_segment(gen, 1, 1, 5, 4, 1, int8=False, mask_kind="hidden")
    for segments in ([empty], [empty, hidden]):
        out, mass = blockwise_attention(query, segments, 0.5)
        assert torch.equal(out, torch.zeros_like(out))
        assert [m.shape[-1] for m in mass] == [s.length for s in segments]
        assert all(torch.equal(m, torch.zeros_like(m)) for m in mass)


def test_int8_read_close_to_fp_read():
    """Quantization error end to end stays small (the scheme, not the read)."""
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(1, 9, 1, 64, generator=gen)
    fp = make_segment(gen, 1, 3, 300, 64, 1, int8=False, mask_kind="none")
    channel = key_channel_scale(fp.keys)
    key_q, key_ts = quantize_keys(fp.keys, channel)
    value_q, value_ts = quantize_values(fp.values)
    q8 = KVSegment(key_q, value_q, None, key_ts, channel, value_ts)
    out_fp, mass_fp = blockwise_attention(query, [fp], 0.125)
    out_q8, mass_q8 = blockwise_attention(query, [q8], 0.125)
    assert (out_fp - out_q8).abs().max() < 0.02
    assert (mass_fp[0] - mass_q8[0]).abs().max() < 0.01


def test_half_precision_query_and_segments():
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(2, 6, 2, 16, generator=gen).to(torch.bfloat16)
    seg_fp = make_segment(gen, 2, 3, 7, 16, 2, int8=False, mask_kind="random", dtype=torch.bfloat16)
    seg_q8 = make_segment(gen, 2, 3, 9, 16, 2, int8=True, mask_kind="per_query")
    out, mass = blockwise_attention(query, [seg_q8, seg_fp], 0.25, block_size=4)
    assert out.dtype == torch.bfloat16
    ref_out, ref_mass = dense_attention_reference(query, [seg_q8, seg_fp], 0.25)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_noncontiguous_cache_views():
    """Segments that are views into a larger preallocated buffer (capacity > length)."""
    gen = torch.Generator().manual_seed(5)
    buffer_k = torch.randn(2, 3, 20, 8, generator=gen)
    buffer_v = torch.randn(2, 3, 20, 8, generator=gen)
    segment = KVSegment(buffer_k[:, :, 3:14], buffer_v[:, :, 3:14], None)
    query = torch.randn(2, 6, 1, 8, generator=gen)
    for block_size in (1, 4, 64):
        out, mass = blockwise_attention(query, [segment], 8**-0.5, block_size)
        assert_matches_reference(query, [segment], out, mass)


def test_matches_sdpa():
    gen = torch.Generator().manual_seed(6)
    query = torch.randn(2, 9, 1, 64, generator=gen)
    segment = make_segment(gen, 2, 3, 100, 64, 1, int8=False, mask_kind="none")
    out, _ = blockwise_attention(query, [segment], 0.125, block_size=32)
    want = torch.nn.functional.scaled_dot_product_attention(query, segment.keys, segment.values, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_attention_read_dispatch_and_validation():
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(1, 4, 1, 8, generator=gen)
    segment = make_segment(gen, 1, 2, 5, 8, 1, int8=True, mask_kind="random")
    out_auto, mass_auto = attention_read(query, [segment], 0.3)  # CPU -> torch
    out_torch, mass_torch = attention_read(query, [segment], 0.3, backend="torch")
    assert torch.equal(out_auto, out_torch)
    assert torch.equal(mass_auto[0], mass_torch[0])
    with pytest.raises(ValueError):
        attention_read(query, [segment], 0.3, backend="nope")
    with pytest.raises(ValueError):
        blockwise_attention(query, [segment], 0.3, block_size=0)
    bad = KVSegment(segment.keys, segment.values, None)  # int8 without scales
    with pytest.raises(ValueError):
        blockwise_attention(query, [bad], 0.3)


# ---------------------------------------------------------------------------------------------------
# KVSegment.validate (confkv/attention/blockwise.py): each malformed segment is refused with its own message.
#
# Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md): the messages are
# compared in full, and int8 keys with only one of their two scales are refused.


FP = torch.zeros(1, 2, 3, 4)
INT8 = torch.zeros(1, 2, 3, 4, dtype=torch.int8)
TOKEN = torch.ones(1, 2, 3)
CHANNEL = torch.ones(1, 2, 4)


def _message(segment: KVSegment) -> str:
    with pytest.raises(ValueError) as refused:
        segment.validate()
    return str(refused.value)


def test_keys_and_values_of_different_shapes_are_named_in_the_message():
    assert _message(KVSegment(FP, torch.zeros(1, 2, 5, 4), None)) == "keys (1, 2, 3, 4) and values (1, 2, 5, 4) differ"


@pytest.mark.parametrize("token,channel", [(TOKEN, None), (None, CHANNEL), (None, None)])
def test_int8_keys_need_both_scales(token, channel):
    segment = KVSegment(INT8, FP, None, key_token_scale=token, key_channel_scale=channel)
    assert _message(segment) == "int8 keys need key_token_scale and key_channel_scale (and fp keys must have none)"


def test_fp_keys_with_both_scales_and_int8_values_without_theirs_are_refused():
    segment = KVSegment(FP, FP, None, key_token_scale=TOKEN, key_channel_scale=CHANNEL)
    assert _message(segment) == "int8 keys need key_token_scale and key_channel_scale (and fp keys must have none)"
    assert _message(KVSegment(FP, INT8, None)) == "int8 values need value_token_scale (and fp values must have none)"
    assert _message(KVSegment(FP, FP, None, value_token_scale=TOKEN)) == (
        "int8 values need value_token_scale (and fp values must have none)")


def test_well_formed_segments_pass():
    KVSegment(FP, FP, None).validate()
    KVSegment(INT8, INT8, None, key_token_scale=TOKEN, key_channel_scale=CHANNEL, value_token_scale=TOKEN).validate()


def test_a_mask_broadcast_over_the_slots_applies_to_every_tile():
    """``visible`` of last dimension 1 ([B, Hkv, Q, 1]: one flag per query row for all slots) is used
    as it is by every tile, not sliced per tile: with tiles of 4 over 10 slots, the read equals the
    dense reference (which masks all 10 slots of the hidden rows)."""
    from confkv.attention.blockwise import blockwise_attention, dense_attention_reference

    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 1, 10, 4, generator=gen), torch.randn(2, 1, 10, 4, generator=gen)
    query = torch.randn(2, 2, 3, 4, generator=gen)
    visible = torch.tensor([True, True, False]).view(1, 1, 3, 1).expand(2, 1, 3, 1)  # third query row: no slot
    segments = [KVSegment(keys, values, torch.ones(2, 1, 3, 10, dtype=torch.bool)),
                KVSegment(keys.flip(2), values.flip(2), visible)]
    out, mass = blockwise_attention(query, segments, 0.5, block_size=2, tile_size=4)
    want_out, want_mass = dense_attention_reference(query, segments, 0.5)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(mass, want_mass):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(mass[1][..., :].sum()) > 0  # the broadcast segment was read for the visible rows


def test_blockwise_attention_refuses_a_bad_block_size_and_no_segments_with_their_messages():
    from confkv.attention.blockwise import blockwise_attention

    query = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError) as refused:
        blockwise_attention(query, [KVSegment(FP, FP, None)], 0.5, block_size=0)
    assert str(refused.value) == "block_size must be >= 1, got 0"
    with pytest.raises(ValueError) as refused:
        blockwise_attention(query, [], 0.5)
    assert str(refused.value) == "need at least one segment (an empty one is fine)"
    with pytest.raises(ValueError) as refused:  # 3 query heads over 2 KV heads: no whole group per KV head
        blockwise_attention(torch.zeros(1, 3, 1, 4), [KVSegment(FP, FP, None)], 0.5)
    assert str(refused.value) == "Hq=3 is not a multiple of Hkv=2"
