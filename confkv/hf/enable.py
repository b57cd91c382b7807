"""Switch a transformers model to confkv: the ``"confkv"`` attention implementation it reads with, and the
hook that closes a cache's step after a forward pass. Everything :func:`enable` installs lives here.

**The attention** (until 5 Dec ``confkv/hf/attention.py``; that path still imports this module).
``ConfKVLayer.update`` returns the keys with its :class:`~confkv.store.LayerStore` attached
(:func:`keys_for_attention`); the model passes them to :func:`confkv_attention`, which reads over the
store (INT8 region, FP window and the new tokens) and records the queries' attention mass for the
policy. No eager attention, no [B, H, q, L] weights returned to the model. transformers builds no 4D
mask for this implementation: the registered mask function only passes the 2D padding mask through,
and the store applies causality, padding and sliding windows itself from the positions it tracks.
Without a confkv cache (a plain forward, or another cache), the function falls back to PyTorch SDPA
with a causal and padding mask, so a model switched to ``"confkv"`` still runs everywhere.

**Who closes a step** (issue 33, "an explicit step"):

- confkv's own loops call ``cache.end_step(logits)`` themselves: :func:`confkv.hf.generate.prefill`,
  :class:`confkv.hf.lean.LeanDecoder`, the evaluation protocols.
- A forward pass that confkv does not drive (transformers' ``model.generate``, or ``model(...)``
  called by hand) is closed by a forward hook on the model: it takes the cache the pass ran with
  from the call itself (``cache=``, or ``past_key_values=``) and hands it the logits the model
  returned. The hook keeps no state, so it is safe with any number of caches and threads. It is
  installed by :func:`enable` (which ``ConfKVCache.for_model`` calls) and removed by :func:`disable`;
  ``with enabled(model): ...`` does both around a block, the way kvpress scopes its hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from confkv.hf.support import check_supported
from confkv.store import LayerStore

_HOOK_HANDLE = "_confkv_step_hook"
_PREVIOUS_ATTENTION = "_confkv_previous_attention"

ATTENTION_NAME = "confkv"
_STORE_ATTRIBUTE = "confkv_store"


def keys_for_attention(store: LayerStore) -> torch.Tensor:
    """The keys ``ConfKVLayer.update`` returns: a fresh view of the store's new keys [B, Hkv, q, D] that carries
    ``store``, so the attention call that receives them reads over it (no state outside the call)."""
    keys = store.recent.keys
    keys = keys.view(keys.shape)
    setattr(keys, _STORE_ATTRIBUTE, store)
    return keys


def confkv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None, **kwargs
                     ) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query [B, Hq, q, D], key/value [B, Hkv, L, D] -> ([B, q, Hq, D], None)."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    padding = attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None
    store = getattr(key, _STORE_ATTRIBUTE, None)
    if store is not None:
        out = store.attend(query, scaling=scaling, padding=padding, softcap=softcap)
    else:
        out = _sdpa_fallback(query, key, value, padding, scaling, sliding_window, softcap)
    return out.transpose(1, 2).contiguous(), None


def _sdpa_fallback(query, key, value, padding, scaling, sliding_window, softcap):
    """Causal attention without a confkv store: new queries sit at the end of ``key``."""
    q_len, kv_len = query.shape[2], key.shape[2]
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
    k_pos = torch.arange(kv_len, device=query.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < sliding_window)
    mask = mask[None, None]
    if padding is not None:
        mask = mask & padding[:, -kv_len:].bool()[:, None, None, :]
    group = query.shape[1] // key.shape[1]
    if softcap is not None:
        key_r, value_r = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        scores = (query @ key_r.transpose(-1, -2)) * scaling
        scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        return probs.to(value_r.dtype) @ value_r
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=group > 1)
    return out.nan_to_num(0.0)


def padding_passthrough_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                             mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs
                             ) -> torch.Tensor | None:
    """Mask function for ``"confkv"``: the 2D padding mask [B, <= kv_length] bool, or None if nothing is padded."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].bool()
    return None if bool(attention_mask.all()) else attention_mask


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, confkv_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, padding_passthrough_mask)


@runtime_checkable
class StepClosing(Protocol):
    """What the hook needs of a cache (:class:`~confkv.hf.cache.ConfKVCache` has it)."""

    closes_own_steps: bool  # the caller ends every step itself (``steps_by_hand``)
    pass_open: bool  # the running pass wrote to the cache and its step is not closed yet

    def end_step(self, logits: torch.Tensor) -> None: ...


def _cache_of_call(args: tuple, kwargs: dict[str, Any]) -> StepClosing | None:
    """The confkv cache a forward call ran with (keyword ``cache``/``past_key_values``, or positional), or None."""
    for name in ("cache", "past_key_values"):
        if isinstance(kwargs.get(name), StepClosing):
            return kwargs[name]
    return next((a for a in args if isinstance(a, StepClosing)), None)


def _output_logits(output: Any) -> torch.Tensor | None:
    """[B, q, V] logits of a causal LM's output (a ModelOutput, or the tuple of ``return_dict=False``)."""
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, tuple):
        logits = next((t for t in output if isinstance(t, torch.Tensor) and t.ndim == 3), None)
    return logits


def close_step_after_forward(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    """Model forward hook: end the step of the confkv cache this call ran with, on its last position's logits.

    Skipped when the caller closes its own steps (:meth:`ConfKVCache.steps_by_hand`) or the pass wrote
    nothing to the cache (a call without a confkv cache, or one whose layers never reached it).
    """
    cache = _cache_of_call(args, kwargs)
    if cache is None or cache.closes_own_steps or not cache.pass_open:
        return
    logits = _output_logits(output)
    if logits is None:
        raise ValueError("confkv: the model's output holds no logits to close the cache's step with; run it as a "
                         "causal LM (e.g. AutoModelForCausalLM), or call cache.end_step(logits) yourself")
    cache.end_step(logits[:, -1, :])


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` run with confkv caches (idempotent).

    Registers the ``"confkv"`` attention implementation, switches the model to it, and installs the
    forward hook that closes the step of the confkv cache a pass ran with (the module docstring).
    Without a confkv cache the model still computes exact causal attention (SDPA).
    Raises :class:`~confkv.errors.UnsupportedModelError` for unsupported architectures.
    """
    check_supported(model.config)
    if model.get_output_embeddings() is None:
        raise ValueError("confkv needs a causal LM with an output head (e.g. AutoModelForCausalLM)")
    register()
    if model.config._attn_implementation != ATTENTION_NAME:
        model.__dict__.setdefault(_PREVIOUS_ATTENTION, model.config._attn_implementation)
        model.set_attn_implementation(ATTENTION_NAME)
    if _HOOK_HANDLE not in model.__dict__:
        model.__dict__[_HOOK_HANDLE] = model.register_forward_hook(close_step_after_forward, with_kwargs=True)
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable`: remove the step hook and restore the attention implementation the model had."""
    handle = model.__dict__.pop(_HOOK_HANDLE, None)
    if handle is not None:
        handle.remove()
    previous = model.__dict__.pop(_PREVIOUS_ATTENTION, None)
    if previous is not None:
        model.set_attn_implementation(previous)
    return model


@contextlib.contextmanager
def enabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``with enabled(model): ...``: :func:`enable` on entry and, if it was not enabled before, :func:`disable` on exit."""
    was_enabled = _HOOK_HANDLE in model.__dict__
    enable(model)
    try:
        yield model
    finally:
        if not was_enabled:
            disable(model)
