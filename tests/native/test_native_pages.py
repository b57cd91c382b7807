"""The native read of packed KIVI cold pages (issue 32): confkv/native/c/pages.c, page_codes.c, page_tasks.c,
confkv/native/pages.py, the read plan (confkv/attention/read_plan.py) and its fallback counts.

The reference is the torch read the store ran before: gather and dequantize every selected page
(``PagedSegment.to_dense``), then the block-wise online-softmax read. Both sum in float32, in different
orders (the C read: one softmax over every slot, its denominators and weighted values summed per slice of
a unit's pages, dot products of one token row at a time; torch: bmm and its online rescaling), so they
agree to float32 rounding, not bit for bit: outputs to
``atol=2e-6, rtol=1e-5`` (values are O(1)), masses to ``atol=1e-6`` (masses are <= 1). The measured
differences are about 3e-7 and 5e-8.
"""

from __future__ import annotations

import pytest
import torch

from confkv import profiling
from confkv.attention import KVSegment, attention_read, read_plan
from confkv.attention.blockwise import blockwise_attention
from confkv.attention.segments import PagedSegment, densify
from confkv.native import page_entry
from confkv.native import pages as native_pages
from confkv.native.loader import available, disabled
from confkv.tiers import lowbit
from thread_counts import same_bits_at_one_and_two_threads, torch_threads

pytestmark = [pytest.mark.skipif(not available(), reason="no C compiler: the native kernels are unavailable"),
              pytest.mark.usefixtures("nan_filled_empty")]  # buffers to be overwritten start as NaN

OUT_TOL = dict(atol=2e-6, rtol=1e-5)
#: scores of size S carry S * 2^-24 of rounding into their weights: the bound where scores reach the tens
TENS_TOL = dict(atol=1e-4, rtol=1e-4)
MASS_TOL = dict(atol=1e-6, rtol=0.0)
BATCH, KV_HEADS, DIM, PAGE, GROUP, PAGES = 3, 2, 32, 8, 4, 5


def _pages(gen: torch.Generator, bits: int, reads: str) -> PagedSegment:
    """Five pages per sequence and KV head, about a fifth of the slots invalid; the selection by ``reads``:
    "none" (every sequence reads 0 of 3 ranks), "some" (3, 1 and 0 ranks, one rank -1), "all" (every page),
    "empty" (a width of 0)."""
    keys = torch.randn(BATCH, KV_HEADS, PAGES, PAGE, DIM, generator=gen) * 2 + 0.5
    values = torch.randn(BATCH, KV_HEADS, PAGES, PAGE, DIM, generator=gen)
    valid = torch.rand(BATCH, KV_HEADS, PAGES, PAGE, generator=gen) > 0.2
    qk = lowbit.quantize_keys(keys, valid, bits, GROUP)
    qv = lowbit.quantize_values(values, bits, GROUP)
    if reads == "all":
        index = torch.stack([torch.randperm(PAGES, generator=gen) for _ in range(BATCH * KV_HEADS)])
        index, counts = index.reshape(BATCH, KV_HEADS, PAGES), torch.full((BATCH,), PAGES)
    elif reads == "empty":
        index, counts = torch.zeros(BATCH, KV_HEADS, 0, dtype=torch.int64), torch.zeros(BATCH, dtype=torch.int64)
    else:
        index = torch.stack([torch.randperm(PAGES, generator=gen)[:3] for _ in range(BATCH * KV_HEADS)])
        index = index.reshape(BATCH, KV_HEADS, 3)
        index[0, 1, 1] = -1  # no page at this rank
        counts = torch.tensor([3, 1, 0]) if reads == "some" else torch.zeros(BATCH, dtype=torch.int64)
    return PagedSegment(index, counts, valid, bits, GROUP, DIM, key_codes=qk.codes, key_scale=qk.scale,
                        key_min=qk.minimum, value_codes=qv.codes, value_scale=qv.scale, value_min=qv.minimum)


def _hot(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> list[KVSegment]:
    """A hot tier with left padding (sequence 1 padded 2 slots, sequence 2 padded 5 of 7) and an open page
    with invalid slots, like a left-padded batch's store."""
    hot_len, open_len = 7, 6
    padding = torch.arange(hot_len)[None, :] >= torch.tensor([0, 2, 5])[:, None]  # [B, L]: True = a real token
    hot = KVSegment(torch.randn(BATCH, KV_HEADS, hot_len, DIM, generator=gen).to(dtype),
                    torch.randn(BATCH, KV_HEADS, hot_len, DIM, generator=gen).to(dtype), padding[:, None, None, :])
    open_valid = torch.rand(BATCH, open_len, generator=gen) > 0.3
    open_page = KVSegment(torch.randn(BATCH, KV_HEADS, open_len, DIM, generator=gen).to(dtype),
                          torch.randn(BATCH, KV_HEADS, open_len, DIM, generator=gen).to(dtype), open_valid[:, None, None, :])
    return [hot, open_page]


def _compare(query, segments, scaling=DIM ** -0.5, out_tol=OUT_TOL, mass_tol=MASS_TOL):
    out, mass = page_entry.page_read(query, segments, scaling)
    ref, ref_mass = blockwise_attention(query, densify(list(segments)), scaling)
    torch.testing.assert_close(out, ref, **out_tol)
    assert len(mass) == len(ref_mass)
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got, want, **mass_tol)
    return out, mass


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("reads", ["empty", "none", "some", "all"])
def test_the_native_page_read_equals_the_torch_read(bits, group, reads):
    gen = torch.Generator().manual_seed(bits * 100 + group * 10 + len(reads))
    segments = [*_hot(gen), _pages(gen, bits, reads)]
    query = torch.randn(BATCH, KV_HEADS * group, 1, DIM, generator=gen)
    _, mass = _compare(query, segments)
    pages = segments[-1]
    if reads in ("none", "empty"):
        assert float(mass[-1].abs().sum()) == 0.0
    else:  # every read slot took some mass, every slot not read none
        seen = pages.visible()[:, :, 0]
        assert bool((mass[-1][seen] > 0).all()) and float(mass[-1][~seen].abs().sum()) == 0.0


