"""``confkv bench``: per-step decode latency, batched throughput and a step breakdown.

A benchmark, never a timed test. Everything is measured in ONE process, with the
configurations interleaved (A, B, C, A, B, C, ...) so that a loaded machine slows all
of them alike; results are reported as medians, spreads (p10-p90) and ratios to
transformers' ``DynamicCache``.

Protocol
--------
* Every configuration owns one cache that grows through the contexts in ascending
  order: the prompt (a real text, ``pydoc-topics`` by default) is fed in chunks up to
  the next context ``C`` (``confkv.hf.prefill`` for confkv caches, chunked forward
  passes for the transformers caches), then ``warmup`` + ``repeats x steps`` decode
  steps are timed, interleaved across configurations. Decode steps feed the text's
  next tokens (teacher forcing), so every configuration sees the same tokens.
* ``DynamicCache`` and ``QuantizedCache`` run with ``attn_implementation="sdpa"``;
  confkv caches with ``"confkv"`` (set before each configuration's turn).
* dtypes (``--dtype float32 bfloat16``): every configuration runs once per dtype, with the
  model loaded in that dtype, all of them interleaved in the same loop; rows of a dtype
  other than float32 are labelled ``name@bf16`` and compared with that dtype's
  ``DynamicCache`` (:mod:`confkv.eval.bench.dtypes`). Before the grid, a perplexity check
  per dtype (streaming, policy ``full``, the text's first ``quality_tokens`` tokens) with its
  ratio to float32's.
* llama.cpp peer row (optional ``llama_cpp``; :mod:`confkv.eval.bench.llamacpp`): the same
  GGUF, threads and contexts, its steps interleaved with the other rows' steps; every row
  also carries its ratio to it (``x llama`` = llama.cpp time / this time).
* Throughput at batch B (after the latency grid): each configuration's cache at the
  last context is grown in place from the previous batch size with
  ``batch_repeat_interleave`` and row ``b`` is fed the text ``8 * b`` tokens further on,
  so the rows (and confkv's per-sequence budgets) diverge; tokens/s = B / step time.
  (transformers' ``QuantizedCache`` cannot repeat its quantized part: reported as such.)
* Floor: memory bandwidth from a large tensor copy measured in the same run; each
  configuration's floor is (weight bytes + KV bytes read) / bandwidth (llama.cpp: the GGUF
  file's bytes + its float16 KV).
* Breakdown: :mod:`confkv.profiling` timers around the policy's functions, for a
  few steps of the ``confkv`` configuration at the last context.
"""

from __future__ import annotations

import contextlib
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

from confkv import profiling
from confkv.native import loader as native_loader
from confkv.eval.bench.configs import BenchConfig, default_configs, kivi_rows, preset_rows  # noqa: F401 - re-exported
from confkv.eval.bench.dtypes import check_quality_tokens, models_by_dtype, parse_dtypes, quality_check, row_label
from confkv.eval.bench.llamacpp import (check_fill, check_kv_types, kv_bytes_per_token_f16, kv_fraction, peer_quality,
                                        peer_runners)
from confkv.eval.bench.loops import _latency_grid, _throughput
from confkv.eval.bench.machine import _loadavg, _peak_rss_bytes, measure_bandwidth, weight_bytes_read
from confkv.eval.bench.output import format_breakdown


