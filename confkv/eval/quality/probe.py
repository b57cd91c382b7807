"""The mechanistic probe: does confidence predict how much evicting recent context matters?

At each step ``t`` of a streaming pass over a text (the query is token ``t``, predicting
token ``t + 1``) we compare two next-token distributions:

- ``p_full``: token ``t`` attends to the full KV cache of tokens ``0 .. t`` (exact full KV);
- ``p_evict``: the same cache with the ``k`` most recent tokens *before* the current one
  (positions ``t-k .. t-1``) evicted: token ``t`` attends to ``0 .. t-k-1`` and to itself.

The cached keys/values of the kept tokens are exactly the full-KV ones (computed when
those tokens were fed, with everything before them visible), as in a real eviction:
only the current query loses access, in every layer, and its own key/value (computed
from its evicted-context hidden states) stays visible. Positions are unchanged.

Reported per step: the confidence ``c_t`` of ``p_full`` (:func:`confkv.confidence.confidence`,
the value the CONF-KV gate would see with an intact cache), ``KL(p_full || p_evict)`` in
nats, and the NLL of the true next token under both. The summary is Pearson ``r`` between
``c`` and the KL with a bootstrap 95% CI (resampling steps; ``block_len > 1`` resamples
contiguous blocks of steps, a moving-block bootstrap that respects autocorrelation), plus
Pearson against ``log(KL)`` and Spearman's rho.

Cost (why this is feasible for thousands of steps on a CPU): no token-by-token loop.
The text goes through the model in blocks of ``block`` tokens with a growing full-KV
``DynamicCache`` (one ordinary chunked forward pass). For each block a *second* forward
pass re-feeds the block's probe steps as queries against a copy of the full KV of
``0 .. block_end`` with a 4D boolean mask: query ``t`` sees past slots ``j <= t-k-1`` and,
among the re-fed tokens, only itself. The copy's positions are the true ones
(``position_ids = t``), so one extra block forward gives the evicted distribution of
every step in the block at once: the whole probe costs about two forward passes over
the text (plus one per extra ``k``), attention over at most twice the keys. ``stride``
evaluates every ``stride``-th step only (default 1: every step).

A second reading matches what a gate over a recall budget decides (``keep_recent``):
``p_evict`` keeps only the ``sinks`` first tokens and the ``R`` most recent ones before the
current token (positions ``< sinks`` and ``t-R .. t-1``), i.e. everything older than the
recent window is dropped. Its summary adds the KL by confidence quintile (median and mean).

The exactness of the batched pass against a literal evict-then-step reference is
checked in ``tests/eval/quality/test_probe.py``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from confkv.confidence import confidence as confidence_of
from confkv.config import ConfidenceConfig
from confkv.progress import progress as show_progress


@dataclass
class ProbeResult:
    """Per-step probe values for one ``k`` (all [S] tensors, S = probed steps)."""

    k: int  # tokens evicted before t ("drop-recent"), or recent tokens kept ("keep-recent": R)
    positions: torch.Tensor  # int64, step t (the query token's position)
    confidence: torch.Tensor  # float32, c of the full-KV distribution at t
    kl: torch.Tensor  # float64, KL(p_full || p_evict) in nats
    nll_full: torch.Tensor  # float64, -log p_full(x_{t+1})
    nll_evict: torch.Tensor  # float64, -log p_evict(x_{t+1})
    confidence_evict: torch.Tensor  # float32, c of the evicted distribution
    seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    mode: str = "drop-recent"  # or "keep-recent" (sinks + R most recent kept, older context dropped)
    sinks: int = 0

    def summary(self) -> dict[str, Any]:
        return {"mode": self.mode, "k": self.k, "sinks": self.sinks, "steps": int(self.positions.numel()),
                "first_step": int(self.positions[0]) if self.positions.numel() else None,
                "last_step": int(self.positions[-1]) if self.positions.numel() else None,
                "mean_confidence": float(self.confidence.mean()), "mean_kl": float(self.kl.mean()),
                "median_kl": float(self.kl.median()),
                "ppl_full": math.exp(float(self.nll_full.mean())),
                "ppl_evict": math.exp(float(self.nll_evict.mean())),
                "seconds": self.seconds, **self.stats}

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "positions": self.positions.tolist(),
                "confidence": self.confidence.tolist(), "kl": self.kl.tolist(),
                "nll_full": self.nll_full.tolist(), "nll_evict": self.nll_evict.tolist(),
                "confidence_evict": self.confidence_evict.tolist()}


# --------------------------------------------------------------------------- statistics

def pearson(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 2:
        return float("nan")
    xc, yc = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((xc * xc).sum()) * float((yc * yc).sum()))
    return float((xc * yc).sum() / denom) if denom > 0 else float("nan")


def spearman(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    def ranks(a: np.ndarray) -> np.ndarray:
        order = np.argsort(a, kind="mergesort")
        r = np.empty(a.size, dtype=np.float64)
        r[order] = np.arange(a.size, dtype=np.float64)
        # average ties
        _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
        sums = np.bincount(inverse, weights=r)
        return sums[inverse] / counts[inverse]

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    return pearson(ranks(x), ranks(y))


def bootstrap_ci(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray, stat=pearson,
                 n_boot: int = 2000, level: float = 0.95, block_len: int = 1, seed: int = 0
                 ) -> tuple[float, float]:
    """Percentile bootstrap CI of ``stat(x, y)``, resampling pairs (``block_len`` > 1: moving blocks)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = x.size
    if n < 3:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    block_len = max(1, min(int(block_len), n))
    n_blocks = math.ceil(n / block_len)
    values = np.empty(n_boot)
    offsets = np.arange(block_len)
    for i in range(n_boot):
        starts = rng.integers(0, n - block_len + 1, size=n_blocks)
        index = (starts[:, None] + offsets[None, :]).reshape(-1)[:n]
        values[i] = stat(x[index], y[index])
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan"), float("nan")
    alpha = (1.0 - level) / 2
    return float(np.quantile(values, alpha)), float(np.quantile(values, 1 - alpha))