@pytest.mark.parametrize("length", [1, 17, 33])
def test_every_slot_of_a_segment_gets_its_mass_when_the_length_is_one_past_sixteen_slots(length):
    """The kernel sums each segment's slot masses 16 slots at a time (c/page_tasks.c, unit_finish); a segment of
    16k + 1 slots ends in a block of one slot, which a loop bound one short would leave at 0. Dense segments of 1,
    17 and 33 slots beside pages of 5 x 8 slots, 2 queries of 3 heads a KV head, masses against the torch read."""
    gen = torch.Generator().manual_seed(length)
    hot = KVSegment(torch.randn(BATCH, KV_HEADS, length, DIM, generator=gen),
                    torch.randn(BATCH, KV_HEADS, length, DIM, generator=gen), None)
    query = torch.randn(BATCH, KV_HEADS * 3, 2, DIM, generator=gen)
    _, mass = _compare(query, [hot, _pages(gen, 4, "all")])
    assert bool((mass[0][..., -1] > 0).all())  # the last slot of every sequence and head took some mass


def test_pages_alone_several_bit_widths_and_a_bfloat16_hot_tier():
    """A ladder's read: the open page and the hot tier in bfloat16, then rungs of 8, 4 and 3 bits."""
    gen = torch.Generator().manual_seed(7)
    segments = [*_hot(gen, torch.bfloat16), _pages(gen, 8, "all"), _pages(gen, 4, "some"), _pages(gen, 3, "all")]
    query = torch.randn(BATCH, KV_HEADS * 3, 1, DIM, generator=gen).to(torch.bfloat16)
    out, mass = page_entry.page_read(query, segments, DIM ** -0.5)
    ref, ref_mass = blockwise_attention(query, densify(segments), DIM ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=0)  # one bfloat16 rounding apart
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got, want, **MASS_TOL)


def _rotated_pages(gen: torch.Generator, bits: int, reads: str, rotation) -> PagedSegment:
    """:func:`_pages` whose codes are of ``k @ R``, ``v @ R`` (R = ``rotation.matrix``) and carry ``rotation``."""
    plain = _pages(gen, bits, reads)  # its selection and valid slots; the codes are made afresh
    keys = torch.randn(BATCH, KV_HEADS, PAGES, PAGE, DIM, generator=gen) * 2 + 0.5
    values = torch.randn(BATCH, KV_HEADS, PAGES, PAGE, DIM, generator=gen)
    qk = lowbit.quantize_keys(rotation.forward(keys), plain.valid, bits, GROUP)
    qv = lowbit.quantize_values(rotation.forward(values), bits, GROUP)
    return PagedSegment(plain.index, plain.counts, plain.valid, bits, GROUP, DIM, key_codes=qk.codes,
                        key_scale=qk.scale, key_min=qk.minimum, value_codes=qv.codes, value_scale=qv.scale,
                        value_min=qv.minimum, rotation=rotation)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("reads", ["none", "some", "all"])
def test_pages_in_a_rotation_are_read_packed_in_their_basis(bits, group, reads):
    """Pages coded in a Hadamard rotation (``kivi+hadamard``) beside plain pages and a padded hot tier: the
    kernel scores them with the query turned into their basis and turns their share of the output back,
    which is the torch read of the pages decoded back (``to_dense`` undoes the rotation)."""
    from confkv.tiers.hadamard import HadamardRotation

    gen = torch.Generator().manual_seed(bits * 10 + group + len(reads))
    rotation = HadamardRotation(DIM, seed=3)
    segments = [*_hot(gen), _pages(gen, 4, "some"), _rotated_pages(gen, bits, reads, rotation),
                _rotated_pages(gen, 3, "all", HadamardRotation(DIM, seed=3))]  # another rung: an equal rotation
    query = torch.randn(BATCH, KV_HEADS * group, 2, DIM, generator=gen)
    assert page_entry.unsupported(query, segments) is None
    assert read_plan.plan(query, segments, None, True, "triton") == read_plan.ReadPlan(
        "torch", "rotated pages (the Triton read takes none)")
    out, _ = _compare(query, segments)
    unturned = [*segments[:3], *(PagedSegment(**{**s.__dict__, "rotation": None}) for s in segments[3:])]
    wrong, _ = page_entry.page_read(query, unturned, DIM ** -0.5)  # the same codes read in the model's basis
    assert (wrong - out).abs().max() > 1e-2


def test_pages_in_two_different_rotations_are_not_read_natively():
    from confkv.tiers.hadamard import HadamardRotation

    gen = torch.Generator().manual_seed(11)
    segments = [*_hot(gen), _rotated_pages(gen, 4, "all", HadamardRotation(DIM, seed=1)),
                _rotated_pages(gen, 4, "all", HadamardRotation(DIM, seed=2))]
    query = torch.randn(BATCH, KV_HEADS, 1, DIM, generator=gen)
    assert page_entry.unsupported(query, segments) == "pages in different rotations"
    assert read_plan.plan(query, segments, None, True, "auto") == read_plan.ReadPlan("torch", "pages in different rotations")
    out, _ = attention_read(query, segments, DIM ** -0.5)  # the torch read decodes each page back
    ref, _ = blockwise_attention(query, densify(segments), DIM ** -0.5)
    torch.testing.assert_close(out, ref, **OUT_TOL)


