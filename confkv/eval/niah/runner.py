"""Running the NIAH grid: lengths x depths x trials, every policy, both protocols, resumable.

Sharing work (on by default, both exact up to float summation order):

- query-aware: nothing is evicted during the prefill, so every policy with the same store
  settings runs the *same* forward pass; one prefill feeds all their statistics
  (:class:`~confkv.policies.tee.TeePolicy`) and each policy compresses its own fork of
  the cache (``share_prefill``).
- ``full`` evicts nothing, so its two protocols are one computation: it runs once and is
  reported under both (``full_once``; ``computed_in`` in each record says which ran).

Resuming: with ``resume_path`` (the CLI's ``<out-dir>/niah.jsonl``) every finished batch
appends its records, and records of the same run already there are skipped.

The depths x trials of one context length run as one batch (``batch`` caps its size).

Units: one batch x one protocol x one group of policies (:class:`NiahUnit`), run by
:func:`run_niah_unit` in this process or, with ``ray`` (``confkv niah --ray``), on Ray
actors (:mod:`confkv.eval.ray.grid`); the records are the same apart from ``seconds_per_seq``.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from confkv.errors import PromptTooLongError
from confkv.eval.jsonl import append_rows
from confkv.data import make_niah_sample, score_niah
from confkv.eval.niah.budgets import full_kv_bytes, memory_params
from confkv.eval.niah.config import PROTOCOL_VERSIONS, NiahConfig, _store_for, parse_spec
from confkv.eval.niah.protocols import run_niah_batch, run_query_aware_shared
from confkv.eval.niah.records import NiahRecord, NiahResult, load_records, record_key
from confkv.models import model_max_positions
from confkv.presets import preset_signature
from confkv.progress import progress as show_progress

if TYPE_CHECKING:
    from confkv.config import StoreConfig
    from confkv.eval.ray.grid import RayOptions


def run_key(config: NiahConfig, model_name: str) -> str:
    """The settings every record of one grid shares (a different run never resumes into it)."""
    parts = {"model": model_name, "haystack": config.haystack, "needle": config.needle_template,
             "question": config.question_template, "answer": config.answer,
             "memory": config.memory, "max_new_tokens": config.max_new_tokens, "chunk": config.chunk, "fp_window": config.fp_window,
             "int8_all": config.kv_int8, "seed": config.seed,
             "extra": config.extra_params, "dtype": config.dtype}
    return json.dumps(parts, sort_keys=True)


def check_niah_positions(model: Any, lengths: Sequence[int], max_new_tokens: int) -> None:
    """Refuse lengths the model cannot hold; warn when the answer runs past its positions.

    A prompt longer than the model's positions raises :class:`PromptTooLongError`. A prompt
    that fits but whose ``max_new_tokens`` answer tokens would sit past the last position
    raises too for learned absolute positions (GPT-2: there is no embedding for them) and
    warns for rotary models (RoPE extrapolates a few positions; transformers only warns).
    Models whose positions cannot be read are not checked.
    """
    try:
        limit = model_max_positions(model)
    except ValueError:
        return
    longest = max(lengths)
    fits = limit - max_new_tokens
    if longest > limit:
        raise PromptTooLongError(f"NIAH length {longest} exceeds the model's {limit} positions; use --lengths up "
                                 f"to {fits} ({limit} minus the {max_new_tokens} answer tokens)")
    if longest + max_new_tokens <= limit:
        return
    from confkv.hf.support import text_config

    config = text_config(model.config)
    rotary = getattr(config, "rope_parameters", None) is not None or getattr(config, "rope_theta", None) is not None
    message = (f"NIAH length {longest} + {max_new_tokens} answer tokens exceeds the model's {limit} positions; "
               f"use --lengths up to {fits} (or lower --max-new-tokens)")
    if not rotary:
        raise PromptTooLongError(message)
    warnings.warn(f"confkv: {message}; the answer tokens past position {limit - 1} rely on RoPE extrapolation",
                  stacklevel=2)


def run_niah_grid(model: Any, tokenizer: Any, config: NiahConfig, *, progress: bool = True,
                  model_name: str = "", resume_path: str | Path | None = None, compute: bool = True,
                  ray: "RayOptions | None" = None, loader: Callable[[], tuple[Any, Any]] | None = None
                  ) -> NiahResult:
    """Run the whole grid; see the module docstring for the protocols. Every cache but ``full`` holds
    ``config.memory`` of the full cache's bytes at the end of every step (``budget_bytes``: that target
    at each length, one sequence).

    Args:
        resume_path: a ``niah.jsonl``: each finished batch's records are appended to it
            (fsynced), and records of the same run already there are not recomputed, so
            an interrupted grid resumes where it stopped.
        compute: False: only collect the records already in ``resume_path`` (a partial grid).
        ray: run the units on Ray (:mod:`confkv.eval.ray.grid`); ``loader`` (e.g. a
            :class:`~confkv.eval.ray.grid.ModelSpec`) loads the same model in each actor.
            The records are those of the in-process loop except ``seconds_per_seq``.
    """
    if ray is not None and loader is None:
        raise ValueError("run_niah_grid: ray needs loader (a ModelSpec naming the same model)")
    specs = list(config.policies)
    for spec in specs:
        parse_spec(spec)
    if compute:
        check_niah_positions(model, config.lengths, config.max_new_tokens)
    sample_kwargs: dict[str, Any] = {"haystack": config.haystack, "seed": config.seed}
    if config.needle_template:
        sample_kwargs["needle_template"] = config.needle_template
    if config.question_template:
        sample_kwargs["question_template"] = config.question_template
    if config.answer:
        sample_kwargs["answer"] = config.answer
    # the target each cache holds at the end of every step: memory x the full cache's bytes at this length
    budget_bytes = {length: config.memory * full_kv_bytes(model, length) for length in config.lengths}
    budgets = {f"{spec}@{length}": memory_params(parse_spec(spec)[0], config.memory, config.extra_params)
               for length in config.lengths for spec in specs}
    run = run_key(config, model_name)
    resume_path = Path(resume_path) if resume_path is not None else None
    records: list[NiahRecord] = []
    done: set[tuple] = set()
    if resume_path is not None:
        def in_grid(row: dict[str, Any]) -> bool:
            return (row["policy"] in specs and row["protocol"] in config.protocols
                    and row.get("protocol_version", 1) == PROTOCOL_VERSIONS[row["protocol"]]
                    and row["length"] in config.lengths
                    and float(row["depth"]) in [float(d) for d in config.depths] and config.first_trial <= row["trial"] < config.first_trial + config.trials
                    and row.get("preset") == preset_signature(parse_spec(row["policy"])[0]))  # not a changed preset's

        for row in load_records(resume_path):
            if row.get("run") == run and in_grid(row) and record_key(row) not in done:
                done.add(record_key(row))
                records.append(NiahRecord(**row))
    started = time.perf_counter()
    # one unit of work: a batch of samples of one length, one protocol, one group of policies
    # ordered batch-major (trials first, then lengths): a partial grid covers every length
    units = []
    batches: dict[int, list[list]] = {}
    for length in config.lengths if compute else ():
        samples = [make_niah_sample(tokenizer, context_tokens=length, depth=d, trial=t, **sample_kwargs)
                   for t in range(config.first_trial, config.first_trial + config.trials) for d in config.depths]
        size = config.batch or len(samples)
        batches[length] = [samples[begin:begin + size] for begin in range(0, len(samples), size)]
    for index in range(max((len(b) for b in batches.values()), default=0)):
        for length, parts in batches.items():
            for protocol in config.protocols:
                units.extend((length, protocol, group, parts[index]) for group in _groups(specs, protocol, config))
    work = []
    for length, protocol, group, part in units:
        todo = [spec for spec in group if any((run, spec, proto, length, float(s.depth), s.trial,
                                               preset_signature(parse_spec(spec)[0])) not in done
                                              for proto in _reported_under(spec, protocol, config) for s in part)]
        if todo:
            work.append(NiahUnit(length=length, protocol=protocol, specs=tuple(todo), samples=tuple(part),
                                 params={spec: budgets[f"{spec}@{length}"] for spec in todo},
                                 reported={spec: tuple(_reported_under(spec, protocol, config)) for spec in todo},
                                 store=_store_for(todo[0], config), chunk=config.chunk,
                                 max_new_tokens=config.max_new_tokens, run=run))

    def land(rows: list[dict[str, Any]]) -> None:
        """The driver's side: keep the records not already there, append them (the only writer)."""
        fresh = [NiahRecord(**row) for row in rows if record_key(row) not in done]
        done.update(record_key(r) for r in fresh)
        if resume_path is not None:
            append_rows(resume_path, [asdict(r) for r in fresh])
        records.extend(fresh)

    if ray is None:
        for unit in show_progress(work, desc="niah", enabled=progress, leave=True):
            land(run_niah_unit(model, tokenizer, unit))
    else:
        from confkv.eval.ray.grid import WorkUnit, run_units

        cost = [unit.length * len(unit.specs) * len(unit.samples) for unit in work]  # the longest go first
        run_units([WorkUnit(unit.key, unit, cost=c) for unit, c in zip(work, cost)], run_niah_unit, loader, ray,
                  lambda unit, rows: land(rows), progress=progress, desc="niah")
    return NiahResult(config=config, records=records, budgets=budgets, budget_bytes=budget_bytes,
                      seconds=time.perf_counter() - started, model=model_name)


