"""The native page read of pages whose key channels each have a width of their own (format ``channel_bits``,
confkv/tiers/channel_bits.py; confkv/native/c/page_widths.c), against the torch read (``PagedSegment.to_dense``,
which must equal the format's own ``decode``: test_native_page_formats.py checks it for these pages too), with
test_native_page_formats.py's pages and bounds.

Each was seen to fail with a bug put in by hand (then removed): the query turned for keys that are not rotated
(``m[32] == 1`` test dropped); the values left unrotated with the keys (the wrapper passing 1 for ``hadamard``);
the key group's scale reloaded only once a page; the wrapper passing no key widths (refused: falls to the torch
read); ``to_dense`` rotating the keys back; in the row-by-row read (pages not read by blocks, and the build without
AVX2), a code's second byte never read and each channel's first bit one channel late. In the block read
(page_widths.c's ``block_scores``): tokens 4-7 of a block shifted as tokens 0-3 (the half byte of odd widths
dropped); the second block read at the first's codes; the width-0 channels' minimums left out; one query row's sums
given to every row of a pass past the first 8; an outlier's correction of the wrong sign; the second block's slots
hidden by the first block's validity; every 8 scales of a float16 row loaded from its first 8 (pages.c's
``load_f16_row``); a page's outliers corrected in every key group, not only their own; the padded copy of a page never made (only
``make sanitize-native SANITIZER=address`` sees it: the bytes read past a page are masked off).
"""

from __future__ import annotations

import pytest
import torch

from confkv.attention import KVSegment, read_plan
from confkv.attention.blockwise import blockwise_attention
from confkv.attention.segments import PagedSegment, densify
from confkv.native import page_entry
from confkv.native.loader import available
from confkv.tiers import channel_bits
from confkv.tiers.formats import KiviFormat, parse_format
from test_native_page_formats import BATCH, KV_HEADS, PAGES, _compare, _encoded, _segment

pytestmark = [pytest.mark.skipif(not available(), reason="no C compiler: the native kernels are unavailable"),
              pytest.mark.usefixtures("nan_filled_empty")]

#: (page, head_dim, group): one key group a page and two (16, 32, 8; 8, 32, 4), a head of 24 channels, the preset's
SHAPES = [(8, 32, 4), (8, 24, 8), (16, 32, 8), (64, 64, 64)]
FORMATS = ["channel_bits", "outliers+channel_bits", "hadamard+outliers+channel_bits"]


def _hot(gen: torch.Generator, dim: int) -> KVSegment:
    """A dense segment with left padding (sequence b sees its last 5 - 2b slots)."""
    return KVSegment(torch.randn(BATCH, KV_HEADS, 5, dim, generator=gen),
                     torch.randn(BATCH, KV_HEADS, 5, dim, generator=gen),
                     (torch.arange(5)[None, :] >= torch.tensor([0, 2, 4])[:, None])[:, None, None, :])


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("page, dim, group", SHAPES)
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("reads, gqa", [("some", 3), ("all", 1)])
def test_pages_at_per_channel_widths_are_read_natively_as_the_torch_read(bits, page, dim, group, format, reads, gqa):
    """Every width, with and without outliers and a rotation of the values only; some pages (a rank with no page,
    a sequence reading none) or all; GQA 3 and 1; batch 3 with a left-padded dense segment beside."""
    gen = torch.Generator().manual_seed(bits * 100 + dim + group + len(format) + gqa)
    fmt = KiviFormat(bits, group, dim, parse_format(format), outlier_fraction=0.02)
    data, valid, _ = _encoded(gen, fmt, page, dim)
    assert data["key_widths"].float().std() > 0  # the channels do get different widths
    pages = _segment(fmt, data, valid, gen, reads, rotation=fmt.rotation)
    query = torch.randn(BATCH, KV_HEADS * gqa, 2, dim, generator=gen)
    segments = [_hot(gen, dim), pages]
    assert read_plan.plan(query, segments, None, True, "auto") == read_plan.ReadPlan("native_pages")
    assert page_entry.reader_of(query, pages) == "channel widths"
    _compare(query, segments, dim ** -0.5)


