"""Chunked prefill and a ``generate`` wrapper that uses it."""

from __future__ import annotations

from typing import Any

import torch

from confkv.errors import PromptTooLongError
from confkv.hf.cache import ConfKVCache


def padding_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as transformers' ``generate`` derives them: [B, L] -> [B, L] int64."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def check_prompt_length(model: torch.nn.Module, prompt_length: int, max_new_tokens: int = 0) -> None:
    """Raise :class:`PromptTooLongError` if the prompt plus new tokens exceed the model's positions."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and prompt_length + max_new_tokens > limit and not max_new_tokens:
        raise PromptTooLongError(
            f"a sequence of {prompt_length} tokens exceeds the model's {limit} positions; "
            f"shorten it (for `confkv ppl`/`sweep`: lower --tokens)")
    if limit is not None and prompt_length + max_new_tokens > limit:
        raise PromptTooLongError(
            f"prompt of {prompt_length} tokens + {max_new_tokens} new tokens exceeds the model's "
            f"{limit} positions; shorten the prompt or lower max_new_tokens")


def check_input_ids(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``input_ids`` is a non-empty [batch, length] integer tensor within the vocabulary."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[0] == 0 \
            or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor (an empty prompt cannot be "
                         f"continued: give at least one token, e.g. the BOS token), got {shape}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids (torch.long), got dtype {input_ids.dtype}")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise ValueError(f"input_ids hold token ids outside the model's vocabulary [0, {vocab}) "
                         f"(min {int(input_ids.min())}, max {int(input_ids.max())}); was the text encoded with "
                         f"this model's tokenizer?")


@torch.no_grad()
def prefill(model: torch.nn.Module, cache: ConfKVCache, input_ids: torch.Tensor,
            attention_mask: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Feed ``input_ids`` [B, L] through ``model`` in chunks, bringing ``cache`` under budget after each.

    Peak KV memory stays at budget + chunk. Returns the logits [B, V] of the last position.
    """
    check_input_ids(model, input_ids)
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"chunk must be a positive integer (tokens per forward pass), got {chunk!r}")
    chunk = chunk or cache.store_config.prefill_chunk
    start = cache.get_seq_length()
    total = start + input_ids.shape[1]
    check_prompt_length(model, total)
    if attention_mask is not None and tuple(attention_mask.shape) != (input_ids.shape[0], total):
        raise ValueError(f"attention_mask must be [batch, cached + new tokens] = {(input_ids.shape[0], total)} "
                         f"(it covers the {start} tokens already cached too), got {tuple(attention_mask.shape)}")
    full_mask = attention_mask
    logits = None
    for begin in range(0, input_ids.shape[1], chunk):
        end = min(begin + chunk, input_ids.shape[1])
        kwargs: dict[str, Any] = {}
        if full_mask is not None:
            kwargs["attention_mask"] = full_mask[:, : start + end]
            kwargs["position_ids"] = padding_positions(full_mask[:, : start + end])[:, start + begin:start + end]
        with cache.steps_by_hand():
            out = model(input_ids=input_ids[:, begin:end], cache=cache, use_cache=True, logits_to_keep=1,
                        **kwargs)
        logits = out.logits[:, -1, :]
        cache.end_step(logits)
    assert cache.get_seq_length() == total
    return logits


@torch.no_grad()
def generate(model: torch.nn.Module, input_ids: torch.Tensor, cache: ConfKVCache,
             attention_mask: torch.Tensor | None = None, chunk: int | None = None, **generate_kwargs: Any
             ) -> torch.Tensor:
    """``model.generate`` with a chunked prefill of all but the last prompt token.

    Returns the same as ``model.generate`` (prompt + new tokens).
    """
    check_input_ids(model, input_ids)
    check_prompt_length(model, input_ids.shape[1], generate_kwargs.get("max_new_tokens", 0) or 0)
    if input_ids.shape[1] > 1:
        prefill(model, cache, input_ids[:, :-1],
                attention_mask[:, :-1] if attention_mask is not None else None, chunk)
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                          **generate_kwargs)
