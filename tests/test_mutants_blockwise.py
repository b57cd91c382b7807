"""KVSegment.validate (confkv/attention/blockwise.py): each malformed segment is refused with its own message.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md): the messages are
compared in full, and int8 keys with only one of their two scales are refused.
"""

import pytest
import torch

from confkv.attention.blockwise import KVSegment

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
