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