def test_a_row_that_sees_nothing_reads_zero():
    gen = torch.Generator().manual_seed(3)
    hot = KVSegment(torch.randn(BATCH, KV_HEADS, 4, DIM, generator=gen), torch.randn(BATCH, KV_HEADS, 4, DIM, generator=gen),
                    torch.zeros(BATCH, 1, 1, 4, dtype=torch.bool))
    out, mass = _compare(torch.randn(BATCH, KV_HEADS, 1, DIM, generator=gen), [hot, _pages(gen, 4, "none")])
    assert float(out.abs().sum()) == 0.0 and all(float(m.abs().sum()) == 0.0 for m in mass)


def test_the_plan_names_the_path_and_why_it_left_the_native_one():
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(BATCH, KV_HEADS, 1, DIM, generator=gen)
    segments = [*_hot(gen), _pages(gen, 4, "some")]
    assert read_plan.plan(query, segments, None, True, "auto") == read_plan.ReadPlan("native_pages")
    assert read_plan.plan(query, segments, None, False, "auto") == read_plan.ReadPlan("native_pages")
    assert read_plan.plan(query, segments, 30.0, True, "auto") == read_plan.ReadPlan("torch", "softcap")
    assert read_plan.plan(query, segments, None, True, "torch").reason == "backend 'torch' asked"
    sixteen = PagedSegment(segments[-1].index, segments[-1].counts, segments[-1].valid, 16, GROUP, DIM,
                           keys=torch.zeros(BATCH, KV_HEADS, PAGES, PAGE, DIM),
                           values=torch.zeros(BATCH, KV_HEADS, PAGES, PAGE, DIM))
    assert read_plan.plan(query, [*segments[:2], sixteen], None, True, "auto") == read_plan.ReadPlan("torch", "16-bit pages")
    with disabled():
        assert read_plan.plan(query, segments, None, True, "auto") == read_plan.ReadPlan("torch", "native kernels unavailable")
        assert not read_plan.hands_pages(query, "auto")
    assert read_plan.hands_pages(query, "auto") and not read_plan.hands_pages(query, "torch")


def test_a_read_that_leaves_the_native_path_is_counted_with_its_reason():
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(BATCH, KV_HEADS, 1, DIM, generator=gen)
    segments = [*_hot(gen), _pages(gen, 2, "all")]
    timers = profiling.Timers()
    profiling.reset_fallbacks()
    with profiling.enabled(timers):
        fast, _ = attention_read(query, segments, DIM ** -0.5)  # native: not counted
        assert dict(timers.fallbacks) == {}
        slow, _ = attention_read(query, segments, DIM ** -0.5, softcap=1e6)  # a soft cap: the torch read
        with disabled():
            attention_read(query, segments, DIM ** -0.5)
    assert dict(timers.fallbacks) == {"softcap": 1, "native kernels unavailable": 1}
    assert profiling.FALLBACKS == timers.fallbacks
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)  # tanh(s / 1e6) * 1e6 ~ s


def _generate(model, ids, mask):
    from confkv.hf import ConfKVCache

    cache = ConfKVCache.for_model(model, memory=0.25)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=10, do_sample=False)
    return out[:, ids.shape[1]:]


def test_greedy_tokens_of_the_memory_preset_are_the_same_with_the_native_read_on_and_off(monkeypatch):
    """A tiny Llama (GQA 3), batch 3 with left padding, 300 tokens at memory=0.25: the ladder holds pages, the
    decode steps read them natively (every one of them: no fallback counted), and the tokens match the torch read."""
    from confkv.models.tiny import tiny_model

    model = tiny_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (3, 300), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    mask[2, :40] = 0
    reads = []
    real = native_pages._read  # the C call, under page_read and the store's PageReader alike
    monkeypatch.setattr(native_pages, "_read", lambda *a, **k: reads.append(1) or real(*a, **k))
    timers = profiling.Timers()
    with profiling.enabled(timers):
        native_tokens = _generate(model, ids, mask)
    layers = model.config.num_hidden_layers
    assert len(reads) == 9 * layers  # the 9 decode steps after the prefill, every layer
    assert set(timers.fallbacks) <= {"masked segment without packed pages"}  # the prefill (no pages yet)
    timers = profiling.Timers()
    with disabled(), profiling.enabled(timers):
        torch_tokens = _generate(model, ids, mask)
    assert len(reads) == 9 * layers
    assert timers.fallbacks["native kernels unavailable"] >= 9 * layers  # the store left the native path: counted
    assert torch.equal(native_tokens, torch_tokens)


def test_the_bench_breakdown_prints_the_fallback_counts():
    from confkv.eval.bench.output import format_breakdown

    breakdown = {"step_ms": 10.0, "sections_ms": {"attention read": 5.0}, "policy_work_ms": 1.0,
                 "policy_work_fraction": 0.1, "cache_overhead_ms": 2.0, "cache_overhead_fraction": 0.2,
                 "left_native": {"softcap": 60, "native kernels unavailable": 3}, "steps": 2}
    text = format_breakdown("tiered", breakdown)
    assert "reads that left the native path over 2 steps" in text
    assert "    60  softcap" in text and "     3  native kernels unavailable" in text
    assert "left the native path over 2 steps: none" in format_breakdown("x", {**breakdown, "left_native": {}})


def test_two_threads_give_the_same_bits_as_one():
    """Big enough for the worker pool: each (sequence, KV head) pair is computed as alone, so bit-equal."""
    gen = torch.Generator().manual_seed(6)
    segments = [*_hot(gen), _pages(gen, 8, "all"), _pages(gen, 4, "all"), _pages(gen, 3, "all")]
    query = torch.randn(BATCH, KV_HEADS * 3, 1, DIM, generator=gen)
    same_bits_at_one_and_two_threads(lambda: _compare(query, segments))