@pytest.mark.parametrize("bits, page, dim, group, gqa", [(2, 8, 20, 4, 3), (4, 20, 20, 10, 1), (3, 64, 64, 64, 9)])
@pytest.mark.parametrize("format", ["channel_bits", "outliers+channel_bits"])
def test_reads_not_by_blocks_and_rows_past_a_blocks_registers_are_read_as_the_torch_read(bits, page, dim, group, gqa, format):
    """Pages not read by blocks of 8 tokens (page_widths.c's block_scores): key groups of 4 tokens, pages of 20;
    and, by blocks, more query rows than a block keeps in registers (GQA 9 x 2 queries = 18 rows: passes of 8, 8
    and 2)."""
    gen = torch.Generator().manual_seed(bits + page + dim + gqa + len(format))
    fmt = KiviFormat(bits, group, dim, parse_format(format), outlier_fraction=0.03)
    data, valid, _ = _encoded(gen, fmt, page, dim)
    pages = _segment(fmt, data, valid, gen, "some")
    query = torch.randn(BATCH, KV_HEADS * gqa, 2, dim, generator=gen)
    assert page_entry.reader_of(query, pages) == "channel widths"
    _compare(query, [_hot(gen, dim), pages], dim ** -0.5)


@pytest.mark.parametrize("page, dim, group", SHAPES)
def test_a_ladder_of_rotated_kivi_pages_and_per_channel_widths_is_read_as_the_torch_read(page, dim, group):
    """One call over pages whose keys and values are rotated (``kivi+hadamard``: the query turned) and pages whose
    values only are (``hadamard+channel_bits``: the query as it is), in turn, with one rotation."""
    gen = torch.Generator().manual_seed(5 * dim + group)
    segments = []
    for bits, format in [(8, "hadamard"), (4, "hadamard+channel_bits"), (3, "hadamard"),
                         (2, "hadamard+outliers+channel_bits")]:
        fmt = KiviFormat(bits, group, dim, parse_format(format), outlier_fraction=0.03)
        data, valid, _ = _encoded(gen, fmt, page, dim)
        segments.append(_segment(fmt, data, valid, gen, "all" if bits % 2 else "some", rotation=fmt.rotation))
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
    assert len({id(s.rotation) for s in segments}) == 1
    _compare(query, segments, dim ** -0.5)


@pytest.mark.parametrize("width", [7, 8])  # 7: codes cross into the byte after the page's last, clamped to the last
@pytest.mark.parametrize("page, dim, group", [(8, 32, 4), (64, 64, 64)])
def test_widths_that_claim_more_bits_than_a_page_holds_read_inside_the_page(page, dim, group, width):
    """The widths come from memory the kernel is handed: widths summing past a page's bytes (every channel at 7 or
    8 bits in rows of fewer) are read with every byte index clamped to the page, as the torch unpacking clamps it,
    so both reads agree and nothing outside the page is read (``make sanitize-native``: with the low byte
    unclamped, AddressSanitizer reported a heap-buffer-overflow here). Such a page is never read by blocks."""
    gen = torch.Generator().manual_seed(page + dim)
    fmt = KiviFormat(2, group, dim, parse_format("channel_bits"))
    data, valid, _ = _encoded(gen, fmt, page, dim)
    data["key_widths"] = torch.full_like(data["key_widths"], width)
    assert width * dim > 8 * data["key_codes"].shape[-1]
    pages = _segment(fmt, data, valid, gen, "all")
    query = torch.randn(BATCH, KV_HEADS, 1, dim, generator=gen)
    out, (mass,) = page_entry.page_read(query, [pages], dim ** -0.5)
    ref, (ref_mass,) = blockwise_attention(query, densify([pages]), dim ** -0.5)
    # codes of up to 255 steps of a 2-bit scale: scores far larger than a real page's, bounds scaled to them
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mass, ref_mass, atol=1e-4, rtol=0)