def correlation_stats(conf: np.ndarray, kl: np.ndarray, *, n_boot: int = 2000, block_len: int = 1,
                      seed: int = 0) -> dict[str, Any]:
    """Pearson r (with bootstrap CI), Pearson against log KL, Spearman rho."""
    conf, kl = np.asarray(conf, dtype=np.float64), np.asarray(kl, dtype=np.float64)
    log_kl = np.log(np.clip(kl, 1e-12, None))
    lo, hi = bootstrap_ci(conf, kl, n_boot=n_boot, block_len=block_len, seed=seed)
    lo_log, hi_log = bootstrap_ci(conf, log_kl, n_boot=n_boot, block_len=block_len, seed=seed)
    return {"pearson_r": pearson(conf, kl), "pearson_ci95": [lo, hi],
            "pearson_r_log_kl": pearson(conf, log_kl), "pearson_log_kl_ci95": [lo_log, hi_log],
            "spearman_rho": spearman(conf, kl), "n_boot": n_boot, "block_len": block_len,
            "kl_by_confidence_quintile": quintile_table(conf, kl)}


def quintile_table(conf: np.ndarray, kl: np.ndarray) -> list[dict[str, float]]:
    """Steps sorted by confidence, cut into five equal groups (least confident first):
    each group's confidence range, mean confidence, and median / mean KL."""
    conf, kl = np.asarray(conf, dtype=np.float64), np.asarray(kl, dtype=np.float64)
    order = np.argsort(conf, kind="mergesort")
    rows = []
    for part in np.array_split(order, 5):
        if part.size == 0:
            continue
        rows.append({"confidence_min": float(conf[part].min()), "confidence_max": float(conf[part].max()),
                     "mean_confidence": float(conf[part].mean()), "median_kl": float(np.median(kl[part])),
                     "mean_kl": float(kl[part].mean()), "steps": int(part.size)})
    return rows


# --------------------------------------------------------------------------- the probe

