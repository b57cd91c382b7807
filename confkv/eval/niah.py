"""Needle in a haystack: a grid of context lengths x depths x trials, two protocols.

Protocols (always reported separately):

- ``query-aware``: the haystack is prefilled in chunks, then the question (all but its
  last token) as its own last chunk, all with eviction *deferred* (``cache.evict = False``:
  the policy still observes attention and the store still ages, nothing is dropped);
  then the cache is brought to budget once, with the budget the policy picks from the
  confidence at the last prefilled position (``cache.end_step(last_logits)`` with
  eviction back on: the same end-of-step every forward pass runs, one extra trace
  record); then greedy generation. The last attention every policy observes is the
  question's alone (SnapKV's observation window; TOVA's "current query"), so the ranking
  has seen the question; peak memory during prefill is the full prompt. (Protocol
  version 2; version 1 chunked the whole prompt, so the question shared its last chunk
  with up to ``chunk`` haystack tokens. Records keep their ``protocol_version``; a grid
  never resumes from records of another version.)
- ``streaming``: the haystack is prefilled in chunks with eviction after each chunk
  (peak bounded by budget + chunk), then the question (all but its last token), then
  greedy generation: the policy must decide what to keep before the question exists.

Grid entries are policy names, optionally with ``+int8`` (INT8 store, e.g.
``confkv+int8``), each matched to the same KV bytes.

Sharing work (on by default, both exact up to float summation order):

- query-aware: nothing is evicted during the prefill, so every policy with the same store
  settings runs the *same* forward pass; one prefill feeds all their statistics
  (:class:`~confkv.policies.tee.TeePolicy`) and each policy compresses its own fork of
  the cache (``share_prefill``).
- ``full`` evicts nothing, so its two protocols are one computation: it runs once and is
  reported under both (``full_once``; ``computed_in`` in each record says which ran).

Resuming: with ``resume_path`` (the CLI's ``<out-dir>/niah.jsonl``) every finished batch
appends its records, and records of the same run already there are skipped.

All samples of one context length have the same number of tokens
(:func:`confkv.data.make_niah_sample` pads the haystack to the exact length), so the
depths x trials of a length run as one batch (``batch`` caps its size) with per-sequence
budgets and no padding.

Budget: ``budget_fraction`` of the full-precision KV bytes of the longest context
(``budget_of="longest"``, the paper's setup: one memory for the whole grid; or of
``budget_tokens`` tokens, so that parts of one grid can run in several processes) or of each
length (``"each"``), converted into each policy's budget parameters by
:func:`budgets_for_bytes` (peak KV bytes; gated policies get ``n_low`` at the budget and
``n_high = ratio * n_low``).
"""

from __future__ import annotations

import csv
import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from confkv.config import StoreConfig
from confkv.errors import ConfigError, PromptTooLongError
from confkv.eval.jsonl import append_rows
from confkv.data import DEFAULT_NEEDLE_TEMPLATE, DEFAULT_QUESTION_TEMPLATE, make_niah_sample, score_niah
from confkv.models import model_max_positions

PROTOCOLS = ("query-aware", "streaming")
#: bumped when a protocol's computation changes; records of another version are not reused
PROTOCOL_VERSIONS = {"query-aware": 2, "streaming": 1}