@dataclass(frozen=True)
class NiahUnit:
    """One unit of the grid: a batch of same-length samples x one protocol x a group of policies.

    ``specs`` are the policies still to run (a group shares one prefill under query-aware),
    ``params`` their budgets, ``reported`` the protocols each one's records go under.
    """

    length: int
    protocol: str
    specs: tuple[str, ...]
    samples: tuple[Any, ...]  # NiahSample
    params: dict[str, dict[str, Any]]
    reported: dict[str, tuple[str, ...]]
    store: "StoreConfig"
    chunk: int
    max_new_tokens: int
    run: str

    @property
    def key(self) -> tuple:
        return (self.length, self.protocol, self.specs, tuple((float(s.depth), s.trial) for s in self.samples))


def run_niah_unit(model: Any, tokenizer: Any, unit: NiahUnit) -> list[dict[str, Any]]:
    """Run one unit; its records as dicts (``seconds_per_seq``: the unit's time / sequences / policies).

    Pure: the same records in process and on a Ray actor (apart from ``seconds_per_seq``).
    """
    t0 = time.perf_counter()
    part = list(unit.samples)
    members = [(parse_spec(spec)[0], unit.params[spec]) for spec in unit.specs]
    if unit.protocol == "query-aware" and len(unit.specs) > 1:
        outputs = run_query_aware_shared(model, tokenizer, part, members, store=unit.store, chunk=unit.chunk,
                                         max_new_tokens=unit.max_new_tokens)
    else:
        outputs = [run_niah_batch(model, tokenizer, part, name, params, unit.protocol, store=unit.store,
                                  chunk=unit.chunk, max_new_tokens=unit.max_new_tokens) for name, params in members]
    per_seq = (time.perf_counter() - t0) / len(part) / len(unit.specs)
    rows = []
    for spec, outs in zip(unit.specs, outputs):
        for proto in unit.reported[spec]:
            for s, (text, kept, peak, resident) in zip(part, outs):
                rows.append(asdict(NiahRecord(
                    policy=spec, protocol=proto, length=unit.length, depth=s.depth, trial=s.trial,
                    actual_depth=s.actual_depth, answer=s.answer, generated=text, correct=score_niah(text, s.answer),
                    params=unit.params[spec], kept_at_answer=kept, peak_kv_bytes_per_seq=peak,
                    peak_resident_bytes_per_seq=resident,
                    seconds_per_seq=per_seq, run=unit.run, computed_in=unit.protocol,
                    protocol_version=PROTOCOL_VERSIONS[proto], preset=preset_signature(parse_spec(spec)[0]))))
    return rows


