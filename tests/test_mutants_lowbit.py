"""Bit unpacking of the cold tier's pages (:func:`confkv.lowbit.unpack`) against codes worked out
by hand and against a pure-Python reading of the bytes, its dtype, and its device.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

import pytest
import torch

from confkv import lowbit


def _python_codes(packed: list[int], bits: int, head_dim: int) -> list[int]:
    """Codes of one row of packed bytes, read with Python ints: a word is the bytes of
    ``per_word`` codes, least significant byte first; code ``i`` sits at bit ``i * bits``."""
    per_word = {2: 4, 3: 8, 4: 2, 8: 1}[bits]
    word_bytes = per_word * bits // 8
    codes = []
    for w in range(head_dim // per_word):
        word = int.from_bytes(bytes(packed[w * word_bytes:(w + 1) * word_bytes]), "little")
        codes += [(word >> (i * bits)) & ((1 << bits) - 1) for i in range(per_word)]
    return codes


@pytest.mark.parametrize("bits, packed, codes", [
    (2, [0b11_10_01_00, 0b00_01_10_11], [0, 1, 2, 3, 3, 2, 1, 0]),
    (4, [0x21, 0xF0], [1, 2, 0, 15]),
    # 1 + 2<<3 + 3<<6 + 4<<9 + 5<<12 + 6<<15 + 7<<18 = 2054353 = 0x1F58D1, little-endian bytes
    (3, [0xD1, 0x58, 0x1F], [1, 2, 3, 4, 5, 6, 7, 0]),
    (8, [7, 255, 0, 128], [7, 255, 0, 128]),
])
def test_unpack_reads_codes_worked_out_by_hand(bits, packed, codes):
    out = lowbit.unpack(torch.tensor([packed], dtype=torch.uint8), bits, len(codes))
    assert out.tolist() == [codes]
    assert _python_codes(packed, bits, len(codes)) == codes  # the reference agrees with the hand values


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpack_matches_a_python_reading_of_the_bytes(bits):
    head_dim = 16
    packed = torch.randint(0, 256, (2, 3, lowbit.packed_width(head_dim, bits)),
                           generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    out = lowbit.unpack(packed, bits, head_dim)
    assert out.shape == (2, 3, head_dim)
    expected = [[_python_codes(row, bits, head_dim) for row in block] for block in packed.tolist()]
    assert out.tolist() == expected
    # signed integers wide enough for arithmetic on the codes (a uint8 result would wrap at 0 - 1)
    assert out.dtype in (torch.int32, torch.int64)
    assert (out - 1).min().item() == min(min(min(r) for r in b) for b in expected) - 1


def test_unpack_of_8_bit_codes_is_int32_as_documented():
    packed = torch.tensor([[0, 1, 200, 255]], dtype=torch.uint8)
    out = lowbit.unpack(packed, 8, 4)
    assert out.dtype == torch.int32 and out.tolist() == [[0, 1, 200, 255]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpack_stays_on_the_device_of_its_input(bits):
    """On the ``meta`` device (shapes only): every tensor unpack makes follows its input's device,
    so a page on an accelerator unpacks there (a CPU-made shift table would not combine with it)."""
    packed = torch.empty(2, 5, lowbit.packed_width(24, bits), dtype=torch.uint8, device="meta")
    out = lowbit.unpack(packed, bits, 24)
    assert out.device.type == "meta" and out.shape == (2, 5, 24)