class _Runner:
    """One configuration's model state and cache."""

    def __init__(self, config: BenchConfig, model: Any, dtype: str = "float32") -> None:
        self.config = config
        self.model = model
        self.dtype = dtype
        self.label = row_label(config.name, dtype)
        self.cache: Any = None
        self.error: str | None = None
        self.fed = 0
        self.decoder: Any = None  # LeanDecoder for lean configurations, built on first use

    def attn(self) -> None:
        wanted = "confkv" if self.config.kind == "confkv" else "sdpa"
        if wanted == "confkv":
            from confkv.hf import enable

            enable(self.model)  # registers the attention (idempotent)
        if self.model.config._attn_implementation != wanted:
            self.model.set_attn_implementation(wanted)

    def new_cache(self) -> Any:
        from transformers import DynamicCache, QuantizedCache

        from confkv.config import StoreConfig
        from confkv.hf import ConfKVCache

        kind = self.config.kind
        if kind == "dynamic":
            return DynamicCache()
        if kind == "quantized":
            return QuantizedCache("quanto", self.model.config, nbits=4)
        cache = ConfKVCache.for_model(self.model, self.config.policy, store=StoreConfig(**self.config.store),
                                      **self.config.params)
        return cache

    @torch.no_grad()
    def feed_to(self, ids: torch.Tensor, target: int, chunk: int) -> None:
        """Prefill up to ``target`` tokens of ``ids`` [1, N]."""
        from confkv.hf.generate import prefill

        self.attn()
        if self.cache is None:
            self.cache = self.new_cache()
        if target <= self.fed:
            return
        if self.config.kind == "confkv":
            prefill(self.model, self.cache, ids[:, self.fed:target], chunk=chunk)
        else:
            for begin in range(self.fed, target, chunk):
                end = min(begin + chunk, target)
                self.model(input_ids=ids[:, begin:end], cache=self.cache, use_cache=True, logits_to_keep=1)
        self.fed = target

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> float:
        """One decode step with ``tokens`` [B, 1]; returns seconds."""
        self.attn()
        if self.config.lean and self.decoder is None:
            from confkv.hf.lean import LeanDecoder

            self.decoder = LeanDecoder(self.model)
        with contextlib.nullcontext() if self.config.native else native_loader.disabled():
            start = time.perf_counter()
            if self.decoder is not None:
                self.decoder(tokens, self.cache)
            else:
                self.model(input_ids=tokens, cache=self.cache, use_cache=True, logits_to_keep=1)
            elapsed = time.perf_counter() - start
        self.fed += 1
        return elapsed

    def next_step(self, ids: torch.Tensor) -> float:
        """One decode step of the text's next token (``ids`` [1, N]); returns seconds."""
        return self.step(ids[:, self.fed:self.fed + 1])

    def kv_bytes(self) -> int:
        cache = self.cache
        if cache is None:
            return 0
        if hasattr(cache, "kv_bytes"):
            return int(cache.kv_bytes())
        total = 0
        for layer in cache.layers:
            for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
                t = getattr(layer, name, None)
                total += _tensor_bytes(t)
        return total

    def kept_tokens(self) -> float:
        cache = self.cache
        if hasattr(cache, "kept_counts"):
            return float(cache.kept_counts().float().mean())
        return float(cache.get_seq_length())


def _tensor_bytes(t: Any) -> int:
    """Bytes of a tensor, including quanto's quantized tensors (data + scales)."""
    if t is None:
        return 0
    if isinstance(t, torch.Tensor) and type(t) is torch.Tensor:
        return t.numel() * t.element_size()
    total = 0
    for attr in ("_data", "_scale", "_shift"):
        inner = getattr(t, attr, None)
        if isinstance(inner, torch.Tensor):
            total += _tensor_bytes(inner)
    if total == 0 and isinstance(t, torch.Tensor):
        total = t.numel() * t.element_size()
    return total


