"""The timed loops of ``confkv bench``: the latency grid (every row interleaved) and batched throughput.

The protocol is in :mod:`confkv.eval.bench.run`'s docstring; the runners are ``bench._Runner``
(a cache configuration in one dtype) and :class:`~confkv.eval.bench.llamacpp.LlamaCppRunner`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from confkv.eval.bench.dtypes import row_label
from confkv.eval.bench.llamacpp import LABEL as LLAMA_LABEL
from confkv.eval.bench.llamacpp import LlamaCppRunner
from confkv.eval.bench.machine import _loadavg, _rss_bytes
from confkv.eval.bench.output import format_latency_rows, format_throughput_rows


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    def q(f: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(f * (len(ordered) - 1))))]
    return {"median_ms": 1e3 * statistics.median(times), "p10_ms": 1e3 * q(0.1), "p90_ms": 1e3 * q(0.9),
            "n": len(times)}


def _latency_grid(result: dict[str, Any], runners: list[Any], ids: torch.Tensor, contexts: list[int], chunk: int,
                  warmup: int, steps: int, repeats: int, weights: dict[str, int], bandwidth: dict[str, float],
                  dtypes: list[str], log: Callable[[str], None]) -> None:
    """Per-step latency at each context, every runner (the llama.cpp one too) interleaved; fills ``result``.

    A llama.cpp failure (its child process crashed, or an error it reported) is logged and
    recorded as the runner's ``error``; the row is dropped from that context on and the others
    go on. A failure of confkv's own rows propagates.
    """
    runners = list(runners)

    def peer_failed(runner: Any, context: int, error: Exception) -> None:
        runner.error = f"context {context}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        log(f"[bench] {runner.label} failed, row dropped from here on: {runner.error}")
        runners.remove(runner)

    for context in contexts:
        for runner in list(runners):
            start = time.perf_counter()
            try:
                runner.feed_to(ids, context, chunk)
            except Exception as error:  # noqa: BLE001 - llama.cpp's row only; ours propagate
                if not isinstance(runner, LlamaCppRunner):
                    raise
                peer_failed(runner, context, error)
                continue
            log(f"[bench] ctx {context} {runner.label}: prefill to {runner.fed} in "
                f"{time.perf_counter() - start:.1f}s")
        times: dict[str, list[float]] = {r.label: [] for r in runners}
        for rep in range(warmup + repeats):
            for runner in list(runners):
                n = 1 if rep < warmup else steps
                try:
                    for _ in range(n):
                        t = runner.next_step(ids)
                        if rep >= warmup:
                            times[runner.label].append(t)
                except Exception as error:  # noqa: BLE001 - llama.cpp's row only; ours propagate
                    if not isinstance(runner, LlamaCppRunner):
                        raise
                    peer_failed(runner, context, error)
                    del times[runner.label]
        medians = {label: statistics.median(t) for label, t in times.items()}
        peer_ms = medians.get(LLAMA_LABEL)
        rows = {}
        for runner in runners:
            label = runner.label
            peer = isinstance(runner, LlamaCppRunner)
            ref = medians.get(row_label("dynamic", dtypes[0] if peer else runner.dtype))
            summary = _summary(times[label])
            kv = runner.kv_bytes()
            weight = runner.file_bytes if peer else weights[runner.dtype]
            floor_s = (weight + kv) / (bandwidth["median_gbps"] * 1e9)
            summary.update({
                "config": runner.label if peer else runner.config.name, "dtype": runner.dtype,
                "kv_bytes": kv, "kept_tokens": runner.kept_tokens(), "floor_ms": 1e3 * floor_s,
                "speedup_vs_dynamic": (ref / medians[label]) if ref else None,
                "speedup_vs_llamacpp": (peer_ms / medians[label]) if peer_ms else None,
                "times_ms": [round(1e3 * t, 3) for t in times[label]],
            })
            rows[label] = summary
        rows["_rss_bytes"] = _rss_bytes()
        rows["_load"] = _loadavg()
        result["latency"][str(context)] = rows
        log(format_latency_rows(context, rows))


def _throughput(result: dict[str, Any], runners_ok: list[Any], ids: torch.Tensor, batches: list[int],
                batch_steps: int, warmup: int, log: Callable[[str], None]) -> None:
    """Batched throughput, the caches grown in place from batch to batch; fills ``result``.

    ``batch_repeat_interleave`` by batch / previous batch; the rows then diverge (row b reads
    the text 8 * b tokens on).
    """
    current = 1
    for batch in sorted(batches):
        if batch % current:
            log(f"[bench] batch {batch}: not a multiple of {current}, skipped")
            continue
        rows = {}
        for runner in runners_ok:
            if batch > current and runner.error is None:
                try:
                    runner.cache.batch_repeat_interleave(batch // current)
                except Exception as error:  # noqa: BLE001 - e.g. a backend without batch ops
                    runner.error = f"throughput: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
                    log(f"[bench] {runner.label}: {runner.error}")
        current = batch
        active = [r for r in runners_ok if r.error is None]
        times = {r.label: [] for r in active}
        for rep in range(warmup + batch_steps):
            for runner in list(active):
                tokens = ids[0, [runner.fed + 8 * b for b in range(batch)]][:, None]
                try:
                    t = runner.step(tokens)
                except Exception as error:  # noqa: BLE001 - QuantizedCache has no working batch repeat
                    runner.error = f"batch {batch}: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
                    log(f"[bench] {runner.label}: {runner.error}")
                    active.remove(runner)
                    del times[runner.label]
                    continue
                if rep >= warmup:
                    times[runner.label].append(t)
        for runner in active:
            label = runner.label
            med = statistics.median(times[label])
            ref_times = times.get(row_label("dynamic", runner.dtype))
            ref = statistics.median(ref_times) if ref_times else None
            rows[label] = {**_summary(times[label]), "config": runner.config.name, "dtype": runner.dtype,
                           "tokens_per_s": batch / med, "kv_bytes": runner.kv_bytes(), "context": runner.fed,
                           "speedup_vs_dynamic": (ref / med) if ref else None}
        rows["_rss_bytes"] = _rss_bytes()
        rows["_load"] = _loadavg()
        result["throughput"][str(batch)] = rows
        log(format_throughput_rows(batch, rows))