@pytest.mark.parametrize("page, dim, group", [(8, 32, 4), (64, 64, 64)])  # the row-by-row readers; the fast path
def test_scores_in_the_tens_are_read_as_the_torch_read(page, dim, group):
    """Attention scores of real models reach tens (a softmax that did not subtract each row's maximum first
    would overflow where a score plus the row's maximum passes 88): queries scaled up so that scores span about
    -60 to 60. A score of size S carries S * 2^-24 of rounding into its weight, so the bound is wider than
    elsewhere (1e-4), and still far below what an overflow gives (inf, NaN, or weights off by orders)."""
    gen = torch.Generator().manual_seed(page + dim)
    segments = [_pages_of(gen, 4, page, dim, group), _pages_of(gen, 8, page, dim, group)]
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen) * 7.0
    scores = torch.einsum("bhqd,bhld->bhql", query[:, ::3], densify(list(segments))[0].keys) * dim ** -0.5
    assert 48.0 < float(scores.abs().max()) < 100.0  # the range the test is about
    _compare(query, segments, dim ** -0.5, TENS_TOL, TENS_TOL)


def test_the_fast_path_gives_the_same_bits_at_two_threads_in_every_read():
    """The fast readers' work buffers (the query and weighted sum in plane order, the unpacked rows) are each
    task's own: tasks that shared them would give other bits only when two ran at once, so the read is repeated."""
    gen = torch.Generator().manual_seed(7)
    segments = [_pages_of(gen, 3, 64, 64, 64), _pages_of(gen, 4, 64, 64, 64)]
    query = torch.randn(BATCH, KV_HEADS * 3, 1, 64, generator=gen)
    same_bits_at_one_and_two_threads(lambda: page_entry.page_read(query, segments, 64 ** -0.5), repeats=20)


def test_a_mask_that_differs_per_kv_head_and_per_query_is_read_as_given():
    """The store's causal mask over its recent slots is [B, Hkv, Q, L]: each KV head keeps other positions, and
    each query of a prefill sees other slots. The kernel reads the mask by its head, query and slot strides."""
    gen = torch.Generator().manual_seed(12)
    queries, length = 3, 9
    visible = (torch.rand(BATCH, KV_HEADS, queries, 2 * length, generator=gen) > 0.4)[..., ::2]  # slots 2 apart
    visible[..., 0] = True  # every row sees a slot
    assert visible.stride(-1) == 2  # read by its strides, not as if contiguous
    assert not torch.equal(visible[:, 0], visible[:, 1]) and not torch.equal(visible[:, :, 0], visible[:, :, 1])
    hot = KVSegment(torch.randn(BATCH, KV_HEADS, length, DIM, generator=gen),
                    torch.randn(BATCH, KV_HEADS, length, DIM, generator=gen), visible)
    query = torch.randn(BATCH, KV_HEADS * 3, queries, DIM, generator=gen)
    _compare(query, [hot, _pages(gen, 4, "some")])


def _pages_of(gen: torch.Generator, bits: int, page: int, dim: int, group: int) -> PagedSegment:
    """Every page read, ``page`` slots of ``dim`` channels, KIVI groups of ``group`` (keys: slots of a page;
    values: channels, at most ``dim``)."""
    keys = torch.randn(BATCH, KV_HEADS, PAGES, page, dim, generator=gen) * 2 + 0.5
    values = torch.randn(BATCH, KV_HEADS, PAGES, page, dim, generator=gen)
    valid = torch.rand(BATCH, KV_HEADS, PAGES, page, generator=gen) > 0.2
    qk = lowbit.quantize_keys(keys, valid, bits, group)
    qv = lowbit.quantize_values(values, bits, group)
    index = torch.arange(PAGES).expand(BATCH, KV_HEADS, PAGES).contiguous()
    return PagedSegment(index, torch.full((BATCH,), PAGES), valid, bits, group, dim, key_codes=qk.codes,
                        key_scale=qk.scale, key_min=qk.minimum, value_codes=qv.codes, value_scale=qv.scale,
                        value_min=qv.minimum)


@pytest.mark.parametrize("page, dim, group", [(64, 64, 64), (8, 32, 8), (16, 128, 16)])
def test_the_side_data_of_slots_that_hold_no_token_is_never_used(page, dim, group):
    """A slot that holds no token keeps whatever its page's side data held (the vector readers read its codes and
    its value scale and minimum, 8 or 16 slots at a time): NaN there changes nothing in the read, which equals the
    read of the same pages with finite side data. (A reader that let a hidden slot's weight, zero, multiply its
    NaN value minimum would return NaN.)"""
    gen = torch.Generator().manual_seed(dim)
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
    pages = _pages_of(gen, 4, page, dim, group)
    out, mass = page_entry.page_read(query, [pages], dim ** -0.5)
    hidden = ~pages.valid  # [B, H, N, P]: the value side data is per slot and value group
    for name in ("value_scale", "value_min"):
        side = getattr(pages, name).clone()
        side[hidden] = float("nan")
        setattr(pages, name, side)
    again, mass_again = page_entry.page_read(query, [pages], dim ** -0.5)
    assert hidden.any() and not out.isnan().any()
    torch.testing.assert_close(again, out, atol=0.0, rtol=0.0)
    torch.testing.assert_close(mass_again[0], mass[0], atol=0.0, rtol=0.0)


