"""Policies x memory budgets (x INT8) on one task, at matched KV memory, resumable.

Memory matching
---------------
The reference is a full-precision sliding window of ``W`` tokens (the paper's "memory of a
512-token window"): ``W`` tokens held per layer at the end of every step, as the README's
"What a budget counts" states for every budget. For each policy we look for the budget whose
KV bytes (``peak`` or ``mean`` over the run, all layers, as the cache's trace measures them)
are the largest not exceeding the reference's.

The bytes are predicted *analytically* by :func:`simulate_kv_bytes`, which replays the
store's bookkeeping step by step (tokens appended, FP window ageing in ``move_block``
groups, INT8 for older tokens with per-token scales and one frozen channel scale per
layer, eviction to the policy's per-layer budgets) from bytes per token: no model
forward. Policies with a constant budget need nothing else. The budget of a gated policy
depends on the confidence at each step: ``peak`` matching sets ``n_low`` (its peak is the
loose budget); ``mean`` matching replays the gate over a confidence trace (a previous run's,
by default the sweep's own full-KV run, which is run first) and searches the scale of
``(n_high, n_low) = (ratio * n, n)``. Every run's row records the predicted bytes next to
the measured ones (``match_error``), so the analytic match is verified by the trace.
The bytes model and the search live in :mod:`confkv.eval.memory_match`.

Resumability
------------
One JSON row per run, appended to a JSONL file as one complete line, flushed and fsynced.
A run's key (task, model, corpus, tokens, offset, policy, params, INT8, FP window) is
checked against the rows already on disk and skipped when present; a torn last line (a
kill in the middle of a write) is cut off on load, so it is neither kept nor duplicated.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from confkv.config import StoreConfig
from confkv.errors import ConfKVError
from confkv.eval.jsonl import append_row, load_rows
from confkv.eval.memory_match import GATED, BytesModel, match_budget, reference_bytes, simulate_kv_bytes

if TYPE_CHECKING:
    from confkv.eval.ray_grid import RayOptions


# --------------------------------------------------------------------------- JSONL rows

def row_key(row: dict[str, Any]) -> str:
    """The identity of a run: equal keys are the same run."""
    fields = ("task", "model", "corpus", "tokens", "offset", "policy", "params", "kv_int8", "fp_window")
    return json.dumps({**{f: row.get(f) for f in fields}, "dtype": row.get("dtype") or "float32"}, sort_keys=True)


def gap_closed(ppl: float, baseline: float, full: float) -> float:
    """Fraction of the ``baseline``-to-``full`` perplexity gap that ``ppl`` closes (1 = as good as full KV,
    0 = no better than the baseline, < 0 worse); NaN when the gap is not positive."""
    gap = baseline - full
    return (baseline - ppl) / gap if gap > 0 else float("nan")


def gap_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row with a reference window: PPL drop vs ``window`` at the same window, and the fraction
    of the window-to-full and streaming-to-full gaps it closes (the full-precision ``full``,
    ``window`` and ``streaming`` rows of the same task are the references)."""
    def same_task(a: dict[str, Any], b: dict[str, Any]) -> bool:
        # fixed-budget references do not depend on how a row was matched (peak or mean)
        return all(a.get(k) == b.get(k) for k in ("model", "corpus", "tokens", "offset"))

    out = []
    for row in rows:
        window = row.get("reference_window")
        if not window or row.get("policy") == "full":
            continue
        refs = {r["policy"]: r["ppl"] for r in rows if same_task(r, row) and not r.get("kv_int8")
                and (r["policy"] == "full" or (r["policy"] in ("window", "streaming") and r.get("reference_window") == window))}
        if not {"full", "window", "streaming"} <= refs.keys():
            continue
        out.append({"policy": row["policy"], "kv_int8": bool(row.get("kv_int8")), "reference_window": window,
                    "ppl": row["ppl"], "drop_vs_window": refs["window"] - row["ppl"],
                    "window_gap_closed": gap_closed(row["ppl"], refs["window"], refs["full"]),
                    "streaming_gap_closed": gap_closed(row["ppl"], refs["streaming"], refs["full"])})
    return out


# --------------------------------------------------------------------------- the sweep

@dataclass
class SweepConfig:
    policies: tuple[str, ...] = ("full", "window", "streaming", "confkv")
    reference_windows: tuple[int, ...] = (512,)
    match: str = "peak"
    int8: tuple[bool, ...] = (False,)
    corpus: str = "pydoc-topics"
    tokens: int = 2048
    offset: int = 0
    model: str = "smollm2"
    store: StoreConfig = field(default_factory=StoreConfig)
    ratio: float = 0.5
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    confidence_trace: Path | None = None
    task: str = "ppl"
    dtype: str = "float32"  # the model's dtype ("bfloat16": what users run; rows say which)
    #: memory targets (fractions of the full cache's bytes, held by the cache at every step): when given,
    #: every policy runs under each target and nothing is matched offline (``reference_windows`` unused)
    memory: tuple[float, ...] = ()


