"""Policies x memory targets (x INT8) on one task, resumable.

Memory
------
Every policy (or preset: ``tiered``, ``tiered-int8``, ``kivi-4``, ``kivi-2``) runs at every ``memory`` fraction
with the cache holding the target itself: at the end of every step it holds at most that
fraction of the bytes the full cache (transformers' ``DynamicCache`` in the model's dtype)
holds at the same length, every tier counted (:meth:`confkv.hf.ConfKVCache.for_model`,
:mod:`confkv.tiers.planner`). Nothing is predicted or matched before a run. ``full`` runs once,
without a target. Each row records its ``memory``, the trace's peak and mean bytes, and
``max_target_share`` (the largest bytes / target over the steps: at most 1 once the prefix is
past the cache's floor).

Resumability
------------
One JSON row per run, appended to a JSONL file as one complete line, flushed and fsynced.
A run's key (task, model, corpus, tokens, offset, policy, params, INT8, FP window) is
checked against the rows already on disk and skipped when present; a torn last line (a
kill in the middle of a write) is cut off on load, so it is neither kept nor duplicated.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from confkv.config import StoreConfig
from confkv.errors import ConfigError
from confkv.eval.jsonl import append_row, load_rows

if TYPE_CHECKING:
    from confkv.eval.ray.grid import RayOptions


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


def memory_size(row: dict[str, Any]) -> tuple[str, float] | None:
    """The memory a sweep row ran at: ``("memory", F)`` for a target, ``("window", W)`` for a row of a
    sweep made before targets (matched to a ``W``-token window); None for ``full``."""
    if row.get("memory") is not None:
        return ("memory", float(row["memory"]))
    if row.get("reference_window"):
        return ("window", int(row["reference_window"]))
    return None


def gap_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row with a memory (:func:`memory_size`): PPL drop vs ``window`` at the same memory, and the
    fraction of the window-to-full and streaming-to-full gaps it closes (the full-precision ``full``,
    ``window`` and ``streaming`` rows of the same task are the references)."""
    def same_task(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return all(a.get(k) == b.get(k) for k in ("model", "corpus", "tokens", "offset"))

    out = []
    for row in rows:
        size = memory_size(row)
        if size is None or row.get("policy") == "full":
            continue
        refs = {r["policy"]: r["ppl"] for r in rows if same_task(r, row) and not r.get("kv_int8")
                and (r["policy"] == "full" or (r["policy"] in ("window", "streaming") and memory_size(r) == size))}
        if not {"full", "window", "streaming"} <= refs.keys():
            continue
        out.append({"policy": row["policy"], "kv_int8": bool(row.get("kv_int8")), "memory_kind": size[0],
                    "memory": size[1], "ppl": row["ppl"], "drop_vs_window": refs["window"] - row["ppl"],
                    "window_gap_closed": gap_closed(row["ppl"], refs["window"], refs["full"]),
                    "streaming_gap_closed": gap_closed(row["ppl"], refs["streaming"], refs["full"])})
    return out


# --------------------------------------------------------------------------- the sweep

@dataclass
class SweepConfig:
    policies: tuple[str, ...] = ("full", "window", "streaming", "confkv")
    #: memory targets: fractions in (0, 1] of the full cache's bytes, held by the cache at every step
    memory: tuple[float, ...] = (0.25, 0.125)
    int8: tuple[bool, ...] = (False,)
    corpus: str = "pydoc-topics"
    tokens: int = 2048
    offset: int = 0
    model: str = "smollm2"
    store: StoreConfig = field(default_factory=StoreConfig)
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    task: str = "ppl"
    dtype: str = "float32"  # the model's dtype ("bfloat16": what users run; rows say which)

    def __post_init__(self) -> None:
        from confkv.tiers.storage import MemoryTarget

        if not self.memory:
            raise ConfigError("memory: give at least one memory target, e.g. --memory 0.25,0.125")
        for fraction in self.memory:
            MemoryTarget(memory=fraction)  # a ConfigError naming memory when outside (0, 1]


@dataclass
class PlannedRun:
    policy: str
    params: dict[str, Any]
    kv_int8: bool
    memory: float | None  # None: full, no target
    config: SweepConfig

    def key_dict(self) -> dict[str, Any]:
        c = self.config
        key = {"task": c.task, "model": c.model, "corpus": c.corpus, "tokens": c.tokens, "offset": c.offset,
               "policy": self.policy, "params": self.params, "kv_int8": self.kv_int8,
               "fp_window": c.store.fp_window if self.kv_int8 else None}
        if c.dtype != "float32":  # float32 rows predate the field: their keys stay as they were
            key["dtype"] = c.dtype
        return key


def _run_params(name: str, config: SweepConfig) -> dict[str, Any]:
    """``name``'s ``--param`` values: its own (``name:key=value``, all of them) and those of ``*`` it takes."""
    from confkv.policies.registry import accepted_parameters
    from confkv.presets import PRESETS, STORAGE_FIELDS

    fields = (accepted_parameters(PRESETS[name].policy) | set(STORAGE_FIELDS) if name in PRESETS
              else accepted_parameters(name))
    shared = {k: v for k, v in config.policy_params.get("*", {}).items() if k in fields}
    return {**shared, **config.policy_params.get(name, {})}


def plan_sweep(config: SweepConfig) -> list[PlannedRun]:
    """The runs of a sweep: every policy (or preset) at every ``config.memory`` fraction, the cache
    holding the target itself (``memory=`` of :meth:`ConfKVCache.for_model`); ``full`` once, without a
    target. No model is needed: nothing is predicted.

    Raises:
        ConfigError: a policy that cannot run under a target or a bad ``--param``, named with its policy
            (e.g. ``--param tiered:ladder=[8,5]``), before anything runs.
    """
    from confkv.presets import resolve

    runs = []
    for kv_int8 in config.int8:
        for name in config.policies:
            extra = _run_params(name, config)
            for fraction in ((None,) if name == "full" else config.memory):
                params = extra if fraction is None else {**extra, "memory": fraction}
                try:
                    resolve(name, **params)
                except ConfigError as error:
                    raise ConfigError(f"--param {name}: {error}" if config.policy_params.get(name)
                                      else f"{name} at memory {fraction}: {error}") from None
                runs.append(PlannedRun(name, params, kv_int8, fraction, config))
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
    from confkv.eval.quality.ppl import streaming_ppl

    run = unit.run
    store = replace(run.config.store, kv_int8=run.kv_int8)
    started = time.time()
    result = streaming_ppl(model, unit.ids, run.policy, store=store, progress=unit.progress, **run.params)
    trace = result.trace
    targets = [step.target_bytes for step in trace.steps]
    row = {**run.key_dict(), "memory": run.memory, "ppl": result.ppl,
           "peak_kv_bytes": trace.peak_kv_bytes(), "mean_kv_bytes": trace.mean_kv_bytes(),
           "final_target_bytes": targets[-1] if targets else None,
           "max_target_share": max((float(step.kv_bytes.sum()) / step.target_bytes for step in trace.steps
                                    if step.target_bytes), default=None),
           "mean_kept_tokens": float(np.mean(trace.kept_tokens(0))),
           "mean_cold_bytes_read": float(np.mean([step.cold_bytes_read for step in trace.steps])),
           "final_rung_tokens": list(trace.steps[-1].rung_tokens) if trace.steps else [],
           "seconds": result.seconds,
           "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started + result.seconds))}
    if run.policy == "full":
        row["confidence"] = [round(c, 5) for c in trace.confidences(0)]
    if unit.trace:
        row["_trace"] = trace.to_dict()
    return [row]


def _trace_name(row: dict[str, Any], config: "SweepConfig") -> str:
    """A run's trace file name: policy, INT8, memory, parameters; prefixed by the corpus
    and the dtype unless they are the defaults (pydoc-topics, float32: the names that predate
    them), so that sweeps of other texts or dtypes into one folder never overwrite each other's traces."""
    prefix = "".join(f"{part}_" for part, default in ((config.corpus, "pydoc-topics"), (config.dtype, "float32"))
                     if part != default)
    memory = f"mem-{row['memory']:g}" if row.get("memory") is not None else "mem-full"
    return f"{prefix}{row['policy']}_int8-{int(row['kv_int8'])}_{memory}_{_params_slug(row['params'])}.json"


def run_sweep(config: SweepConfig, out: str | Path, *, model: Any = None, tokenizer: Any = None,
              progress: bool = True, traces_dir: str | Path | None = None,
              stop_after: int | None = None, ray: "RayOptions | None" = None) -> list[dict[str, Any]]:
    """Run (or resume) a sweep; returns all rows of ``out`` for this sweep's runs.

    ``stop_after`` stops after that many new runs (used to simulate an interruption).
    A ``KeyboardInterrupt`` (Ctrl-C) during a run propagates; the rows completed before it
    are on disk, the interrupted run is not written and is redone on resume.
    ``ray``: run the runs on Ray actors (:mod:`confkv.eval.ray.grid`), each loading
    ``config.model`` once; only this process writes ``out`` (rows as they finish).
    """
    from contextlib import ExitStack

    from confkv.data import corpus_tokens
    from confkv.outputs import check_writable

    check_writable(out, what="sweep output")  # fail before loading or running anything
    if traces_dir is not None:
        check_writable(traces_dir, folder=True, what="traces folder")
    plan = plan_sweep(config)  # a policy that cannot run under a target fails here, before any model loads
    if model is None:  # a name for load_model, or tiny-<arch> (a tiny random test model)
        from confkv.eval.ray.grid import ModelSpec

        model, tokenizer = ModelSpec(config.model, config.dtype)()
    ids = corpus_tokens(tokenizer, config.corpus, config.tokens, offset=config.offset)
    done = {row_key(r): r for r in load_rows(out)}
    # the full-KV run goes first (the reference of every other row)
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
                todo = []
                for run in (r for r in plan if r.kv_int8 == kv_int8 and r.policy in group):
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
                    from confkv.eval.ray.grid import ModelSpec, RayGrid, WorkUnit

                    if grid is None:  # one pool for every group: each actor loads the model once
                        grid = stack.enter_context(RayGrid(ray, ModelSpec(config.model, config.dtype),
                                                           run_sweep_unit))
                    grid.run([WorkUnit(unit.key, unit) for unit in todo], lambda unit, rows: land(rows),
                             progress=progress, desc="sweep")
    return collected()


def _params_slug(params: dict[str, Any]) -> str:
    return "-".join(f"{k}{v}" for k, v in sorted(params.items()) if isinstance(v, (int, float, str))) or "default"
