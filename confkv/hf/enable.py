"""Switch a transformers model to confkv attention, and close a cache's step after a forward pass.

Who closes a step (issue 33, "an explicit step"):

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

from confkv.hf import attention as attention_glue
from confkv.hf.support import check_supported

_HOOK_HANDLE = "_confkv_step_hook"
_PREVIOUS_ATTENTION = "_confkv_previous_attention"


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
    attention_glue.register()
    if model.config._attn_implementation != attention_glue.ATTENTION_NAME:
        model.__dict__.setdefault(_PREVIOUS_ATTENTION, model.config._attn_implementation)
        model.set_attn_implementation(attention_glue.ATTENTION_NAME)
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