@dataclass
class PlannedRun:
    policy: str
    params: dict[str, Any]
    kv_int8: bool
    reference_window: int
    target: float
    predicted: float
    config: SweepConfig

    def key_dict(self) -> dict[str, Any]:
        c = self.config
        key = {"task": c.task, "model": c.model, "corpus": c.corpus, "tokens": c.tokens, "offset": c.offset,
               "policy": self.policy, "params": self.params, "kv_int8": self.kv_int8,
               "fp_window": c.store.fp_window if self.kv_int8 else None}
        if c.dtype != "float32":  # float32 rows predate the field: their keys stay as they were
            key["dtype"] = c.dtype
        return key


def _confidences_from_json(path: Path) -> list[float]:
    data = json.loads(Path(path).read_text())
    if "trace" in data:
        return [float(c[0]) for c in data["trace"]["confidence"]]
    if "confidence" in data:
        return [float(c[0]) if isinstance(c, list) else float(c) for c in data["confidence"]]
    raise ValueError(f"{path}: no confidence trace (expected a ppl JSON with 'trace')")


def plan_memory_runs(config: SweepConfig) -> list[PlannedRun]:
    """The runs of a sweep under memory targets: every policy (or preset) at every ``config.memory``
    fraction, the cache holding the target itself (``memory=`` of :meth:`ConfKVCache.for_model`); ``full``
    once, without a target."""
    runs = []
    for kv_int8 in config.int8:
        for name in config.policies:
            extra = {**config.policy_params.get("*", {}), **config.policy_params.get(name, {})}
            for fraction in ((None,) if name == "full" else config.memory):
                params = extra if fraction is None else {**extra, "memory": fraction}
                runs.append(PlannedRun(name, params, kv_int8, 0, float("nan"), float("nan"), config))
    return runs


def plan_sweep(model: Any, config: SweepConfig, confidences: Sequence[float] | None = None) -> list[PlannedRun]:
    """The runs of a sweep with their memory-matched parameters (no model forward)."""
    if config.memory:
        return plan_memory_runs(config)
    bytes_model = BytesModel.for_model(model)
    steps = config.tokens - 1
    if confidences is None and config.confidence_trace is not None:
        confidences = _confidences_from_json(config.confidence_trace)
    runs = []
    for kv_int8 in config.int8:
        store = replace(config.store, kv_int8=kv_int8)
        for window in config.reference_windows:
            target = reference_bytes(bytes_model, window, steps, config.match)
            for name in config.policies:
                extra = {**config.policy_params.get("*", {}), **config.policy_params.get(name, {})}
                if name == "full":
                    params, predicted = extra, float("nan")
                    window_key = 0
                else:
                    conf = confidences if (config.match == "mean" and name in GATED) else None
                    try:
                        params, predicted = match_budget(name, target, bytes_model, steps, stat=config.match,
                                                         store=store, ratio=config.ratio, confidences=conf, extra=extra)
                    except ConfKVError as error:  # e.g. quest keeps everything in full precision
                        print(f"confkv sweep: skipped {name} at the {window}-token window's {config.match} bytes: "
                              f"{error}", file=sys.stderr)
                        continue
                    window_key = window
                runs.append(PlannedRun(name, params, kv_int8, window_key, target if name != "full" else float("nan"),
                                       predicted, config))
    return runs


@dataclass(frozen=True)
class SweepUnit:
    """One run of a sweep: the planned run and the corpus tokens ``ids`` [1, T].

    ``trace``: also return the run's trace (``--traces-dir``; the driver writes the file).
    """

    run: PlannedRun
    ids: Any
    trace: bool = False
    progress: bool = False

    @property
    def key(self) -> str:
        return row_key(self.run.key_dict())


