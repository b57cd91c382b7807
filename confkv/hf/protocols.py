"""Batched generation and continuation scoring through a compressed cache (left padding).

Two prefill protocols, as ``confkv niah`` defines them (:mod:`confkv.eval.niah`):

- ``streaming`` (default): the prompt but its last token is fed in chunks of ``chunk`` tokens
  and the cache is brought under budget after every chunk (peak KV = budget + chunk): the
  policy decides what to keep before it has seen the question.
- ``query-aware``: the same chunks with eviction deferred (``cache.evict = False``), the last
  ``query_window`` prompt tokens (but the last) as their own final chunk (the observation
  window, where a RULER question sits), then one compression to the budget
  (``cache.end_step(last_logits)``). Peak KV during the prefill is the whole prompt.

Then greedy decoding with ``model.generate`` on the cache. Prompts of different lengths are
left-padded and masked; confkv keeps the padding out of attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from confkv.hf.cache import ConfKVCache
from confkv.hf.generate import padding_positions, prefill

PROTOCOLS = ("streaming", "query-aware")


@dataclass
class Generation:
    text: str
    new_tokens: int
    kept_at_answer: float  # mean over layers of tokens kept when the first answer token is generated
    peak_kv_bytes_per_seq: float


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, L], attention mask [B, L]), padded on the left with ``pad_id``."""
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("left_pad: every row needs at least one token")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.as_tensor(list(row), dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def _check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")


def pad_token_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    return 0 if pad is None else int(pad)


def _fill(model: Any, cache: ConfKVCache, ids: torch.Tensor, mask: torch.Tensor, *, protocol: str, chunk: int,
          query_window: int) -> None:
    """Bring ``ids[:, :-1]`` into ``cache`` with ``protocol`` (see the module docstring)."""
    body = ids.shape[1] - 1
    if body < 1:
        return
    if protocol == "query-aware":
        cache.evict = False
    split = max(0, body - query_window) if protocol == "query-aware" else body
    logits = None
    if split > 0:
        logits = prefill(model, cache, ids[:, :split], mask[:, :split], chunk=chunk)
    if split < body:
        logits = prefill(model, cache, ids[:, split:body], mask[:, :body], chunk=chunk)
    if protocol == "query-aware":
        cache.evict = True
        cache.end_step(logits)


@torch.no_grad()
def generate_compressed(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], *, policy: str,
                        params: dict[str, Any], store: Any = None, protocol: str = "streaming", chunk: int = 512,
                        query_window: int = 64, max_new_tokens: int = 32,
                        stop: Sequence[str] = ()) -> list[Generation]:
    """Greedy continuations of token-id ``prompts`` with a ``policy`` cache, one batch.

    ``stop``: strings that end a continuation (the text is cut before the first one).
    """
    _check_protocol(protocol)
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in left_pad(prompts, pad_token_id(tokenizer)))
    cache = ConfKVCache.for_model(model, policy, store=store, **params)
    _fill(model, cache, ids, mask, protocol=protocol, chunk=chunk, query_window=query_window)
    answer_step = len(cache.trace)
    kwargs: dict[str, Any] = {}
    stop = [s for s in stop if s]
    if stop:
        kwargs.update(stop_strings=list(stop), tokenizer=tokenizer)
    out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=pad_token_id(tokenizer), **kwargs)
    new = out[:, ids.shape[1]:]
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    batch = ids.shape[0]
    trace = cache.trace
    kept = trace.steps[answer_step].kept.float().mean(0) if len(trace) > answer_step else torch.zeros(batch)
    peak = trace.peak_kv_bytes() / batch
    results = []
    for i, text in enumerate(texts):
        for s in stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        results.append(Generation(text=text, new_tokens=int(new.shape[1]), kept_at_answer=float(kept[i]),
                                  peak_kv_bytes_per_seq=peak))
    return results


@torch.no_grad()
def score_compressed(model: Any, tokenizer: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                     policy: str, params: dict[str, Any], store: Any = None, chunk: int = 512
                     ) -> list[tuple[float, bool]]:
    """Log-probability of each continuation given its context, read through a ``policy`` cache.

    ``pairs``: (context ids, continuation ids), both non-empty. The sequences context +
    continuation are left-padded to a common end; everything before the last
    ``max continuation`` + 1 tokens is prefilled in chunks with eviction (the streaming
    protocol), then one forward pass over the rest gives the continuation logits.
    Returns ``(sum of log-probabilities, continuation is the greedy choice)`` per pair.
    """
    if any(len(c) == 0 or len(x) == 0 for c, x in pairs):
        raise ValueError("score_compressed: contexts and continuations must be non-empty")
    device = next(model.parameters()).device
    rows = [list(c) + list(x) for c, x in pairs]
    ids, mask = (t.to(device) for t in left_pad(rows, pad_token_id(tokenizer)))
    tail = max(len(x) for _, x in pairs)
    length = ids.shape[1]
    split = max(0, length - tail - 1)  # tokens prefilled with eviction; the rest is read in one pass
    cache = ConfKVCache.for_model(model, policy, store=store, **params)
    if split > 0:
        prefill(model, cache, ids[:, :split], mask[:, :split], chunk=chunk)
    window = mask[:, : length - 1]
    out = model(input_ids=ids[:, split: length - 1], cache=cache, use_cache=True, attention_mask=window,
                position_ids=padding_positions(window)[:, split:])
    logprobs = torch.log_softmax(out.logits.float(), dim=-1)  # [B, tail(+1), V] predicting ids[:, split+1:]
    targets = ids[:, split + 1:]
    results = []
    for i, (_, continuation) in enumerate(pairs):
        n = len(continuation)
        lp = logprobs[i, -n:]
        target = targets[i, -n:]
        total = float(lp.gather(-1, target[:, None]).sum())
        greedy = bool((lp.argmax(-1) == target).all())
        results.append((total, greedy))
    return results


__all__ = ["Generation", "PROTOCOLS", "generate_compressed", "left_pad", "pad_token_id", "score_compressed"]
