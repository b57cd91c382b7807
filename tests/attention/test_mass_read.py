"""The few-op read with attention mass == the block-wise read (output and mass), and the dispatch."""

from __future__ import annotations
import pytest
import torch
from confkv import native
from confkv.attention import attention_read
from confkv.attention.blockwise import blockwise_attention, dense_attention_reference
from confkv.attention.mass_read import MAX_SCORES, mass_read, mass_read_eligible
from confkv.config import StoreConfig
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from segment_cases import make_segment, unmasked_segments
from confkv.attention import KVSegment


@pytest.mark.parametrize("lengths", [[37], [64, 5], [0, 40, 3], [1, 1, 1]])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("num_queries", [1, 4])
def test_mass_read_equals_the_block_wise_read(lengths, group, num_queries):
    segments = unmasked_segments(lengths, num_queries=num_queries)
    query = torch.randn(2, 3 * group, num_queries, 16, generator=torch.Generator().manual_seed(1))
    assert mass_read_eligible(query, segments, None)
    out, mass = mass_read(query, segments, 0.25)
    ref_out, ref_mass = blockwise_attention(query, segments, 0.25, need_mass=True)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    assert [m.shape for m in mass] == [m.shape for m in ref_mass] == [(2, 3, n) for n in lengths]
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # the mass of every query row sums to 1 over all slots; summed over Q queries to Q
    total = sum(m.sum(-1) for m in mass)
    torch.testing.assert_close(total, torch.full((2, 3), float(num_queries)), atol=1e-5, rtol=0)


def test_mass_by_hand_on_one_head():
    """Two slots, one KV head, a group of two query heads: softmax of the scaled dot products, averaged."""
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]])  # [1, 1, 2, 2]
    values = torch.tensor([[[[10.0, 0.0], [0.0, 10.0]]]])
    query = torch.tensor([[[[1.0, 1.0]], [[2.0, 0.0]]]])  # [1, 2 heads, 1, 2]
    from confkv.attention import KVSegment

    out, (mass,) = mass_read(query, [KVSegment(keys, values, None)], 0.5)
    p0 = torch.softmax(torch.tensor([0.5, 1.0]), 0)  # head 0: q.k = 1, 2
    p1 = torch.softmax(torch.tensor([1.0, 0.0]), 0)  # head 1: q.k = 2, 0
    torch.testing.assert_close(mass[0, 0], (p0 + p1) / 2)
    torch.testing.assert_close(out[0, 0, 0], 10 * p0)
    torch.testing.assert_close(out[0, 1, 0], 10 * p1)