def run_bench(*, model_name: str = "smollm2", contexts: list[int], budget: int = 1024, slack: int = 64,
              steps: int = 4, repeats: int = 3, warmup: int = 2, chunk: int = 1024, batches: list[int] | None = None,
              batch_steps: int = 3, breakdown_steps: int = 8, configs: list[str] | None = None,
              corpus: str = "pydoc-topics", dtypes: list[str] | None = None, quality_tokens: int = 0,
              llamacpp: bool = True, gguf: str | Path | None = None, log: Callable[[str], None] = print,
              model: Any = None, tokenizer: Any = None, llamacpp_module: str = "llama_cpp",
              llamacpp_path: tuple[str, ...] = (), memory: tuple[float, ...] = (0.25,),
              formats: tuple[str, ...] = (), llamacpp_kv: tuple[str, ...] = ("f16",),
              kivi: tuple[str, ...] = (), preset_slacks: tuple[int | float, ...] = (),
              llamacpp_fill: str = "native") -> dict[str, Any]:
    """Run the benchmark; returns a JSON-ready dict (see the module docstring).

    Args:
        dtypes: ``--dtype`` names (``"float32"``, ``"bfloat16"``; default float32): the grid runs
            once per dtype, interleaved, with the model in that dtype (rows labelled, see
            :mod:`confkv.eval.bench.dtypes`).
        quality_tokens: perplexity check on this many tokens of the text per dtype (0, the default
            here: skip; the CLI asks for 2048).
        llamacpp: add the llama.cpp row when ``llama_cpp`` is installed (else one line says how).
        gguf: that row's GGUF file (default: the file ``model_name`` is loaded from; with
            ``model`` given there is none unless passed here).
        model, tokenizer: an already loaded model (default: load ``model_name`` per dtype).
        llamacpp_module, llamacpp_path: the module llama.cpp's child process imports and the
            folders it searches first (a stand-in module in the tests).
        llamacpp_kv: llama.cpp's KV cache types, one row (and child process) each: ``f16`` is the
            row ``llama.cpp`` (the reference of ``x llama``), ``q8_0`` / ``q4_0`` the rows
            ``llama.cpp[q8_0]`` / ``llama.cpp[q4_0]``; with ``quality_tokens`` each also reports its
            perplexity from its own logits (``result["quality"]["llama.cpp[q4_0]"]``).
        llamacpp_fill: how the q8_0 / q4_0 rows' caches reach each context: ``"native"`` (llama.cpp's
            own prefill with that cache, flash attention: hours at 32K on two threads) or ``"f16"`` (a
            float16 prefill converted to the row's block format,
            :mod:`~confkv.eval.bench.llamacpp_state`); their timed steps are the same either way.
        preset_slacks: more ``tiered@<percent>+slack<s>-lean`` rows (``slack`` gives one), a count of tokens or a
            share of the tokens kept by rank each (:func:`~confkv.eval.bench.configs.preset_rows`).
        kivi: specs of extra KIVI rows (:func:`~confkv.eval.bench.configs.kivi_rows`), to compare page formats
            at one load.
    """
    from confkv.data import corpus_tokens, load_corpus
    from confkv.hf import ConfKVCache  # noqa: F401 - registers nothing, fails early if transformers is broken
    from confkv.models import load_model

    dtypes = parse_dtypes(dtypes)
    check_quality_tokens(quality_tokens)
    check_kv_types(llamacpp_kv)
    check_fill(llamacpp_fill)
    batches = batches or []
    contexts = sorted(contexts)
    all_configs = (default_configs(budget, slack, tuple(memory), tuple(formats), tuple(preset_slacks))
                   + kivi_rows(tuple(kivi)))
    if configs:
        unknown = set(configs) - {c.name for c in all_configs}
        if unknown:
            raise ValueError(f"unknown bench configs {sorted(unknown)}; known: {[c.name for c in all_configs]}")
        all_configs = [c for c in all_configs if c.name in configs]
    model_given = model is not None
    models, tokenizer = models_by_dtype(dtypes, model_name, model, tokenizer, load_model)
    decode_budget = len(contexts) * (warmup + steps * repeats) + 2
    max_batch = max(batches, default=1)
    need = (contexts[-1] + decode_budget + breakdown_steps * 4 + (batch_steps + warmup + 2) * (len(batches) + 1)
            + max_batch * 8 + 64)
    ids = corpus_tokens(tokenizer, corpus, max(need, quality_tokens))
    ids = ids if ids.ndim == 2 else ids[None]
    runners = [_Runner(c, models[d], d) for d in dtypes for c in all_configs]
    log(f"[bench] {torch.get_num_threads()} thread(s), dtypes {', '.join(dtypes)}")

    # the quantized cache's backend may not be installed: try it on a few tokens first
    for runner in runners:
        if runner.config.kind == "quantized":
            try:
                probe = _Runner(runner.config, runner.model, runner.dtype)
                probe.feed_to(ids, 16, chunk)
                probe.step(ids[:, 16:17])
            except Exception as error:  # noqa: BLE001 - report any backend failure
                runner.error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                log(f"[bench] {runner.label}: not available ({runner.error})")
    runners_ok = [r for r in runners if r.error is None]

    bandwidth = measure_bandwidth()
    weights = {d: weight_bytes_read(m) for d, m in models.items()}
    log(f"[bench] bandwidth {bandwidth['median_gbps']:.2f} GB/s (copy), weights read/step "
        + ", ".join(f"{d} {w / 1e6:.1f} MB" for d, w in weights.items()))
    result: dict[str, Any] = {
        "model": model_name, "contexts": contexts, "budget": budget, "slack": slack,
        "preset_slacks": list(preset_slacks), "steps": steps,
        "repeats": repeats, "warmup": warmup, "chunk": chunk, "threads": torch.get_num_threads(),
        "dtypes": dtypes, "torch": torch.__version__, "platform": platform.platform(), "bandwidth": bandwidth,
        "weight_bytes": weights[dtypes[0]], "weight_bytes_by_dtype": weights,
        "configs": {r.label: {"config": r.config.name, "dtype": r.dtype, "kind": r.config.kind,
                              "policy": r.config.policy, "params": r.config.params, "store": r.config.store,
                              "note": r.config.note, "error": r.error}
                    for r in runners},
        "quality": {}, "latency": {}, "throughput": {}, "breakdown": {}, "load": {},
    }
    result["load"]["start"] = _loadavg()
    if quality_tokens:
        result["quality"] = quality_check(models, ids, quality_tokens, log, tuple(memory))

    with contextlib.ExitStack() as stack:
        peers = peer_runners(llamacpp, gguf, None if model_given else model_name, load_corpus(corpus),
                             contexts[-1] + decode_budget, kv_bytes_per_token_f16(models[dtypes[0]]), stack, log,
                             torch.get_num_threads(), llamacpp_module, llamacpp_path, llamacpp_kv, llamacpp_fill)
        for peer in peers:
            result["configs"][peer.label] = {**peer.describe(), "error": None}
        if quality_tokens and peers:
            result["quality"].update(peer_quality(peers, quality_tokens, log))
            for line in equal_bytes_lines(result["quality"]):
                log(line)
        _latency_grid(result, runners_ok + peers, ids, contexts, chunk, warmup,
                      steps, repeats, weights, bandwidth, dtypes, log)
        for peer in peers:
            result["configs"][peer.label]["error"] = peer.error

    if breakdown_steps:  # every listed configuration that ran
        for dtype in dtypes:
            for name in ("confkv", f"confkv+slack{slack}", "confkv-int8", f"confkv-int8+slack{slack}", "window",
                         f"window+slack{slack}", "full", "confkv-r", f"confkv-r+slack{slack}",
                         f"confkv-r-offload+slack{slack}",
                         *preset_rows(tuple(memory), tuple(formats), slack, tuple(preset_slacks)),
                         *(config.name for config in kivi_rows(tuple(kivi)))):
                label = row_label(name, dtype)
                runner = next((r for r in runners_ok if r.label == label), None)
                if runner is not None:
                    result["breakdown"][label] = step_breakdown(runner, ids, breakdown_steps)
                    log(format_breakdown(label, result["breakdown"][label]))

    _throughput(result, runners_ok, ids, batches, batch_steps, warmup, log)
    result["load"]["end"] = _loadavg()
    result["peak_rss_bytes"] = _peak_rss_bytes()
    return result