@pytest.mark.parametrize("page, dim, group", [(16, 32, 8), (64, 64, 64)])
@pytest.mark.parametrize("gqa", [1, 3])  # 2 and 6 query rows: two blocks of 8 tokens at a time, and one
def test_pages_with_whole_blocks_of_empty_slots_are_read_as_the_torch_read(page, dim, group, gqa):
    """Partial pages (sealed early: their first tokens only), a page whose first 16 slots hold nothing (a
    left-padded sequence's first page), and one valid token after an empty block of 8, so that the block read
    meets blocks with no valid token beside blocks with some, alone and as the second of a pair."""
    gen = torch.Generator().manual_seed(page + dim + gqa)
    fmt = KiviFormat(3, group, dim, parse_format("outliers+channel_bits"), outlier_fraction=0.03)
    data, valid, _ = _encoded(gen, fmt, page, dim)
    valid[:, :, 0] = False
    valid[:, :, 0, :9] = True  # a block, then one token
    valid[:, :, 1] = True
    valid[:, :, 1, :16] = False  # two empty blocks, then full ones
    valid[:, :, 2] = False
    valid[:, :, 2, 8] = True  # an empty block, then one token, then nothing
    pages = _segment(fmt, data, valid, gen, "all")
    _compare(torch.randn(BATCH, KV_HEADS * gqa, 2, dim, generator=gen), [_hot(gen, dim), pages], dim ** -0.5)


@pytest.mark.parametrize("last", [1, 3])
def test_a_narrow_last_channel_at_the_end_of_a_page_is_read_as_the_torch_read(last):
    """Widths that use every bit of the page with a narrow channel last: its 8-byte reads pass the page's end, so
    the block read reads a padded copy of the page (``make sanitize-native SANITIZER=address`` on this test: no read
    outside the page); every code drawn at random below its width."""
    gen = torch.Generator().manual_seed(last)
    page, dim, group = 64, 32, 64
    fmt = KiviFormat(2, group, dim, parse_format("channel_bits"))
    data, valid, _ = _encoded(gen, fmt, page, dim)
    width_bytes = data["key_codes"].shape[-1]
    widths = torch.zeros(dim, dtype=torch.int64)
    widths[-1] = last
    left = 8 * width_bytes - last
    for d in range(dim - 1):  # the rest of the bits, 8 at most a channel, from the first channel on
        widths[d] = min(8, left)
        left -= widths[d]
    assert int(widths.sum()) == 8 * width_bytes and left == 0
    widths = widths.expand(*data["key_widths"].shape).contiguous()
    top = (2 ** widths[:, :, :, None, :]).expand(*data["key_codes"].shape[:-1], dim)
    codes = (torch.rand(top.shape, generator=gen) * top).floor()
    data["key_widths"] = widths.to(torch.uint8)
    data["key_codes"] = channel_bits.pack(codes, widths, width_bytes)
    data["key_scale"] = (data["key_scale"].float() / 64).to(data["key_scale"].dtype)  # codes up to 255: keys as wide
    assert torch.equal(channel_bits.unpack(data["key_codes"], widths), codes)
    pages = _segment(fmt, data, valid, gen, "all")
    _compare(torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen), [pages], dim ** -0.5)


def test_key_widths_change_the_read():
    """The read with the stored widths is far from the read of the same codes at widths shifted by one channel
    (so a kernel that ignored them, or read them one channel off, would fail the torch comparison above)."""
    gen = torch.Generator().manual_seed(9)
    page, dim, group = 64, 64, 64
    fmt = KiviFormat(3, group, dim, parse_format("channel_bits"))
    data, valid, _ = _encoded(gen, fmt, page, dim)
    pages = _segment(fmt, data, valid, gen, "all")
    query = torch.randn(BATCH, KV_HEADS, 1, dim, generator=gen) * 3.0
    out = _compare(query, [pages], dim ** -0.5)
    shifted = PagedSegment(**{**pages.__dict__, "key_widths": data["key_widths"].roll(1, -1), "native_args": None})
    moved, _ = page_entry.page_read(query, [shifted], dim ** -0.5)
    assert (moved - out).abs().max() > 1e-2


def test_pages_at_per_channel_widths_are_not_plain_pages():
    """The Triton read takes plain pages only (one width, no outliers): these go to the torch read there."""
    gen = torch.Generator().manual_seed(3)
    fmt = KiviFormat(2, 8, 32, parse_format("channel_bits"))
    data, valid, _ = _encoded(gen, fmt, 8, 32)
    pages = _segment(fmt, data, valid, gen, "all")
    assert not pages.plain
    assert channel_bits.row_bytes(2, 32, 8) == data["key_codes"].shape[-1]