def test_bfloat16_segments_read_in_float32():
    segments = unmasked_segments([300, 20], dtype=torch.bfloat16)
    query = torch.randn(2, 9, 1, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out, mass = mass_read(query, segments, 0.25)
    ref_out, ref_mass = blockwise_attention(query, segments, 0.25, need_mass=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out)  # both round the same float32 result to bfloat16
    for got, want in zip(mass, ref_mass):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_only_unmasked_full_precision_reads_are_eligible():
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(1, 3, 1, 8)
    plain = [make_segment(gen, 1, 3, 10, 8, 1, False, "none")]
    assert mass_read_eligible(query, plain, None)
    assert not mass_read_eligible(query, plain, 30.0)  # soft-capping
    assert not mass_read_eligible(query, [make_segment(gen, 1, 3, 10, 8, 1, True, "none")], None)  # INT8
    assert not mass_read_eligible(query, [make_segment(gen, 1, 3, 10, 8, 1, False, "random")], None)  # masked
    assert not mass_read_eligible(query, [make_segment(gen, 1, 3, 0, 8, 1, False, "none")], None)  # empty
    wide = torch.randn(1, 3, MAX_SCORES // (3 * 10) + 1, 8)
    assert not mass_read_eligible(wide, plain, None)  # too many scores at once


def test_dispatch_uses_it_for_the_mass_and_keeps_the_reference_otherwise(monkeypatch):
    import confkv.attention.read_plan as attention  # the read and the names it calls

    monkeypatch.setattr(native, "mass_read", lambda *a: None)  # the torch one (native: tests/native/test_native_kernels.py)
    calls = []
    monkeypatch.setattr(attention, "mass_read", lambda *a: calls.append(1) or mass_read(*a))
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(1, 6, 1, 8)
    plain = [make_segment(gen, 1, 3, 12, 8, 1, False, "none")]
    out, mass = attention_read(query, plain, 0.3, need_mass=True, backend="auto")
    assert calls == [1] and mass[0].shape == (1, 3, 12)
    reference, _ = dense_attention_reference(query, plain, 0.3)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    attention_read(query, plain, 0.3, need_mass=True, backend="torch")  # the reference, as asked
    masked = [make_segment(gen, 1, 3, 12, 8, 1, False, "random")]
    attention_read(query, masked, 0.3, need_mass=True, backend="auto")
    assert calls == [1]


@pytest.mark.parametrize("policy,params", [("h2o", {"budget": 20, "protect": 4}), ("tova", {"budget": 20}),
                                           ("confkv", {"n_high": 16, "n_low": 24, "protect": 4})])
def test_a_mass_ranked_policy_evicts_the_same_tokens_with_either_read(policy, params, monkeypatch):
    """The store's decode reads take the mass read under "auto"; the kept tokens and the logits
    equal those of the block-wise read ("torch")."""
    import confkv.attention.read_plan as attention  # the read and the names it calls

    monkeypatch.setattr(native, "mass_read", lambda *a: None)  # the torch one (native: tests/native/test_native_kernels.py)
    calls = []
    monkeypatch.setattr(attention, "mass_read", lambda *a: calls.append(1) or mass_read(*a))
    model = tiny_model("llama", seed=8)
    ids = torch.randint(0, 250, (1, 24), generator=torch.Generator().manual_seed(9))
    runs = {}
    for backend in ("auto", "torch"):
        cache = ConfKVCache.for_model(model, policy, store=StoreConfig(read_backend=backend), **params)
        out = model.generate(ids, max_new_tokens=16, do_sample=False, cache=cache, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=258)
        kept = [torch.cat([r.positions.masked_fill(~r.valid[:, None], -1) for r in (s.old, s.recent)], -1)
                for s in (layer.store for layer in cache.layers)]
        runs[backend] = (out.sequences, torch.stack(out.logits, 1), kept)
        assert len(calls) == (15 * model.config.num_hidden_layers if backend == "auto" else 0)
        calls.clear()
    assert torch.equal(runs["auto"][0], runs["torch"][0])
    torch.testing.assert_close(runs["auto"][1], runs["torch"][1], atol=1e-5, rtol=1e-5)
    for auto, torch_read in zip(runs["auto"][2], runs["torch"][2]):
        assert torch.equal(auto.sort(-1).values, torch_read.sort(-1).values)  # the same tokens kept
    assert max(int((k[0, 0] >= 0).sum()) for k in runs["auto"][2]) < 24 + 16  # tokens were evicted


# ---------------------------------------------------------------------------------------------------
# The few-op read's dispatch rule and its error, checked against hand-worked limits.
#
# Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md). The size
# checks use expanded zero tensors: their shapes are large but they own one element, so
# no score row is ever materialised.


def _segment(length: int, kv_heads: int = 1, head_dim: int = 4) -> KVSegment:
    zero = torch.zeros(1, 1, 1, 1).expand(1, kv_heads, length, head_dim)
    return KVSegment(zero, zero, None)


def _query(batch: int, heads: int, queries: int, dtype: torch.dtype = torch.float32,
           device: str = "cpu") -> torch.Tensor:
    return torch.zeros(1, 1, 1, 1, dtype=dtype, device=device).expand(batch, heads, queries, 4)


@pytest.mark.parametrize("batch, heads, queries", [(1, 2, 1), (1, 1, 2), (2, 1, 1), (2, 2, 2)])
def test_the_score_limit_counts_batch_times_heads_times_queries_times_slots(batch, heads, queries):
    """B * Hq * Q * L scores: exactly MAX_SCORES still fits, one slot more does not."""
    rows = batch * heads * queries
    fits = MAX_SCORES // rows  # slots in total, split over two segments
    assert mass_read_eligible(_query(batch, heads, queries), [_segment(fits - 5), _segment(5)], None)
    assert not mass_read_eligible(_query(batch, heads, queries), [_segment(fits - 4), _segment(5)], None)


def test_only_a_floating_point_query_on_the_cpu_is_eligible():
    segments = [_segment(3)]
    assert mass_read_eligible(_query(1, 1, 1), segments, None)
    assert not mass_read_eligible(_query(1, 1, 1, dtype=torch.int64), segments, None)
    assert not mass_read_eligible(_query(1, 1, 1, device="meta"), segments, None)
    assert not mass_read_eligible(_query(1, 1, 1), segments, 30.0)  # a soft-cap takes the block-wise read


def test_query_heads_not_a_multiple_of_the_kv_heads_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^Hq=4 is not a multiple of Hkv=3$"):
        mass_read(torch.zeros(1, 4, 1, 4), [_segment(2, kv_heads=3)], 0.5)
