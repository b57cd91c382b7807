"""One shared prefill (TeePolicy) then fork per policy == each policy prefilled alone."""

import pytest
import torch

from confkv.config import StoreConfig
from confkv.hf import ConfKVCache, prefill
from confkv.models import tiny_model
from confkv.policies import make_policy
from confkv.policies.tee import TeePolicy

MEMBERS = [("window", {"budget": 24, "protect": 4}), ("streaming", {"budget": 24, "sinks": 2, "protect": 4}),
           ("h2o", {"budget": 24, "protect": 4}), ("tova", {"budget": 24, "protect": 4}),
           ("confkv", {"n_high": 12, "n_low": 24, "protect": 6, "sinks": 2}),
           ("scissorhands", {"budget": 24, "protect": 4})]


def _query_aware(model, cache, ids, chunk):
    cache.evict = False
    logits = prefill(model, cache, ids, chunk=chunk)
    cache.evict = True
    return logits


def _state(cache):
    """Per layer: positions and keys of every kept slot, in slot order."""
    out = []
    for layer in cache.layers:
        store = layer.store
        out.append([(r.positions.clone(), r.keys.clone(), {k: v.clone() for k, v in r.stats.items()})
                    for r in (store.old, store.recent)])
    return out


@pytest.mark.parametrize("arch,int8", [("llama", False), ("qwen2", False), ("llama", True), ("gemma3", False), ("gemma3", True)])
def test_fork_after_shared_prefill_equals_separate_runs(arch, int8):
    torch.manual_seed(0)
    model = tiny_model(arch)
    ids = torch.randint(5, model.config.vocab_size, (2, 70))
    store = StoreConfig(kv_int8=int8, fp_window=8)
    policies = [make_policy(name, **params) for name, params in MEMBERS]
    shared = ConfKVCache.for_model(model, TeePolicy.of(policies), store=store)
    with torch.no_grad():
        logits = _query_aware(model, shared, ids, chunk=16)
    for index, policy in enumerate(policies):
        alone = ConfKVCache.for_model(model, policy, store=store)
        with torch.no_grad():
            alone_logits = _query_aware(model, alone, ids, chunk=16)
        # same computation; the old/recent split differs (FP window = widest protect), so
        # the block-wise read sums in another order: equal to float rounding
        torch.testing.assert_close(logits, alone_logits, rtol=0, atol=1e-6)
        fork = shared.fork(index)
        assert fork.policy is policy and fork.trace.steps == shared.trace.steps
        for cache in (fork, alone):
            cache.end_step(logits)
        for a_layer, b_layer in zip(_state(fork), _state(alone)):
            for (pa, ka, sa), (pb, kb, sb) in zip(a_layer, b_layer):
                assert torch.equal(pa, pb)  # the same tokens kept, in the same slots
                if ka.dtype == torch.int8:  # quantised from keys equal up to rounding: codes may differ by one step
                    assert (ka.int() - kb.int()).abs().max() <= 1
                else:  # later layers' keys come from reads summed in another order (gemma3: ~1.4e-6)
                    torch.testing.assert_close(ka, kb, rtol=0, atol=1e-5)
                assert sa.keys() == sb.keys()
                for name in sa:
                    torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=1e-6)
        assert fork.kv_bytes() == alone.kv_bytes()
        with torch.no_grad():
            out_fork = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=fork,
                                      do_sample=False, max_new_tokens=4, pad_token_id=0)
            out_alone = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=alone,
                                       do_sample=False, max_new_tokens=4, pad_token_id=0)
        assert torch.equal(out_fork, out_alone), policy.name


def test_forks_are_independent_and_tee_never_evicts():
    torch.manual_seed(1)
    model = tiny_model("llama")
    ids = torch.randint(5, model.config.vocab_size, (1, 50))
    shared = ConfKVCache.for_model(model, TeePolicy.of((make_policy("h2o", budget=20, protect=4),
                                                     make_policy("confkv", n_high=10, n_low=20, protect=4))))
    with torch.no_grad():
        logits = prefill(model, shared, ids, chunk=50)
    assert shared.kept_counts().min() == 50  # unlimited budget
    before = [layer.store.old.stats["0.acc"].clone() for layer in shared.layers if layer.store.old.length]
    first = shared.fork(0)
    first.end_step(logits)
    with torch.no_grad():
        model(input_ids=ids[:, :1], cache=first, use_cache=True)  # updates the fork's statistics in place
    after = [layer.store.old.stats["0.acc"] for layer in shared.layers if layer.store.old.length]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert shared.kept_counts().min() == 50


def test_fork_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="TeePolicy"):
        ConfKVCache.for_model(model, "h2o", budget=20, protect=4).fork(0)
    tee = ConfKVCache.for_model(model, TeePolicy.of((make_policy("window", budget=20, protect=4),)))
    with pytest.raises(ValueError, match="out of range"):
        tee.fork(1)
    with pytest.raises(ValueError, match="non-empty"):
        TeePolicy.of(())
