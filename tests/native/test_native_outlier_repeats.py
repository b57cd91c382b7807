"""Outlier entries that repeat an index, read natively as the torch read reads them (each entry's correction
added: outliers.restore's scatter_add): every reader that takes pages with outliers. The encoder never repeats an
index (one top-k a page), but a page handed over from elsewhere (a page file, another encoder) may, and no reader
may then differ from the torch read.

Seen failing (stop 71, when a stored entry was the value itself and the last entry stood): on the block read of
per-channel key widths as it then was (it added every entry of a repeated index), and with a bug put in by hand.
Since stop 72 (entries are corrections, added): with bugs put in by hand (then removed): pages.c's add_corrections
skipping an entry whose index repeats the one before it, and restore_outliers writing a correction over the entry
instead of adding it (patch_outliers, used by the plane-order readers, which this CPU's reads of these shapes do not
take, is held by test_native_page_formats.py and test_native_channel_bits.py). The groups-not-of-a-power-of-two test gives the readers heads of
96 channels, where an entry's token is found by a division, not a shift.
"""

from __future__ import annotations

import pytest
import torch

from confkv.native import page_entry
from confkv.native.loader import available
from confkv.tiers.formats import KiviFormat, parse_format
from test_native_page_formats import BATCH, KV_HEADS, _compare, _encoded, _segment

pytestmark = [pytest.mark.skipif(not available(), reason="no C compiler: the native kernels are unavailable"),
              pytest.mark.usefixtures("nan_filled_empty")]


def _repeat_first(index: torch.Tensor, value: torch.Tensor, times: int) -> None:
    """Entries 1 .. times of each page given entry 0's index, each with a correction of its own (a large one)."""
    for k in range(1, times + 1):
        index[..., k] = index[..., 0]
        value[..., k] = torch.tensor(7.0 + k, dtype=value.dtype)


@pytest.mark.parametrize("format, group, reader", [
    ("outliers", 4, None),                            # the row-by-row reader
    ("outliers", 8, None),                            # the fast reader of this CPU (AVX2, AVX-512 or plane order)
    ("hadamard+outliers+clip", 8, None),
    ("outliers+channel_bits", 8, "channel widths"),   # the block read of per-channel key widths
    ("hadamard+outliers+channel_bits", 4, "channel widths"),  # its row-by-row read
])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_an_index_repeated_in_a_page_adds_each_of_its_corrections(format, group, reader, bits):
    gen = torch.Generator().manual_seed(bits * 10 + group + len(format))
    page, dim = 16, 32
    fmt = KiviFormat(bits, group, dim, parse_format(format), outlier_fraction=0.03)
    data, valid, _ = _encoded(gen, fmt, page, dim)
    valid[..., :2] = True  # the first rows hold real tokens, so a repeated index on them is read
    for which in ("key", "value"):
        index, value = data[f"{which}_outlier_index"], data[f"{which}_outlier_value"]
        index[..., 0] = torch.randint(0, 2 * dim, index.shape[:-1], generator=gen).to(index.dtype)
        _repeat_first(index, value, 2)
    pages = _segment(fmt, data, valid, gen, "all", rotation=fmt.rotation)
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
    if reader is not None:
        assert page_entry.reader_of(query, pages) == reader
    _compare(query, [pages], dim ** -0.5)


@pytest.mark.parametrize("format", ["outliers", "hadamard+outliers+clip"])
@pytest.mark.parametrize("bits, value_bits", [(4, 2), (3, 3)])
def test_outliers_in_groups_not_of_a_power_of_two_are_read_as_the_torch_read(format, bits, value_bits):
    """Key groups of 24 tokens and value groups of 24 channels (pages of 48, heads of 96): a multiple of 8, which the
    AVX2 reader takes, but not a power of two, so an outlier's token is found by a division, not a shift
    (c/pages.c's add_corrections), with a repeated index on top."""
    gen = torch.Generator().manual_seed(bits + value_bits + len(format))
    page, dim, group = 48, 96, 24
    fmt = KiviFormat(bits, group, dim, parse_format(format), outlier_fraction=0.01, value_bits=value_bits)
    data, valid, _ = _encoded(gen, fmt, page, dim)
    valid[..., :2] = True
    for which in ("key", "value"):
        _repeat_first(data[f"{which}_outlier_index"], data[f"{which}_outlier_value"], 1)
    pages = _segment(fmt, data, valid, gen, "all", rotation=fmt.rotation)
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
    _compare(query, [pages], dim ** -0.5)