def _reported_under(spec: str, protocol: str, config: NiahConfig) -> list[str]:
    """The protocols one computation of ``spec`` is reported under (full KV evicts nothing: all of them)."""
    return list(config.protocols) if spec == "full" and config.full_once else [protocol]


def _groups(specs: list[str], protocol: str, config: NiahConfig) -> list[list[str]]:
    """The policies one unit runs together: query-aware shares one prefill per store setting."""
    if config.full_once and protocol != config.protocols[0]:
        specs = [s for s in specs if s != "full"]  # computed with the first protocol
    if protocol != "query-aware" or not config.share_prefill:
        return [[s] for s in specs]
    by_store: dict[tuple, list[str]] = {}
    for spec in specs:  # one prefill per store setting and storage (a fork keeps the shared cache's storage)
        store = _store_for(spec, config)
        by_store.setdefault((store.kv_int8, store.evict_slack, _storage_of(spec, config)), []).append(spec)
    return list(by_store.values())


def _storage_of(spec: str, config: NiahConfig) -> Any:
    """How ``spec`` holds its tokens under the grid's target (None for ``full``)."""
    name, _ = parse_spec(spec)
    if name == "full":
        return None
    from confkv.presets import resolve

    return resolve(name, **memory_params(name, config.memory, config.extra_params)).storage


