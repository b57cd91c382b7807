"""One agent episode on one streaming confkv cache, in the two protocols.

Both protocols keep the whole history in ONE cache per episode: every observation
segment is prefilled in chunks with eviction on (peak KV bytes <= budget + chunk), every
action is generated greedily with eviction on (one forward pass per token).

- ``teacher-forced``: the history is the expert's. At each step the model's greedy action
  is generated on a clone of the cache (:meth:`ConfKVCache.clone`, thrown away after),
  then the expert's action is fed to the cache. Scored per step: the parsed prediction
  equals the expert's action (canonical spelling), and, in :mod:`confkv.eval.agent.grid`, equals
  full KV's prediction at the same step.
- ``closed-loop``: the model acts; its action is applied to the environment; the episode
  ends at ``stop``, after ``max_steps`` steps, or when the model's positions run out.
  Scored: the task's checker on the final state.

Peak KV bytes cover the clones; mean KV bytes are over the forward passes of the episode's
cache (teacher-forced: the clones' generation passes are not in the mean).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from confkv.eval.agent.actions import parse_action
from confkv.eval.agent.env import WebEnv
from confkv.eval.agent.expert import run_plan
from confkv.eval.agent.prompt import ChatFormat
from confkv.eval.agent.tasks import Task
from confkv.eval.agent.world import World
from confkv.config import StoreConfig

PROTOCOLS = ("teacher-forced", "closed-loop")


@dataclass
class Episode:
    """What one episode produced. steps: one dict per step (predicted, and expert / ok / error)."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    success: bool | None = None  # closed loop only
    answer: str | None = None
    tokens: int = 0  # history tokens fed to the episode's cache
    peak_kv_bytes: int = 0
    mean_kv_bytes: float = 0.0
    truncated: bool = False  # the model's positions ran out before the end
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _stop_ids(tokenizer: Any) -> set[int]:
    ids = {getattr(tokenizer, "eos_token_id", None)}
    end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    return {i for i in ids | {end} if isinstance(i, int)}


@torch.no_grad()
def greedy_action(model: Any, tokenizer: Any, cache: Any, logits: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Greedy tokens from ``logits`` [1, V] on, fed to ``cache`` one per forward pass (eviction on).

    Stops at an end-of-turn token, at the first line break after some text, or after
    ``max_new_tokens``. The last returned token is NOT in the cache.
    """
    stops, out = _stop_ids(tokenizer), []
    token = int(logits[0].argmax())
    device = next(model.parameters()).device
    while True:
        out.append(token)
        if token in stops or len(out) >= max_new_tokens:
            break
        text = tokenizer.decode(out, skip_special_tokens=True)
        if "\n" in text.lstrip():
            break
        result = model(input_ids=torch.tensor([[token]], device=device), cache=cache, use_cache=True,
                       logits_to_keep=1)
        token = int(result.logits[0, -1].argmax())
    return out


def _feed(model: Any, cache: Any, ids: list[int], chunk: int) -> torch.Tensor:
    from confkv.hf import prefill

    device = next(model.parameters()).device
    return prefill(model, cache, torch.tensor([ids], device=device), chunk=chunk)


def _fits(limit: int | None, cache: Any, n: int, max_new_tokens: int) -> bool:
    return limit is None or cache.get_seq_length() + n + max_new_tokens <= limit


def _limit(model: Any) -> int | None:
    from confkv.models import model_max_positions

    try:
        return model_max_positions(model)
    except ValueError:
        return None


def expert_history_tokens(tokenizer: Any, world: World, task: Task, fmt: ChatFormat,
                          max_steps: int | None = None) -> int:
    """Tokens of the teacher-forced history (observations and expert actions of the first ``max_steps`` steps)."""
    steps = run_plan(WebEnv(world, task.start_url, task.cart), task.plan)[:max_steps]
    total = 0
    for t, step in enumerate(steps):
        segment = fmt.first(task.goal, step.observation) if t == 0 else fmt.next(step.observation)
        total += len(encode(tokenizer, segment)) + len(encode(tokenizer, step.action.canonical()))
    return total


@torch.no_grad()
def run_episode(model: Any, tokenizer: Any, world: World, task: Task, protocol: str, policy: str,
                params: dict[str, Any], *, store: StoreConfig, chunk: int = 128, max_new_tokens: int = 24,
                max_steps: int | None = None, extra_steps: int = 5, fmt: ChatFormat | None = None) -> Episode:
    """Run ``task`` under ``protocol`` with a fresh ``policy`` cache; see the module docstring."""
    from confkv.hf import ConfKVCache

    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    fmt = fmt or ChatFormat.for_tokenizer(tokenizer)
    started = time.perf_counter()
    cache = ConfKVCache.for_model(model, policy, store=store, **params)
    limit, episode, peak = _limit(model), Episode(), 0
    expert = run_plan(WebEnv(world, task.start_url, task.cart), task.plan)
    if protocol == "teacher-forced":
        for t, step in enumerate(expert[:max_steps]):
            ids = encode(tokenizer, fmt.first(task.goal, step.observation) if t == 0 else fmt.next(step.observation))
            action_ids = encode(tokenizer, step.action.canonical())
            if not _fits(limit, cache, len(ids) + len(action_ids), max_new_tokens):
                episode.truncated = True
                break
            logits = _feed(model, cache, ids, chunk)
            look = cache.clone()
            out = greedy_action(model, tokenizer, look, logits, max_new_tokens)
            peak = max(peak, look.trace.peak_kv_bytes())
            del look
            text = tokenizer.decode(out, skip_special_tokens=True).strip()
            predicted = parse_action(text).canonical()
            episode.steps.append({"predicted": predicted, "expert": step.action.canonical(), "raw": text,
                                  "agree": predicted == step.action.canonical()})
            _feed(model, cache, action_ids, chunk)
    else:
        env = WebEnv(world, task.start_url, task.cart)
        budget_steps = max_steps if max_steps is not None else len(expert) + extra_steps
        pending: list[int] = []
        stops = _stop_ids(tokenizer)
        for t in range(budget_steps):
            observation = env.observation()
            ids = pending + encode(tokenizer, fmt.first(task.goal, observation) if t == 0 else fmt.next(observation))
            if not _fits(limit, cache, len(ids), max_new_tokens):
                episode.truncated = True
                break
            logits = _feed(model, cache, ids, chunk)
            out = greedy_action(model, tokenizer, cache, logits, max_new_tokens)
            text = tokenizer.decode(out, skip_special_tokens=True).strip()
            action = parse_action(text)
            result = env.step(action)
            episode.steps.append({"predicted": action.canonical(), "raw": text, "ok": result.ok,
                                  "error": result.error})
            pending = [] if out[-1] in stops else [out[-1]]
            if result.done:
                break
        episode.answer = env.state.answer
        episode.success = bool(task.check(env.state))
    episode.tokens = cache.get_seq_length()
    episode.peak_kv_bytes = int(max(peak, cache.trace.peak_kv_bytes()))
    episode.mean_kv_bytes = float(cache.trace.mean_kv_bytes())
    episode.seconds = time.perf_counter() - started
    return episode