def _kv_copy(cache: Any, end: int) -> Any:
    """A fresh DynamicCache holding slots ``[0, end)`` of ``cache`` (tensors are not modified)."""
    from transformers import DynamicCache

    copy = DynamicCache()
    for layer_idx, layer in enumerate(cache.layers):
        copy.update(layer.keys[:, :, :end], layer.values[:, :, :end], layer_idx)
    return copy


def _evicted_mask(steps: torch.Tensor, past: int, k: int, keep_recent: bool = False, sinks: int = 0) -> torch.Tensor:
    """[1, 1, S, past + S] bool: which slots query ``steps[i] = t`` sees, and re-fed query i only.

    drop-recent: past slots ``j <= t-k-1``; keep-recent: ``j < sinks`` or ``t-k <= j <= t-1``.
    """
    j = torch.arange(past)
    if keep_recent:
        t = steps[:, None]
        old = ((j[None, :] < sinks) | (j[None, :] >= t - k)) & (j[None, :] < t)
    else:
        old = j[None, :] <= (steps[:, None] - k - 1)
    own = torch.eye(steps.numel(), dtype=torch.bool)
    return torch.cat([old, own], dim=1)[None, None]


@torch.no_grad()
def probe_confidence_kl(model: torch.nn.Module, input_ids: torch.Tensor, *, k: int | Sequence[int] = 32,
                        start: int | None = None, stride: int = 1, block: int = 256,
                        confidence_config: ConfidenceConfig | None = None, n_boot: int = 2000,
                        block_len: int = 1, seed: int = 0, progress: bool = True,
                        keep_recent: bool = False, sinks: int = 4) -> list[ProbeResult]:
    """Run the probe over ``input_ids`` [1, N] for each eviction size in ``k``.

    Args:
        k: tokens evicted just before the current one (one result per value); with
            ``keep_recent``, the recent tokens kept (R) while everything older but the
            ``sinks`` first tokens is dropped.
        start: first probed step (default ``max(64, 2 * max(k))``: enough context left after
            eviction that early-position artefacts do not dominate); steps go to ``N - 2``
            (the last step with a next token to score).
        stride: probe every ``stride``-th step from ``start``.
        block: tokens per forward block (memory vs. speed).
    Returns:
        one :class:`ProbeResult` per ``k``, with ``stats`` holding the correlation summary.
    """
    ks = [k] if isinstance(k, int) else list(k)
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, N], got {tuple(input_ids.shape)}")
    if any((not isinstance(v, int)) or v < 1 for v in ks):
        raise ValueError(f"k must be positive integers, got {ks}")
    n = input_ids.shape[1]
    start = max(64, 2 * max(ks)) if start is None else start
    if start < max(ks) + 1 or start > n - 2:
        raise ValueError(f"start={start} must be in [max(k)+1, N-2] = [{max(ks) + 1}, {n - 2}]")
    from transformers import DynamicCache

    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    previous_impl = model.config._attn_implementation
    if previous_impl not in ("sdpa", "eager"):
        model.set_attn_implementation("sdpa")  # the confkv fallback ignores custom 4D masks
    config = confidence_config or ConfidenceConfig()
    acc: dict[int, dict[str, list[torch.Tensor]]] = {v: {n_: [] for n_ in
                                                         ("pos", "c", "kl", "nf", "ne", "ce")} for v in ks}
    started = time.perf_counter()
    try:
        full = DynamicCache()
        for a in show_progress(range(0, n - 1, block), desc="probe", enabled=progress):
            b = min(a + block, n - 1)  # queries a..b-1 (each has a next token)
            positions = torch.arange(a, b, device=device)
            logits = model(input_ids=input_ids[:, a:b], cache=full, use_cache=True,
                           position_ids=positions[None]).logits[0].float()
            steps = positions[(positions >= start) & ((positions - start) % stride == 0)]
            if steps.numel() == 0:
                continue
            rows = steps - a
            full_logits = logits[rows]
            full_logp = torch.log_softmax(full_logits, -1)
            target = input_ids[0, steps + 1]
            c_full = confidence_of(full_logits, config)
            for v in ks:
                past = _kv_copy(full, b)
                mask = _evicted_mask(steps.cpu(), b, v, keep_recent, sinks).to(device)
                ev_logits = model(input_ids=input_ids[:, steps], cache=past, use_cache=True,
                                  position_ids=steps[None], attention_mask=mask).logits[0].float()
                ev_logp = torch.log_softmax(ev_logits, -1)
                kl = (full_logp.exp() * (full_logp - ev_logp)).sum(-1).clamp_min(0.0)
                store = acc[v]
                store["pos"].append(steps.cpu())
                store["c"].append(c_full.cpu())
                store["kl"].append(kl.double().cpu())
                store["nf"].append(-full_logp.gather(-1, target[:, None])[:, 0].double().cpu())
                store["ne"].append(-ev_logp.gather(-1, target[:, None])[:, 0].double().cpu())
                store["ce"].append(confidence_of(ev_logits, config).cpu())
    finally:
        if model.config._attn_implementation != previous_impl:
            model.set_attn_implementation(previous_impl)
    seconds = time.perf_counter() - started
    results = []
    for v in ks:
        s = acc[v]
        result = ProbeResult(k=v, positions=torch.cat(s["pos"]), confidence=torch.cat(s["c"]),
                             kl=torch.cat(s["kl"]), nll_full=torch.cat(s["nf"]), nll_evict=torch.cat(s["ne"]),
                             confidence_evict=torch.cat(s["ce"]), seconds=seconds,
                             mode="keep-recent" if keep_recent else "drop-recent", sinks=sinks if keep_recent else 0)
        result.stats = correlation_stats(result.confidence.numpy(), result.kl.numpy(), n_boot=n_boot,
                                         block_len=block_len, seed=seed)
        results.append(result)
    return results