@dataclass
class NiahConfig:
    lengths: tuple[int, ...] = (1024, 2048)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 1
    first_trial: int = 0  # trials first_trial .. first_trial + trials - 1 (split one grid over processes)
    policies: tuple[str, ...] = ("full", "streaming", "confkv")
    protocols: tuple[str, ...] = PROTOCOLS
    haystack: str = "pydoc-topics"
    needle_template: str | None = None
    question_template: str | None = None
    answer: str | None = None
    budget_fraction: float = 0.25
    budget_of: str = "longest"
    max_new_tokens: int = 10
    chunk: int = 512
    batch: int = 0
    kv_int8: bool = False
    fp_window: int = 128
    ratio: float = 0.5
    seed: int = 0
    extra_params: dict[str, Any] = field(default_factory=dict)
    share_prefill: bool = True  # query-aware: one prefill per store setting, forked per policy
    full_once: bool = True  # full KV: one computation reported under both protocols
    dtype: str = "float32"  # the model's dtype (recorded; the caller loads the model)
    budget_tokens: int | None = None  # budget = fraction of this many tokens' KV (overrides budget_of)

    def __post_init__(self) -> None:
        unknown = [p for p in self.protocols if p not in PROTOCOLS]
        if unknown:
            raise ValueError(f"unknown NIAH protocol {unknown[0]!r}; choose from {PROTOCOLS}")
        if self.budget_of not in ("longest", "each"):
            raise ValueError("budget_of must be 'longest' or 'each'")
        if self.budget_tokens is not None and (isinstance(self.budget_tokens, bool) or self.budget_tokens < 1):
            raise ValueError(f"budget_tokens must be a positive number of tokens, got {self.budget_tokens!r}")
        if isinstance(self.first_trial, bool) or not isinstance(self.first_trial, int) or self.first_trial < 0:
            raise ValueError(f"first_trial must be a non-negative integer, got {self.first_trial!r}")
        if not 0 < self.budget_fraction <= 1:
            raise ValueError("budget_fraction must be in (0, 1]")


@dataclass
class NiahRecord:
    policy: str
    protocol: str
    length: int
    depth: float
    trial: int
    actual_depth: float
    answer: str
    generated: str
    correct: bool
    params: dict[str, Any]
    kept_at_answer: float  # mean over layers of tokens kept when the answer is generated
    peak_kv_bytes_per_seq: float  # trace peak / batch size
    seconds_per_seq: float
    run: str = ""  # run_key(): the settings shared by every record of the grid
    computed_in: str = ""  # the protocol whose computation produced it (full: one run for both)
    protocol_version: int = 1  # PROTOCOL_VERSIONS[protocol] when it was computed


