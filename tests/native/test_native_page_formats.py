"""The native page read of the cold tier's richer formats (issues 31 and 32): keys and values at two widths, and
outliers kept apart (confkv/tiers/outliers.py), written over each dequantized row in the kernel
(confkv/native/c/pages.c's sort_outliers / restore_outliers, used by the row-by-row and the plane-order readers), or
added as corrections after the packed read (the AVX2 reader).

Pages are encoded by the format itself (:class:`~confkv.tiers.formats.KiviFormat`), handed over as the cold tier
hands them (:meth:`~confkv.tiers.cold_read.PageRead._paged`'s fields), and read against the torch reference
(``PagedSegment.to_dense``, which must equal the format's own ``decode``), with test_native_pages.py's bounds
(the absolute output bound scaled by the 4x value row, ``OUT_TOL``).

Each was seen to fail with a bug put in by hand (then removed): the value codes read at the key width (either
reader); the outliers not written (keys or values, either reader); an outlier written at its channel instead of
its plane position; the rows of a counting sort off by one; an index's row from the wrong shift or divisor; the
value readers given the key codes' plane order; the wrapper passing no outliers; ``to_dense`` decoding values at
the key width; the page pointers of a segment not padded to the kernel's stride (a ladder's read). In the AVX2
reader's outliers (c/page_avx2.c, corrections after the packed read): a key outlier's correction of the wrong sign;
a value outlier's entry at its token's first value group; a 3-bit code's second byte never read; an index that a
later entry repeats corrected twice (no marks); pages with outliers refused by the AVX2 reader (the reader test).
"""

from __future__ import annotations

import pytest
import torch

from confkv.attention import KVSegment, read_plan
from confkv.attention.blockwise import blockwise_attention
from confkv.attention.segments import OUTLIER_STORAGE, PagedSegment, densify
from confkv.native import page_entry
from confkv.native import pages as native_pages
from confkv.native.loader import available
from confkv.tiers.formats import KiviFormat, parse_format
from thread_counts import same_bits_at_one_and_two_threads

pytestmark = [pytest.mark.skipif(not available(), reason="no C compiler: the native kernels are unavailable"),
              pytest.mark.usefixtures("nan_filled_empty")]  # buffers to be overwritten start as NaN

#: test_native_pages.py's bounds, the absolute one scaled by 4: a page's middle value row is 4x the others here, so
#: float32 summation-order noise is too (2.2e-6 seen on an AVX-512 VBMI machine, at 2-bit keys and 4-bit values)
OUT_TOL = dict(atol=8e-6, rtol=1e-5)
MASS_TOL = dict(atol=1e-6, rtol=0.0)
BATCH, KV_HEADS, PAGES = 3, 2, 5
WIDTHS = [(4, 2), (2, 4), (3, 8), (8, 3), (4, 4)]
#: the row-by-row readers (value groups of 4 channels) and the fast ones (plane order at 32 and 24 channels;
#: channel order with AVX-512 VBMI at 64), each also at a head of 24 channels (not a power of two: an index's row
#: by a division, not a shift); (16, 32, 8): the fast readers with two key groups a page (each group's scales)
SHAPES = [(8, 32, 4), (8, 24, 4), (8, 32, 8), (8, 24, 8), (16, 32, 8), (64, 64, 64)]