@pytest.mark.parametrize("bits", [3, 8])
@pytest.mark.parametrize("group", [1, PAGE])
def test_the_smallest_and_the_largest_group_are_read_as_the_torch_read(bits, group):
    """A group of one slot / channel, and a group as long as the page (its value groups then 8 channels)."""
    gen = torch.Generator().manual_seed(bits + group)
    query = torch.randn(BATCH, KV_HEADS, 1, DIM, generator=gen)
    _compare(query, [*_hot(gen), _pages_of(gen, bits, PAGE, DIM, group)])


@pytest.mark.parametrize("page, dim, group", [(16, 32, 8), (16, 32, 4), (64, 64, 16)])  # plane order; the row-by-row
def test_a_key_group_with_one_valid_slot_at_either_end_is_read_with_its_own_scales(page, dim, group):  # ...; AVX-512
    """Each key group of slots has its own per-channel scale and minimum, loaded when any of its slots is valid. Here
    the groups hold no valid slot, only their first, only their last, or all, in turn (random validity almost never
    gives a group whose only valid slot is an end one), and each group's keys sit at their own offset: a reader
    that looks at too few slots before loading a group's scales reads the last group's instead."""
    gen = torch.Generator().manual_seed(page + group)
    groups = page // group
    keys = torch.randn(BATCH, KV_HEADS, PAGES, page, dim, generator=gen)
    keys = keys + 4.0 * torch.arange(groups).repeat_interleave(group)[:, None]  # a group's own range
    values = torch.randn(BATCH, KV_HEADS, PAGES, page, dim, generator=gen)
    pattern = torch.zeros(4, group, dtype=torch.bool)
    pattern[1, 0] = pattern[2, -1] = True  # none, first only, last only, all
    pattern[3] = True
    which = (torch.arange(PAGES * groups).reshape(PAGES, groups) + torch.arange(BATCH * KV_HEADS)[:, None, None]) % 4
    valid = pattern[which].reshape(BATCH, KV_HEADS, PAGES, page)
    qk = lowbit.quantize_keys(keys, valid, 3, group)
    qv = lowbit.quantize_values(values, 3, group)
    index = torch.arange(PAGES).expand(BATCH, KV_HEADS, PAGES).contiguous()
    pages = PagedSegment(index, torch.full((BATCH,), PAGES), valid, 3, group, dim, key_codes=qk.codes,
                         key_scale=qk.scale, key_min=qk.minimum, value_codes=qv.codes, value_scale=qv.scale,
                         value_min=qv.minimum)
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen) * 0.3  # 3 rows a unit: each row's slots hidden
    _compare(query, [pages], dim ** -0.5)


@pytest.mark.parametrize("page, dim, group", [
    (8, 32, 0),    # no group at all
    (8, 32, 16),   # the keys' group longer than the page (the values' 16 channels would divide 32)
    (16, 24, 16),  # the values' group does not divide the head (the keys' 16 slots would divide the page)
    (8, 32, 3),    # neither
])
def test_a_group_the_kernel_does_not_take_is_refused_before_any_read(page, dim, group):
    """The kernel checks each page segment's groups before it reads anything: a group it does not take is an
    error named by the wrapper, never a read of the wrong bytes (the codes below are for a valid group)."""
    gen = torch.Generator().manual_seed(7)
    pages = _pages_of(gen, 8, page, dim, 8 if page % 8 == 0 and dim % 8 == 0 else 1)
    pages.group_size = group
    query = torch.randn(BATCH, KV_HEADS, 1, dim, generator=gen)
    with pytest.raises(ValueError, match="group size or outlier storage is not one it takes"):
        page_entry.page_read(query, [pages], dim ** -0.5)
    with pytest.raises(ValueError, match="group size or outlier storage is not one it takes"):
        page_entry.reader_of(query, pages)  # asked which reader: none (and no division by a group of 0)


# The fast path (confkv/native/c/page_codes.c) reads segments whose value group is a multiple of 8: codes
# unpacked in plane order (or, with AVX-512 VBMI and a head of a multiple of 64 channels, in channel order, 64
# codes per multishift), a value block of 4 rows per pass. The cases: plane order (32 channels, groups of 8),
# a head that is not a multiple of 16 (the dot product's tail), channel order (64 and 128 channels, one and
# two value groups, and groups of 32), a value group of 264 channels (3-bit words unpacked 32 at a time: a
# second, partial run of them), plane order in three groups of 16 channels (48: plane order on every machine; a
# group of two 3-bit words, so each group's words start 3 x 2 bytes after the last), every bit width; pages of 8
# to 264 slots with about a fifth invalid, so that full and partial value blocks occur.
# With AVX-512 VBMI, heads of 64 to 256 channels in groups of 16, 32 and 64 go to the AVX-512 reader
# (c/page_simd.c: dequantization folded into the sums; one to eight value groups a row; 64 and 128 channels with
# the sums unrolled, 192 and 256 without).
FAST_SHAPES = [(8, 32, 8), (8, 24, 8), (64, 64, 64), (64, 128, 64), (32, 128, 32), (264, 264, 264), (16, 48, 16),
               (16, 128, 16), (48, 64, 16), (64, 192, 64), (64, 256, 64)]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("page, dim, group", FAST_SHAPES)
def test_the_fast_page_read_equals_the_torch_read(bits, page, dim, group):
    gen = torch.Generator().manual_seed(bits * 1000 + dim * 10 + group)
    query = torch.randn(BATCH, KV_HEADS * 3, 2, dim, generator=gen)
    hot = KVSegment(torch.randn(BATCH, KV_HEADS, 5, dim, generator=gen),
                    torch.randn(BATCH, KV_HEADS, 5, dim, generator=gen),
                    (torch.arange(5)[None, :] >= torch.tensor([0, 2, 4])[:, None])[:, None, None, :])
    pages = _pages_of(gen, bits, page, dim, group)
    pages.index[1, 0, 2] = -1  # a rank with no page
    pages.counts[2] = 3  # the last sequence reads 3 of its 5 ranks
    _compare(query, [hot, pages], dim ** -0.5)


