"""Soak test: a long token-by-token stream through a confkv cache on the real SmolLM2.

What it checks, through the whole run:

- the KV bytes the cache holds (its exact accounting, the trace's ``kv_bytes``) never exceed the
  memory target it runs under (``--max-kv-bytes N``, a cap: what a stream that never ends wants;
  or ``--memory F``, a fraction of the full cache's bytes at the current length) at the end of
  any step: the target itself is the bound, each step's from the cache's own plan
  (``StepRecord.target_bytes``), nothing is predicted;
- the process RSS (``/proc/self/statm``) stays flat after a warm-up;
- the number of Python objects tracked by the garbage collector (``len(gc.get_objects())``
  after a ``gc.collect()``) does not grow after the warm-up.

Positions past the model's 8,192
--------------------------------
SmolLM2 was trained with 8,192 positions; the stream is longer. We feed the **true**
positions (0, 1, ..., N-1: the cache's logical positions, what transformers derives from
``cache.get_seq_length()``), uncapped. RoPE scores depend only on the *offset* between a
query and a key, so a query at position 15,000 and a key at 14,990 interact exactly as at
positions 10 and 0: everything inside the recent/kept window is in distribution. Only keys
kept from more than 8,191 positions back (the attention sinks and old heavy hitters) are
seen at offsets the model never trained on. Capping the positions instead (``min(pos, 8191)``)
would give every new token the same rotary angle, collapse the offsets to the recent keys
to zero and wreck the model much more, so we do not. The per-1K-token perplexity is
recorded so the reader can see what happens to quality past 8K; the point of the soak is
the memory behaviour, which does not depend on the position scheme.

The cache's own trace (``cache.trace``, one ``StepRecord`` per step) grows with the number
of steps by design (it *is* the record of the run). A stream that never ends must drain it;
this script copies each step's numbers into preallocated NumPy arrays and clears
``cache.trace.steps`` after every step (``--keep-trace`` keeps it, to measure its growth).

Usage (the recorded run, ``results/soak/``)::

    OMP_NUM_THREADS=1 .venv/bin/python -m confkv.eval.quality.soak --tokens 20000 --threads 1 \\
        --policy tiered --max-kv-bytes 24000000 --out results/soak

(``results/soak/`` was recorded before memory targets, against an analytic bound of the
policy's budgets; see its README.)

Exit status 0 when all three checks pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import csv
import gc
import io
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * _PAGE


def object_count() -> int:
    gc.collect()
    return len(gc.get_objects())


def within_target(kv: np.ndarray, target: np.ndarray) -> tuple[bool, int, float]:
    """(every step with a target holds at most it, steps over it, the largest bytes / target).

    ``target`` is 0 at a step without a plan (none: every step of a cache under a target has one).
    """
    planned = target > 0
    over = int((kv[planned] > target[planned]).sum())
    share = float((kv[planned] / target[planned]).max()) if planned.any() else float("nan")
    return bool(planned.all() and over == 0), over, share


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", default="pydoc-topics")
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--policy", default="tiered", help="a policy or preset (default: the preset tiered)")
    parser.add_argument("--param", action="append", metavar="KEY=VALUE")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--max-kv-bytes", type=int, default=None,
                        help="the memory target: a cap in bytes, held at the end of every step (a flat stream)")
    target.add_argument("--memory", type=float, default=None,
                        help="the memory target: a fraction of the full cache's bytes at the current length")
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--fp-window", type=int, default=128)
    parser.add_argument("--move-block", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sample-every", type=int, default=250, help="RSS / object-count sample period (steps)")
    parser.add_argument("--warmup", type=int, default=2000, help="steps before RSS/object counts must be flat")
    parser.add_argument("--rss-tolerance-mb", type=float, default=16.0,
                        help="allowed RSS growth after warm-up (allocator noise)")
    parser.add_argument("--objects-tolerance", type=int, default=2000,
                        help="allowed growth of gc-tracked objects after warm-up")
    parser.add_argument("--keep-trace", action="store_true", help="do not drain cache.trace (measure its growth)")
    parser.add_argument("--out", type=Path, default=Path("results/soak"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    from confkv.cli.common import parse_params
    from confkv.config import StoreConfig
    from confkv.data import corpus_tokens
    from confkv.display import budget_text
    from confkv.hf import ConfKVCache
    from confkv.eval.ray.grid import ModelSpec
    from confkv.models import model_max_positions

    args.out.mkdir(parents=True, exist_ok=True)
    command = "OMP_NUM_THREADS={} {} -m confkv.eval.quality.soak {}".format(os.environ.get("OMP_NUM_THREADS", "?"),
                                                                  Path(sys.executable).name, " ".join(sys.argv[1:]))
    params = parse_params(args.param)
    store = StoreConfig(kv_int8=args.int8, fp_window=args.fp_window, move_block=args.move_block)
    model, tokenizer = ModelSpec(args.model)()  # a name for load_model, or tiny-<arch> (a test model)
    ids = corpus_tokens(tokenizer, args.corpus, args.tokens, offset=args.offset)
    cache = ConfKVCache.for_model(model, args.policy, store=store, memory=args.memory,
                                  max_kv_bytes=args.max_kv_bytes, record_confidence=True, **params)
    max_positions = model_max_positions(model)

    steps = args.tokens - 1
    nll = np.full(steps, np.nan)
    kv = np.zeros(steps, dtype=np.int64)
    target = np.zeros(steps, dtype=np.int64)  # the step's target (StepRecord.target_bytes)
    kept = np.zeros(steps, dtype=np.float64)
    budget = np.zeros(steps, dtype=np.int64)
    conf = np.zeros(steps, dtype=np.float64)
    samples: list[dict] = []
    started = time.perf_counter()
    interrupted = False
    done = 0

    def sample(step: int) -> None:
        samples.append({"step": step, "seconds": round(time.perf_counter() - started, 2), "rss_bytes": rss_bytes(),
                        "gc_objects": object_count(), "kv_bytes": int(kv[step - 1]) if step else 0,
                        "trace_records": len(cache.trace.steps)})

    csv_path = args.out / "soak_steps.csv"
    with open(csv_path, "w", newline="") as handle:
        csv.writer(handle).writerow(["step", "position", "confidence", "budget", "kept_mean", "kv_bytes", "nll"])
    written = 0  # steps already in the CSV

    def finish(final: bool = True) -> int:
        nonlocal written
        walltime = time.perf_counter() - started
        s = np.array([x["step"] for x in samples])
        rss = np.array([x["rss_bytes"] for x in samples], dtype=np.float64)
        objs = np.array([x["gc_objects"] for x in samples], dtype=np.int64)
        after = s >= args.warmup
        base = np.argmax(after) if after.any() else len(s) - 1
        rss_growth = float(rss[after].max() - rss[base]) if after.any() else float("nan")
        obj_growth = int(objs[after].max() - objs[base]) if after.any() else 0
        if after.sum() >= 3:
            slope = float(np.polyfit(s[after], rss[after], 1)[0])  # bytes per step
        else:
            slope = float("nan")
        per_k = []
        for k0 in range(0, done, 1000):
            chunk = nll[k0:min(k0 + 1000, done)]
            per_k.append({"from": k0, "to": k0 + len(chunk), "ppl": float(math.exp(chunk.mean()))})
        peak = int(kv[:done].max()) if done else 0
        held, over, share = within_target(kv[:done], target[:done])
        checks = {
            "kv_within_target": held,
            "rss_flat": bool(after.any() and rss_growth <= args.rss_tolerance_mb * 2**20),
            "objects_flat": bool(after.any() and obj_growth <= args.objects_tolerance),
        }
        summary = {
            "command": command, "model": args.model, "corpus": args.corpus, "offset": args.offset,
            "policy": args.policy, "params": params, "store": store.__dict__, "threads": args.threads,
            "model_max_positions": max_positions,
            "position_scheme": "true (uncapped) positions; RoPE offsets inside the kept window stay in distribution",
            "steps_done": done, "steps_planned": steps, "interrupted": interrupted,
            "seconds": round(walltime, 1), "ms_per_step": round(1000 * walltime / max(done, 1), 2),
            "memory": args.memory, "max_kv_bytes": args.max_kv_bytes, "kv_steps_over_target": over,
            "kv_max_target_share": share, "kv_peak_bytes": peak,
            "kv_mean_bytes": float(kv[:done].mean()) if done else 0.0,
            "kv_peak_after_warmup": int(kv[args.warmup:done].max()) if done > args.warmup else None,
            "kept_tokens_max": float(kept[:done].max()) if done else 0.0,
            "warmup_steps": args.warmup,
            "rss_at_warmup_mb": round(rss[base] / 2**20, 2) if len(rss) else None,
            "rss_max_after_warmup_mb": round(rss[after].max() / 2**20, 2) if after.any() else None,
            "rss_growth_after_warmup_mb": round(rss_growth / 2**20, 3),
            "rss_slope_bytes_per_step": slope,
            "gc_objects_at_warmup": int(objs[base]) if len(objs) else None,
            "gc_objects_growth_after_warmup": obj_growth,
            "ppl_total": float(math.exp(nll[:done].mean())) if done else None,
            "ppl_per_1k": per_k,
            "checks": checks, "passed": all(checks.values()),
        }
        (args.out / "soak.json").write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
        # the steps since the last write are appended: a partial write costs the same memory every time
        with open(csv_path, "a", newline="") as handle:
            writer = csv.writer(handle)
            for t in range(written, done):
                writer.writerow([t + 1, t, f"{conf[t]:.5f}", budget_text(budget[t]), f"{kept[t]:.2f}", kv[t], f"{nll[t]:.5f}"])
        written = done
        if not final:
            return 0
        plot(args.out / "soak.png", samples, kv[:done], kept[:done], budget[:done], target[:done], args.warmup, summary)
        print(json.dumps({k: summary[k] for k in ("steps_done", "seconds", "ms_per_step", "kv_max_target_share",
                                                  "kv_peak_bytes",
                                                  "rss_growth_after_warmup_mb", "gc_objects_growth_after_warmup",
                                                  "ppl_total", "checks")}, indent=1))
        return 0 if summary["passed"] and not interrupted else 1

    # One-time costs of the final write (importing matplotlib and drawing a figure: ~44K
    # objects and ~33 MB RSS, measured in the first run) are paid here, before the baseline.
    # Partial writes draw nothing and append only the new CSV rows (run 2 redrew the whole
    # figure and rewrote the whole CSV every 2,000 steps: RSS rose by a step after each write).
    plot(io.BytesIO(), [{"step": 0, "rss_bytes": 0, "gc_objects": 0}], kv[:1], kept[:1], budget[:1], target[:1],
         args.warmup, {"policy": "", "params": {}, "store": store.__dict__, "steps_done": 0, "ppl_total": 0.0,
                       "model_max_positions": max_positions})
    sample(0)
    try:
        with torch.no_grad():
            for t in range(steps):
                logits = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1].float()
                nll[t] = float(torch.logsumexp(logits, -1) - logits[ids[0, t + 1]])
                record = cache.trace.steps[-1]
                kv[t] = int(record.kv_bytes.sum())
                target[t] = record.target_bytes or 0
                kept[t] = float(record.kept[:, 0].float().mean())
                budget[t] = int(record.budget[0])
                conf[t] = float(record.confidence[0])
                if not args.keep_trace:
                    cache.trace.steps.clear()
                done = t + 1
                if done % args.sample_every == 0:
                    sample(done)
                    if done % (args.sample_every * 8) == 0:
                        x = samples[-1]
                        print(f"step {done}/{steps}  {x['seconds']:.0f}s  kv {kv[t] / 1e6:.2f} MB (target "
                              f"{target[t] / 1e6:.2f})  "
                              f"rss {x['rss_bytes'] / 2**20:.1f} MiB  objects {x['gc_objects']}", flush=True)
                        finish(final=False)  # keep a valid partial result on disk (JSON + CSV; the plot at the end)
    except KeyboardInterrupt:
        interrupted = True
        print(f"interrupted after {done} steps; writing the partial result", file=sys.stderr)
    if samples[-1]["step"] != done:
        sample(done)
    return finish()


def plot(path, samples, kv, kept, budget, target, warmup, summary) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from confkv.display import budget_for_plot

    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    steps = np.arange(1, len(kv) + 1)
    axes[0].plot(steps, kept, lw=0.5, label="kept tokens (mean over layers)")
    axes[0].plot(steps, [budget_for_plot(b) for b in budget], lw=0.5, alpha=0.6, label="budget")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[0].set_ylabel("tokens")
    axes[1].plot(steps, kv / 1e6, lw=0.5, label="KV bytes held")
    axes[1].plot(steps, target / 1e6, color="r", ls="--", lw=1, label="target")
    axes[1].legend(loc="lower right", fontsize=8)
    axes[1].set_ylabel("KV MB")
    s = [x["step"] for x in samples]
    axes[2].plot(s, [x["rss_bytes"] / 2**20 for x in samples], marker=".", lw=1)
    axes[2].set_ylabel("RSS MiB")
    axes[3].plot(s, [x["gc_objects"] for x in samples], marker=".", lw=1)
    axes[3].set_ylabel("gc objects")
    axes[3].set_xlabel("step (token position + 1)")
    for ax in axes:
        ax.axvline(warmup, color="gray", ls=":", lw=1)
        ax.axvline(summary["model_max_positions"], color="k", ls=":", lw=0.8)
    fig.suptitle(f"soak: {summary['policy']} {summary['params']} int8={summary['store']['kv_int8']}  "
                 f"{summary['steps_done']} steps, PPL {summary['ppl_total'] or float('nan'):.2f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
