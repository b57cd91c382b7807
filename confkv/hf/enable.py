"""Switch a transformers model to confkv attention and hook the end of each forward pass.

The hook closes the step of the cache whose layers ran in this pass: the cache marks itself
(:func:`mark_active`) and the hook takes it (:func:`take_active_cache`), so the two live here.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from confkv.hf import attention as attention_glue
from confkv.hf.support import check_supported

if TYPE_CHECKING:
    from confkv.hf.cache import ConfKVCache

_HOOK_FLAG = "_confkv_end_step_hook"


class _ActiveCache(threading.local):
    cache: ConfKVCache | None = None


_ACTIVE_CACHE = _ActiveCache()


def mark_active(cache: ConfKVCache) -> None:
    """Name ``cache`` as the one whose step the running forward pass closes (called by its layers' ``update``)."""
    _ACTIVE_CACHE.cache = cache


def take_active_cache() -> ConfKVCache | None:
    """The confkv cache used by the forward pass that is ending, if any (then cleared)."""
    cache = _ACTIVE_CACHE.cache
    _ACTIVE_CACHE.cache = None
    return cache


def _end_of_forward(module: torch.nn.Module, inputs, output) -> None:
    """LM-head forward hook: hand the last position's raw logits to the active confkv cache."""
    cache = take_active_cache()
    if cache is not None:
        logits = output[0] if isinstance(output, tuple) else output
        cache.end_step(logits[:, -1, :])


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` run with confkv caches (idempotent).

    Registers the ``"confkv"`` attention implementation, switches the model to it, and
    hooks the LM head so that every forward pass ends with the cache's ``end_step``.
    Without a confkv cache the model still computes exact causal attention (SDPA).
    Raises :class:`~confkv.errors.UnsupportedModelError` for unsupported architectures.
    """
    check_supported(model.config)
    attention_glue.register()
    if model.config._attn_implementation != attention_glue.ATTENTION_NAME:
        model.set_attn_implementation(attention_glue.ATTENTION_NAME)
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError("confkv needs a causal LM with an output head (e.g. AutoModelForCausalLM)")
    if not getattr(head, _HOOK_FLAG, False):
        head.register_forward_hook(_end_of_forward)
        setattr(head, _HOOK_FLAG, True)
    return model
