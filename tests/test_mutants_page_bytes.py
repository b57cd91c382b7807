"""Bytes of one sealed low-bit page (:func:`confkv.tiers.lowbit.page_bytes`), worked out by hand.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

from __future__ import annotations

from confkv.tiers import lowbit


def test_four_bit_page_by_hand_is_an_exact_integer():
    """2 KV heads, head_dim 8, 4 tokens a page, 4-bit codes, groups of 2.

    codes: keys and values, 2 * 2 heads * 4 tokens * 4 bytes (two codes a byte)   =  64
    key scale + min (float16): 2 * 2 heads * (4 / 2 token groups) * 8 channels * 2 = 128
    value scale + min:         2 * 2 heads * 4 tokens * (8 / 2 channel groups) * 2 = 128
    digest (key min + max):    2 * 2 heads * 8 channels * 2                        =  64
    """
    total = lowbit.page_bytes(2, 8, 4, 4, 2)
    assert total == 64 + 128 + 128 + 64 and type(total) is int
    without_digest = lowbit.page_bytes(2, 8, 4, 4, 2, digest=False)
    assert without_digest == 64 + 128 + 128 and type(without_digest) is int


def test_full_precision_page_defaults_to_two_byte_elements_and_a_digest():
    """bits=16: keys and values in the model's dtype, float16/bfloat16 (2 bytes) unless told otherwise."""
    assert lowbit.page_bytes(2, 8, 4, 16, 2) == 2 * 2 * 4 * 8 * 2 + 64
    assert lowbit.page_bytes(2, 8, 4, 16, 2, fp_element_size=4, digest=False) == 2 * 2 * 4 * 8 * 4