def test_a_segment_with_widths_of_another_type_is_refused():
    gen = torch.Generator().manual_seed(4)
    fmt = KiviFormat(3, 8, 32, parse_format("channel_bits"))
    data, valid, _ = _encoded(gen, fmt, 8, 32)
    data["key_widths"] = data["key_widths"].to(torch.int32)
    pages = _segment(fmt, data, valid, gen, "all")
    with pytest.raises(ValueError, match="key widths must be uint8"):
        page_entry.page_read(torch.randn(BATCH, KV_HEADS, 1, 32, generator=gen), [pages], 0.2)


@pytest.mark.parametrize("params", [dict(memory=0.25, format="hadamard+outliers+channel_bits"),
                                    dict(memory=0.25, format="hadamard+channel_bits", ladder=(8, 4, 3, 2))])
def test_greedy_tokens_are_the_same_with_the_native_read_on_and_off(monkeypatch, params):
    """The memory preset with these pages on every rung (a tiny Llama, GQA 3, batch 3 with left padding, 300
    tokens): every decode step reads them natively (no read counted as leaving the native path but the
    prefill's), and the greedy tokens and logits are those of the torch read."""
    from confkv import profiling
    from confkv.hf import ConfKVCache
    from confkv.models.tiny import tiny_model
    from confkv.native import pages as native_pages
    from confkv.native.loader import disabled

    model = tiny_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (3, 300), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    mask[2, :40] = 0

    def generate():
        cache = ConfKVCache.for_model(model, **params)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        return out.sequences[:, ids.shape[1]:], torch.stack(out.scores), cache

    reads = []
    real = native_pages._read
    monkeypatch.setattr(native_pages, "_read", lambda *a, **k: reads.append(1) or real(*a, **k))
    timers = profiling.Timers()
    with profiling.enabled(timers):
        native_tokens, native_logits, cache = generate()
    assert len(reads) == 7 * model.config.num_hidden_layers
    assert set(timers.fallbacks) <= {"masked segment without packed pages", "no mass needed, not fused-eligible"}
    rungs = cache.trace.steps[-1].rung_tokens  # tokens on each rung, every layer (pages were read, and stepped down)
    assert sum(rungs[1:]) > 0
    with disabled():
        torch_tokens, torch_logits, _ = generate()
    assert torch.equal(native_tokens, torch_tokens)
    torch.testing.assert_close(native_logits, torch_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("page, dim, group", [(8, 24, 4), (64, 64, 64)])
def test_pages_at_per_channel_widths_give_the_same_bits_at_two_threads(page, dim, group):
    """Each task lays out a page's widths in its own work buffer (and sorts its outliers in its own scratch): a
    shared one would give other bits only when two tasks ran at once (``make sanitize-native SANITIZER=thread``
    reports it on the first read)."""
    from thread_counts import same_bits_at_one_and_two_threads

    gen = torch.Generator().manual_seed(page + dim + 1)
    segments = []
    for bits, format in [(2, "outliers+channel_bits"), (3, "channel_bits")]:
        fmt = KiviFormat(bits, group, dim, parse_format(format), outlier_fraction=0.03)
        data, valid, _ = _encoded(gen, fmt, page, dim)
        segments.append(_segment(fmt, data, valid, gen, "all"))
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
    same_bits_at_one_and_two_threads(lambda: page_entry.page_read(query, segments, dim ** -0.5), repeats=10)
    _compare(query, segments, dim ** -0.5)


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="-mno-avx2 is an x86 flag")
def test_a_build_without_avx2_reads_these_pages_as_the_torch_read(tmp_path, monkeypatch):
    """Built without AVX2 and FMA (no block read: each code read from its two bytes, the row dequantized and scored
    as the row-by-row reader scores it): what an older CPU runs."""
    from confkv.native import loader

    plain = loader.build(tmp_path, [*loader.default_flags(), "-mno-avx512f", "-mno-avx2", "-mno-fma"])
    monkeypatch.setitem(loader._state, "lib", loader.load(plain))
    for format in ("channel_bits", "hadamard+outliers+channel_bits"):
        test_pages_at_per_channel_widths_are_read_natively_as_the_torch_read(3, 64, 64, 64, format, "some", 3)
        test_pages_at_per_channel_widths_are_read_natively_as_the_torch_read(2, 8, 32, 4, format, "all", 1)
