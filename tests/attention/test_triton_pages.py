"""Triton paged read == torch gather + dequantize + block-wise read, in Triton's CPU interpreter.

The reference is independent of the kernel: pages are gathered with plain indexing, dequantized
with :mod:`confkv.tiers.lowbit` and read by :func:`blockwise_attention`; the kernel reads the packed
storage itself (TRITON_INTERPRET=1, set before triton compiles anything).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from confkv.tiers import lowbit  # noqa: E402
from confkv.attention import KVSegment, attention_read, blockwise_attention  # noqa: E402
from confkv.attention import triton_pages, triton_read  # noqa: E402
from confkv.attention.segments import PagedSegment  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# the kernel runs interpreted on CPU tensors, or compiled on CUDA ones (TRITON_INTERPRET=0 on a GPU machine)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = [
    pytest.mark.skipif(not triton_read.triton_available(), reason="optional 'triton' package not installed"),
    pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                       reason="needs TRITON_INTERPRET=1 (CPU interpreter) or a CUDA GPU"),
    pytest.mark.usefixtures("one_thread"),
]
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors: interpreter run (TRITON_INTERPRET=1)")

DIM = 16
KV_HEADS = 2


def _storage(gen, bits, batch, pages, page, group, dim=DIM, heads=KV_HEADS, dtype=torch.float32):
    """Packed pages as ColdTier stores them, and the [B, H, N, P] valid mask (some padding slots)."""
    keys = torch.randn(batch, heads, pages, page, dim, generator=gen) * 2
    keys[..., 1] *= 6  # an outlier key channel, as KIVI's per-channel grouping expects
    values = torch.randn(batch, heads, pages, page, dim, generator=gen)
    valid = torch.rand(batch, 1, pages, page, generator=gen) > 0.2
    valid = valid.expand(batch, heads, pages, page).clone()
    if bits == 16:  # unquantized pages in the model's dtype
        return dict(keys=keys.to(dtype), values=values.to(dtype)), valid
    qk = lowbit.quantize_keys(keys, valid, bits, group)
    qv = lowbit.quantize_values(values, bits, group)
    return dict(key_codes=qk.codes, key_scale=qk.scale, key_min=qk.minimum,
                value_codes=qv.codes, value_scale=qv.scale, value_min=qv.minimum), valid


def _selection(gen, batch, pages, width, counts, heads=KV_HEADS, holes=False):
    """[B, H, K] page numbers (distinct per head, best first) with -1 past ``pages``."""
    index = torch.full((batch, heads, width), -1, dtype=torch.int64)
    for b in range(batch):
        for h in range(heads):
            chosen = torch.randperm(pages, generator=gen)[:width]
            index[b, h, :chosen.numel()] = chosen
    if holes:
        index[0, 0, 0] = -1
    return index, torch.tensor(counts, dtype=torch.int64)


def _reference_dense(paged: PagedSegment) -> KVSegment:
    """Gather with plain indexing, dequantize with lowbit: [B, H, K * P, D] float32 plus the visible mask."""
    batch, heads, width = paged.index.shape
    page, dim = paged.page_size, paged.head_dim
    keys = torch.zeros(batch, heads, width, page, dim)
    values = torch.zeros(batch, heads, width, page, dim)
    visible = torch.zeros(batch, heads, width, page, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for j in range(width):
                n = int(paged.index[b, h, j])
                if n < 0 or j >= int(paged.counts[b]):
                    continue
                visible[b, h, j] = paged.valid[b, h, n]
                if paged.bits == 16:
                    keys[b, h, j], values[b, h, j] = paged.keys[b, h, n].float(), paged.values[b, h, n].float()
                    continue
                qk = lowbit.Quantized(paged.key_codes[b, h, n], paged.key_scale[b, h, n], paged.key_min[b, h, n])
                qv = lowbit.Quantized(paged.value_codes[b, h, n], paged.value_scale[b, h, n],
                                      paged.value_min[b, h, n])
                keys[b, h, j] = lowbit.dequantize_keys(qk, paged.bits, dim, paged.group_size)
                values[b, h, j] = lowbit.dequantize_values(qv, paged.bits, dim, paged.group_size)
    shape = (batch, heads, width * page, dim)
    return KVSegment(keys.reshape(shape), values.reshape(shape), visible.reshape(batch, heads, 1, width * page))


def _check(gen, bits, page, group, ratio, counts, width, pages=5, queries=1, softcap=None, holes=False, split=16,
           dtype=torch.float32):
    batch = len(counts)
    storage, valid = _storage(gen, bits, batch, pages, page, group, dtype=dtype)
    index, count = _selection(gen, batch, pages, width, counts, holes=holes)
    paged = PagedSegment(index, count, valid, bits, group, DIM, **storage)
    hot = KVSegment(torch.randn(batch, KV_HEADS, 7, DIM, generator=gen),
                    torch.randn(batch, KV_HEADS, 7, DIM, generator=gen), None)
    query = torch.randn(batch, KV_HEADS * ratio, queries, DIM, generator=gen)
    scaling = DIM ** -0.5
    on_device = PagedSegment(index.to(DEVICE), count.to(DEVICE), valid.to(DEVICE), bits, group, DIM,
                             **{name: t.to(DEVICE) for name, t in storage.items()})
    hot_on_device = KVSegment(hot.keys.to(DEVICE), hot.values.to(DEVICE), None)
    out, mass = triton_read.triton_attention(query.to(DEVICE), [hot_on_device, on_device], scaling, softcap=softcap,
                                             split_size=split, block_n=16)
    ref_out, ref_mass = blockwise_attention(query, [hot, _reference_dense(paged)], scaling, softcap=softcap)
    torch.testing.assert_close(out.cpu(), ref_out, atol=3e-5, rtol=1e-4)
    assert mass[1].shape == (batch, KV_HEADS, width * page)  # what ColdTier.observe takes
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got.cpu(), want, atol=3e-5, rtol=1e-4)
    # the torch path of the same segment (PagedSegment.to_dense) agrees as well
    dense_out, _ = attention_read(query, [hot, paged], scaling, softcap=softcap, backend="torch")
    torch.testing.assert_close(dense_out, ref_out, atol=1e-5, rtol=1e-5)
    return out


# bits, page, group, Hq / Hkv, pages read per sequence (batch 2), K selected
CASES = [
    (2, 8, 4, 3, [3, 1], 3),
    (3, 16, 8, 1, [2, 1], 2),
    (4, 4, 2, 3, [4, 2], 4),
    (8, 8, 8, 1, [2, 2], 2),
    (16, 8, 4, 3, [3, 0], 3),
    (3, 4, 4, 3, [1, 2], 2),
]


@pytest.mark.parametrize("bits,page,group,ratio,counts,width", CASES)
def test_paged_read_matches_torch_reference(bits, page, group, ratio, counts, width):
    gen = torch.Generator().manual_seed(100 * bits + page)
    _check(gen, bits, page, group, ratio, counts, width)


def test_k_larger_than_the_pages_held_and_holes():
    """K = 4 ranks over 3 pages: the last rank is -1 (no page); a hole at rank 0; counts past K."""
    gen = torch.Generator().manual_seed(7)
    _check(gen, 4, 8, 8, 3, [9, 4], 4, pages=3, holes=True)


def test_k_zero_reads_only_the_hot_segments():
    gen = torch.Generator().manual_seed(8)
    out = _check(gen, 2, 8, 8, 1, [0, 0], 0)
    assert torch.isfinite(out).all()


def test_bfloat16_pages_at_16_bits():
    gen = torch.Generator().manual_seed(10)
    _check(gen, 16, 16, 16, 3, [2, 1], 2, dtype=torch.bfloat16)


def test_softcap_two_queries_and_several_splits():
    gen = torch.Generator().manual_seed(9)
    _check(gen, 3, 8, 4, 3, [5, 3], 5, pages=6, queries=2, softcap=5.0)  # 2 pages a split: 3 splits


# ------------------------------------------------------------------ through the store

def _tier(bits, heads=2, dim=DIM, page=8, tokens=44, batch=2, seed=0):
    from confkv.tiers.cold import ColdTier
    from confkv.config import ColdConfig

    gen = torch.Generator().manual_seed(seed)
    tier = ColdTier(ColdConfig(bits=bits, page_size=page, group_size=4 if bits != 16 else page, k_high=2, k_low=2))
    keys = torch.randn(batch, heads, tokens, dim, generator=gen)
    values = torch.randn(batch, heads, tokens, dim, generator=gen)
    positions = torch.arange(tokens).expand(batch, heads, tokens).clone()
    valid = torch.ones(batch, tokens, dtype=torch.bool)
    valid[1, :5] = False  # a left-padded second sequence
    for start in range(0, tokens, 9):
        end = min(start + 9, tokens)
        tier.demote(keys[:, :, start:end], values[:, :, start:end], positions[:, :, start:end], valid[:, start:end])
    return tier, gen


@interpreter_only
@pytest.mark.parametrize("bits", [3, 16])
def test_cold_tier_paged_segments_read_like_the_dense_ones(bits):
    tier, gen = _tier(bits)
    query = torch.randn(2, 6, 1, DIM, generator=gen)
    read = torch.tensor([3, 20])  # the second sequence reads more pages than the tier holds
    dense = tier.segments(query, read)
    dense_bytes, dense_selected = tier.bytes_read, tier._selected
    paged = tier.segments(query, read, paged=True)
    assert isinstance(paged[-1], PagedSegment) and tier.bytes_read == dense_bytes
    assert torch.equal(tier._selected, dense_selected)
    out, mass = attention_read(query, paged, 0.25, backend="triton")
    ref_out, ref_mass = attention_read(query, dense, 0.25, backend="torch")
    torch.testing.assert_close(out, ref_out, atol=3e-5, rtol=1e-4)
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)


@pytest.fixture
def paged_calls(monkeypatch) -> list:
    """One entry per call of the Triton paged kernel (the real one still runs)."""
    calls: list = []
    real = triton_pages.paged_partials
    monkeypatch.setattr(triton_pages, "paged_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@interpreter_only
def test_store_with_triton_backend_equals_torch_backend(paged_calls):
    """confkv-r on a tiny random model: the Triton read (pages packed) vs the torch read."""
    from confkv.config import StoreConfig
    from confkv.hf import ConfKVCache, generate
    from confkv.models import tiny_model

    model = tiny_model("llama", seed=3)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 250, (2, 48), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    results = {}
    for backend in ("torch", "triton"):
        cache = ConfKVCache.for_model(model, "confkv-r", store=StoreConfig(read_backend=backend), budget=24,
                                      protect=8, bits=4, page_size=8, group_size=4, k_high=2, k_low=3,
                                      promote=0.05)
        # one prefill chunk of 2 * 48 query rows: over triton_read.MAX_ROWS, so the prefill runs the
        # torch read (quick); the 5 decode steps run the interpreted kernels
        out = generate(model, ids, cache, chunk=48, max_new_tokens=5, do_sample=False, output_logits=True,
                       return_dict_in_generate=True, pad_token_id=258, attention_mask=mask)
        managed = [cache.layers[i].store for i in cache.managed]
        assert all(int(s.cold_counts().min()) > 0 for s in managed)  # pages were demoted and read
        results[backend] = (out.sequences, torch.stack(out.logits, 1),
                            [s.cold.pages["heat"].clone() for s in managed])
    assert paged_calls  # the triton run read its cold pages packed, through the paged kernel
    assert torch.equal(results["triton"][0], results["torch"][0])
    torch.testing.assert_close(results["triton"][1], results["torch"][1], atol=1e-4, rtol=1e-4)
    for got, want in zip(results["triton"][2], results["torch"][2]):  # observe() saw the same page mass
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@interpreter_only
def test_rotated_pages_reach_the_triton_read_packed_in_the_reads_basis(paged_calls):
    """``kivi+hadamard`` pages under the Triton read: the store folds the rotation into the query, the hot tier
    and the output, and hands the pages over packed in that basis (the Triton kernel takes no rotation of its
    own): the paged kernel runs, nothing falls back, and the logits are the torch read's."""
    from confkv import profiling
    from confkv.config import StoreConfig
    from confkv.hf import ConfKVCache
    from confkv.models import tiny_model

    model = tiny_model("llama", seed=3)
    ids = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(6))
    logits = {}
    for backend in ("torch", "triton"):
        cache = ConfKVCache.for_model(model, "kivi", store=StoreConfig(read_backend=backend), bits=4,
                                      format="hadamard", page_size=8, group_size=8, budget=8)
        with torch.no_grad():
            model(input_ids=ids[:, :32], cache=cache, use_cache=True)
            profiling.reset_fallbacks()
            steps = [model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1] for t in range(32, 40)]
        assert cache.layers[0].store.cold.num_pages >= 2
        logits[backend] = torch.cat(steps)
        if backend == "triton":
            assert paged_calls and "rotated pages (the Triton read takes none)" not in profiling.FALLBACKS
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
