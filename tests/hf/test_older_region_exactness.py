"""Exactness once tokens have aged into the older region (FP and INT8), every architecture.

With ``protect=4`` and ``move_block=4`` (INT8: ``fp_window=6``) tokens leave the recent FP
window after a few steps, so most of a 48-token sequence is read from the older region. The
reference is transformers' own forward pass / ``DynamicCache``: full precision must match it
to float noise; INT8 must stay within INT8 error, far below what dropping the older region
costs.
"""

import pytest
import torch
from transformers import DynamicCache

from confkv.config import StoreConfig
from confkv.hf import ConfKVCache
from confkv.models import SUPPORTED_TINY_ARCHS, tiny_model

LENGTH = 48
POLICIES = {"full": {"protect": 4}, "confkv": {"n_high": 200, "n_low": 400, "protect": 4, "sinks": 1}}


def _store(int8: bool) -> StoreConfig:
    return StoreConfig(kv_int8=True, fp_window=6, move_block=4) if int8 else StoreConfig(move_block=4)


def _step_logits(model, cache, ids):
    with torch.no_grad():
        return torch.stack([model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1]
                            for t in range(ids.shape[1])], 1)


def _older_region_holds_most(cache) -> None:
    for layer_idx in cache.managed:
        store = cache.layers[layer_idx].store
        assert store.old.length >= LENGTH - 10 and store.old.length + store.recent.length == LENGTH


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("int8", [False, True], ids=["fp", "int8"])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_step_loop_matches_one_forward_pass(arch, policy, int8, asymmetric):
    model = tiny_model(arch, seed=5, asymmetric=asymmetric)
    ids = torch.randint(0, 250, (2, LENGTH), generator=torch.Generator().manual_seed(6))
    # a truncated run: each token sees only the last 6 (the FP window), what ignoring the older region gives
    band = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril() & ~torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(-6)
    with torch.no_grad():  # before the model is switched to confkv attention (which builds its own causal mask)
        reference = model(ids).logits
        truncated = model(ids, attention_mask=torch.zeros(LENGTH, LENGTH).masked_fill(~band, -1e9)[None, None]).logits
    cache = ConfKVCache.for_model(model, policy, store=_store(int8), **POLICIES[policy])
    logits = _step_logits(model, cache, ids)
    _older_region_holds_most(cache)
    if not int8:
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
        return
    error = (logits.softmax(-1) - reference.softmax(-1)).abs().amax(-1)  # [B, T]
    truncation = (truncated.softmax(-1) - reference.softmax(-1)).abs().amax(-1)
    late = slice(20, None)  # where most keys are INT8
    assert error.max() < 1e-2, float(error.max())
    assert error[:, late].mean() < 0.1 * truncation[:, late].mean(), (float(error[:, late].mean()),
                                                                      float(truncation[:, late].mean()))


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_generate_with_padding_matches_dynamic_cache(arch, policy, asymmetric):
    model = tiny_model(arch, seed=8, asymmetric=asymmetric)
    ids = torch.randint(0, 250, (2, 30), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids[1, :7] = 258
    kwargs = dict(attention_mask=mask, max_new_tokens=LENGTH - 30, do_sample=False, pad_token_id=258,
                  output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
    cache = ConfKVCache.for_model(model, policy, store=_store(False), **POLICIES[policy])
    out = model.generate(ids, cache=cache, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(ref.logits, 1), atol=1e-4, rtol=1e-4)
    for layer_idx in cache.managed:
        assert cache.layers[layer_idx].store.old.length >= LENGTH - 12  # most cached slots had aged