@pytest.mark.parametrize("heads, queries", [(3, 2), (4, 2), (3, 3), (3, 4)])
def test_more_query_rows_than_the_avx512_value_sums_hold_are_read_as_the_torch_read(heads, queries):
    """The AVX-512 reader (c/page_simd.c) keeps a weight per query row and value group for a block of tokens, at
    most 64 of them. Heads of 128 channels in 8 value groups: 2 queries of 3 heads a KV head (6 rows, 48 weights)
    and of 4 heads (8 rows, 64 weights: every weight it holds, so a row loop one past writes beyond them) are read
    by it, 3 (72) and 4 (96) queries of 3 heads by the plane-order reader, and each as the torch read reads them."""
    gen = torch.Generator().manual_seed(queries * 10 + heads)
    query = torch.randn(BATCH, KV_HEADS * heads, queries, 128, generator=gen)
    _compare(query, [_pages_of(gen, 3, 16, 128, 16), _pages_of(gen, 4, 32, 128, 16)], 128 ** -0.5)


def _cpu_flags() -> set[str]:
    """This CPU's feature flags (the library is built with -march=native, so its vector readers follow them)."""
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    line = next((x for x in info.read_text().splitlines() if x.startswith("flags")), "") if info.exists() else ""
    return set(line.split(":", 1)[-1].split())


def _fast_reader(flags: set[str]) -> str | None:
    """The vector reader a library built for a CPU with ``flags`` has: "avx512" (AVX-512 VBMI and BW), "avx2"
    (AVX2, FMA and F16C without them), or None."""
    if {"avx512vbmi", "avx512bw"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else None


@pytest.mark.parametrize("page, dim, group, heads, queries, on_avx512, on_avx2", [
    (64, 64, 64, 3, 1, "avx512", "avx2"),              # the preset on SmolLM2: heads of 64, pages and groups of 64
    (64, 128, 64, 6, 1, "avx512", "avx2"),             # Qwen2.5-1.5B's heads: 128 channels, 6 query heads a KV head
    (64, 256, 64, 3, 1, "avx512", "avx2"),             # the widest head the vector readers take
    (64, 320, 64, 3, 1, "plane order", "plane order"),  # wider
    (16, 128, 16, 4, 2, "avx512", "avx2"),             # 8 query rows x 8 value groups: 64 weights a token, the most
    (16, 128, 16, 3, 3, "plane order", "plane order"),  # 9 x 8 = 72
    (8, 32, 8, 3, 1, "plane order", "avx2"),           # heads of 32 channels: AVX2 only (AVX-512: 64 a multishift)
    (8, 32, 4, 3, 1, "row by row", "row by row"),      # value groups of 4 channels
])
def test_each_page_shape_goes_to_the_reader_meant_for_it(page, dim, group, heads, queries, on_avx512, on_avx2):
    """The kernel's own dispatch (``confkv_page_reader``): the preset's pages go to the AVX-512 reader wherever the
    CPU has VBMI, else to the AVX2 reader where it has AVX2 (else to the plane-order one). Every reader reads as the
    torch read does (the tests above), so only this test sees a shape sent to a slower reader than it should be.
    ``heads``: query heads a KV head."""
    gen = torch.Generator().manual_seed(dim + group)
    query = torch.randn(BATCH, KV_HEADS * heads, queries, dim, generator=gen)
    fast = _fast_reader(_cpu_flags())
    want = on_avx512 if fast == "avx512" else on_avx2 if fast == "avx2" else on_avx2.replace("avx2", "plane order")
    assert page_entry.reader_of(query, _pages_of(gen, 3, page, dim, group)) == want


@pytest.mark.parametrize("page, dim, group", [(8, 32, 8), (64, 64, 64)])
def test_fast_pages_in_a_rotation_are_read_in_their_basis(page, dim, group):
    from confkv.tiers.hadamard import HadamardRotation

    gen = torch.Generator().manual_seed(dim + group)
    rotation = HadamardRotation(dim, seed=5)
    plain = _pages_of(gen, 3, page, dim, group)
    keys = torch.randn(BATCH, KV_HEADS, PAGES, page, dim, generator=gen) * 2 + 0.5
    values = torch.randn(BATCH, KV_HEADS, PAGES, page, dim, generator=gen)
    qk = lowbit.quantize_keys(rotation.forward(keys), plain.valid, 3, group)
    qv = lowbit.quantize_values(rotation.forward(values), 3, group)
    turned = PagedSegment(plain.index, plain.counts, plain.valid, 3, group, dim, key_codes=qk.codes,
                          key_scale=qk.scale, key_min=qk.minimum, value_codes=qv.codes, value_scale=qv.scale,
                          value_min=qv.minimum, rotation=rotation)
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
    _compare(query, [_pages_of(gen, 4, page, dim, group), turned], dim ** -0.5)


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
@pytest.mark.parametrize("flag, reader", [("-mno-avx512f", "avx2"), ("-mno-avx2", "plane order")])
def test_the_portable_builds_read_as_the_torch_read(tmp_path, flag, reader):
    """Built without AVX-512 (no VBMI unpacking, no vector dot product): on a CPU with AVX2 the AVX2 reader serves
    the preset's heads; built without AVX2 as well, the plane-order unpacking and the portable dot product serve
    every head. Each reads what the torch read reads, whichever CPU runs the tests."""
    from confkv.native import loader

    if reader == "avx2" and _fast_reader(_cpu_flags()) is None:
        reader = "plane order"  # a CPU without AVX2: its -march=native build has no AVX2 reader
    lib = loader.load(loader.build(tmp_path, [*loader.default_flags(), flag]))
    saved = loader._state.get("lib")
    loader._state["lib"] = lib
    try:
        for bits, (page, dim, group) in [(3, FAST_SHAPES[2]), (4, FAST_SHAPES[3]), (2, FAST_SHAPES[1]),
                                         (8, FAST_SHAPES[0])]:
            gen = torch.Generator().manual_seed(bits + dim)
            query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
            pages = _pages_of(gen, bits, page, dim, group)
            if dim % 32 == 0:  # (heads of 24 channels: the plane-order reader in every build)
                assert page_entry.reader_of(query, pages) == reader
            _compare(query, [pages, _pages_of(gen, 8, page, dim, group)], dim ** -0.5)
    finally:
        loader._state["lib"] = saved


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 5, 7, 9, 11])
def test_every_count_of_query_rows_is_read_as_the_torch_read(heads):
    """The vector readers add the values of 3 (AVX2) or 4 (AVX-512) query rows at a time, the rest in a block of
    their own: 1 to 7 query heads a KV head leave every remainder. The AVX2 scores take the rows in blocks of 8,
    3 at a time within one: 9 and 11 rows make a second block (of 1 and of 3)."""
    gen = torch.Generator().manual_seed(heads)
    query = torch.randn(BATCH, KV_HEADS * heads, 1, 64, generator=gen)
    _compare(query, [_pages_of(gen, 4, 64, 64, 64), _pages_of(gen, 3, 64, 64, 64)], 64 ** -0.5)


