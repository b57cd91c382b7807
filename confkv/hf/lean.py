"""A lean forward pass for Llama-family models: the model's own weights, without transformers'
per-layer Python (issue "Speed: faster than llama.cpp", item 1).

transformers' forward builds output dataclasses, checks kwargs, dispatches the attention
interface and walks several module wrappers per layer; at 30 layers that costs milliseconds a
step, more than the attention itself at short contexts. :class:`LeanDecoder` binds each
layer's modules once and runs the same operations in the same order: embedding, per layer
RMSNorm -> q/k/v projections -> rotary embedding -> the confkv store (append, then the store's
read: the same call the ``"confkv"`` attention implementation makes) -> o projection ->
residual -> RMSNorm -> gated MLP -> residual; final RMSNorm and the LM head on the last
position. The decoder then closes the cache's step itself (``cache.end_step(logits)``), as the
model's forward hook (:mod:`confkv.hf.enable`) does after a normal forward, so budgets, eviction
and the trace are unchanged. The logits equal the
model's own forward with the same cache (tests/hf/test_lean.py).

Where the native CPU kernels are available (:mod:`confkv.native`; ``CONFKV_NATIVE=0`` switches
them off), the RMSNorms and the rotary embedding run as one C call each, with the same
roundings as the torch operations; otherwise the model's own modules and torch ops run.

With weight-only INT8 projections (:func:`confkv.hf.weights.quantize_linear_weights`) and the native
kernels on, a decode-sized input (at most ``confkv.native.MAX_GEMV_ROWS`` rows) runs each layer as
two native calls around the store (:mod:`confkv.native.layer`: norm, q/k/v and rotary; o projection,
residual, norm, gated MLP, residual), the same roundings in one call each instead of about fifteen
Python-level ones; :attr:`LeanDecoder.fuse_layers` = False keeps the per-op path (A/B timings).

Supported: ``llama``, ``qwen2`` and ``mistral`` (SmolLM2 is a Llama). Other architectures
(Gemma-3's extra norms and soft-caps, GPT-2's fused projections) raise
:class:`~confkv.errors.UnsupportedModelError`; run them through ``model(...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from confkv import native
from confkv.errors import UnsupportedModelError
from confkv.hf.cache import ConfKVCache
from confkv.hf.enable import enable
from confkv.hf.generate import padding_positions
from confkv.hf.support import text_config
from confkv.hf.weights import Int8Linear
from confkv.native.layer import LayerKernels

LEAN_MODEL_TYPES = ("llama", "qwen2", "mistral")
#: the norm classes computed as ``weight * x / sqrt(mean(x^2) + variance_epsilon)``, which the native norm computes
LLAMA_STYLE_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's modules, bound once."""

    input_norm: Any
    q_proj: Any
    k_proj: Any
    v_proj: Any
    o_proj: Any
    post_norm: Any
    gate_proj: Any
    up_proj: Any
    down_proj: Any
    act: Any
    head_dim: int
    scaling: float


def _llama_norm_eps(module: Any) -> float | None:
    """The epsilon of a norm of a class in :data:`LLAMA_STYLE_NORMS`, or None for any other module (a norm put
    in by hand may have a ``variance_epsilon`` and another formula)."""
    return getattr(module, "variance_epsilon", None) if type(module).__name__ in LLAMA_STYLE_NORMS else None