def _encoded(gen: torch.Generator, fmt: KiviFormat, page: int, dim: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Pages of keys with a few large channels (what outliers are for), about a fifth of the slots invalid."""
    keys = torch.randn(BATCH, KV_HEADS, PAGES, page, dim, generator=gen)
    keys[..., :3] *= 4.0
    values = torch.randn(BATCH, KV_HEADS, PAGES, page, dim, generator=gen)
    values[..., page // 2, :] *= 4.0
    valid = torch.rand(BATCH, KV_HEADS, PAGES, page, generator=gen) > 0.2
    positions = torch.arange(PAGES * page).reshape(PAGES, page).expand(BATCH, KV_HEADS, PAGES, page)
    return fmt.encode(keys, values, valid, positions), valid, positions


def _segment(fmt: KiviFormat, data: dict, valid: torch.Tensor, gen: torch.Generator, reads: str = "some",
             rotation=None) -> PagedSegment:
    """The cold tier's hand-over of ``data``: a selection of pages ("some": ranks 3, 1 and 0 of 3, one rank
    with no page; "all": every page in a random order)."""
    if reads == "all":
        index = torch.stack([torch.randperm(PAGES, generator=gen) for _ in range(BATCH * KV_HEADS)])
        index, counts = index.reshape(BATCH, KV_HEADS, PAGES), torch.full((BATCH,), PAGES)
    else:
        index = torch.stack([torch.randperm(PAGES, generator=gen)[:3] for _ in range(BATCH * KV_HEADS)])
        index = index.reshape(BATCH, KV_HEADS, 3)
        index[0, 1, 1] = -1
        counts = torch.tensor([3, 1, 0])
    storage = {name: data[name] for name in fmt.storage}
    value_bits = fmt.widths["value"]
    return PagedSegment(index, counts, valid, fmt.bits, fmt.group_size, fmt.head_dim, **storage, rotation=rotation,
                        value_bits=None if value_bits == fmt.bits else value_bits)


def _compare(query, segments, scaling):
    out, mass = page_entry.page_read(query, segments, scaling)
    ref, ref_mass = blockwise_attention(query, densify(list(segments)), scaling)
    torch.testing.assert_close(out, ref, **OUT_TOL)
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got, want, **MASS_TOL)
    return out


@pytest.mark.parametrize("key_bits, value_bits", WIDTHS)
@pytest.mark.parametrize("page, dim, group", SHAPES)
@pytest.mark.parametrize("format", ["kivi", "kivi+outliers", "kivi+hadamard+outliers+clip"])
def test_pages_of_two_widths_and_outliers_are_read_natively_as_the_torch_read(key_bits, value_bits, page, dim,
                                                                              group, format):
    gen = torch.Generator().manual_seed(key_bits * 100 + value_bits * 10 + dim + len(format))
    fmt = KiviFormat(key_bits, group, dim, parse_format(format), outlier_fraction=0.02, value_bits=value_bits)
    data, valid, _ = _encoded(gen, fmt, page, dim)
    pages = _segment(fmt, data, valid, gen, "some", rotation=fmt.rotation)
    hot = KVSegment(torch.randn(BATCH, KV_HEADS, 5, dim, generator=gen),
                    torch.randn(BATCH, KV_HEADS, 5, dim, generator=gen),
                    (torch.arange(5)[None, :] >= torch.tensor([0, 2, 4])[:, None])[:, None, None, :])
    query = torch.randn(BATCH, KV_HEADS * 3, 2, dim, generator=gen)
    segments = [hot, pages]
    assert read_plan.plan(query, segments, None, True, "auto") == read_plan.ReadPlan("native_pages")
    _compare(query, segments, dim ** -0.5)


@pytest.mark.parametrize("page, dim, group", SHAPES)
@pytest.mark.parametrize("gqa", [3, 1])
def test_a_ladder_of_plain_and_outlier_pages_of_several_widths_is_read_as_the_torch_read(page, dim, group, gqa):
    """A ladder's read: segments of plain pages and pages with outliers or two widths, in turn (each segment's
    pointers and meta at their own offsets, whatever the segment before them held); with one query row per KV
    head too (GQA 1), where a task's work buffers sit closest to its query rows, which every segment reads again."""
    gen = torch.Generator().manual_seed(7 * dim + group)
    segments = []
    for bits, value_bits, format in [(8, 8, "kivi"), (4, 2, "outliers"), (4, 4, "kivi"), (3, 3, "outliers"),
                                     (2, 4, "kivi")]:
        fmt = KiviFormat(bits, group, dim, parse_format(format), outlier_fraction=0.03, value_bits=value_bits)
        data, valid, _ = _encoded(gen, fmt, page, dim)
        segments.append(_segment(fmt, data, valid, gen, "all" if bits % 2 else "some"))
    query = torch.randn(BATCH, KV_HEADS * gqa, 1, dim, generator=gen)
    _compare(query, segments, dim ** -0.5)


@pytest.mark.parametrize("bits, value_bits, format", [(4, 2, "hadamard+outliers"),
                                                      (3, None, "hadamard+outliers+channel_bits")])
@pytest.mark.parametrize("page, dim, group", SHAPES)
def test_the_reference_read_is_the_formats_own_decode(page, dim, group, bits, value_bits, format):
    """``to_dense`` (the torch read of a PagedSegment) gives what the format decodes: two widths, outliers and
    the rotation undone; per-channel key widths (``channel_bits``: the keys left unrotated). Every page read, so its
    slots are the pages in rank order."""
    gen = torch.Generator().manual_seed(dim + group)
    fmt = KiviFormat(bits, group, dim, parse_format(format), outlier_fraction=0.02, value_bits=value_bits)
    data, valid, positions = _encoded(gen, fmt, page, dim)
    pages = _segment(fmt, data, valid, gen, "all", rotation=fmt.rotation)
    keys, values = fmt.decode(data, positions)
    dense = pages.to_dense()
    order = pages.index[..., None, None].expand(-1, -1, -1, page, dim)
    shape = (BATCH, KV_HEADS, PAGES * page, dim)
    torch.testing.assert_close(dense.keys, keys.gather(2, order).reshape(shape), atol=1e-5, rtol=0)
    torch.testing.assert_close(dense.values, values.gather(2, order).reshape(shape), atol=1e-5, rtol=0)


