"""``confkv ruler``: RULER tasks x lengths x policies x memory targets, resumable, with a table and a plot.

Samples come from :mod:`confkv.eval.ruler.tasks` (offline, deterministic); each is answered
by :func:`confkv.hf.protocols.generate_compressed` (the streaming protocol by default: the
prompt is prefilled in chunks evicted as they arrive, then greedy decoding with RULER's
``tokens_to_generate``) and scored by RULER's metric (:mod:`confkv.eval.ruler.score`).

Memory: each policy (or preset: ``tiered``, ``tiered-int8``, ``kivi-4``, ``kivi-2``) runs at each ``memory``
fraction, the cache holding that fraction of the full cache's bytes at the end of every step
(of the length fed so far: under the query-aware protocol the prompt is prefilled without
eviction, then brought to the fraction of its bytes in one step). Records keep the fraction in
``kv_fraction``. ``full`` runs once per sample, at fraction 1.

Resuming: every finished batch appends its records to ``<out-dir>/ruler.jsonl``; records of
the same run already there are skipped.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from confkv.config import StoreConfig
from confkv.errors import ConfigError
from confkv.eval.jsonl import append_rows, load_rows
from confkv.eval.ruler.score import ruler_score
from confkv.eval.ruler.tasks import DEFAULT_TASKS, TASKS, make_ruler_sample
from confkv.progress import progress as show_progress

if TYPE_CHECKING:
    from confkv.eval.ray.grid import RayOptions

#: bumped when a sample generator or the protocol changes; other versions are not resumed
RULER_VERSION = 1


@dataclass
class RulerConfig:
    tasks: tuple[str, ...] = DEFAULT_TASKS
    lengths: tuple[int, ...] = (4096,)
    policies: tuple[str, ...] = ("full", "streaming", "tova", "confkv")
    #: memory targets: fractions in (0, 1] of the full cache's bytes, held by the cache at every step
    memory: tuple[float, ...] = (0.25, 0.5)
    samples: int = 3
    first_sample: int = 0
    seed: int = 0
    protocol: str = "streaming"
    chunk: int = 512
    query_window: int = 64
    batch: int = 1
    fp_window: int = 128
    extra_params: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"  # the model's dtype (recorded in the run key; the caller loads the model)

    def __post_init__(self) -> None:
        from confkv.hf.protocols import PROTOCOLS

        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ConfigError(f"--tasks: unknown RULER task {unknown[0]!r}; known: {', '.join(TASKS)} "
                              f"(QA is not available offline: no local QA source)")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"--protocol {self.protocol!r}: choose one of {', '.join(PROTOCOLS)}")
        if not self.memory or any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1
                                  for f in self.memory):
            raise ConfigError(f"--memory {list(self.memory)}: give fractions of the full cache's bytes, each in "
                              "(0, 1], e.g. 0.25,0.125")
        if self.samples < 1 or self.batch < 1 or self.first_sample < 0:
            raise ConfigError("--samples and --batch must be >= 1, --first-sample >= 0")
        for spec in self.policies:
            parse_policy_spec(spec)
        from confkv.eval.niah.budgets import check_scoped_params, memory_params

        check_scoped_params(self.extra_params, self.policies)
        for spec in self.policies:  # a policy that cannot run under a target fails here, before any model
            for fraction in self.memory:
                memory_params(parse_policy_spec(spec)[0], fraction, self.extra_params)


@dataclass
class RulerRecord:
    task: str
    length: int
    index: int
    policy: str  # spec, e.g. "confkv+int8"
    kv_fraction: float  # the memory target (a fraction of the full cache's bytes); 1.0 for full
    score: float  # RULER metric in [0, 1]
    generated: str
    outputs: list[str]
    prompt_tokens: int
    params: dict[str, Any]
    kept_at_answer: float
    peak_kv_bytes_per_seq: float
    seconds_per_seq: float
    run: str = ""


def parse_policy_spec(spec: str) -> tuple[str, bool]:
    """``"confkv+int8"`` -> ``("confkv", True)`` (the NIAH grid's syntax)."""
    from confkv.eval.niah import parse_spec

    return parse_spec(spec)


def run_key(config: RulerConfig, model_name: str) -> str:
    parts = {"model": model_name, "seed": config.seed, "protocol": config.protocol, "chunk": config.chunk,
             "query_window": config.query_window if config.protocol == "query-aware" else None,
             "fp_window": config.fp_window, "extra": config.extra_params,
             "dtype": config.dtype, "version": RULER_VERSION, "memory_target": True}
    return json.dumps(parts, sort_keys=True)


def record_key(r: dict[str, Any]) -> tuple:
    return (r["run"], r["task"], r["length"], r["index"], r["policy"], float(r["kv_fraction"]))


def _cells(config: RulerConfig) -> list[tuple[str, float]]:
    """(policy spec, memory) pairs: ``full`` once at 1.0, the others at each memory target."""
    cells = []
    for spec in config.policies:
        if parse_policy_spec(spec)[0] == "full":
            cells.append((spec, 1.0))
        else:
            cells.extend((spec, float(f)) for f in config.memory)
    return cells


@dataclass(frozen=True)
class RulerUnit:
    """One unit of the grid: a batch of samples of one task and length x one policy at one memory target."""

    task: str
    length: int
    spec: str  # policy spec, e.g. "confkv+int8"
    fraction: float
    samples: tuple[Any, ...]  # RulerSample
    params: dict[str, Any]
    fp_window: int
    protocol: str
    chunk: int
    query_window: int
    run: str

    @property
    def key(self) -> tuple:
        return (self.task, self.length, self.spec, self.fraction, tuple(s.index for s in self.samples))


def run_ruler_unit(model: Any, tokenizer: Any, unit: RulerUnit) -> list[dict[str, Any]]:
    """Answer and score one unit's samples; the records as dicts.

    Pure: the same records in process and on a Ray actor, apart from ``seconds_per_seq``.
    """
    from confkv.hf.protocols import generate_compressed

    name, int8 = parse_policy_spec(unit.spec)
    store = StoreConfig(kv_int8=int8, fp_window=unit.fp_window, prefill_chunk=unit.chunk)
    batch = list(unit.samples)
    prompts = [list(tokenizer(s.prompt, verbose=False).input_ids) for s in batch]
    t0 = time.perf_counter()
    outs = generate_compressed(model, tokenizer, prompts, policy=name, params=unit.params, store=store,
                               protocol=unit.protocol, chunk=unit.chunk, query_window=unit.query_window,
                               max_new_tokens=batch[0].max_new_tokens)
    per_seq = (time.perf_counter() - t0) / len(batch)
    return [asdict(RulerRecord(task=unit.task, length=unit.length, index=s.index, policy=unit.spec,
                               kv_fraction=unit.fraction, score=ruler_score(out.text, s.outputs, s.metric),
                               generated=out.text, outputs=s.outputs, prompt_tokens=len(p), params=unit.params,
                               kept_at_answer=out.kept_at_answer, peak_kv_bytes_per_seq=out.peak_kv_bytes_per_seq,
                               seconds_per_seq=per_seq, run=unit.run))
            for s, p, out in zip(batch, prompts, outs)]


def run_ruler_grid(model: Any, tokenizer: Any, config: RulerConfig, *, model_name: str = "",
                   resume_path: str | Path | None = None, progress: bool = True, ray: "RayOptions | None" = None,
                   loader: Callable[[], tuple[Any, Any]] | None = None) -> list[RulerRecord]:
    """Run every (task, length, sample, policy, fraction) not already in ``resume_path``; all records.

    ``ray``: run the units on Ray actors that each load the model with ``loader`` (a
    :class:`~confkv.eval.ray.grid.ModelSpec`); only this process writes ``resume_path``.
    """
    from confkv.eval.niah import check_niah_positions
    from confkv.eval.niah.budgets import memory_params

    if ray is not None and loader is None:
        raise ValueError("run_ruler_grid: ray needs loader (a ModelSpec naming the same model)")
    check_niah_positions(model, config.lengths, 0)
    run = run_key(config, model_name)
    done: dict[tuple, RulerRecord] = {}
    if resume_path is not None:
        for row in load_rows(resume_path):
            if row.get("run") == run:
                done.setdefault(record_key(row), RulerRecord(**row))
    cells = _cells(config)

    def budget(spec: str, fraction: float) -> dict[str, Any]:
        """The cache parameters of ``spec`` under the memory target ``fraction`` (none for ``full``)."""
        return memory_params(parse_policy_spec(spec)[0], fraction, config.extra_params)
    indices = list(range(config.first_sample, config.first_sample + config.samples))
    units = [(begin, length, task, spec, fraction)
             for begin in range(0, len(indices), config.batch)
             for length in config.lengths for task in config.tasks for spec, fraction in cells]
    samples: dict[tuple[str, int, int], Any] = {}
    records = [r for r in done.values() if r.task in config.tasks and r.length in config.lengths
               and r.index in indices and (r.policy, r.kv_fraction) in cells]
    work = []
    for begin, length, task, spec, fraction in units:
        part = indices[begin:begin + config.batch]
        todo = [i for i in part if (run, task, length, i, spec, fraction) not in done]
        if not todo:
            continue
        batch = []
        for i in todo:
            if (task, length, i) not in samples:
                samples[(task, length, i)] = make_ruler_sample(task, tokenizer, length, i, seed=config.seed)
            batch.append(samples[(task, length, i)])
        work.append(RulerUnit(task=task, length=length, spec=spec, fraction=fraction, samples=tuple(batch),
                              params=budget(spec, fraction), fp_window=config.fp_window,
                              protocol=config.protocol, chunk=config.chunk, query_window=config.query_window,
                              run=run))

    def land(rows: list[dict[str, Any]]) -> None:
        """The driver's side: remember and append the unit's records (the only writer of the JSONL)."""
        fresh = [RulerRecord(**row) for row in rows]
        for r in fresh:
            done[record_key(asdict(r))] = r
        if resume_path is not None:
            append_rows(resume_path, [asdict(r) for r in fresh])
        records.extend(fresh)

    if ray is None:
        for unit in show_progress(work, desc="ruler", enabled=progress, leave=True):
            land(run_ruler_unit(model, tokenizer, unit))
    else:
        from confkv.eval.ray.grid import WorkUnit, run_units

        run_units([WorkUnit(unit.key, unit, cost=unit.length) for unit in work], run_ruler_unit, loader, ray,
                  lambda unit, rows: land(rows), progress=progress, desc="ruler")
    return records


# --------------------------------------------------------------------------- table and plot

def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(records: Sequence[RulerRecord | dict[str, Any]]) -> dict[tuple[int, str, float], dict[str, float]]:
    """(length, policy, fraction) -> {task: 100 x mean score, "avg": mean over tasks, "n": samples per task}."""
    rows = [asdict(r) if isinstance(r, RulerRecord) else r for r in records]
    cells: dict[tuple[int, str, float], dict[str, list[float]]] = {}
    for r in rows:
        cells.setdefault((r["length"], r["policy"], float(r["kv_fraction"])), {}).setdefault(r["task"], []).append(
            float(r["score"]))
    out = {}
    for key, per_task in cells.items():
        scores = {task: 100 * _mean(v) for task, v in per_task.items()}
        scores["avg"] = _mean([scores[t] for t in per_task])
        scores["n"] = min(len(v) for v in per_task.values())
        out[key] = scores
    return out


def ruler_table(records: Sequence[RulerRecord | dict[str, Any]], tasks: Sequence[str] | None = None) -> str:
    """Markdown: one table per length; rows policy @ KV fraction, columns tasks and their average (0-100)."""
    summary = summarize(records)
    rows = [asdict(r) if isinstance(r, RulerRecord) else r for r in records]
    tasks = list(tasks) if tasks else list(dict.fromkeys(r["task"] for r in rows))
    lines = []
    for length in sorted({k[0] for k in summary}):
        keys = [k for k in summary if k[0] == length]
        full = [k for k in keys if parse_policy_spec(k[1])[0] == "full"]
        keys = full + sorted((k for k in keys if k not in full), key=lambda k: (k[2], k[1]))
        lines += [f"**{length} tokens** (RULER score 0-100, mean over samples; n = samples per task)", "",
                  "| policy | memory | " + " | ".join(tasks) + " | avg | n |",
                  "|---|---:|" + "---:|" * len(tasks) + "---:|---:|"]
        for key in keys:
            s = summary[key]
            cells = " | ".join("-" if t not in s else f"{s[t]:.1f}" for t in tasks)
            lines.append(f"| {key[1]} | {key[2]:.3g} | {cells} | {s['avg']:.1f} | {s['n']} |")
        lines.append("")
    return "\n".join(lines)


def plot_ruler(records: Sequence[RulerRecord | dict[str, Any]], path: str | Path) -> Path:
    """Average RULER score vs KV fraction, one line per policy, one panel per length (full: dashed)."""
    from confkv.eval.report.plots import plt

    summary = summarize(records)
    lengths = sorted({k[0] for k in summary})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(lengths), squeeze=False, figsize=(4.6 * len(lengths), 3.6))
    for ax, length in zip(axes[0], lengths):
        policies = list(dict.fromkeys(k[1] for k in summary if k[0] == length))
        for spec in policies:
            points = sorted((k[2], v["avg"]) for k, v in summary.items() if k[0] == length and k[1] == spec)
            if parse_policy_spec(spec)[0] == "full":
                ax.axhline(points[0][1], color="black", ls="--", lw=1, label=f"{spec} (100% KV)")
            else:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=spec)
        ax.set_title(f"RULER, {length} tokens")
        ax.set_xlabel("memory target (fraction of the full cache's bytes)")
        ax.set_ylabel("average score (0-100)")
        ax.set_ylim(-2, 102)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_ruler(records: Sequence[RulerRecord], out_dir: str | Path, tasks: Sequence[str], command: str = ""
                ) -> list[Path]:
    """``ruler.md`` (the command, then the tables) and ``ruler.png`` (score vs KV fraction)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "ruler.md"
    head = f"```\n{command}\n```\n\n" if command else ""
    md.write_text(head + ruler_table(records, tasks) + "\n![score vs KV fraction](ruler.png)\n")
    return [md, plot_ruler(records, out_dir / "ruler.png")]


__all__ = ["RULER_VERSION", "RulerConfig", "RulerRecord", "plot_ruler", "ruler_table", "run_ruler_grid",
           "summarize", "write_ruler"]