def _norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module on ``x`` [..., n]: the native kernel for Llama-style norms where available, else the
    module itself."""
    eps = _llama_norm_eps(module)
    out = native.rms_norm(x, module.weight, eps) if eps is not None else None
    return module(x) if out is None else out


def _store_read(store: Any, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, scaling: float,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Append key / value [B, Hkv, q, D] to ``store`` and read with query [B, Hq, q, D] -> [B, Hq, q, D]; a
    decode step with nothing padded takes the store's :meth:`~confkv.store.LayerStore.decode_step`."""
    if attention_mask is None and query.shape[2] == 1:
        return store.decode_step(key, value, query, scaling=scaling)
    store.append(key, value)
    return store.attend(query, scaling=scaling, padding=attention_mask, softcap=None)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoder:
    """Forward passes of a Llama-family causal LM over a :class:`ConfKVCache`, without transformers' wrappers.

    Args:
        model: a ``LlamaForCausalLM``-like model (``model.model.layers``, ``model.lm_head``)
            of a type in :data:`LEAN_MODEL_TYPES`; switched to confkv attention here.
    """

    #: False: never the fused native layer calls (:mod:`confkv.native.layer`), always the per-op path
    fuse_layers = True

    def __init__(self, model: torch.nn.Module) -> None:
        config = text_config(model.config)
        model_type = getattr(config, "model_type", None)
        if model_type not in LEAN_MODEL_TYPES:
            raise UnsupportedModelError(
                f"confkv: the lean decoder supports model_type {', '.join(LEAN_MODEL_TYPES)}, got {model_type!r}; "
                f"run this model through model(...) or confkv.hf.generate instead")
        enable(model)
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.layers = [self._bind(layer) for layer in inner.layers]
        self.silu = getattr(config, "hidden_act", None) in ("silu", "swish")
        # (library, per layer: its LayerKernels and the projections' prepared states they were made from, or None)
        self._fused: tuple[object, list[tuple[LayerKernels, tuple] | None]] | None = None

    @staticmethod
    def _bind(layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _Layer(layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                      layer.post_attention_layernorm, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn,
                      attn.head_dim, attn.scaling)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache: ConfKVCache,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ``input_ids`` [B, q] (appended to ``cache``); returns the last position's logits [B, V].

        ``attention_mask`` [B, cached + q] (1 = real token) as ``model(...)`` takes it, for
        left-padded batches; positions then follow it as in ``generate``. The step is closed here
        (``cache.end_step``: confidence, budgets, eviction, trace).
        """
        if not isinstance(cache, ConfKVCache):
            raise TypeError(f"the lean decoder runs over a ConfKVCache, got {type(cache).__name__}")
        batch, length = input_ids.shape
        seen = cache.get_seq_length()
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (batch, seen + length):
                raise ValueError(f"attention_mask must be [batch, cached + new tokens] = {(batch, seen + length)}, "
                                 f"got {tuple(attention_mask.shape)}")
            positions = padding_positions(attention_mask)[:, seen:]
        else:
            positions = torch.arange(seen, seen + length, device=input_ids.device)[None].expand(batch, -1)
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, positions)  # [B, q, D]
        fused = self._fused_layers(hidden)
        for index, layer in enumerate(self.layers):
            kernels = fused[index] if fused is not None else None
            if kernels is not None and self._current(kernels[1]):
                hidden = self._fused_layer(kernels[0], layer, hidden, cache, index, cos, sin, attention_mask)
                continue
            hidden = hidden + self._attention(layer, _norm(layer.input_norm, hidden), cache, index, cos, sin,
                                              attention_mask)
            normed = _norm(layer.post_norm, hidden)
            hidden = hidden + layer.down_proj(layer.act(layer.gate_proj(normed)) * layer.up_proj(normed))
        logits = self.lm_head(_norm(self.norm, hidden[:, -1:]))[:, -1]
        cache.end_step(logits)
        return logits

    # -- the fused native layer (INT8 projections) --------------------------------------------------
    @staticmethod
    def _projections(layer: _Layer) -> tuple[Any, ...]:
        return (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj, layer.gate_proj, layer.up_proj,
                layer.down_proj)

    @staticmethod
    def _current(states: tuple) -> bool:
        """Whether a layer still holds what its kernels were made from: ``states`` are (mapping, key, object)
        for the projections' prepared GEMVs (an Int8Linear drops its prepared state when its tensors change)
        and the norms' weight parameters; a plain loop, as it runs in every layer of every step."""
        for mapping, key, then in states:
            if mapping.get(key) is not then:
                return False
        return True

    def _fused_layers(self, hidden: torch.Tensor) -> list[tuple[LayerKernels, tuple] | None] | None:
        """Per layer, its :class:`LayerKernels` (and the states they were made from) for this input, or
        None when the input, the model or the library does not allow the fused calls."""
        if not self.fuse_layers or not self.silu or not Int8Linear.use_native_gemv:
            return None
        lib = native.library()
        if lib is None:
            return None
        if self._fused is None or self._fused[0] is not lib:
            self._fused = (lib, [self._prepare(layer) for layer in self.layers])
        layers = self._fused[1]
        first = next((k for k in layers if k is not None), None)
        return layers if first is not None and first[0].fits(hidden) else None

    @classmethod
    def _prepare(cls, layer: _Layer) -> tuple[LayerKernels, tuple] | None:
        modules = cls._projections(layer)
        if not all(isinstance(m, Int8Linear) for m in modules):
            return None
        projections = tuple(m.native_projection() for m in modules)
        norms = []
        for norm in (layer.input_norm, layer.post_norm):
            eps = _llama_norm_eps(norm)
            if eps is None:
                return None
            norms.append((norm.weight.detach(), eps))
        if any(p is None for p in projections) or not LayerKernels.supports(projections, *norms, layer.head_dim):
            return None
        states = (*((m.__dict__, "_native", m.__dict__.get("_native")) for m in modules),
                  *((n._parameters, "weight", n._parameters.get("weight")) for n in (layer.input_norm, layer.post_norm)))
        return LayerKernels(*projections, *norms, layer.head_dim), states

    @staticmethod
    def _fused_layer(kernels: LayerKernels, layer: _Layer, hidden: torch.Tensor, cache: ConfKVCache, index: int,
                     cos: torch.Tensor, sin: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """One decoder layer on ``hidden`` [B, q, hidden] through the two native calls and the store."""
        batch, length, _ = hidden.shape
        query, key, value = kernels.attention_inputs(hidden, cos, sin)  # [B, q, H, D]
        out = _store_read(cache.layers[index].store, key.transpose(1, 2), value.transpose(1, 2), query.transpose(1, 2),
                          layer.scaling, attention_mask)
        return kernels.mlp(out.transpose(1, 2).reshape(batch, length, -1), hidden)

    @staticmethod
    def _attention(layer: _Layer, x: torch.Tensor, cache: ConfKVCache, index: int, cos: torch.Tensor,
                   sin: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """One layer's attention block on normed ``x`` [B, q, hidden] -> [B, q, hidden]; ``cos``, ``sin`` [B, q, D]."""
        batch, length, _ = x.shape
        shape = (batch, length, -1, layer.head_dim)
        query, key = layer.q_proj(x).view(shape), layer.k_proj(x).view(shape)  # [B, q, H, D]
        value = layer.v_proj(x).view(shape).transpose(1, 2)
        rotated = native.rotary(query, key, cos, sin)
        if rotated is not None:
            query, key = rotated[0].transpose(1, 2), rotated[1].transpose(1, 2)
        else:
            query, key = query.transpose(1, 2), key.transpose(1, 2)  # [B, H, q, D]
            cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
            query = query * cos + _rotate_half(query) * sin
            key = key * cos + _rotate_half(key) * sin
        out = _store_read(cache.layers[index].store, key, value, query, layer.scaling, attention_mask)
        return layer.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
