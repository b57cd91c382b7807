"""Token-by-token streaming perplexity through a confkv cache.

Every token is fed alone (after the cache was brought under budget at the previous
step), so each prediction sees exactly what the policy kept: the honest measure of an
eviction policy, and the loop the paper's perplexity numbers use.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from confkv.config import StoreConfig
from confkv.hf.cache import ConfKVCache
from confkv.hf.generate import check_prompt_length
from confkv.policies import Policy
from confkv.progress import progress as show_progress
from confkv.tiers.planner import MemoryTrace


@dataclass
class PplResult:
    """Outcome of :func:`streaming_ppl`.

    Attributes:
        nll: [N-1] float64 negative log-likelihood of tokens 1..N-1 (nats).
        trace: the cache's per-step memory trace.
        seconds: wall time of the loop.
    """

    nll: torch.Tensor
    trace: MemoryTrace
    seconds: float
    policy: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False

    @property
    def ppl(self) -> float:
        return math.exp(float(self.nll.mean())) if self.nll.numel() else float("nan")

    @property
    def tokens(self) -> int:
        return int(self.nll.numel())

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "params": self.params, "tokens": self.tokens, "ppl": self.ppl,
                "peak_kv_bytes": self.trace.peak_kv_bytes(), "mean_kv_bytes": self.trace.mean_kv_bytes(),
                "seconds": self.seconds, "tokens_per_second": self.tokens / self.seconds if self.seconds else None,
                "interrupted": self.interrupted}


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (``KeyboardInterrupt``) during :func:`streaming_ppl`; ``partial`` holds the tokens done.

    A ``KeyboardInterrupt`` subclass, so callers that do not handle it still stop as on Ctrl-C.
    """

    def __init__(self, partial: PplResult) -> None:
        super().__init__(f"interrupted after {partial.tokens} tokens")
        self.partial = partial


@torch.no_grad()
def streaming_ppl(model: torch.nn.Module, input_ids: torch.Tensor, policy: str | Policy | None = "full", *,
                  store: StoreConfig | None = None, progress: bool = True, **policy_params: Any) -> PplResult:
    """Streaming perplexity of ``input_ids`` [1, N] under ``policy``.

    Each step feeds one token, scores the next one from the raw logits, and lets the
    cache evict. Returns per-token NLL and the memory trace.

    Raises:
        PromptTooLongError: ``N`` exceeds the model's positions.
        RunInterrupted: on Ctrl-C; its ``partial`` is the result of the tokens done so far.
    """
    if input_ids.ndim != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [1, N] with N >= 2, got {tuple(input_ids.shape)}")
    check_prompt_length(model, input_ids.shape[1])
    cache = ConfKVCache.for_model(model, policy, store=store, record_confidence=True, **policy_params)
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    steps = input_ids.shape[1] - 1
    nll = torch.empty(steps, dtype=torch.float64)
    name = policy if isinstance(policy, str) else (policy.name if policy is not None else "tiered")
    start = time.perf_counter()
    done = 0
    try:
        for t in show_progress(range(steps), desc=f"ppl {cache.policy.name}", enabled=progress):
            logits = model(input_ids=input_ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1].float()
            nll[t] = float(torch.logsumexp(logits, -1) - logits[input_ids[0, t + 1]])
            done = t + 1
    except KeyboardInterrupt as interrupt:
        del cache.trace.steps[done:]  # a step cut between the forward pass and its NLL is dropped
        partial = PplResult(nll=nll[:done].clone(), trace=cache.trace, seconds=time.perf_counter() - start,
                            policy=name, params=dict(policy_params), interrupted=True)
        raise RunInterrupted(partial) from interrupt
    seconds = time.perf_counter() - start
    return PplResult(nll=nll, trace=cache.trace, seconds=seconds, policy=name, params=dict(policy_params))


@dataclass(frozen=True)
class PplUnit:
    """One ``confkv ppl`` run: the corpus slice and the policy (tokens are read with the worker's tokenizer)."""

    corpus: str
    tokens: int
    offset: int
    policy: str
    params: dict[str, Any]
    store: StoreConfig
    progress: bool = False

    @property
    def key(self) -> tuple:
        return (self.corpus, self.tokens, self.offset, self.policy, repr(sorted(self.params.items())), self.store)


def run_ppl_unit(model: Any, tokenizer: Any, unit: PplUnit) -> list[PplResult]:
    """Run one streaming-perplexity run; its :class:`PplResult` in a list.

    Pure: the same result in process and on a Ray actor, apart from ``seconds``.
    """
    from confkv.data import corpus_tokens

    ids = corpus_tokens(tokenizer, unit.corpus, unit.tokens, offset=unit.offset)
    return [streaming_ppl(model, ids, unit.policy, store=unit.store, progress=unit.progress, **unit.params)]