@pytest.mark.parametrize("high_head", [0, 1])
def test_each_unit_combines_the_maxima_of_its_own_slices(high_head):
    """Batch 1, 3 KV heads: each unit read in 4 slices. One KV head's scores sit near +56 and the others' near -56
    (keys with a positive mean, queries along it or against it), so a unit that took another unit's slice maxima
    would subtract a maximum over 100 above its scores: every exp would clamp at the same floor, and its weights
    would come out flat instead of following its scores. The high head first, then second: a unit that also took
    the next unit's maxima (one slice past its own) sees them only when the next unit's are the higher. Scores of
    size S carry S * 2^-24 of rounding into their weights, so the bound is that of the scores-in-the-tens test
    (1e-4; at 2e-6, 20 of 576 outputs missed by up to 8.3e-6 on one machine's AVX-512 VBMI path, the read right);
    flat weights miss it by orders."""
    gen = torch.Generator().manual_seed(9)
    dim, page, group, heads, count = 64, 64, 64, 3, 7
    keys = torch.randn(1, heads, count, page, dim, generator=gen) * 0.5 + 1.0
    values = torch.randn(1, heads, count, page, dim, generator=gen)
    valid = torch.ones(1, heads, count, page, dtype=torch.bool)
    qk, qv = lowbit.quantize_keys(keys, valid, 8, group), lowbit.quantize_values(values, 8, group)
    pages = PagedSegment(torch.arange(count).expand(1, heads, count).contiguous(), torch.tensor([count]), valid, 8,
                         group, dim, key_codes=qk.codes, key_scale=qk.scale, key_min=qk.minimum,
                         value_codes=qv.codes, value_scale=qv.scale, value_min=qv.minimum)
    sign = torch.full((heads,), -1.0)
    sign[high_head] = 1.0
    sign = sign.repeat_interleave(3)  # query heads 0-2 read KV head 0, ...
    query = 7.0 * sign[None, :, None, None] * torch.ones(1, heads * 3, 1, dim)
    query = query + torch.randn(1, heads * 3, 1, dim, generator=gen)
    _compare(query, [pages], dim ** -0.5, TENS_TOL, TENS_TOL)


@pytest.mark.parametrize("pages_per_segment", [(2, 7), (1, 12)])
def test_a_few_units_pages_are_read_in_slices_as_the_torch_read(pages_per_segment):
    """Batch 1 with 3 KV heads is 3 units: big enough, each unit's pages are read in 4 slices (page_tasks.c's
    page_parts), so a segment of 1 or 2 pages leaves slices empty and one of 7 or 12 splits unevenly; the
    dense hot tier goes to the first slice. The slices' sums and maxima combine to the torch read."""
    gen = torch.Generator().manual_seed(sum(pages_per_segment))
    dim, page, group, heads = 64, 64, 64, 3

    def segment(bits: int, count: int) -> PagedSegment:
        keys = torch.randn(1, heads, count, page, dim, generator=gen) * 2 + 0.5
        values = torch.randn(1, heads, count, page, dim, generator=gen)
        valid = torch.rand(1, heads, count, page, generator=gen) > 0.1
        qk, qv = lowbit.quantize_keys(keys, valid, bits, group), lowbit.quantize_values(values, bits, group)
        index = torch.stack([torch.randperm(count, generator=gen) for _ in range(heads)])[None]
        return PagedSegment(index, torch.tensor([count]), valid, bits, group, dim, key_codes=qk.codes,
                            key_scale=qk.scale, key_min=qk.minimum, value_codes=qv.codes, value_scale=qv.scale,
                            value_min=qv.minimum)

    hot = KVSegment(torch.randn(1, heads, 40, dim, generator=gen), torch.randn(1, heads, 40, dim, generator=gen), None)
    segments = [hot, segment(8, pages_per_segment[0]), segment(3, pages_per_segment[1])]
    query = torch.randn(1, heads * 3, 1, dim, generator=gen) * 3  # peaked: the row max matters
    with torch_threads(1):
        one, one_mass = _compare(query, segments, dim ** -0.5)
        torch.set_num_threads(2)
        two, two_mass = page_entry.page_read(query, segments, dim ** -0.5)
    assert torch.equal(one, two) and all(torch.equal(a, b) for a, b in zip(one_mass, two_mass))


