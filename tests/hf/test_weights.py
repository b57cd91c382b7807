"""Weight-only INT8 (confkv/hf/weights.py): the kernel multiplies by the dequantized weight; the model still runs."""

import pytest
import torch
from torch import nn

from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder
from confkv.hf.weights import Int8Linear, quantize_linear_weights
from confkv.models import tiny_model


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_the_dequantized_weight_product(bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    q = Int8Linear(linear, torch.bfloat16)
    # per output channel: the scale is max|W| / 127 rounded up to bfloat16; the largest weight maps to +-127
    weight = linear.weight.detach()
    exact = weight.abs().amax(1) / 127
    assert bool((q.scale.float() >= exact).all()) and bool((q.scale.float() <= exact * (1 + 2 ** -7)).all())
    assert int(q.weight_int8.abs().amax(1).min()) >= 126
    # rounding to the nearest step: error at most half a step per weight
    assert float(((q.dequantized_weight() - weight).abs() / q.scale.float()[:, None]).max()) <= 0.5 + 1e-4
    x = torch.randn(3, 5, 64).bfloat16()
    expected = x.float() @ q.dequantized_weight().T + (linear.bias.detach() if bias else 0)
    torch.testing.assert_close(q(x).float(), expected, rtol=2e-2, atol=2e-2)
    assert q(x).shape == (3, 5, 48) and q(x).dtype == torch.bfloat16


def test_int8_linear_refuses_other_activation_dtypes():
    q = Int8Linear(nn.Linear(16, 8), torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 activations, got torch.float32"):
        q(torch.randn(2, 16))


def test_quantize_refuses_a_float32_model_with_the_fix():
    with pytest.raises(ValueError, match="dtype=torch.bfloat16"):
        quantize_linear_weights(tiny_model("llama"))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_quantized_model_decodes_close_to_bf16_and_the_lean_decoder_agrees(arch):
    reference = tiny_model(arch).to(torch.bfloat16)
    model = tiny_model(arch).to(torch.bfloat16)
    replaced = quantize_linear_weights(model)
    layers = model.config.num_hidden_layers
    assert replaced == 7 * layers + 1  # q, k, v, o, gate, up, down per layer + the LM head
    assert all(not isinstance(m, nn.Linear) for m in model.modules())
    ids = torch.randint(1, 250, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = reference(input_ids=ids).logits.float()
        quantized = model(input_ids=ids).logits.float()
    # INT8 weights move the logits a little, never by much (random tiny model: relative to their spread)
    assert float((quantized - exact).abs().mean()) < 0.05 * float(exact.std())
    caches = [ConfKVCache.for_model(model, "streaming", budget=24, sinks=2) for _ in range(2)]
    lean = LeanDecoder(model)
    for cache in caches:
        prefill(model, cache, ids[:, :30], chunk=8)
    for t in range(30, 40):
        token = ids[:, t:t + 1]
        expected = model(input_ids=token, cache=caches[0], logits_to_keep=1).logits[:, -1]
        torch.testing.assert_close(lean(token, caches[1]), expected)
