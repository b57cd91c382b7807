"""The scheduler behind ``confkv serve``: one decode loop, requests join and leave between steps.

Design (stated plainly, docs/SERVING.md "confkv serve"):

- **One cache per row.** Every request gets its own :class:`~confkv.hf.ConfKVCache`, built from its
  own settings (memory target, policy, parameters). One cache object holds one memory target, so
  rows with different targets cannot share a cache; they share the model and the loop.
- **One forward per row per step, round-robin.** A scheduler *round* gives every running row one
  forward pass: a prefill chunk of at most ``chunk`` prompt tokens, or one decode token. New
  requests join the running set at the start of the next round (at most ``max_batch`` rows run;
  the rest wait in a queue of at most ``max_queue``); finished, failed and cancelled rows leave at
  the end of their step. So a running row waits, between two of its tokens, at most
  ``max_batch - 1`` other forwards of at most ``chunk`` tokens each: the stall a new long prompt
  causes is bounded by the chunk, not by the prompt's length.
- **Exactness.** A row runs exactly what :func:`confkv.hf.generate` runs for one sequence: the
  prompt but its last token in chunks of ``chunk`` tokens, then one token per forward. Greedy
  output (temperature 0) therefore equals ``confkv.hf.generate(model, ids, cache, chunk=chunk,
  do_sample=False)`` (``model.generate`` after the chunked prefill) token for token, whatever else
  runs in the loop; seeded sampling uses transformers' temperature / top-p warpers and a
  per-request ``torch.Generator``, as ``model.generate`` after ``torch.manual_seed(seed)`` does.

The loop runs in one thread; HTTP handlers talk to it through :meth:`Engine.submit` and each
request's ``emit`` callback.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from confkv.errors import ConfKVError


class QueueFull(ConfKVError):
    """The waiting queue is full (HTTP 429)."""


class ShuttingDown(ConfKVError):
    """The engine is draining and takes no new requests (HTTP 503)."""


@dataclass
class Job:
    """One request: its prompt, sampling settings, cache, and progress."""

    prompt: list[int]
    cache: Any  # ConfKVCache
    max_tokens: int
    emit: Callable[[str, Any], None]  # emit("token", id) / emit("done", reason) / emit("error", message)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    eos: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stop_check: Callable[[list[int]], bool] | None = None  # True: a stop string was reached
    id: int = 0
    fed: int = 0  # prompt tokens fed so far
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False
    kv_bytes: int = 0
    peak_kv_bytes: int = 0
    target_bytes: int = 0
    submitted: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    warpers: list[Any] = field(default_factory=list)

    def cancel(self) -> None:
        """Ask the loop to drop this row at its next step (a client that went away)."""
        self.cancelled = True


class Engine:
    """The scheduler: one thread, one model, rows with their own caches (see the module docstring).

    Args:
        model: a causal LM switched to confkv attention (``ConfKVCache.for_model`` does it).
        chunk: prompt tokens per prefill forward (the bound on a new prompt's stall per round).
        max_batch: rows running at once; max_queue: requests waiting beyond them (then :class:`QueueFull`).
        step_hook: called with each job before its forward (tests inject faults with it).
    """

    def __init__(self, model: torch.nn.Module, *, chunk: int = 256, max_batch: int = 8, max_queue: int = 64,
                 step_hook: Callable[[Job], None] | None = None) -> None:
        if chunk < 1 or max_batch < 1 or max_queue < 0:
            raise ValueError("chunk and max_batch must be >= 1, max_queue >= 0")
        self.model = model
        self.chunk, self.max_batch, self.max_queue = chunk, max_batch, max_queue
        self.step_hook = step_hook
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self._cv = threading.Condition()
        #: held by the loop during each row's step; hold it to see the rows between steps (tests, metrics)
        self.step_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._stopping = False
        self._thread: threading.Thread | None = None
        # metrics (written by the loop; read by /metrics)
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.kv_bytes_held = 0
        self.offloaded_bytes_held = 0
        self.target_bytes_held = 0
        self.peak_kv_bytes_held = 0
        self.target_bytes_at_peak = 0
        self.request_peaks: list[int] = []  # per finished request: its peak KV bytes (the last 1,000)
        self.request_peak_sum = 0
        self.request_peak_count = 0
        self.request_peak_max = 0
        self._token_times: collections.deque[tuple[float, int]] = collections.deque()

    # -- the HTTP side ------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="confkv-engine", daemon=True)
            self._thread.start()
        return self

    def submit(self, job: Job) -> Job:
        """Queue ``job``; raises :class:`QueueFull` or :class:`ShuttingDown` instead of waiting."""
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down; retry on another replica")
            if len(self.waiting) >= self.max_queue:
                self.outcomes["rejected"] += 1
                raise QueueFull(f"the queue is full ({len(self.waiting)} requests waiting, {len(self.running)} "
                                f"running); retry later")
            job.id = next(self._ids)
            job.submitted = time.monotonic()
            if job.temperature > 0:
                from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

                job.generator = torch.Generator()
                job.generator.manual_seed(job.seed if job.seed is not None else torch.seed())
                job.warpers = [TemperatureLogitsWarper(job.temperature)]
                if job.top_p < 1.0:
                    job.warpers.append(TopPLogitsWarper(job.top_p))
            self.waiting.append(job)
            self._cv.notify()
        return job

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new requests; with ``drain`` finish the running and waiting ones, else cancel them."""
        with self._cv:
            self._stopping = True
            if not drain:
                for job in list(self.waiting) + self.running:
                    job.cancel()
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last ``window`` seconds."""
        now = time.monotonic()
        times = list(self._token_times)
        count = sum(n for t, n in times if t >= now - window)
        return count / window

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self.waiting and not self.running and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self.waiting and not self.running:
                    return
                while self.waiting and len(self.running) < self.max_batch:
                    self.running.append(self.waiting.popleft())
            for job in list(self.running):
                with self.step_lock:
                    try:
                        end = self._step(job)
                        if end is not None:  # the row leaves: accounted before its client hears the end,
                            self._finish(job, end[0])  # and the totals before it leaves the running list,
                        self._update_totals()  # so a reader that sees it gone sees its bytes gone too
                        if end is not None:
                            self.running.remove(job)
                    except Exception as error:  # noqa: BLE001 - the loop's own bookkeeping failed: this row ends
                        end = ("failed", "error", f"internal error: {type(error).__name__}: {error}")
                        if job in self.running:
                            self.running.remove(job)
                            self.outcomes["failed"] += 1
                if end is not None:
                    job.emit(end[1], end[2])

    @torch.no_grad()
    def _step(self, job: Job) -> tuple[str, str, Any] | None:
        """One forward for ``job``; when the row leaves, returns (outcome, last event, its payload), else None."""
        if job.cancelled:
            return "cancelled", "done", "cancelled"
        try:
            if self.step_hook is not None:
                self.step_hook(job)
            last = len(job.prompt) - 1
            if job.fed < last:  # prefill: a chunk of the prompt but its last token
                ids = job.prompt[job.fed:min(job.fed + self.chunk, last)]
                self.model(input_ids=torch.tensor([ids]), cache=job.cache, use_cache=True, logits_to_keep=1)
                job.fed += len(ids)
                self.prompt_tokens += len(ids)
                self._account(job)
                return None
            token_in = job.prompt[-1] if not job.tokens else job.tokens[-1]
            if not job.tokens:
                job.fed += 1
                self.prompt_tokens += 1
            out = self.model(input_ids=torch.tensor([[token_in]]), cache=job.cache, use_cache=True, logits_to_keep=1)
            self._account(job)
            logits = out.logits[:, -1, :].to(dtype=torch.float32)
            if bool(torch.isnan(logits).any()):
                raise FloatingPointError("the model produced NaN logits for this request; it was stopped")
            token = self._sample(job, logits)
        except Exception as error:  # noqa: BLE001 - one request fails, the loop goes on
            message = str(error) or type(error).__name__
            return "failed", "error", message if isinstance(error, ConfKVError) else f"{type(error).__name__}: {message}"
        job.tokens.append(token)
        self.generated_tokens += 1
        self._token_times.append((time.monotonic(), 1))
        while self._token_times and self._token_times[0][0] < time.monotonic() - 60:
            self._token_times.popleft()
        job.emit("token", token)
        if token in job.eos and not job.ignore_eos:
            return "completed", "done", "stop"
        if job.stop_check is not None and job.stop_check(job.tokens):
            return "completed", "done", "stop"
        if len(job.tokens) >= job.max_tokens:
            return "completed", "done", "length"
        return None

    @staticmethod
    def _sample(job: Job, logits: torch.Tensor) -> int:
        if job.generator is None:
            return int(logits.argmax(-1))
        scores = logits
        for warper in job.warpers:  # temperature and top-p read only the scores
            scores = warper(None, scores)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=job.generator))

    def _account(self, job: Job) -> None:
        job.kv_bytes = job.cache.kv_bytes()
        job.peak_kv_bytes = max(job.peak_kv_bytes, job.kv_bytes)
        plan = getattr(job.cache, "last_plan", None)
        job.target_bytes = plan.target_bytes if plan is not None else job.kv_bytes

    def _finish(self, job: Job, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.request_peak_count += 1
        self.request_peak_sum += job.peak_kv_bytes
        self.request_peak_max = max(self.request_peak_max, job.peak_kv_bytes)
        close = getattr(job.cache, "close", None)
        if close is not None:
            close()
        job.cache = None  # the row's KV memory goes with it
        job.kv_bytes = job.target_bytes = 0

    def _update_totals(self) -> None:
        rows = list(self.running)
        held = sum(j.kv_bytes for j in rows)
        self.kv_bytes_held = held
        self.offloaded_bytes_held = sum(j.cache.offloaded_bytes() for j in rows if j.cache is not None)
        self.target_bytes_held = sum(j.target_bytes for j in rows)
        if held > self.peak_kv_bytes_held:
            self.peak_kv_bytes_held = held
            self.target_bytes_at_peak = self.target_bytes_held

