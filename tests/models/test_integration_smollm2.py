"""The real SmolLM2-135M (integration: ~30 s; run with `-m integration`)."""

import pytest
import torch
from transformers import DynamicCache

from confkv.hf import ConfKVCache, generate

pytestmark = pytest.mark.integration


def test_smollm2_no_eviction_is_exact(smollm2):
    model, tokenizer = smollm2
    texts = ["The history of the Roman empire begins", "def fibonacci(n):\n    "]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    kwargs = dict(attention_mask=batch.attention_mask, max_new_tokens=24, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    ref = model.generate(batch.input_ids, cache=DynamicCache(config=model.config), **kwargs)
    cache = ConfKVCache.for_model(model, "confkv", n_high=256, n_low=512)
    out = generate(model, batch.input_ids, cache, chunk=4, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(ref.logits, 1), atol=2e-3, rtol=1e-3)