def run_sweep_unit(model: Any, tokenizer: Any, unit: SweepUnit) -> list[dict[str, Any]]:
    """Run one planned run; its row (in a list), with ``"_trace"`` when ``unit.trace``.

    Pure: the same row in process and on a Ray actor, apart from ``seconds`` and ``finished_at``.
    """
    from confkv.eval.ppl import streaming_ppl

    run = unit.run
    store = replace(run.config.store, kv_int8=run.kv_int8)
    started = time.time()
    result = streaming_ppl(model, unit.ids, run.policy, store=store, progress=unit.progress, **run.params)
    trace = result.trace
    peak, mean = trace.peak_kv_bytes(), trace.mean_kv_bytes()
    measured = peak if run.config.match == "peak" else mean
    row = {**run.key_dict(), "reference_window": run.reference_window, "match": run.config.match,
           "target_bytes": run.target, "predicted_bytes": run.predicted, "ppl": result.ppl,
           "peak_kv_bytes": peak, "mean_kv_bytes": mean,
           "match_error": (measured / run.target - 1) if run.target == run.target and run.target else None,
           "mean_kept_tokens": float(np.mean(trace.kept_tokens(0))),
           "mean_cold_bytes_read": float(np.mean([step.cold_bytes_read for step in trace.steps])),
           "max_target_share": max((float(step.kv_bytes.sum()) / step.target_bytes for step in trace.steps
                                    if step.target_bytes), default=None),
           "final_rung_tokens": list(trace.steps[-1].rung_tokens) if trace.steps else [],
           "seconds": result.seconds,
           "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started + result.seconds))}
    if run.policy == "full":
        row["confidence"] = [round(c, 5) for c in trace.confidences(0)]
    if unit.trace:
        row["_trace"] = trace.to_dict()
    return [row]


def _trace_name(row: dict[str, Any], config: "SweepConfig") -> str:
    """A run's trace file name: policy, INT8, reference window, parameters; prefixed by the corpus
    and the dtype unless they are the defaults (pydoc-topics, float32: the names that predate
    them), so that sweeps of other texts or dtypes into one folder never overwrite each other's traces."""
    prefix = "".join(f"{part}_" for part, default in ((config.corpus, "pydoc-topics"), (config.dtype, "float32"))
                     if part != default)
    return (f"{prefix}{row['policy']}_int8-{int(row['kv_int8'])}_ref-{row['reference_window']}_"
            f"{_params_slug(row['params'])}.json")


def run_sweep(config: SweepConfig, out: str | Path, *, model: Any = None, tokenizer: Any = None,
              progress: bool = True, traces_dir: str | Path | None = None,
              stop_after: int | None = None, ray: "RayOptions | None" = None) -> list[dict[str, Any]]:
    """Run (or resume) a sweep; returns all rows of ``out`` for this sweep's runs.

    ``stop_after`` stops after that many new runs (used to simulate an interruption).
    A ``KeyboardInterrupt`` (Ctrl-C) during a run propagates; the rows completed before it
    are on disk, the interrupted run is not written and is redone on resume.
    ``ray``: run the runs on Ray actors (:mod:`confkv.eval.ray_grid`), each loading
    ``config.model`` once; only this process writes ``out`` (rows as they finish).
    """
    from contextlib import ExitStack

    from confkv.data import corpus_tokens
    from confkv.outputs import check_writable

    check_writable(out, what="sweep output")  # fail before loading or running anything
    if traces_dir is not None:
        check_writable(traces_dir, folder=True, what="traces folder")
    if model is None:
        from confkv.models import load_model

        model, tokenizer = load_model(config.model, dtype=getattr(torch, config.dtype))
    ids = corpus_tokens(tokenizer, config.corpus, config.tokens, offset=config.offset)
    done = {row_key(r): r for r in load_rows(out)}
    confidences = None
    if config.match == "mean" and config.confidence_trace is not None:
        confidences = _confidences_from_json(config.confidence_trace)
    # the full-KV run goes first: its confidence trace drives mean matching of gated policies
    planned: list[PlannedRun] = []

    def collected() -> list[dict[str, Any]]:
        keys = [row_key(r.key_dict()) for r in planned]
        return [done[k] for k in dict.fromkeys(keys) if k in done]

    def land(rows: list[dict[str, Any]]) -> None:
        """The driver's side: the trace file, then the row (the only writer of ``out``)."""
        row = rows[0]
        trace = row.pop("_trace", None)
        if traces_dir is not None:
            folder = Path(traces_dir)
            folder.mkdir(parents=True, exist_ok=True)
            name = _trace_name(row, config)
            (folder / name).write_text(json.dumps({"summary": row, "trace": trace}))
            row["trace_file"] = str(folder / name)
        append_row(out, row)
        done[row_key(row)] = row

    new_runs = 0
    with ExitStack() as stack:
        grid = None
        for kv_int8 in config.int8:
            sub = replace(config, int8=(kv_int8,))
            groups = [tuple(p for p in sub.policies if p == "full"), tuple(p for p in sub.policies if p != "full")]
            for group in groups:
                if not group:
                    continue
                if confidences is None and config.match == "mean":
                    full_rows = [r for r in done.values() if r["policy"] == "full" and r.get("confidence")
                                 and r["model"] == config.model and r["corpus"] == config.corpus
                                 and r["tokens"] == config.tokens and r["offset"] == config.offset
                                 and (r.get("dtype") or "float32") == config.dtype]
                    if full_rows:
                        confidences = full_rows[0]["confidence"]
                todo = []
                for run in plan_sweep(model, replace(sub, policies=group), confidences):
                    planned.append(run)
                    if row_key(run.key_dict()) not in done:
                        todo.append(SweepUnit(run, ids, trace=traces_dir is not None, progress=progress and not ray))
                if ray is None:
                    for unit in todo:
                        if stop_after is not None and new_runs >= stop_after:
                            return collected()
                        land(run_sweep_unit(model, tokenizer, unit))
                        new_runs += 1
                elif todo:
                    from confkv.eval.ray_grid import ModelSpec, RayGrid, WorkUnit

                    if grid is None:  # one pool for every group: each actor loads the model once
                        grid = stack.enter_context(RayGrid(ray, ModelSpec(config.model, config.dtype),
                                                           run_sweep_unit))
                    grid.run([WorkUnit(unit.key, unit) for unit in todo], lambda unit, rows: land(rows),
                             progress=progress, desc="sweep")
    return collected()


def _params_slug(params: dict[str, Any]) -> str:
    return "-".join(f"{k}{v}" for k, v in sorted(params.items()) if isinstance(v, (int, float, str))) or "default"