@dataclass
class NiahResult:
    config: NiahConfig
    records: list[NiahRecord]
    budgets: dict[str, dict[str, Any]]  # "policy@length" -> params
    budget_bytes: dict[int, float]
    seconds: float
    model: str = ""

    def accuracy(self, policy: str, protocol: str, length: int | None = None, depth: float | None = None) -> float:
        rows = [r for r in self.records if r.policy == policy and r.protocol == protocol
                and (length is None or r.length == length) and (depth is None or r.depth == depth)]
        return sum(r.correct for r in rows) / len(rows) if rows else float("nan")

    def grid(self, policy: str, protocol: str) -> list[list[float]]:
        """[depth][length] accuracy."""
        return [[self.accuracy(policy, protocol, length, depth) for length in self.config.lengths]
                for depth in self.config.depths]

    def count(self, policy: str, protocol: str) -> int:
        return sum(1 for r in self.records if r.policy == policy and r.protocol == protocol)

    def relative_to_full(self, policy: str, protocol: str) -> float:
        """Accuracy / full-KV accuracy on the same samples (NaN without full records or hits)."""
        full = {(r.length, r.depth, r.trial): r.correct for r in self.records
                if r.policy == "full" and r.protocol == protocol}
        pairs = [(r.correct, full[(r.length, r.depth, r.trial)]) for r in self.records
                 if r.policy == policy and r.protocol == protocol and (r.length, r.depth, r.trial) in full]
        hits_full = sum(f for _, f in pairs)
        return sum(c for c, _ in pairs) / hits_full if hits_full else float("nan")

    def summary(self) -> dict[str, Any]:
        return {f"{policy}/{protocol}": self.accuracy(policy, protocol)
                for protocol in self.config.protocols for policy in self.config.policies}

    def summary_lines(self) -> list[str]:
        lines = []
        for protocol in self.config.protocols:
            for policy in self.config.policies:
                per_length = "  ".join(f"{length}:{self.accuracy(policy, protocol, length):.2f}"
                                       for length in self.config.lengths)
                lines.append(f"{protocol:12s} {policy:14s} acc {self.accuracy(policy, protocol):.3f}  "
                             f"vs full {self.relative_to_full(policy, protocol):.3f}  "
                             f"n={self.count(policy, protocol):4d}   {per_length}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        keys = [(p, q) for q in self.config.protocols for p in self.config.policies]
        return {"model": self.model, "config": asdict(self.config), "budgets": self.budgets,
                "budget_bytes": {str(k): v for k, v in self.budget_bytes.items()}, "seconds": self.seconds,
                "summary": self.summary(),
                "relative_to_full": {f"{p}/{q}": self.relative_to_full(p, q) for p, q in keys},
                "counts": {f"{p}/{q}": self.count(p, q) for p, q in keys},
                "grids": {f"{p}/{q}": self.grid(p, q) for p, q in keys},
                "records": [asdict(r) for r in self.records]}


def budgets_for_bytes(model: Any, policies: Sequence[str], target_bytes: float, context_tokens: int, *,
                      store: StoreConfig | None = None, ratio: float = 0.5,
                      extra: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Each policy's budget parameters whose peak KV bytes (one sequence) are the largest <= ``target_bytes``.

    ``full`` gets no budget. Uses the analytic bytes model of :mod:`confkv.eval.sweep`.
    """
    from confkv.eval.sweep import BytesModel, match_budget

    bytes_model = BytesModel.for_model(model)
    out = {}
    for name in policies:
        if name == "full":
            out[name] = {}
            continue
        params, _ = match_budget(name, target_bytes, bytes_model, context_tokens, stat="peak", store=store,
                                 ratio=ratio, extra=_policy_extra(name, extra))
        out[name] = params
    return out


def _policy_extra(name: str, extra: dict[str, Any] | None) -> dict[str, Any]:
    """Extra parameters that ``name`` accepts (one ``--param`` list for several policies)."""
    from confkv.policies.registry import accepted_parameters

    if not extra:
        return {}
    fields = accepted_parameters(name)
    return {k: v for k, v in extra.items() if k in fields}


def full_kv_bytes(model: Any, tokens: int, store: StoreConfig | None = None) -> float:
    """Full-precision KV bytes of one sequence of ``tokens`` tokens (all layers), as ``full`` holds them.

    A sliding-window layer (Gemma-3's local layers) holds at most ``window - 1`` past tokens
    whatever the policy, as :func:`confkv.eval.sweep.simulate_kv_bytes` counts it.
    """
    from confkv.eval.sweep import BytesModel

    bm = BytesModel.for_model(model)
    held = sum(tokens if w is None else min(tokens, w - 1) for w in bm.sliding_windows)
    return float(held * bm.fp_bytes)


def parse_spec(spec: str) -> tuple[str, bool]:
    """A grid entry -> (policy name, INT8 store): ``"confkv+int8"`` -> ``("confkv", True)``."""
    from confkv.policies import POLICIES

    name, plus, suffix = spec.partition("+")
    if plus and suffix != "int8":
        raise ValueError(f"NIAH policy {spec!r}: the only suffix is '+int8' (INT8 store), e.g. 'confkv+int8'")
    if name not in POLICIES:
        raise ConfigError(f"unknown policy {name!r} in NIAH policy {spec!r}; known: {', '.join(sorted(POLICIES))}")
    return name, bool(plus)


def _store_for(spec: str, config: NiahConfig) -> StoreConfig:
    _, int8 = parse_spec(spec)
    return StoreConfig(kv_int8=int8 or config.kv_int8, fp_window=config.fp_window, prefill_chunk=config.chunk)


def _generate(model: Any, tokenizer: Any, cache: Any, ids: torch.Tensor, max_new_tokens: int
              ) -> list[tuple[str, float, float]]:
    """Greedy answer from a cache holding the prompt minus its last token -> (text, kept, peak bytes/seq)."""
    batch = ids.shape[0]
    answer_step = len(cache.trace)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=pad)
    texts = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    trace = cache.trace
    kept = trace.steps[answer_step].kept.float().mean(0) if len(trace) > answer_step else torch.zeros(batch)
    peak = trace.peak_kv_bytes() / batch
    return [(texts[i], float(kept[i]), peak) for i in range(batch)]


def _batch_ids(samples: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.cat([s.input_ids for s in samples]), torch.cat([s.context_ids for s in samples]),
            torch.cat([s.question_ids for s in samples]))


@torch.no_grad()
def run_niah_batch(model: Any, tokenizer: Any, samples: list, policy: str, params: dict[str, Any], protocol: str,
                   *, store: StoreConfig, chunk: int, max_new_tokens: int) -> list[tuple[str, float, float]]:
    """Run one batch of same-length samples; returns (generated text, kept tokens at answer, peak bytes/seq)."""
    from confkv.hf import ConfKVCache

    device = next(model.parameters()).device
    ids, context, question = (t.to(device) for t in _batch_ids(samples))
    cache = ConfKVCache.for_model(model, policy, store=store, **params)
    if protocol == "query-aware":
        cache.evict = False
        logits = _feed_prompt(model, cache, context, question, chunk)
        cache.evict = True
        cache.end_step(logits)  # bring the cache to the budget picked at the last prompt position
    else:
        _feed_prompt(model, cache, context, question, chunk)
    return _generate(model, tokenizer, cache, ids, max_new_tokens)


def _feed_prompt(model: Any, cache: Any, context: torch.Tensor, question: torch.Tensor, chunk: int) -> torch.Tensor:
    """Prefill the haystack in chunks, then the question but its last token as its own chunk; last logits."""
    from confkv.hf import prefill

    logits = prefill(model, cache, context, chunk=chunk)
    if question.shape[1] > 1:
        logits = prefill(model, cache, question[:, :-1], chunk=chunk)
    return logits


@torch.no_grad()
def run_query_aware_shared(model: Any, tokenizer: Any, samples: list, members: list[tuple[str, dict[str, Any]]],
                           *, store: StoreConfig, chunk: int, max_new_tokens: int
                           ) -> list[list[tuple[str, float, float]]]:
    """Query-aware protocol for several policies from ONE prefill (same store settings).

    Nothing is evicted during a query-aware prefill, so the forward pass is the same for
    every policy; a :class:`~confkv.policies.tee.TeePolicy` feeds all their statistics,
    then each policy gets a fork of the cache, compresses it and answers. Equal to running
    :func:`run_niah_batch` per policy up to float summation order (tests/test_tee_fork.py).
    Returns one list of (text, kept, peak bytes/seq) per member.
    """
    from confkv.hf import ConfKVCache
    from confkv.policies import make_policy
    from confkv.policies.tee import TeePolicy

    device = next(model.parameters()).device
    ids, context, question = (t.to(device) for t in _batch_ids(samples))
    tee = TeePolicy.of([make_policy(name, **params) for name, params in members])
    shared = ConfKVCache.for_model(model, tee, store=store)
    shared.evict = False
    logits = _feed_prompt(model, shared, context, question, chunk)
    outputs = []
    for index in range(len(members)):
        cache = shared.fork(index)
        cache.end_step(logits)
        outputs.append(_generate(model, tokenizer, cache, ids, max_new_tokens))
        del cache
    return outputs


def record_key(record: "NiahRecord | dict[str, Any]") -> tuple:
    """What identifies one NIAH generation (resuming skips keys already on disk)."""
    r = asdict(record) if isinstance(record, NiahRecord) else record
    return (r["run"], r["policy"], r["protocol"], r["length"], float(r["depth"]), r["trial"])


def run_key(config: NiahConfig, model_name: str) -> str:
    """The settings every record of one grid shares (a different run never resumes into it)."""
    parts = {"model": model_name, "haystack": config.haystack, "needle": config.needle_template,
             "question": config.question_template, "answer": config.answer,
             "budget_fraction": config.budget_fraction, "budget_of": config.budget_of,
             "budget_tokens": _reference_tokens(config, None),
             "max_new_tokens": config.max_new_tokens, "chunk": config.chunk, "fp_window": config.fp_window,
             "int8_all": config.kv_int8, "ratio": config.ratio, "seed": config.seed,
             "extra": config.extra_params, "dtype": config.dtype}
    return json.dumps(parts, sort_keys=True)


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``niah.jsonl`` (a torn last line from a kill is cut off)."""
    from confkv.eval.jsonl import load_rows

    return load_rows(path)


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
                  model_name: str = "", resume_path: str | Path | None = None, compute: bool = True) -> NiahResult:
    """Run the whole grid; see the module docstring for the protocols and budgets.

    Args:
        resume_path: a ``niah.jsonl``: each finished batch's records are appended to it
            (fsynced), and records of the same run already there are not recomputed, so
            an interrupted grid resumes where it stopped.
        compute: False: only collect the records already in ``resume_path`` (a partial grid).
    """
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
    budget_bytes: dict[int, float] = {}
    budgets: dict[str, dict[str, Any]] = {}
    for length in config.lengths:
        reference = _reference_tokens(config, length)
        budget_bytes[length] = config.budget_fraction * full_kv_bytes(model, reference)
        for spec in specs:
            name, _ = parse_spec(spec)
            params = budgets_for_bytes(model, [name], budget_bytes[length], reference, store=_store_for(spec, config),
                                       ratio=config.ratio, extra=config.extra_params)[name]
            budgets[f"{spec}@{length}"] = params
    run = run_key(config, model_name)
    resume_path = Path(resume_path) if resume_path is not None else None
    records: list[NiahRecord] = []
    done: set[tuple] = set()
    if resume_path is not None:
        def in_grid(row: dict[str, Any]) -> bool:
            return (row["policy"] in specs and row["protocol"] in config.protocols
                    and row.get("protocol_version", 1) == PROTOCOL_VERSIONS[row["protocol"]]
                    and row["length"] in config.lengths
                    and float(row["depth"]) in [float(d) for d in config.depths] and config.first_trial <= row["trial"] < config.first_trial + config.trials)

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
    for length, protocol, group, part in tqdm(units, desc="niah", disable=not progress):
        todo = [spec for spec in group if any((run, spec, proto, length, float(s.depth), s.trial) not in done
                                              for proto in _reported_under(spec, protocol, config) for s in part)]
        if not todo:
            continue
        t0 = time.perf_counter()
        store = _store_for(todo[0], config)
        members = [(parse_spec(spec)[0], budgets[f"{spec}@{length}"]) for spec in todo]
        if protocol == "query-aware" and len(todo) > 1:
            outputs = run_query_aware_shared(model, tokenizer, part, members, store=store, chunk=config.chunk,
                                             max_new_tokens=config.max_new_tokens)
        else:
            outputs = [run_niah_batch(model, tokenizer, part, name, params, protocol, store=store, chunk=config.chunk,
                                      max_new_tokens=config.max_new_tokens) for name, params in members]
        per_seq = (time.perf_counter() - t0) / len(part) / len(todo)
        fresh = []
        for spec, outs in zip(todo, outputs):
            for proto in _reported_under(spec, protocol, config):
                for s, (text, kept, peak) in zip(part, outs):
                    record = NiahRecord(policy=spec, protocol=proto, length=length, depth=s.depth, trial=s.trial,
                                        actual_depth=s.actual_depth, answer=s.answer, generated=text,
                                        correct=score_niah(text, s.answer), params=budgets[f"{spec}@{length}"],
                                        kept_at_answer=kept, peak_kv_bytes_per_seq=peak, seconds_per_seq=per_seq,
                                        run=run, computed_in=protocol,
                                        protocol_version=PROTOCOL_VERSIONS[proto])
                    if record_key(record) not in done:
                        done.add(record_key(record))
                        fresh.append(record)
        if resume_path is not None:
            append_rows(resume_path, [asdict(r) for r in fresh])
        records.extend(fresh)
    return NiahResult(config=config, records=records, budgets=budgets, budget_bytes=budget_bytes,
                      seconds=time.perf_counter() - started, model=model_name)


def _reference_tokens(config: NiahConfig, length: int | None) -> int | None:
    """The context whose full KV bytes the budget is a fraction of (None: each length's own)."""
    if config.budget_tokens is not None:
        return config.budget_tokens
    if config.budget_of == "longest":
        return max(config.lengths)
    return length


def _reported_under(spec: str, protocol: str, config: NiahConfig) -> list[str]:
    """The protocols one computation of ``spec`` is reported under (full KV evicts nothing: all of them)."""
    return list(config.protocols) if spec == "full" and config.full_once else [protocol]


def _groups(specs: list[str], protocol: str, config: NiahConfig) -> list[list[str]]:
    """The policies one unit runs together: query-aware shares one prefill per store setting."""
    if config.full_once and protocol != config.protocols[0]:
        specs = [s for s in specs if s != "full"]  # computed with the first protocol
    if protocol != "query-aware" or not config.share_prefill:
        return [[s] for s in specs]
    by_store: dict[bool, list[str]] = {}
    for spec in specs:
        by_store.setdefault(_store_for(spec, config).kv_int8, []).append(spec)
    return list(by_store.values())


def write_niah(result: NiahResult, out_dir: str | Path) -> list[Path]:
    """``niah.json`` (config, budgets, grids, records) and ``niah.csv`` (one row per sample)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / "niah.json", out_dir / "niah.csv"
    json_path.write_text(json.dumps(result.to_dict(), indent=1))
    fields = ["policy", "protocol", "length", "depth", "trial", "actual_depth", "answer", "generated", "correct",
              "kept_at_answer", "peak_kv_bytes_per_seq", "seconds_per_seq", "computed_in", "protocol_version",
              "params"]
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for r in result.records:
            row = asdict(r)
            del row["run"]  # the same for every record; niah.json has the config
            row["params"] = json.dumps(row["params"], sort_keys=True)
            writer.writerow(row)
    return [json_path, csv_path]


def plot_niah(result: NiahResult | dict[str, Any], path: str | Path) -> Path:
    """Heatmaps: rows = protocols, columns = policies; depth (y) x context length (x), accuracy colour."""
    from confkv.eval.plots import plt

    data = result.to_dict() if isinstance(result, NiahResult) else result
    config = data["config"]
    protocols, policies = config["protocols"], config["policies"]
    lengths, depths = config["lengths"], config["depths"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(protocols), len(policies), squeeze=False,
                             figsize=(1.2 + 0.9 * len(lengths) * len(policies), 0.9 + 0.55 * len(depths) * len(protocols)))
    for i, protocol in enumerate(protocols):
        for j, policy in enumerate(policies):
            ax = axes[i][j]
            grid = data["grids"][f"{policy}/{protocol}"]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for y, row in enumerate(grid):
                for x, value in enumerate(row):
                    ax.text(x, y, "-" if value != value else f"{value:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [str(v) for v in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
            acc = data["summary"][f"{policy}/{protocol}"]
            ax.set_title(f"{policy} / {protocol}\nacc {acc:.2f}", fontsize=8)
            if j == 0:
                ax.set_ylabel("needle depth")
            if i == len(protocols) - 1:
                ax.set_xlabel("context tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["DEFAULT_NEEDLE_TEMPLATE", "DEFAULT_QUESTION_TEMPLATE", "NiahConfig", "NiahRecord", "NiahResult",
           "PROTOCOL_VERSIONS", "load_records", "parse_spec", "record_key", "run_key", "run_query_aware_shared",
           "PROTOCOLS", "budgets_for_bytes", "full_kv_bytes", "plot_niah", "run_niah_batch", "run_niah_grid",
           "write_niah"]
