"""Needle in a haystack: a grid of context lengths x depths x trials, two protocols.

Protocols (always reported separately):

- ``query-aware``: the whole prompt (haystack + question, all but its last token) is
  prefilled in chunks with eviction *deferred* (``cache.evict = False``: the policy
  still observes attention and the store still ages, nothing is dropped); then the cache
  is brought to budget once, with the budget the policy picks from the confidence at
  the last prefilled position (``cache.end_step(last_logits)`` with eviction back on:
  the same end-of-step every forward pass runs, one extra trace record); then greedy
  generation. The policy ranks tokens having seen the question (SnapKV-style); peak
  memory during prefill is the full prompt.
- ``streaming``: the haystack is prefilled in chunks with eviction after each chunk
  (peak bounded by budget + chunk), then the question (all but its last token), then
  greedy generation: the policy must decide what to keep before the question exists.

All samples of one context length have the same number of tokens
(:func:`confkv.data.make_niah_sample` pads the haystack to the exact length), so the
depths x trials of a length run as one batch (``batch`` caps its size) with per-sequence
budgets and no padding.

Budget: ``budget_fraction`` of the full-precision KV bytes of the longest context
(``budget_of="longest"``, the paper's setup: one memory for the whole grid) or of each
length (``"each"``), converted into each policy's budget parameters by
:func:`budgets_for_bytes` (peak KV bytes; gated policies get ``n_low`` at the budget and
``n_high = ratio * n_low``).
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from confkv.config import StoreConfig
from confkv.data import DEFAULT_NEEDLE_TEMPLATE, DEFAULT_QUESTION_TEMPLATE, make_niah_sample, score_niah

PROTOCOLS = ("query-aware", "streaming")


@dataclass
class NiahConfig:
    lengths: tuple[int, ...] = (1024, 2048)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 1
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

    def __post_init__(self) -> None:
        unknown = [p for p in self.protocols if p not in PROTOCOLS]
        if unknown:
            raise ValueError(f"unknown NIAH protocol {unknown[0]!r}; choose from {PROTOCOLS}")
        if self.budget_of not in ("longest", "each"):
            raise ValueError("budget_of must be 'longest' or 'each'")
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

    def summary(self) -> dict[str, Any]:
        return {f"{policy}/{protocol}": self.accuracy(policy, protocol)
                for protocol in self.config.protocols for policy in self.config.policies}

    def summary_lines(self) -> list[str]:
        lines = []
        for protocol in self.config.protocols:
            for policy in self.config.policies:
                per_length = "  ".join(f"{length}:{self.accuracy(policy, protocol, length):.2f}"
                                       for length in self.config.lengths)
                lines.append(f"{protocol:12s} {policy:14s} acc {self.accuracy(policy, protocol):.3f}   {per_length}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "config": asdict(self.config), "budgets": self.budgets,
                "budget_bytes": {str(k): v for k, v in self.budget_bytes.items()}, "seconds": self.seconds,
                "summary": self.summary(),
                "grids": {f"{p}/{q}": self.grid(p, q) for q in self.config.protocols for p in self.config.policies},
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
    from confkv.policies import POLICIES
    from confkv.policies.registry import _CONFIDENCE_FIELDS, _GATE_FIELDS

    if not extra:
        return {}
    fields = set(POLICIES[name].__dataclass_fields__)
    if "gate" in fields:
        fields |= set(_GATE_FIELDS) | set(_CONFIDENCE_FIELDS)
    return {k: v for k, v in extra.items() if k in fields}


def full_kv_bytes(model: Any, tokens: int, store: StoreConfig | None = None) -> float:
    """Full-precision KV bytes of one sequence of ``tokens`` tokens (all layers)."""
    from confkv.eval.sweep import BytesModel

    bm = BytesModel.for_model(model)
    return float(tokens * bm.fp_bytes * len(bm.sliding_windows))


@torch.no_grad()
def run_niah_batch(model: Any, tokenizer: Any, samples: list, policy: str, params: dict[str, Any], protocol: str,
                   *, store: StoreConfig, chunk: int, max_new_tokens: int) -> list[tuple[str, float, float]]:
    """Run one batch of same-length samples; returns (generated text, kept tokens at answer, peak bytes/seq)."""
    from confkv.hf import ConfKVCache, prefill

    device = next(model.parameters()).device
    ids = torch.cat([s.input_ids for s in samples]).to(device)
    context = torch.cat([s.context_ids for s in samples]).to(device)
    question = torch.cat([s.question_ids for s in samples]).to(device)
    batch = ids.shape[0]
    cache = ConfKVCache.for_model(model, policy, store=store, **params)
    if protocol == "query-aware":
        cache.evict = False
        logits = prefill(model, cache, ids[:, :-1], chunk=chunk)
        cache.evict = True
        cache.end_step(logits)  # bring the cache to the budget picked at the last prompt position
    else:
        prefill(model, cache, context, chunk=chunk)
        if question.shape[1] > 1:
            prefill(model, cache, question[:, :-1], chunk=chunk)
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


def run_niah_grid(model: Any, tokenizer: Any, config: NiahConfig, *, progress: bool = True,
                  model_name: str = "") -> NiahResult:
    """Run the whole grid; see the module docstring for the protocols and budgets."""
    store = StoreConfig(kv_int8=config.kv_int8, fp_window=config.fp_window, prefill_chunk=config.chunk)
    sample_kwargs: dict[str, Any] = {"haystack": config.haystack, "seed": config.seed}
    if config.needle_template:
        sample_kwargs["needle_template"] = config.needle_template
    if config.question_template:
        sample_kwargs["question_template"] = config.question_template
    if config.answer:
        sample_kwargs["answer"] = config.answer
    longest = max(config.lengths)
    budget_bytes: dict[int, float] = {}
    budgets: dict[str, dict[str, Any]] = {}
    for length in config.lengths:
        reference = longest if config.budget_of == "longest" else length
        budget_bytes[length] = config.budget_fraction * full_kv_bytes(model, reference)
        params = budgets_for_bytes(model, config.policies, budget_bytes[length], reference, store=store,
                                   ratio=config.ratio, extra=config.extra_params)
        for name, p in params.items():
            budgets[f"{name}@{length}"] = p
    records: list[NiahRecord] = []
    started = time.perf_counter()
    jobs = [(length, protocol, policy) for length in config.lengths for protocol in config.protocols
            for policy in config.policies]
    for length, protocol, policy in tqdm(jobs, desc="niah", disable=not progress):
        samples = [make_niah_sample(tokenizer, context_tokens=length, depth=d, trial=t, **sample_kwargs)
                   for d in config.depths for t in range(config.trials)]
        groups: dict[tuple[int, int], list] = {}
        for s in samples:  # same shapes batch together (all of them, normally)
            groups.setdefault((s.input_ids.shape[1], s.context_ids.shape[1]), []).append(s)
        params = budgets[f"{policy}@{length}"]
        for group in groups.values():
            size = config.batch or len(group)
            for begin in range(0, len(group), size):
                part = group[begin:begin + size]
                t0 = time.perf_counter()
                outs = run_niah_batch(model, tokenizer, part, policy, params, protocol, store=store,
                                      chunk=config.chunk, max_new_tokens=config.max_new_tokens)
                per_seq = (time.perf_counter() - t0) / len(part)
                for s, (text, kept, peak) in zip(part, outs):
                    records.append(NiahRecord(policy=policy, protocol=protocol, length=length, depth=s.depth,
                                              trial=s.trial, actual_depth=s.actual_depth, answer=s.answer,
                                              generated=text, correct=score_niah(text, s.answer), params=params,
                                              kept_at_answer=kept, peak_kv_bytes_per_seq=peak,
                                              seconds_per_seq=per_seq))
    return NiahResult(config=config, records=records, budgets=budgets, budget_bytes=budget_bytes,
                      seconds=time.perf_counter() - started, model=model_name)


def write_niah(result: NiahResult, out_dir: str | Path) -> list[Path]:
    """``niah.json`` (config, budgets, grids, records) and ``niah.csv`` (one row per sample)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / "niah.json", out_dir / "niah.csv"
    json_path.write_text(json.dumps(result.to_dict(), indent=1))
    fields = ["policy", "protocol", "length", "depth", "trial", "actual_depth", "answer", "generated", "correct",
              "kept_at_answer", "peak_kv_bytes_per_seq", "seconds_per_seq", "params"]
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for r in result.records:
            row = asdict(r)
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
           "PROTOCOLS", "budgets_for_bytes", "full_kv_bytes", "plot_niah", "run_niah_batch", "run_niah_grid",
           "write_niah"]
