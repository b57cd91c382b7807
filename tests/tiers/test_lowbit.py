"""Bit unpacking of the cold tier's pages (:func:`confkv.tiers.lowbit.unpack`) against codes worked out
by hand and against a pure-Python reading of the bytes, its dtype, and its device.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

from __future__ import annotations
import pytest
import torch
from confkv.tiers import lowbit


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


# ------------------------------------------------------------------ quantization: codes worked out by hand

def test_key_codes_stay_in_range_when_float16_rounding_pushes_them_out():
    """KIVI keys at 2 bits, one group of 4 tokens, codes worked out by hand per channel:

    * channel 0 (an outlier channel, narrow range near 1): the minimum 1.0007 rounds UP to the
      float16 1 + 2**-10 = 1.0009765625, so the smallest key sits below it: (1.0007 - 1.0009765625)
      / scale = -0.68 rounds to -1 and must clamp to code 0 (a -1 would wrap to 255 as uint8);
      scale = f16((1.0022 - 1.0009765625) / 3) ~ 0.0004077: codes 0.55 -> 1, 1.77 -> 2, 3.0 -> 3;
    * channel 1 (tiny range): the scale 2.4e-7 / 3 = 8e-8 rounds DOWN to the float16 subnormal
      2**-24 = 5.96e-8, so the largest key is 2.4e-7 / 2**-24 = 4.03 -> 4 steps: it must clamp to 3
      (a 4 would carry into channel 2's bits of the packed byte);
    * channel 2 (constant 0.5): scale 0, every code 0;
    * channel 3 (range 1e-8): the scale 3.3e-9 underflows to a float16 0, and every code is 0
      (a division by that zero scale would give code 3 for the 1e-8)."""
    keys = torch.tensor([[1.0007, 0.0, 0.5, 0.0],
                         [1.0012, 0.0, 0.5, 0.0],
                         [1.0017, 0.0, 0.5, 0.0],
                         [1.0022, 2.4e-7, 0.5, 1e-8]])
    q = lowbit.quantize_keys(keys, torch.ones(4, dtype=torch.bool), 2, group_size=4)
    assert q.minimum.tolist() == [[1 + 2 ** -10, 0.0, 0.5, 0.0]]
    scale = q.scale.tolist()[0]
    assert scale[0] == pytest.approx(0.0004077, abs=1e-7) and scale[1:] == [2 ** -24, 0.0, 0.0]
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (4, 1)
    assert lowbit.unpack(q.codes, 2, 4).tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [3, 3, 0, 0]]
    # the packed bytes themselves: code i sits at bit 2 * i
    assert q.codes.flatten().tolist() == [0, 1, 2, 3 + (3 << 2)]


def test_eight_bit_codes_of_a_small_range_clamp_at_255():
    """A channel spanning 0 .. 0.00098 at 8 bits: the scale 0.00098 / 255 = 3.84e-6 is a float16
    subnormal and rounds down to 64 * 2**-24 = 2**-18, so 0.00098 is 256.9 steps: code 255, not a
    wrapped 257 (= 1 as uint8). Codes: 0.0003 / 2**-18 = 78.6 -> 79, 0.0006 / 2**-18 = 157.3 -> 157."""
    keys = torch.tensor([0.0, 0.0003, 0.0006, 0.00098])[:, None].expand(4, 2).clone()
    q = lowbit.quantize_keys(keys, torch.ones(4, dtype=torch.bool), 8, group_size=4)
    assert q.scale.tolist() == [[2 ** -18, 2 ** -18]] and q.minimum.tolist() == [[0.0, 0.0]]
    assert q.codes.dtype == torch.uint8 and q.codes.tolist() == [[0, 0], [79, 79], [157, 157], [255, 255]]
    top = lowbit.dequantize_keys(q, 8, 2, 4)[3].tolist()
    assert top == [255 * 2 ** -18] * 2  # 0.000973, the nearest the codes reach to 0.00098


def test_eight_bit_codes_pack_one_to_a_byte_whatever_the_head_dim():
    """8-bit codes need no word of several codes: any head_dim packs, into head_dim bytes."""
    lowbit.check_packable(7, 8)  # no error
    assert lowbit.packed_width(7, 8) == 7 and lowbit.packed_width(5, 8) == 5
    # one page, one head, 5 tokens of 5 channels, group 5: codes (keys and values) 2 * 5 * 5 bytes,
    # key scale+min 2 * 5 channels * 2 bytes, value scale+min 2 * 5 tokens * 2, digest 2 * 5 * 2
    assert lowbit.page_bytes(1, 5, 5, 8, 5) == 50 + 20 + 20 + 20
    with pytest.raises(ValueError, match="head_dim 7"):
        lowbit.check_packable(7, 4)  # 4-bit codes pack two to a byte


# ------------------------------------------------------------------ devices

@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_table_lookup_unpacking_stays_on_the_device_of_its_input(bits, monkeypatch):
    """On the ``meta`` device: the byte table is made on the packed bytes' device (a CPU table
    would not combine with the pages of an accelerator). The table cache starts empty, so the
    table is built here and not taken from an earlier test."""
    monkeypatch.setattr(lowbit, "_BYTE_TABLES", {})
    packed = torch.empty(3, lowbit.packed_width(8, bits), dtype=torch.uint8, device="meta")
    out = lowbit.unpack_float(packed, bits, 8)
    assert out.device.type == "meta" and out.shape == (3, 8) and out.dtype == torch.float32
    assert [key[1].type for key in lowbit._BYTE_TABLES] == ["meta"]
    assert all(table.device.type == "meta" for table in lowbit._BYTE_TABLES.values())


class _MadeOn(torch.overrides.TorchFunctionMode):
    """Records the device of every tensor any torch call returns."""

    def __init__(self):
        super().__init__()
        self.devices = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(item, torch.Tensor):
                self.devices.add(item.device.type)
        return out


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantization_makes_every_tensor_on_the_device_of_its_input(bits):
    """On the ``meta`` device, every tensor quantize, pack and dequantize make (masks and shift
    tables included) is a meta tensor: on an accelerator, one made on the CPU is refused (CUDA's
    masked_fill wants its mask on the tensor's device) or costs a host copy each step."""
    keys = torch.empty(2, 8, 16, device="meta")
    valid = torch.empty(2, 8, dtype=torch.bool, device="meta")
    with _MadeOn() as made:
        qk = lowbit.quantize_keys(keys, valid, bits, group_size=4)
        qv = lowbit.quantize_values(keys, bits, group_size=4)
        k_hat = lowbit.dequantize_keys(qk, bits, 16, 4)
        v_hat = lowbit.dequantize_values(qv, bits, 16, 4)
    assert made.devices == {"meta"}
    assert qk.codes.shape == qv.codes.shape == (2, 8, lowbit.packed_width(16, bits))
    assert k_hat.shape == v_hat.shape == (2, 8, 16)


# ---------------------------------------------------------------------------------------------------
# Bytes of one sealed low-bit page (:func:`confkv.tiers.lowbit.page_bytes`), worked out by hand.
#
# Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).


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


def test_masked_extremes_skip_invalid_entries_and_give_zero_to_an_empty_group():
    """The shared range helper (KIVI codes, the page formats and the clipping search take their ranges from it):
    an invalid entry never widens a group's range, and a group without a valid entry gets [0, 0], not
    [+inf, -inf] (which would make its scale and every code NaN). Seen to fail with the empty-group guard dropped
    and with the mask left out of the maximum."""
    x = torch.tensor([[-5.0, 1.0, 2.0, 9.0],
                      [3.0, 4.0, -7.0, 8.0]])
    valid = torch.tensor([[False, True, True, False],
                          [False, False, False, False]])
    bottom, top = lowbit.masked_extremes(x, valid, dim=-1)
    assert bottom.tolist() == [[1.0], [0.0]] and top.tolist() == [[2.0], [0.0]]
    scale, minimum = lowbit.scale_and_minimum(bottom, top, 2)
    assert scale.tolist() == [[torch.tensor(1 / 3, dtype=torch.float16).item()], [0.0]]  # (2 - 1) / 3 levels' steps
    assert minimum.tolist() == [[1.0], [0.0]]