def reference_evicted_logits(model: torch.nn.Module, input_ids: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """Literal reference for one step: full KV of ``0..t-1``, drop slots ``t-k..t-1``, feed token ``t``.

    Slow (a full forward per call); used by the tests to check :func:`probe_confidence_kl`.
    """
    from transformers import DynamicCache

    previous_impl = model.config._attn_implementation
    if previous_impl not in ("sdpa", "eager"):
        model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            full = DynamicCache()
            model(input_ids=input_ids[:, :t], cache=full, use_cache=True)
            kept = DynamicCache()
            for i, layer in enumerate(full.layers):
                kept.update(layer.keys[:, :, : t - k], layer.values[:, :, : t - k], i)
            mask = torch.ones(1, 1, 1, t - k + 1, dtype=torch.bool)
            out = model(input_ids=input_ids[:, t:t + 1], cache=kept, use_cache=True,
                        position_ids=torch.tensor([[t]]), attention_mask=mask)
        return out.logits[0, -1].float()
    finally:
        if model.config._attn_implementation != previous_impl:
            model.set_attn_implementation(previous_impl)


# --------------------------------------------------------------------------- plot

def plot_probe(results: list[ProbeResult], path: Any, title: str = "") -> Any:
    """Scatter of KL shift against confidence, one panel per ``k``."""
    from pathlib import Path

    from confkv.eval.report.plots import plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2), squeeze=False)
    for ax, r in zip(axes[0], results):
        s = r.stats
        ax.scatter(r.confidence.numpy(), r.kl.numpy(), s=3, alpha=0.35, color="tab:blue")
        ax.set_yscale("log")
        ax.set_xlabel("confidence c (full KV)")
        what = f"keep {r.sinks} sinks + {r.k} recent" if r.mode == "keep-recent" else f"evict {r.k} recent"
        ax.set_ylabel(f"KL(full || {what}) [nats]")
        ci = s.get("pearson_ci95", [float("nan")] * 2)
        ax.set_title(f"k={r.k}: r={s.get('pearson_r', float('nan')):.3f} [{ci[0]:.3f}, {ci[1]:.3f}]\n"
                     f"r(log KL)={s.get('pearson_r_log_kl', float('nan')):.3f}  "
                     f"rho={s.get('spearman_rho', float('nan')):.3f}  n={r.positions.numel()}", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