@pytest.mark.parametrize("page, dim, group", SHAPES)
def test_outliers_change_the_read_and_are_written_where_their_index_says(page, dim, group):
    """The read with the outliers is the torch read with them, and far from the read of the same codes without
    them (so a kernel that skipped them, or wrote them at another row or channel, would fail the first check)."""
    gen = torch.Generator().manual_seed(3 * dim + group)
    fmt = KiviFormat(2, group, dim, parse_format("outliers"), outlier_fraction=0.05)
    data, valid, _ = _encoded(gen, fmt, page, dim)
    pages = _segment(fmt, data, valid, gen, "all")
    query = torch.randn(BATCH, KV_HEADS, 1, dim, generator=gen) * 3.0
    out = _compare(query, [pages], dim ** -0.5)
    bare = PagedSegment(**{**pages.__dict__, **{name: None for name in OUTLIER_STORAGE}})
    without, _ = page_entry.page_read(query, [bare], dim ** -0.5)
    assert (without - out).abs().max() > 1e-2


@pytest.mark.parametrize("group", [4, 8])  # the row-by-row readers, the fast ones
def test_outliers_in_any_order_and_on_invalid_rows_are_read_as_the_torch_read(group):
    """Outliers come in the order the picking returns them (not sorted), and value outliers may sit on padding
    rows (every value entry can be picked): here they are shuffled and some moved onto invalid rows, one key and
    one value correction there infinite, which the native read must leave unread. Every page also keeps one at flat
    index 0 (its first row's first channel), the edge of the kernel's range check."""
    gen = torch.Generator().manual_seed(21 + group)
    page, dim = 8, 32
    fmt = KiviFormat(3, group, dim, parse_format("outliers"), outlier_fraction=0.05)
    data, valid, _ = _encoded(gen, fmt, page, dim)
    for which in ("key", "value"):
        index, value = data[f"{which}_outlier_index"], data[f"{which}_outlier_value"]
        has_zero = (index == 0).any(-1)
        index[..., 0] = torch.where(has_zero, index[..., 0], torch.zeros_like(index[..., 0]))
        value[..., 0] = torch.where(has_zero, value[..., 0], torch.full_like(value[..., 0], -9.0))
        order = torch.randperm(index.shape[-1], generator=gen)
        data[f"{which}_outlier_index"], data[f"{which}_outlier_value"] = index[..., order], value[..., order]
    invalid_row = (~valid).float().argmax(-1)  # [B, H, N] a padding row of each page (0 when none)
    padded = (~valid).any(-1)
    data["value_outlier_index"][..., 0] = (invalid_row * dim + 5).to(torch.int16)
    # a page handed over may hold anything on a padding row: the native read leaves an infinite correction there
    # unread (the torch read takes it up, 0 * inf: it is held to the same pages with a correction of 0 there)
    unread = {name: t.clone() for name, t in data.items()}
    for which, slot in (("value", 1), ("key", 1)):
        for pages_data, correction in ((data, float("inf")), (unread, 0.0)):
            index, value = pages_data[f"{which}_outlier_index"], pages_data[f"{which}_outlier_value"]
            index[..., slot] = torch.where(padded, (invalid_row * dim + 7).to(torch.int16), index[..., slot])
            value[..., slot] = torch.where(padded, torch.tensor(correction, dtype=torch.float16), value[..., slot])
    assert padded.any()
    pages = _segment(fmt, data, valid, torch.Generator().manual_seed(3), "all")
    same = _segment(fmt, unread, valid, torch.Generator().manual_seed(3), "all")
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
    out, mass = page_entry.page_read(query, [pages], dim ** -0.5)
    want, want_mass = _compare(query, [same], dim ** -0.5), page_entry.page_read(query, [same], dim ** -0.5)[1]
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    for got, expected in zip(mass, want_mass):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("format", ["outliers", "hadamard+outliers+clip", "hadamard+outliers+channel_bits"])
def test_on_an_avx2_cpu_pages_with_outliers_take_the_avx2_reader(format):
    """Where the preset's plain pages take the AVX2 reader (a CPU with AVX2 and not AVX-512 VBMI), pages with
    outliers do too (their values, and their keys unless at per-channel widths), the outliers added after the
    packed read as corrections (c/page_avx2.c); the tests above hold that read to the torch read."""
    gen = torch.Generator().manual_seed(len(format))
    plain = KiviFormat(2, 8, 32, parse_format("kivi"))
    data, valid, _ = _encoded(gen, plain, 16, 32)
    query = torch.randn(BATCH, KV_HEADS * 3, 1, 32, generator=gen)
    if page_entry.reader_of(query, _segment(plain, data, valid, gen, "all")) != "avx2":
        pytest.skip("this CPU's plain pages are not read by the AVX2 reader")
    fmt = KiviFormat(3, 8, 32, parse_format(format), outlier_fraction=0.05)
    data, valid, _ = _encoded(gen, fmt, 16, 32)
    pages = _segment(fmt, data, valid, gen, "all", rotation=fmt.rotation)
    assert read_plan.plan(query, [pages], None, True, "auto") == read_plan.ReadPlan("native_pages")
    assert page_entry.reader_of(query, pages) == ("channel widths" if "channel_bits" in format else "avx2")
    _compare(query, [pages], 32 ** -0.5)