def equal_bytes_lines(quality: dict[str, Any]) -> list[str]:
    """One line per preset row whose target is a llama.cpp KV type's bytes (q4_0: 18 / 64 = 0.28125 of f16,
    q8_0: 34 / 64): both rises over their own full caches, side by side."""
    lines = []
    for label, row in quality.items():
        if "rise_over_full" not in row:
            continue
        for peer_label, peer in quality.items():
            kv_type = peer.get("kv_type")
            if kv_type is None or peer.get("rise_over_f16") is None:
                continue
            if abs(row["memory"] - kv_fraction(kv_type)) < 1e-9:
                lines.append(f"[bench] equal KV bytes ({row['memory']:g} of a 16-bit cache): {label} "
                             f"{row['rise_over_full']:+.2%} over our full cache ({row['dtype']}), {peer_label} "
                             f"{peer['rise_over_f16']:+.2%} over llama.cpp's f16 cache")
    return lines


#: The policy's own work as issue 6 lists it (confidence, EMA update, ranking and top-k,
#: compaction, quantization) plus the gate and the eviction/ageing bookkeeping. The rest
#: of confkv's instrumented time (appending to the FP window, positions and masks, the
#: trace) is the store's per-step plumbing, reported as "cache overhead" with the policy work.
POLICY_SECTIONS = ("confidence", "budget gate", "EMA / stats update", "ranking and top-k", "compaction gather",
                   "quantization", "eviction bookkeeping", "ageing (old-region concat)", "ageing + eviction (one call)")


def step_breakdown(runner: _Runner, ids: torch.Tensor, steps: int) -> dict[str, Any]:
    """Mean ms per step spent in each instrumented section, over ``steps`` decode steps."""
    timers = profiling.Timers()
    total = 0.0
    with profiling.enabled(timers):
        for _ in range(steps):
            total += runner.step(ids[:, runner.fed:runner.fed + 1])
    sections = {name: 1e3 * t / steps for name, t in timers.seconds.items()}
    # the native decode step (the token's write, the read and the statistics update in one C call,
    # LayerStore._decode_in_place in confkv/store/read.py) is mostly its read: it counts with the
    # attention read, not as overhead
    overhead = sum(v for k, v in sections.items() if k not in ("attention read", "native decode step"))
    policy_work = sum(v for k, v in sections.items() if k in POLICY_SECTIONS)
    step_ms = 1e3 * total / steps
    # Model compute: everything that is not an instrumented confkv section.
    sections = {"model compute (rest)": step_ms - sum(sections.values()), **sections}
    # reads (one per layer and step) that left the native path, by reason (confkv.attention.read_plan)
    return {"step_ms": step_ms, "sections_ms": sections, "calls": dict(timers.calls),
            "left_native": dict(timers.fallbacks), "steps": steps,
            "policy_work_ms": policy_work, "policy_work_fraction": policy_work / step_ms,
            "cache_overhead_ms": overhead, "cache_overhead_fraction": overhead / step_ms}
