"""The fused native layer calls (confkv/native/layer.py) give the lean decoder's per-op results, and the
threaded mass read gives the single-threaded one bit for bit."""

import pytest
import torch

from confkv import native
from confkv.config import StoreConfig
from confkv.hf import ConfKVCache, prefill
from confkv.hf.lean import LeanDecoder
from confkv.hf.weights import quantize_linear_weights
from confkv.models import tiny_model
from confkv.native.layer import LayerKernels
from call_counts import counted_calls
from thread_counts import torch_threads

pytestmark = [pytest.mark.skipif(not native.available(), reason="no C compiler: the native kernels are off"),
              pytest.mark.usefixtures("nan_filled_empty")]  # buffers to be overwritten start as NaN

SHAPES = {
    "default": {},  # hidden 64, 4 / 2 heads of 16, MLP 128
    "ragged": {"hidden_size": 40, "head_dim": 10, "intermediate_size": 72},  # widths not multiples of 16
    # random norm weights and biases (Llama: on every projection), head_dim 16 != hidden 40 / 4 heads
    "asymmetric": {"asymmetric": True},
    # an MLP narrower than the hidden size (the fused MLP's scratch rows are sized by the wider of the two)
    "narrow_mlp": {"intermediate_size": 48},
}


def _model(arch: str, dtype: torch.dtype, **overrides) -> torch.nn.Module:
    model = tiny_model(arch, num_hidden_layers=3, **overrides).to(dtype)
    quantize_linear_weights(model, allow_float32=True)
    return model