@pytest.mark.parametrize("page, dim, group", [(8, 32, 4), (8, 24, 4), (8, 32, 8), (8, 24, 8), (64, 64, 64)])
def test_an_outlier_index_outside_its_page_is_left_out(page, dim, group):
    """Stored indices are always inside their page, but the kernel reads them from memory it is handed: an index
    of -1 or of P * D (one past the page) is left out, as if that entry were a correction of 0 to another entry of
    the page (adding nothing), never added into a neighbouring row's or buffer's place."""
    gen = torch.Generator().manual_seed(page + dim + group)
    fmt = KiviFormat(3, group, dim, parse_format("outliers"), outlier_fraction=0.05)
    data, valid, _ = _encoded(gen, fmt, page, dim)
    reference = {name: t.clone() for name, t in data.items()}
    for which in ("key", "value"):  # each tensor both edges: -1 and P * D, on both of its readers' paths
        for slot, bad in ((1, page * dim), (2, -1)):
            index, value = data[f"{which}_outlier_index"], data[f"{which}_outlier_value"]
            index[..., slot], value[..., slot] = bad, 1000.0
            reference[f"{which}_outlier_index"][..., slot] = reference[f"{which}_outlier_index"][..., 0]
            reference[f"{which}_outlier_value"][..., slot] = 0.0
    pages = _segment(fmt, data, valid, torch.Generator().manual_seed(1), "all")
    same = _segment(fmt, reference, valid, torch.Generator().manual_seed(1), "all")
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
    out, _ = page_entry.page_read(query, [pages], dim ** -0.5)
    want = _compare(query, [same], dim ** -0.5)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_a_segment_with_half_its_outlier_storage_is_refused():
    gen = torch.Generator().manual_seed(5)
    fmt = KiviFormat(4, 8, 32, parse_format("outliers"), outlier_fraction=0.05)
    data, valid, _ = _encoded(gen, fmt, 8, 32)
    pages = _segment(fmt, data, valid, gen, "all")
    pages.value_outlier_value = None
    with pytest.raises(ValueError, match="outliers need all of"):
        pages.validate()


def test_the_triton_plan_leaves_pages_of_two_widths_or_with_outliers_to_the_torch_read():
    gen = torch.Generator().manual_seed(6)
    query = torch.randn(BATCH, KV_HEADS, 1, 32, generator=gen)
    reason = "pages of two widths or with outliers (the Triton read takes neither)"
    for fmt in (KiviFormat(4, 8, 32, value_bits=2), KiviFormat(4, 8, 32, parse_format("outliers"))):
        data, valid, _ = _encoded(gen, fmt, 8, 32)
        pages = _segment(fmt, data, valid, gen, "all")
        assert not pages.plain
        assert read_plan.plan(query, [pages], None, True, "triton") == read_plan.ReadPlan("torch", reason)
    plain = KiviFormat(4, 8, 32)
    data, valid, _ = _encoded(gen, plain, 8, 32)
    assert _segment(plain, data, valid, gen, "all").plain


