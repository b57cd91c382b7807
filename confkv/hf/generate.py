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
    if limit is not None and prompt_length + max_new_tokens > limit:
        raise PromptTooLongError(
            f"prompt of {prompt_length} tokens + {max_new_tokens} new tokens exceeds the model's "
            f"{limit} positions; shorten the prompt or lower max_new_tokens")


@torch.no_grad()
def prefill(model: torch.nn.Module, cache: ConfKVCache, input_ids: torch.Tensor,
            attention_mask: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Feed ``input_ids`` [B, L] through ``model`` in chunks, bringing ``cache`` under budget after each.

    Peak KV memory stays at budget + chunk. Returns the logits [B, V] of the last position.
    """
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, length] tensor, got shape {tuple(input_ids.shape)}")
    chunk = chunk or cache.store_config.prefill_chunk
    start = cache.get_seq_length()
    total = start + input_ids.shape[1]
    full_mask = attention_mask
    logits = None
    for begin in range(0, input_ids.shape[1], chunk):
        end = min(begin + chunk, input_ids.shape[1])
        kwargs: dict[str, Any] = {}
        if full_mask is not None:
            kwargs["attention_mask"] = full_mask[:, : start + end]
            kwargs["position_ids"] = padding_positions(full_mask[:, : start + end])[:, start + begin:start + end]
        out = model(input_ids=input_ids[:, begin:end], cache=cache, use_cache=True, logits_to_keep=1,
                    **kwargs)
        logits = out.logits[:, -1, :]
    assert cache.get_seq_length() == total
    return logits


@torch.no_grad()
def generate(model: torch.nn.Module, input_ids: torch.Tensor, cache: ConfKVCache,
             attention_mask: torch.Tensor | None = None, chunk: int | None = None, **generate_kwargs: Any
             ) -> torch.Tensor:
    """``model.generate`` with a chunked prefill of all but the last prompt token.

    Returns the same as ``model.generate`` (prompt + new tokens).
    """
    check_prompt_length(model, input_ids.shape[1], generate_kwargs.get("max_new_tokens", 0) or 0)
    if input_ids.shape[1] > 1:
        prefill(model, cache, input_ids[:, :-1],
                attention_mask[:, :-1] if attention_mask is not None else None, chunk)
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                          **generate_kwargs)