def _decode(model, fuse: bool, batch: int, steps: int = 12, prompt: int = 20, policy=("streaming", {"budget": 16})):
    """Prefill, then decode the same tokens through the lean decoder; logits of every step, and the calls
    that went through the fused kernels."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, 250, (batch, prompt + steps), generator=gen)
    mask = torch.ones(batch, prompt + steps, dtype=torch.long)
    mask[1:, :3] = 0  # left padding of every sequence after the first
    cache = ConfKVCache.for_model(model, policy[0], store=StoreConfig(), **policy[1])
    prefill(model, cache, ids[:, :prompt], attention_mask=mask[:, :prompt], chunk=8)
    decoder = LeanDecoder(model)
    decoder.fuse_layers = fuse
    with counted_calls(LayerKernels, "mlp") as calls:
        logits = [decoder(ids[:, t:t + 1], cache, attention_mask=mask[:, :t + 1]) for t in range(prompt, prompt + steps)]
    return logits, len(calls), cache


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q / k / v (asymmetric llama: on all)
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_layers_equal_the_per_op_path(arch, shape, dtype, batch):
    model = _model(arch, dtype, **SHAPES[shape])
    fused, used, fused_cache = _decode(model, True, batch)
    per_op, unused, per_op_cache = _decode(model, False, batch)
    assert used == 12 * 3 and unused == 0  # every layer of every step went through the fused calls (or none)
    for got, expected in zip(fused, per_op):
        # the same GEMV and roundings (bit-equal here in bfloat16); SiLU's exp is libm's here and Sleef's in
        # torch, one float32 ulp apart at times, which may flip a bfloat16 rounding
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert fused_cache.kept_counts().tolist() == per_op_cache.kept_counts().tolist()


def test_fused_layers_use_several_threads_alike():
    model = _model("llama", torch.bfloat16, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=32)
    with torch_threads(1):
        single, _, _ = _decode(model, True, batch=2)
        torch.set_num_threads(2)
        double, used, _ = _decode(model, True, batch=2)
    assert used
    for a, b in zip(single, double):
        assert torch.equal(a, b)  # the rows are split over threads, each computed as alone


def test_a_replaced_projection_falls_back_to_the_per_op_path():
    model = _model("llama", torch.bfloat16)
    decoder = LeanDecoder(model)
    cache = ConfKVCache.for_model(model, "full")
    token = torch.tensor([[5]])
    decoder(token, cache)  # prepares the fused kernels
    layer = model.model.layers[1].mlp.down_proj
    layer.weight_int8 = torch.zeros_like(layer.weight_int8)  # the prepared GEMV pointed at the old tensor
    reference_model = _model("llama", torch.bfloat16)
    reference_model.model.layers[1].mlp.down_proj.weight_int8 = torch.zeros_like(layer.weight_int8)
    reference = LeanDecoder(reference_model)
    reference.fuse_layers = False
    reference_cache = ConfKVCache.for_model(reference_model, "full")
    reference(token, reference_cache)
    torch.testing.assert_close(decoder(torch.tensor([[7]]), cache), reference(torch.tensor([[7]]), reference_cache),
                               rtol=2e-2, atol=2e-2)


def test_a_replaced_norm_weight_falls_back_to_the_per_op_path():
    model = _model("llama", torch.bfloat16)
    decoder = LeanDecoder(model)
    cache = ConfKVCache.for_model(model, "full")
    decoder(torch.tensor([[5]]), cache)  # prepares the fused kernels
    norm = model.model.layers[0].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 2, requires_grad=False)
    kernels, states = decoder._fused[1][0]
    assert not decoder._current(states)  # the kernels hold the old weight: not used
    assert decoder._current(decoder._fused[1][1][1])  # the other layer keeps its kernels
    reference = LeanDecoder(model)
    reference.fuse_layers = False
    reference_cache = cache.clone()
    torch.testing.assert_close(decoder(torch.tensor([[7]]), cache), reference(torch.tensor([[7]]), reference_cache),
                               rtol=1e-2, atol=1e-2)


def test_unquantized_models_and_prefill_chunks_take_the_per_op_path():
    model = tiny_model("llama").to(torch.bfloat16)  # nn.Linear projections: nothing to fuse
    decoder = LeanDecoder(model)
    assert decoder._fused_layers(torch.zeros(1, 1, 64, dtype=torch.bfloat16)) is None
    quantize_linear_weights(model)
    decoder = LeanDecoder(model)
    assert decoder._fused_layers(torch.zeros(1, 1, 64, dtype=torch.bfloat16)) is not None
    assert decoder._fused_layers(torch.zeros(1, 5, 64, dtype=torch.bfloat16)) is None  # 5 rows: a prefill chunk
    assert decoder._fused_layers(torch.zeros(1, 1, 64)) is None  # another dtype than the weights'
    with native.loader.disabled():
        assert decoder._fused_layers(torch.zeros(1, 1, 64, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threaded_mass_read_equals_the_single_threaded_one(dtype):
    from confkv.attention import KVSegment

    gen = torch.Generator().manual_seed(3)
    batch, kv_heads, groups, queries, dim = 2, 3, 3, 2, 64
    query = torch.randn(batch, kv_heads * groups, queries, dim, generator=gen).to(dtype)
    segments = [KVSegment(torch.randn(batch, kv_heads, n, dim, generator=gen).to(dtype),
                          torch.randn(batch, kv_heads, n, dim, generator=gen).to(dtype), None) for n in (300, 45)]
    with torch_threads(1):
        out1, mass1 = native.mass_read(query, segments, 0.125)
        torch.set_num_threads(2)
        out2, mass2 = native.mass_read(query, segments, 0.125)
    assert torch.equal(out1, out2)
    assert all(torch.equal(a, b) for a, b in zip(mass1, mass2))
    workers = native.gemv_settings()
    assert workers >= 1  # the two-thread read ran on the pool (a worker exists)


class _OffsetNorm(torch.nn.Module):
    """A norm put in by hand with a ``variance_epsilon`` and Gemma's ``(1 + weight)`` scale: not the native norm's
    formula, so neither the fused layer nor the per-op native norm may take it."""

    def __init__(self, like: torch.nn.Module) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(like.weight.shape, generator=torch.Generator().manual_seed(9)) * 0.1,
                                         requires_grad=False)
        self.variance_epsilon = like.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x.float() * scale * (1.0 + self.weight.float())).to(x.dtype)


class _EpsNorm(_OffsetNorm):
    """The same norm with its epsilon named ``eps`` (as Gemma's): no ``variance_epsilon`` at all."""

    def __init__(self, like: torch.nn.Module) -> None:
        super().__init__(like)
        self.eps = self.__dict__.pop("variance_epsilon")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.variance_epsilon = self.eps
        try:
            return super().forward(x)
        finally:
            del self.variance_epsilon


def _reference_logits(model, batch: int, steps: int = 6, prompt: int = 20) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, 250, (batch, prompt + steps), generator=gen)
    cache = ConfKVCache.for_model(model, "streaming", budget=16)
    prefill(model, cache, ids[:, :prompt], chunk=8)
    with torch.no_grad():
        return [model(ids[:, t:t + 1], cache=cache).logits[:, -1] for t in range(prompt, prompt + steps)]