@pytest.mark.parametrize("policy, params", [
    (None, dict(memory=0.25, format="hadamard+outliers")),  # the preset's 8/4/3 ladder, every rung with outliers
    ("kivi", dict(bits=4, value_bits=2, group_size=16, page_size=16, budget=32, sinks=4,
                  format="hadamard+outliers+clip")),  # issue 31's 3-bit-bytes format
])
def test_greedy_tokens_are_the_same_with_the_native_read_on_and_off(monkeypatch, policy, params):
    """A tiny Llama (GQA 3), batch 3 with left padding, 300 tokens: the cold pages (outliers, and keys and values at
    two widths) are read natively at every decode step (no read counted as leaving the native path but the
    prefill's), and the greedy tokens are those of the torch read."""
    from confkv import profiling
    from confkv.hf import ConfKVCache
    from confkv.models.tiny import tiny_model
    from confkv.native.loader import disabled

    model = tiny_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (3, 300), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    mask[2, :40] = 0

    def generate():
        cache = ConfKVCache.for_model(model, policy, **params)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False)
        return out[:, ids.shape[1]:]

    reads = []
    real = native_pages._read  # the C call, under page_read and the store's PageReader alike
    monkeypatch.setattr(native_pages, "_read", lambda *a, **k: reads.append(1) or real(*a, **k))
    timers = profiling.Timers()
    with profiling.enabled(timers):
        native_tokens = generate()
    assert len(reads) == 7 * model.config.num_hidden_layers  # the decode steps after the prefill, every layer
    prefill = {"masked segment without packed pages", "no mass needed, not fused-eligible"}  # no pages yet
    assert set(timers.fallbacks) <= prefill
    with disabled():
        torch_tokens = generate()
    assert torch.equal(native_tokens, torch_tokens)


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
def test_the_portable_build_reads_a_ladder_of_two_widths_and_outliers_as_the_torch_read(tmp_path, monkeypatch):
    """Built without AVX-512 (no VBMI unpacking, the plain C dot product that scores pages with outliers): what a
    CPU without AVX-512 runs. The ladder of the test above, every reader's shape, both GQA widths."""
    from confkv.native import loader

    portable = loader.build(tmp_path, [*loader.default_flags(), "-mno-avx512f"])
    monkeypatch.setitem(loader._state, "lib", loader.load(portable))
    for page, dim, group in SHAPES:
        for gqa in (3, 1):
            test_a_ladder_of_plain_and_outlier_pages_of_several_widths_is_read_as_the_torch_read(page, dim, group, gqa)


@pytest.mark.parametrize("page, dim, group", [(8, 24, 4), (64, 64, 64)])  # the row-by-row readers; the fast ones
def test_pages_with_outliers_give_the_same_bits_at_two_threads(page, dim, group):
    """Each task sorts and patches a page's outliers in scratch of its own (after its float work buffer): tasks
    that shared it would give other bits only when two ran at once, so the read is repeated. Under
    ``make sanitize-native SANITIZER=thread`` (the pool's chunks split statically) a shared scratch is a race
    reported on the first read. The second segment keeps more outliers a page than the first: the scratch is
    sized by the segment that needs the most."""
    gen = torch.Generator().manual_seed(page + dim)
    segments = []
    for bits, value_bits, fraction in [(4, 2, 0.01), (3, 3, 0.05)]:
        fmt = KiviFormat(bits, group, dim, parse_format("outliers"), outlier_fraction=fraction, value_bits=value_bits)
        data, valid, _ = _encoded(gen, fmt, page, dim)
        segments.append(_segment(fmt, data, valid, gen, "all"))
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
    same_bits_at_one_and_two_threads(lambda: page_entry.page_read(query, segments, dim ** -0.5), repeats=10)
    _compare(query, segments, dim ** -0.5)


def test_segments_of_two_page_sizes_with_outliers_are_read_at_two_threads_as_at_one():
    """Each task's outlier scratch is sized by the segment that needs the most (a page's rows dequantized whole:
    page x dim floats): here the second segment's pages are 8x the first's, so scratch sized by the first would
    spill into the next task's buffers, which another thread is using (seen under ThreadSanitizer)."""
    gen = torch.Generator().manual_seed(11)
    dim, segments = 64, []
    for page, group in [(8, 8), (64, 64)]:
        fmt = KiviFormat(4, group, dim, parse_format("outliers"), outlier_fraction=0.02)
        data, valid, _ = _encoded(gen, fmt, page, dim)
        segments.append(_segment(fmt, data, valid, gen, "all"))
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
    same_bits_at_one_and_two_threads(lambda: page_entry.page_read(query, segments, dim ** -0.5))
    _compare(query, segments, dim ** -0.5)
