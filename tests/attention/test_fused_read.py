"""The fused CPU read == the dense reference, and the dispatch only uses it where it is exact."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from confkv.attention import KVSegment, attention_read
from confkv.attention.blockwise import blockwise_attention, dense_attention_reference
from confkv.attention.fused_cpu import fused_attention, fused_read_available, fused_read_eligible
from confkv.config import StoreConfig
from confkv.hf import ConfKVCache
from confkv.models import tiny_model
from segment_cases import make_segment, unmasked_segments

pytestmark = pytest.mark.skipif(not fused_read_available(), reason="this torch build has no fused CPU attention")


@pytest.mark.parametrize("lengths", [[37], [64, 5], [0, 40, 3], [1, 1, 1]])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("num_queries", [1, 4])
def test_fused_equals_dense_reference(lengths, group, num_queries):
    segments = unmasked_segments(lengths, num_queries=num_queries)
    query = torch.randn(2, 3 * group, num_queries, 16, generator=torch.Generator().manual_seed(1))
    assert fused_read_eligible(query, segments, None, need_mass=False)
    out = fused_attention(query, segments, 0.25)
    reference, _ = dense_attention_reference(query, segments, 0.25)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_fused_bfloat16_matches_blockwise():
    segments = unmasked_segments([300, 20], dtype=torch.bfloat16)
    query = torch.randn(2, 9, 1, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    fused = fused_attention(query, segments, 0.25)
    blockwise, _ = blockwise_attention(query, segments, 0.25, need_mass=False)
    assert fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), blockwise.float(), atol=2e-2, rtol=2e-2)


def test_ineligible_reads_are_not_fused():
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(1, 3, 1, 8)
    plain = [make_segment(gen, 1, 3, 10, 8, 1, False, "none")]
    assert fused_read_eligible(query, plain, None, need_mass=False)
    assert not fused_read_eligible(query, plain, None, need_mass=True)  # the policy needs the mass
    assert not fused_read_eligible(query, plain, 30.0, need_mass=False)  # soft-capping
    assert not fused_read_eligible(query, [make_segment(gen, 1, 3, 10, 8, 1, True, "none")], None, False)  # INT8
    assert not fused_read_eligible(query, [make_segment(gen, 1, 3, 10, 8, 1, False, "random")], None, False)
    assert not fused_read_eligible(query, [make_segment(gen, 1, 3, 0, 8, 1, False, "none")], None, False)
    assert not fused_read_eligible(query.to(torch.bfloat16), plain, None, False)  # dtype mismatch


def test_dispatch_falls_back_and_forced_fused_refuses():
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(1, 6, 1, 8)
    masked = [make_segment(gen, 1, 3, 12, 8, 1, False, "random")]
    out, mass = attention_read(query, masked, 0.3, need_mass=False, backend="auto")  # block-wise
    reference, _ = dense_attention_reference(query, masked, 0.3)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="backend 'fused' needs"):
        attention_read(query, masked, 0.3, need_mass=False, backend="fused")
    plain = [make_segment(gen, 1, 3, 12, 8, 1, False, "none")]
    out, mass = attention_read(query, plain, 0.3, need_mass=True, backend="auto")  # mass: block-wise
    assert mass is not None and mass[0].shape == (1, 3, 12)


@pytest.mark.parametrize("policy,params", [("full", {}), ("window", {"budget": 64})])
def test_fused_and_blockwise_store_reads_agree_and_match_dynamic_cache(policy, params, monkeypatch):
    """Batch 1, no padding: decode reads take the fused path under "auto", never under "torch"."""
    from confkv.attention import fused_cpu

    calls = []
    original = fused_cpu.fused_attention
    monkeypatch.setattr(fused_cpu, "fused_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = tiny_model("llama", seed=8)
    ids = torch.randint(0, 250, (1, 24), generator=torch.Generator().manual_seed(9))
    runs = {}
    for backend in ("auto", "torch"):
        calls.clear()
        cache = ConfKVCache.for_model(model, policy, store=StoreConfig(read_backend=backend), **params)
        out = model.generate(ids, max_new_tokens=10, do_sample=False, cache=cache, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=258)
        runs[backend] = (out.sequences, torch.stack(out.logits, 1))
        layers = model.config.num_hidden_layers
        assert len(calls) == (9 * layers if backend == "auto" else 0)  # 9 decode steps; the prompt is masked
    reference = model.generate(ids, max_new_tokens=10, do_sample=False, cache=DynamicCache(config=model.config),
                               output_logits=True, return_dict_in_generate=True, pad_token_id=258)
    for sequences, logits in runs.values():
        assert torch.equal(sequences, reference.sequences)
        torch.testing.assert_close(logits, torch.stack(reference.logits, 1), atol=1e-4, rtol=1e-4)