@pytest.mark.parametrize("norm_type", [_OffsetNorm, _EpsNorm], ids=["variance_epsilon", "eps"])
@pytest.mark.parametrize("which", ["input_layernorm", "post_attention_layernorm"])
def test_a_norm_of_another_formula_is_run_as_the_module(norm_type, which):
    """A layer whose norm is not a Llama-style RMSNorm: the lean decoder (fused or per op) runs that module, so its
    logits are the model's own; the layer is left out of the fused calls, the others keep them. fp32, batch 2."""
    model = _model("llama", torch.float32)
    layer = model.model.layers[1]
    setattr(layer, which, norm_type(getattr(layer, which)))
    reference = _reference_logits(model, batch=2, steps=6)
    for fuse in (True, False):
        logits, used, _ = _decode(model, fuse, batch=2, steps=6, policy=("streaming", {"budget": 16}))
        for got, expected in zip(logits, reference):  # _decode left-pads the rows after the first: row 0 compared
            torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-4)
        assert used == (6 * 2 if fuse else 0)  # layers 0 and 2 fused, layer 1 per op


def _fused_calls_matching_per_op(model, steps: int) -> int:
    """Decode ``steps`` tokens (batch 1) with the fused calls and per op; their logits agree (bf16 tolerance).
    Returns the fused run's fused-call count (one per fused layer and step)."""
    fused, used, _ = _decode(model, True, batch=1, steps=steps)
    per_op, _, _ = _decode(model, False, batch=1, steps=steps)
    for got, expected in zip(fused, per_op):
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    return used


def test_mistral_takes_the_fused_calls():
    model = _model("mistral", torch.bfloat16)
    assert _fused_calls_matching_per_op(model, steps=4) == 4 * 3


def test_a_projection_without_a_native_form_leaves_its_layer_per_op(monkeypatch):
    """A layer one of whose INT8 projections has no prepared GEMV (the library would not take its tensors) runs
    per op; the other layers stay fused."""
    from confkv.hf.weights import Int8Linear

    model = _model("llama", torch.bfloat16)
    odd = model.model.layers[2].mlp.up_proj
    real = Int8Linear.native_projection
    monkeypatch.setattr(Int8Linear, "native_projection", lambda self: None if self is odd else real(self))
    assert _fused_calls_matching_per_op(model, steps=4) == 4 * 2


def test_the_per_op_path_takes_the_native_norm_and_rotary(monkeypatch):
    """Per op (unquantized weights, or the fused calls off), a step still runs the norms and the rotary embedding
    as native calls whose outputs are used: each layer's two norms and the final one (the norm modules never run),
    and one rotary per layer. Counted on a step of
    a tiny Llama (3 layers), bf16 and fp32."""
    for dtype in (torch.bfloat16, torch.float32):
        model = tiny_model("llama", num_hidden_layers=3).to(dtype)
        decoder = LeanDecoder(model)
        cache = ConfKVCache.for_model(model, "full")
        decoder(torch.tensor([[5, 6, 7]]), cache)
        counts = {"rms_norm": 0, "rotary": 0}
        for name in counts:
            real = getattr(native, name)

            def counted(*args, _real=real, _name=name):
                out = _real(*args)
                counts[_name] += out is not None
                return out

            monkeypatch.setattr(native, name, counted)
        modules_run = []
        norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
        hooks = [m.register_forward_hook(lambda *_: modules_run.append(1)) for m in norms]
        try:
            decoder(torch.tensor([[8]]), cache)
        finally:
            for hook in hooks:
                hook.remove()
        monkeypatch.undo()
        assert counts == {"rms_norm": 3 * 2 + 1, "rotary": 3}, dtype
        assert len(norms) == 7 and modules_run == []  # the native norm's output is used, the module never runs
