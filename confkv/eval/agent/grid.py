"""The agent grid: tasks x protocols x policies x memory targets, resumable, with a progress bar.

Memory (as every grid sets it): each policy (or preset: ``tiered``, ``tiered-int8``, ``kivi-4``, ``kivi-2``) runs
at each ``memory`` fraction, the cache holding that fraction of the full cache's bytes at the
end of every forward pass (during a prefill chunk it holds up to ``chunk`` more). Records keep
``memory`` and ``compression = 1 / memory``, and ``full_peak_reference``: the full cache's
bytes for the expert's whole history (``full_kv_bytes(model, T)``).

Resuming: each finished episode appends one record to ``<out-dir>/agent.jsonl``
(:mod:`confkv.eval.jsonl`); records of the same run already there are skipped. ``full``
runs first for each task, so every record can carry its agreement with full KV
(``agree_full``); :func:`summarize` recomputes it from the stored predictions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from confkv.eval.agent.harness import PROTOCOLS, expert_history_tokens, run_episode
from confkv.eval.agent.prompt import ChatFormat
from confkv.eval.agent.tasks import Task, build_tasks
from confkv.eval.agent.world import make_world
from confkv.config import StoreConfig
from confkv.eval.jsonl import append_row, load_rows
from confkv.progress import progress as show_progress

if TYPE_CHECKING:
    from confkv.eval.ray.grid import RayOptions

DEFAULT_POLICIES = ("full", "window", "streaming", "h2o", "tova", "confkv", "confkv+int8")


@dataclass
class AgentConfig:
    policies: tuple[str, ...] = DEFAULT_POLICIES
    protocols: tuple[str, ...] = PROTOCOLS
    #: memory targets: fractions in (0, 1] of the full cache's bytes, held by the cache at every step
    #: (compression ``1 / memory``; 0.36 and 0.25 are the earlier grids' compressions 2.8 and 4)
    memory: tuple[float, ...] = (0.36, 0.25)
    tasks: tuple[str, ...] = ()  # task ids or template names (empty: all)
    limit: int | None = None  # the first N selected tasks
    seed: int = 0
    chunk: int = 128
    max_new_tokens: int = 24
    max_steps: int | None = None  # cap on steps per episode (None: the whole trajectory)
    extra_steps: int = 5  # closed loop: expert length + this many steps
    fp_window: int = 128
    extra_params: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"  # the model's dtype (recorded in the run key; the caller loads the model)

    def __post_init__(self) -> None:
        from confkv.eval.niah.config import parse_spec

        bad = [p for p in self.protocols if p not in PROTOCOLS]
        if bad:
            raise ValueError(f"protocols: unknown {bad[0]!r}; choose from {PROTOCOLS}")
        for spec in self.policies:
            parse_spec(spec)
        from confkv.eval.niah.budgets import check_scoped_params, memory_params

        check_scoped_params(self.extra_params, self.policies)
        if not self.memory or any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1
                                  for f in self.memory):
            raise ValueError(f"memory must be fractions of the full cache's bytes in (0, 1], e.g. 0.36,0.25; "
                             f"got {self.memory}")
        for spec in self.policies:  # a policy that cannot run under a target fails here, before any model
            for fraction in self.memory:
                memory_params(parse_spec(spec)[0], fraction, self.extra_params)
        for name in ("chunk", "max_new_tokens", "max_steps", "limit"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def select_tasks(config: AgentConfig) -> list[Task]:
    """The configured tasks (by id or template name), in suite order, at most ``limit``."""
    tasks = build_tasks(make_world(config.seed))
    if config.tasks:
        known = {t.tid for t in tasks} | {t.template for t in tasks}
        unknown = [x for x in config.tasks if x not in known]
        if unknown:
            raise ValueError(f"tasks: unknown {unknown[0]!r}; use a task id like 'shop_cheapest-0' or a template "
                             f"name ({', '.join(sorted({t.template for t in tasks}))})")
        tasks = [t for t in tasks if t.tid in config.tasks or t.template in config.tasks]
    return tasks[:config.limit] if config.limit is not None else tasks


def run_key(config: AgentConfig, model_name: str) -> str:
    """Settings shared by every record of one grid (another run never resumes into it)."""
    parts = {"model": model_name, "seed": config.seed, "chunk": config.chunk, "max_new_tokens": config.max_new_tokens,
             "max_steps": config.max_steps, "extra_steps": config.extra_steps, "fp_window": config.fp_window,
             "extra": config.extra_params, "dtype": config.dtype, "memory_target": True}
    return json.dumps(parts, sort_keys=True)


def _store(spec: str, config: AgentConfig) -> StoreConfig:
    from confkv.eval.niah.config import parse_spec

    return StoreConfig(kv_int8=parse_spec(spec)[1], fp_window=config.fp_window, prefill_chunk=config.chunk)


def _units(config: AgentConfig, tasks: list[Task]) -> list[tuple[Task, str, str, float]]:
    """(task, protocol, policy, memory): full first (memory 1), task-major."""
    units = []
    for task in tasks:
        for protocol in config.protocols:
            if "full" in config.policies:
                units.append((task, protocol, "full", 1.0))
            units += [(task, protocol, spec, float(f)) for f in config.memory for spec in config.policies
                      if spec != "full"]
    return units


def _agreement(a: list[str], b: list[str]) -> float | None:
    n = min(len(a), len(b))
    return sum(x == y for x, y in zip(a[:n], b[:n])) / n if n else None


@dataclass(frozen=True)
class AgentUnit:
    """One episode of the grid: task ``tid`` of world ``seed`` x protocol x policy spec x memory target.

    ``params`` are the cache's parameters (``memory`` among them); ``reference`` the full cache's
    bytes for the expert's whole history.
    """

    tid: str
    protocol: str
    spec: str
    memory: float
    params: dict[str, Any]
    reference: float
    expert_tokens: int
    seed: int
    store: StoreConfig
    chunk: int
    max_new_tokens: int
    max_steps: int | None
    extra_steps: int
    run: str

    @property
    def key(self) -> tuple:
        return (self.tid, self.protocol, self.spec, float(self.memory))


_WORLDS: dict[int, tuple[Any, dict[str, Task]]] = {}


def _world_and_tasks(seed: int) -> tuple[Any, dict[str, Task]]:
    """The world of ``seed`` and its tasks by id (built once per process: a Ray actor runs many episodes)."""
    if seed not in _WORLDS:
        world = make_world(seed)
        _WORLDS[seed] = (world, {t.tid: t for t in build_tasks(world)})
    return _WORLDS[seed]


def run_agent_unit(model: Any, tokenizer: Any, unit: AgentUnit) -> list[dict[str, Any]]:
    """Run one episode; its record (in a list), without ``agree_full`` (the driver adds it from full's record).

    Pure: the same record in process and on a Ray actor, apart from ``seconds``.
    """
    from confkv.eval.niah.config import parse_spec

    world, tasks = _world_and_tasks(unit.seed)
    task = tasks[unit.tid]
    episode = run_episode(model, tokenizer, world, task, unit.protocol, parse_spec(unit.spec)[0], unit.params,
                          store=unit.store, chunk=unit.chunk, max_new_tokens=unit.max_new_tokens,
                          max_steps=unit.max_steps, extra_steps=unit.extra_steps,
                          fmt=ChatFormat.for_tokenizer(tokenizer))
    row = {"run": unit.run, "task": task.tid, "template": task.template, "info_early": task.info_early,
           "protocol": unit.protocol, "policy": unit.spec, "memory": float(unit.memory),
           "compression": 1.0 / float(unit.memory),
           "params": unit.params, "full_peak_reference": unit.reference, "expert_tokens": unit.expert_tokens,
           **episode.to_dict()}
    if unit.protocol == "teacher-forced":
        row["agree_expert"] = sum(s["agree"] for s in episode.steps) / max(1, len(episode.steps))
    return [row]


def run_agent_grid(model: Any, tokenizer: Any, config: AgentConfig, out_path: str | Path, *, model_name: str = "",
                   progress: bool = True, compute: bool = True, ray: "RayOptions | None" = None,
                   loader: Callable[[], tuple[Any, Any]] | None = None) -> list[dict[str, Any]]:
    """Run (or, with ``compute=False``, only collect) the grid; returns this run's records.

    ``ray``: run the episodes on Ray actors that each load the model with ``loader`` (a
    :class:`~confkv.eval.ray.grid.ModelSpec`): the ``full`` episodes first, then the others
    (their ``agree_full`` needs full's record); only this process writes ``out_path``.
    """
    from confkv.eval.niah.budgets import full_kv_bytes, memory_params
    from confkv.eval.niah.config import parse_spec

    if ray is not None and loader is None:
        raise ValueError("run_agent_grid: ray needs loader (a ModelSpec naming the same model)")
    run = run_key(config, model_name)
    tasks = select_tasks(config)
    world = make_world(config.seed)
    records: dict[tuple, dict[str, Any]] = {}
    for row in load_rows(out_path):
        if row.get("run") == run:
            records.setdefault((row["task"], row["protocol"], row["policy"], float(row["memory"])), row)
    fmt = ChatFormat.for_tokenizer(tokenizer)
    history: dict[str, int] = {}

    def unit_for(task: Task, protocol: str, spec: str, memory: float) -> AgentUnit:
        if task.tid not in history:
            history[task.tid] = expert_history_tokens(tokenizer, world, task, fmt, config.max_steps)
        return AgentUnit(tid=task.tid, protocol=protocol, spec=spec, memory=float(memory),
                         params=memory_params(parse_spec(spec)[0], memory, config.extra_params),
                         reference=full_kv_bytes(model, history[task.tid]), expert_tokens=history[task.tid],
                         seed=config.seed, store=_store(spec, config), chunk=config.chunk,
                         max_new_tokens=config.max_new_tokens, max_steps=config.max_steps,
                         extra_steps=config.extra_steps, run=run)

    def land(rows: list[dict[str, Any]]) -> None:
        """The driver's side: agreement with full KV's record, then append (the only writer of ``out_path``)."""
        row = rows[0]
        if row["protocol"] == "teacher-forced":
            full = row if row["policy"] == "full" else records.get((row["task"], row["protocol"], "full", 1.0))
            row["agree_full"] = _agreement([s["predicted"] for s in row["steps"]],
                                           [s["predicted"] for s in full["steps"]]) if full else None
        append_row(out_path, row)
        records[(row["task"], row["protocol"], row["policy"], float(row["memory"]))] = row

    todo = [u for u in (_units(config, tasks) if compute else []) if (u[0].tid, u[1], u[2], float(u[3])) not in records]
    if ray is None:
        for task, protocol, spec, memory in show_progress(todo, desc="agent", enabled=progress, leave=True):
            land(run_agent_unit(model, tokenizer, unit_for(task, protocol, spec, memory)))
    elif todo:
        from confkv.eval.ray.grid import RayGrid, WorkUnit

        units = [unit_for(*u) for u in todo]
        with RayGrid(ray, loader, run_agent_unit) as grid:
            for phase in ([u for u in units if u.spec == "full"], [u for u in units if u.spec != "full"]):
                if phase:
                    grid.run([WorkUnit(u.key, u) for u in phase], lambda unit, rows: land(rows),
                             progress=progress, desc="agent")
    return [r for (tid, protocol, spec, _), r in records.items()
            if spec in config.policies and protocol in config.protocols and tid in {t.tid for t in tasks}]


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (protocol, policy, compression): scores, relative to full, KV bytes."""
    full = {(r["task"], r["protocol"]): r for r in records if r["policy"] == "full"}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["protocol"], r["policy"], r["compression"]), []).append(r)
    rows = []
    for (protocol, policy, compression), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        pairs = [(r, full.get((r["task"], protocol))) for r in rs]
        row: dict[str, Any] = {"protocol": protocol, "policy": policy, "compression": compression,
                               "memory": 1.0 / compression, "tasks": len(rs),
                               "peak_kv_bytes": sum(r["peak_kv_bytes"] for r in rs) / len(rs),
                               "mean_kv_bytes": sum(r["mean_kv_bytes"] for r in rs) / len(rs),
                               "peak_vs_full": _mean([f["peak_kv_bytes"] / r["peak_kv_bytes"] for r, f in pairs if f]),
                               "seconds": sum(r["seconds"] for r in rs) / len(rs)}
        if protocol == "teacher-forced":
            row["agree_expert"] = _mean([r["agree_expert"] for r in rs])
            full_agree = _mean([f["agree_expert"] for r, f in pairs if f])
            mine = _mean([r["agree_expert"] for r, f in pairs if f])
            row["agree_expert_vs_full"] = mine / full_agree if full_agree else None
            row["agree_full"] = _mean([_agreement([s["predicted"] for s in r["steps"]],
                                                  [s["predicted"] for s in f["steps"]]) for r, f in pairs if f])
        else:
            row["success"] = _mean([float(r["success"]) for r in rs])
            full_success = _mean([float(f["success"]) for r, f in pairs if f])
            mine = _mean([float(r["success"]) for r, f in pairs if f])
            row["success_vs_full"] = mine / full_success if full_success else None
        rows.append(row)
    return rows


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}"

    lines = []
    for r in rows:
        score = (f"agree(expert) {f(r['agree_expert'])}  vs full {f(r['agree_expert_vs_full'])}  "
                 f"agree(full) {f(r['agree_full'])}") if r["protocol"] == "teacher-forced" else \
            f"success {f(r['success'])}  vs full {f(r['success_vs_full'])}"
        lines.append(f"{r['protocol']:14s} {r['policy']:12s} memory {r['memory']:<6.3g} n={r['tasks']:3d}  {score}  "
                     f"peak {r['peak_kv_bytes'] / 1e6:.2f} MB (full/peak {f(r['peak_vs_full'])})  "
                     f"mean {r['mean_kv_bytes'] / 1e6:.2f} MB  {r['seconds']:.0f}s/task")
    return lines


__all__ = ["AgentConfig", "DEFAULT_POLICIES", "run_agent_grid", "run_key", "select_tasks", "summarize",
           "summary_lines"]
