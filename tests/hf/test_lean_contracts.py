"""The lean decoder's contracts that its end-to-end file (tests/hf/test_lean.py, left out of mutmut's selection
for its run time) also covers, here on one tiny model each so that mutation runs see them: left padding read
through the store, the refusal naming the model types and the fix, which activations and libraries the fused
layer calls take, and fused kernels prepared once."""

from __future__ import annotations

import types

import pytest
import torch

from confkv import native
from confkv.errors import UnsupportedModelError
from confkv.hf import ConfKVCache
from confkv.hf.lean import LEAN_MODEL_TYPES, LeanDecoder
from confkv.hf.weights import quantize_linear_weights
from confkv.models import tiny_model
from confkv.native.layer import LayerKernels
from call_counts import counted_calls


def _logits_both(model, batch: int, padded: int, steps: int = 4, prompt: int = 12):
    """A left-padded prompt (``padded`` pad slots in every row after the first) through model(...) and through
    the lean decoder (the whole prompt in one pass, its pad tokens among the new ones), then the same tokens
    decoded by each; [(reference, lean)] per pass, the prompt's last logits first."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 250, (batch, prompt + steps), generator=gen)
    mask = torch.ones(batch, prompt + steps, dtype=torch.long)
    mask[1:, :padded] = 0
    caches = [ConfKVCache.for_model(model, "streaming", budget=10, protect=2) for _ in range(2)]
    lean = LeanDecoder(model)
    with torch.no_grad():
        positions = (mask[:, :prompt].cumsum(-1) - 1).masked_fill(mask[:, :prompt] == 0, 1)
        pairs = [(model(input_ids=ids[:, :prompt], cache=caches[0], attention_mask=mask[:, :prompt],
                        position_ids=positions).logits[:, -1],
                  lean(ids[:, :prompt], caches[1], attention_mask=mask[:, :prompt]))]
        for t in range(prompt, prompt + steps):
            seen = mask[:, :t + 1]
            positions = (seen.cumsum(-1) - 1).masked_fill(seen == 0, 1)[:, -1:]
            reference = model(input_ids=ids[:, t:t + 1], cache=caches[0], attention_mask=seen,
                              position_ids=positions).logits[:, -1]
            pairs.append((reference, lean(ids[:, t:t + 1], caches[1], attention_mask=seen)))
    return pairs


@pytest.mark.parametrize("padded", [0, 3])
def test_left_padded_rows_are_read_as_the_model_reads_them(padded):
    """With an attention mask a pass appends and reads with the padding (the prompt's pad tokens are new tokens
    of its one pass); a padded row's logits are the model's own (fp32, batch 2; 0 padded slots: the mask is all
    ones)."""
    model = tiny_model("llama", asymmetric=True)
    for reference, lean in _logits_both(model, batch=2, padded=padded):
        torch.testing.assert_close(lean, reference, rtol=1e-5, atol=1e-5)


def test_other_model_types_are_refused_naming_the_supported_ones_and_the_fix():
    model = tiny_model("gpt2")
    with pytest.raises(UnsupportedModelError) as refused:
        LeanDecoder(model)
    assert str(refused.value) == (f"confkv: the lean decoder supports model_type {', '.join(LEAN_MODEL_TYPES)}, got "
                                  "'gpt2'; run this model through model(...) or confkv.hf.generate instead")
    stripped = types.SimpleNamespace(config=types.SimpleNamespace())  # a config without a model_type at all
    with pytest.raises(UnsupportedModelError, match="got None"):
        LeanDecoder(stripped)


def _fused_calls(model, steps: int = 3) -> int:
    with counted_calls(LayerKernels, "mlp") as calls:
        decoder, cache = LeanDecoder(model), ConfKVCache.for_model(model, "full")
        for t in range(steps):
            decoder(torch.tensor([[7 + t]]), cache)
    return len(calls)


@pytest.mark.skipif(not native.available(), reason="the fused layer calls need the library")
@pytest.mark.parametrize("act, fused", [("silu", True), ("swish", True), ("gelu", False)])
def test_the_fused_calls_take_silu_mlps_only(act, fused):
    """The fused MLP computes SiLU: a ``silu`` or ``swish`` model takes it (2 layers x 3 one-token steps), a GELU
    one runs per op."""
    model = tiny_model("llama", hidden_act=act).to(torch.bfloat16)
    quantize_linear_weights(model)
    assert _fused_calls(model) == (2 * 3 if fused else 0)


@pytest.mark.skipif(not native.available(), reason="the fused layer calls need the library")
def test_the_fused_kernels_are_prepared_once_and_again_for_another_library():
    model = tiny_model("llama").to(torch.bfloat16)
    quantize_linear_weights(model)
    decoder, cache = LeanDecoder(model), ConfKVCache.for_model(model, "full")
    decoder(torch.tensor([[5]]), cache)
    prepared = decoder._fused
    assert prepared is not None and prepared[0] is native.library()
    decoder(torch.tensor([[6]]), cache)
    assert decoder._fused is prepared  # kept across steps
    decoder._fused = (object(), prepared[1])  # kernels made with a library since unloaded
    decoder(torch.tensor([[7]]), cache)
    assert decoder._fused[0] is native.library() and decoder._fused is not prepared
