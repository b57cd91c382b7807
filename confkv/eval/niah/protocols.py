"""The two NIAH protocols: how a prompt is fed and when the cache is brought to its budget.

Protocols (always reported separately):

- ``query-aware``: the haystack is prefilled in chunks, then the question (all but its
  last token) as its own last chunk, all with eviction *deferred* (``cache.evict = False``:
  the policy still observes attention and the store still ages, nothing is dropped);
  then the cache is brought to its memory target once (``cache.end_step(last_logits)``
  with eviction back on: the same end-of-step every forward pass runs, one extra trace
  record; the target at that step is ``memory`` x the prompt's full bytes, kvpress's
  ``compression_ratio = 1 - memory``); then greedy generation, every step under the target.
  The last attention every policy observes is the question's alone (SnapKV's observation window; TOVA's "current query"), so the ranking
  has seen the question; peak memory during prefill is the full prompt. (Protocol
  version 2; version 1 chunked the whole prompt, so the question shared its last chunk
  with up to ``chunk`` haystack tokens. Records keep their ``protocol_version``; a grid
  never resumes from records of another version.)
- ``streaming``: the haystack is prefilled in chunks with eviction after each chunk
  (the target held at the end of every chunk; a chunk's forward pass holds up to ``chunk`` more), then the question (all but its last token), then
  greedy generation: the policy must decide what to keep before the question exists.

All samples of one batch have the same number of tokens
(:func:`confkv.data.make_niah_sample` pads the haystack to the exact length), so they run
with per-sequence budgets and no padding.
"""

from __future__ import annotations

from typing import Any

import torch

from confkv.config import StoreConfig


def _generate(model: Any, tokenizer: Any, cache: Any, ids: torch.Tensor, max_new_tokens: int
              ) -> list[tuple[str, float, float, float]]:
    """Greedy answer from a cache holding the prompt minus its last token.

    Returns per sequence (text, kept tokens at the answer, peak KV bytes/seq, peak resident
    KV bytes/seq); the two peaks differ only with an offloaded cold tier.
    """
    batch = ids.shape[0]
    answer_step = len(cache.trace)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=pad)
    texts = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    trace = cache.trace
    kept = trace.steps[answer_step].kept.float().mean(0) if len(trace) > answer_step else torch.zeros(batch)
    peak = trace.peak_kv_bytes() / batch
    resident = trace.peak_resident_bytes() / batch
    return [(texts[i], float(kept[i]), peak, resident) for i in range(batch)]


def _batch_ids(samples: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.cat([s.input_ids for s in samples]), torch.cat([s.context_ids for s in samples]),
            torch.cat([s.question_ids for s in samples]))


@torch.no_grad()
def run_niah_batch(model: Any, tokenizer: Any, samples: list, policy: str, params: dict[str, Any], protocol: str,
                   *, store: StoreConfig, chunk: int, max_new_tokens: int) -> list[tuple[str, float, float, float]]:
    """Run one batch of same-length samples; per sequence (generated text, kept tokens at the answer,
    peak KV bytes/seq, peak resident KV bytes/seq)."""
    from confkv.hf import ConfKVCache

    device = next(model.parameters()).device
    ids, context, question = (t.to(device) for t in _batch_ids(samples))
    cache = ConfKVCache.for_model(model, policy, store=store, **params)
    if protocol == "query-aware":
        cache.evict = False
        logits = _feed_prompt(model, cache, context, question, chunk)
        cache.evict = True
        cache.end_step(logits)  # bring the cache to its target at the prompt's length
    else:
        _feed_prompt(model, cache, context, question, chunk)
    return _generate(model, tokenizer, cache, ids, max_new_tokens)


def _feed_prompt(model: Any, cache: Any, context: torch.Tensor, question: torch.Tensor, chunk: int) -> torch.Tensor:
    """Prefill the haystack in chunks, then the question but its last token as its own chunk; last logits."""
    from confkv.hf import prefill

    logits = prefill(model, cache, context, chunk=chunk)
    if question.shape[1] > 1:
        logits = prefill(model, cache, question[:, :-1], chunk=chunk)
    return logits


@torch.no_grad()
def run_query_aware_shared(model: Any, tokenizer: Any, samples: list, members: list[tuple[str, dict[str, Any]]],
                           *, store: StoreConfig, chunk: int, max_new_tokens: int
                           ) -> list[list[tuple[str, float, float, float]]]:
    """Query-aware protocol for several policies from ONE prefill (same store settings).

    Nothing is evicted during a query-aware prefill, so the forward pass is the same for
    every policy; a :class:`~confkv.policies.tee.TeePolicy` feeds all their statistics,
    then each policy gets a fork of the cache, compresses it and answers. Equal to running
    :func:`run_niah_batch` per policy up to float summation order (tests/hf/test_tee_fork.py).
    ``members`` are (policy or preset, parameters) pairs that share one memory target and one
    storage when they have one (``memory=`` among the parameters; a fork keeps the shared
    cache's target and storage).
    Returns one list of (text, kept, peak bytes/seq, peak resident bytes/seq) per member.
    """
    from confkv.hf import ConfKVCache
    from confkv.policies.tee import TeePolicy
    from confkv.presets import resolve

    device = next(model.parameters()).device
    ids, context, question = (t.to(device) for t in _batch_ids(samples))
    specs = [resolve(name, **params) for name, params in members]
    if len({(s.target, s.storage) for s in specs}) > 1:
        raise ValueError("run_query_aware_shared: the members must share one memory target and storage; "
                         f"got {sorted({(str(s.target), str(s.storage)) for s in specs})}")
    tee = TeePolicy.of([s.policy for s in specs])
    target = specs[0].target
    shared = ConfKVCache.for_model(model, tee, store=store, storage=specs[0].storage,
                                   memory=target.memory if target else None,
                                   max_kv_bytes=target.max_kv_bytes if target else None)
    shared.evict = False
    logits = _feed_prompt(model, shared, context, question, chunk)
    outputs = []
    for index in range(len(members)):
        cache = shared.fork(index)
        cache.end_step(logits)
        outputs.append(_generate(model, tokenizer, cache, ids, max_new_tokens))
        del cache
    return outputs

