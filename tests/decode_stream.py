"""A prefill then one ``model(...)`` step per token, as the cache tests stream a text (:func:`decode_logits`)."""

from __future__ import annotations

import torch

from confkv.hf import prefill


def decode_logits(model, cache, ids: torch.Tensor, prompt: int, chunk: int) -> torch.Tensor:
    """Prefill ``ids[:, :prompt]`` into ``cache`` in chunks of ``chunk``, then step ``model`` one token at a time
    through the rest of ``ids`` [B, T]; returns each step's last logits, [T - prompt, B, V]."""
    logits = []
    with torch.no_grad():
        prefill(model, cache, ids[:, :prompt], chunk=chunk)
        for t in range(prompt, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], cache=cache).logits[:, -1])
    return torch.stack(logits)