@pytest.mark.parametrize("change", ["key bits 5", "value bits 5", "outliers without index", "outliers without values",
                                    "outliers without value index", "outliers without value values"])
def test_the_kernel_itself_refuses_pages_it_does_not_take(monkeypatch, change):
    """The wrapper checks widths before the C call (``unsupported``); the kernel checks again and returns 2 (a
    ValueError) instead of reading what it cannot: a width other than 2, 3, 4, 8 for keys or values, and pages
    that say they keep outliers (meta[35] > 0) with one of the four outlier tensors missing. The other three
    pointers are real tensors, so a kernel that read on would read them, and the missing one would crash it."""
    gen = torch.Generator().manual_seed(21)
    segments = [*_hot(gen), _pages(gen, 4, "all")]
    query = torch.randn(BATCH, KV_HEADS, 1, DIM, generator=gen)
    real = native_pages._paged
    stand_in = torch.zeros(64, dtype=torch.int64)

    def altered(segment, keep):
        ptrs, meta = real(segment, keep)
        if change == "key bits 5":
            meta[4] = 5
        elif change == "value bits 5":
            meta[33] = 5
        else:
            keep.append(stand_in)
            meta[35] = 1  # one outlier per page (its strides, meta[36..47], are zero: never read)
            missing = ["outliers without index", "outliers without values", "outliers without value index",
                       "outliers without value values"].index(change)
            ptrs[9:13] = [0 if i == missing else stand_in.data_ptr() for i in range(4)]
        return ptrs, meta

    monkeypatch.setattr(native_pages, "_paged", altered)
    with pytest.raises(ValueError, match="bits, group size or outlier storage"):
        page_entry.page_read(query, segments, DIM ** -0.5)


def test_a_read_too_big_for_memory_is_refused_not_attempted(monkeypatch):
    """A hot segment that says it holds 2^44 slots: the kernel's score buffer (64 TB) cannot be allocated, so it
    returns 1 (a MemoryError) before writing anything."""
    gen = torch.Generator().manual_seed(22)
    segments = [*_hot(gen), _pages(gen, 4, "all")]
    query = torch.randn(BATCH, KV_HEADS, 1, DIM, generator=gen)
    real = native_pages._dense

    def huge(segment, batch, kv_heads, queries, keep):
        ptrs, meta = real(segment, batch, kv_heads, queries, keep)
        meta[1] = 1 << 44
        return ptrs, meta

    monkeypatch.setattr(native_pages, "_dense", huge)
    with pytest.raises(MemoryError, match="out of memory"):
        page_entry.page_read(query, segments, DIM ** -0.5, need_mass=False)


@pytest.mark.parametrize("large_row", [0, 2])
def test_each_row_is_softmaxed_at_its_own_maximum(large_row):
    """One query row whose scores reach the hundreds beside rows of ordinary scores (GQA 3: three rows a unit):
    a row exponentiated at another row's maximum, or at 0, would overflow float32 (e^89) or underflow to nothing.
    The read must give the torch read's output and masses."""
    gen = torch.Generator().manual_seed(23)
    segments = [*_hot(gen), _pages(gen, 4, "all")]
    query = torch.randn(BATCH, KV_HEADS * 3, 1, DIM, generator=gen)
    query[:, large_row::3] *= 80.0  # the first (or last) query head of each KV head
    out, mass = page_entry.page_read(query, segments, DIM ** -0.5)
    ref, ref_mass = blockwise_attention(query, densify(list(segments)), DIM ** -0.5)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, **TENS_TOL)
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0.0)


@pytest.mark.parametrize("page, group", [(64, 32), (16, 8)])
def test_a_group_of_no_token_at_the_end_writes_no_score_past_its_slots(page, group):
    """The last key group of the last page holds no token (its slots hidden without reading a code), and the pages
    are the read's last segment, after a hot one: a reader that hid one slot too many would write -inf into the
    next query row's first score, the hot segment's first slot, which the torch read weighs."""
    gen = torch.Generator().manual_seed(page + group)
    dim = 64
    valid = torch.rand(BATCH, KV_HEADS, PAGES, page, generator=gen) > 0.2
    valid[:, :, -1, page - group:] = False  # every sequence's last group of its last page: no token
    valid[:, :, :, 0] = True  # (and each page's first slot one, so that no page is empty)
    keys = torch.randn(BATCH, KV_HEADS, PAGES, page, dim, generator=gen) * 2 + 0.5
    values = torch.randn(BATCH, KV_HEADS, PAGES, page, dim, generator=gen)
    qk, qv = lowbit.quantize_keys(keys, valid, 4, group), lowbit.quantize_values(values, 4, group)
    index = torch.arange(PAGES).expand(BATCH, KV_HEADS, PAGES).contiguous()
    pages = PagedSegment(index, torch.full((BATCH,), PAGES), valid, 4, group, dim, key_codes=qk.codes,
                         key_scale=qk.scale, key_min=qk.minimum, value_codes=qv.codes, value_scale=qv.scale,
                         value_min=qv.minimum)
    hot = KVSegment(torch.randn(BATCH, KV_HEADS, 5, dim, generator=gen), torch.randn(BATCH, KV_HEADS, 5, dim,
                                                                                     generator=gen), None)
    query = torch.randn(BATCH, KV_HEADS * 3, 1, dim, generator=gen)
    _compare(query, [hot, pages], dim ** -0.5)
