"""With budgets at least the sequence length, confkv must equal transformers' own cache (on the symmetric tiny
models and on the asymmetric ones: random norm weights and biases, head_dim != hidden / heads)."""

import pytest
import torch
from transformers import DynamicCache

from confkv.hf import ConfKVCache, generate
from confkv.models import SUPPORTED_TINY_ARCHS, tiny_model

NEW_TOKENS = 12


def _prompt(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(1, batch):  # left padding of different lengths
        mask[b, : 3 * b] = 0
        ids[b, : 3 * b] = 258
    return ids, mask


def _reference(model, ids, mask):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         cache=DynamicCache(config=model.config), output_logits=True, return_dict_in_generate=True,
                         pad_token_id=258)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", ["confkv", "full"])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_generate_matches_dynamic_cache(arch, batch, policy, asymmetric):
    model = tiny_model(arch, seed=1, asymmetric=asymmetric)
    ids, mask = _prompt(batch, 20)
    ref_tokens, ref_logits = _reference(model, ids, mask)
    params = {"n_high": 200, "n_low": 400} if policy == "confkv" else {}
    cache = ConfKVCache.for_model(model, policy, **params)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, cache=cache,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=258)
    assert torch.equal(out.sequences, ref_tokens)
    torch.testing.assert_close(torch.stack(out.logits, 1), ref_logits, atol=1e-4, rtol=1e-4)
    assert len(cache.trace) == NEW_TOKENS  # one end-of-step per forward pass


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_chunked_prefill_then_generate_matches(arch, asymmetric):
    model = tiny_model(arch, seed=2, asymmetric=asymmetric)
    ids, mask = _prompt(2, 37, seed=3)
    ref_tokens, ref_logits = _reference(model, ids, mask)
    cache = ConfKVCache.for_model(model, "confkv", n_high=300, n_low=500)
    out = generate(model, ids, cache, attention_mask=mask, chunk=8, max_new_tokens=NEW_TOKENS, do_sample=False,
                   output_logits=True, return_dict_in_generate=True, pad_token_id=258)
    assert torch.equal(out.sequences, ref_tokens)
    torch.testing.assert_close(torch.stack(out.logits, 1), ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_manual_step_loop_logits_match(arch, asymmetric):
    model = tiny_model(arch, seed=4, asymmetric=asymmetric)
    ids = torch.randint(0, 250, (2, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = model(ids).logits
        cache = ConfKVCache.for_model(model, "confkv", n_high=64, n_low=128)
        steps = [model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1] for t in range(ids.shape[1])]
    torch.testing.assert_close(torch.stack(steps, 1), reference, atol=1e-5, rtol=1e-4)


def test_sampling_runs_and_is_seeded():
    model = tiny_model("llama", seed=6)
    ids, mask = _prompt(2, 10)
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        cache = ConfKVCache.for_model(model, "confkv", n_high=200, n_low=400)
        outs.append(model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.5, top_k=20,
                                   max_new_tokens=8, cache=cache, pad_token_id=258))
    torch.manual_seed(0)
    ref = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.5, top_k=20, max_new_tokens=8,
                         pad_token_id=258)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], ref)


def test_sequences_finishing_early_keep_working():
    model = tiny_model("llama", seed=7)
    ids, mask = _prompt(3, 12)
    ref_tokens, _ = _reference(model, ids, mask)
    eos = int(ref_tokens[0, ids.shape[1] + 2])  # sequence 0 emits this at its 3rd new token
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=258, eos_token_id=eos)
    expected = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
    cache = ConfKVCache.for_model(model, "confkv", n_high=200, n_low=400)
    got = model.generate(ids, cache=cache, **kwargs)
    assert torch.equal(got, expected)
