"""Every eviction policy at the KV memory of a 512-token full-precision sliding window.

Streaming perplexity (token by token, ``confkv.eval.quality.ppl.streaming_ppl``) of SmolLM2-135M
over the first 2,048 tokens of ``pydoc-topics``, one run per row, fp32 on CPU.

Memory matching (exact bytes from the cache's trace, all layers):

- fixed-budget policies (window, streaming, h2o, scissorhands, tova, random,
  confkv-fixed) keep ``budget = 512`` tokens in every layer: after the first 512 steps
  they hold exactly the window's bytes, so both peak and mean match the window;
- ``confkv`` (gated): ``tau`` is the median confidence of the full-KV run (half the
  steps are "confident"), ``n_low = 2 * n_high``, and ``n_high`` is the largest value
  whose *simulated* mean KV bytes (a one-layer ``LayerStore`` with SmolLM2's KV geometry
  driven with the full run's confidence sequence) do not exceed the window's mean; its
  peak is higher (``n_low``) and is reported;
- ``confkv-l``: the same gate, budgets split by the PyramidKV rule (``beta = 20``), the
  same total at steady state (lower during the warm-up, since shallow layers fill last);
- ``+int8`` rows: ``StoreConfig(kv_int8=True)`` (fp_window 128). They cannot be matched on
  the mean over 2,048 tokens: keeping *every* token (INT8 beyond the FP window) already
  averages less than the window's mean. So they are matched on PEAK, worst case: ``n_low``
  is the largest budget whose steady-state bytes do not exceed the window's (whatever the
  confidences), ``n_high = n_low / 2``, same ``tau``; ``full+int8`` (no eviction) is shown
  for reference. That bound is loose, so ``@gated peak`` rows match the peak of the gated run
  simulated with the full-KV confidences instead (actual peak reported).

Usage (rows are appended to the JSON as they finish; ``--resume`` skips finished rows)::

    .venv/bin/python -m confkv.eval.quality.policy_table --tokens 2048 --window 512 --out results/policies_512 --resume

``--render-only`` rewrites the ``.md`` from the ``.json`` without running any row (it loads
the model's config only to fill in a description the JSON lacks).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from confkv.config import StoreConfig
from confkv.policies import make_policy
from confkv.store import LayerStore

DEFAULTS = {"model": "smollm2", "corpus": "pydoc-topics"}


def run_command(record: dict[str, Any], out: str) -> str:
    """The command that (re)runs the table of ``record`` (finished rows are kept by ``--resume``)."""
    extra = [f"--{k} {record[k]}" for k, default in DEFAULTS.items() if record.get(k, default) != default]
    return " ".join([".venv/bin/python -m confkv.eval.quality.policy_table", *extra, f"--tokens {record['tokens']}",
                     f"--window {record['window']}", f"--out {out}", "--resume"])


# -- memory calibration ----------------------------------------------------------------------------
def simulate_layer_bytes(budgets: list[int], kv_heads: int, head_dim: int, store: StoreConfig,
                         protect: int = 32, sinks: int = 4) -> list[int]:
    """KV bytes of one layer (batch 1) after each step, for a given per-step budget sequence.

    Drives a real :class:`LayerStore` (so the FP window, ageing, INT8 scales and eviction
    are accounted exactly as in the model) with random keys/queries of the model's KV geometry.
    """
    policy = make_policy("confkv", n_high=min(budgets), n_low=max(budgets), protect=protect, sinks=sinks)
    layer = LayerStore(policy, store)
    g = torch.Generator().manual_seed(0)
    out = []
    for budget in budgets:
        layer.append(torch.randn(1, kv_heads, 1, head_dim, generator=g), torch.randn(1, kv_heads, 1, head_dim, generator=g))
        layer.attend(torch.randn(1, kv_heads, 1, head_dim, generator=g), scaling=head_dim ** -0.5)
        layer.end_step(torch.tensor([budget]))
        out.append(layer.kv_bytes())
    return out


def calibrate_gate(confidences: list[float], target_bytes: float, num_layers: int, kv_heads: int,
                   head_dim: int, store: StoreConfig, low: int, high: int, match: str = "mean") -> dict[str, Any]:
    """Largest ``n_high`` in [low, high] (with ``n_low = 2 n_high``, ``tau`` = median confidence)
    whose simulated bytes stay <= ``target_bytes``.

    ``match="mean"``: mean bytes over the run, the gate driven by ``confidences``.
    ``match="peak"``: worst-case peak, i.e. the steady-state bytes of a constant budget ``n_low``
    (holds whatever the confidences of the actual run turn out to be).
    ``match="gated-peak"``: the peak of the run with the gate driven by ``confidences`` (the
    actual run's confidences differ a little, so its peak may too: it is reported).
    """
    tau = statistics.median(confidences)

    def simulated(n_high: int) -> float:
        if match == "peak":
            steps = max(len(confidences), 2 * n_high + 64)
            return num_layers * max(simulate_layer_bytes([2 * n_high] * steps, kv_heads, head_dim, store))
        budgets = [n_high if c >= tau else 2 * n_high for c in confidences]
        per_layer = simulate_layer_bytes(budgets, kv_heads, head_dim, store)
        if match == "gated-peak":
            return num_layers * max(per_layer)
        return num_layers * sum(per_layer) / len(per_layer)

    while low < high:  # bisection on a monotone function
        mid = (low + high + 1) // 2
        if simulated(mid) <= target_bytes:
            low = mid
        else:
            high = mid - 1
    return {"match": match, "tau": round(tau, 4), "n_high": low, "n_low": 2 * low,
            f"simulated_{match}_bytes": simulated(low), "target_bytes": target_bytes}


# -- the table --------------------------------------------------------------------------------------
def render(record: dict[str, Any]) -> str:
    rows = record["rows"]
    by_label = {r["label"]: r for r in rows}
    window = by_label.get("window")
    full = by_label.get("full")
    model = record.get("description") or f"`{record['model']}`"
    layers = record.get("layers", "?")
    int8_window = record.get("int8_fp_window", "?")
    lines = [
        f"# Policies at the KV memory of a {record['window']}-token full-precision window",
        "",
        f"Command: `{record['command']}`",
        "",
        f"{model}, streaming perplexity token by token over the "
        f"first {record['tokens']} tokens of `{record['corpus']}` (no BOS), one run per row "
        f"(commit {record['commit']}). KV bytes are exact (keys + values + INT8 scales, all {layers} layers, "
        "from the cache's trace after every step; bookkeeping such as positions and policy statistics excluded). "
        "`peak`/`mean` are over the steps; ratios are to the window row. "
        "Gap closed = (PPL(window) - PPL) / (PPL(window) - PPL(full)). "
        "Confident steps: fraction of steps with c >= tau in the row's own run.",
        "",
        f"Matching: fixed-budget rows keep {record['window']} tokens per layer, so peak and mean equal the window's "
        "exactly. Gated rows (`confkv`, `confkv-l`) are matched on MEAN bytes: tau = median confidence of the full-KV "
        "run, n_low = 2 n_high, n_high the largest value whose simulated mean does not exceed the window's; their "
        "peak is reported. `confkv-l` uses the same gate as `confkv` (same steady-state total, less during "
        f"warm-up). INT8 rows (`StoreConfig(kv_int8=True)`, FP window {int8_window} tokens) are matched on PEAK, "
        "worst case: n_low is the largest budget whose steady-state "
        "bytes do not exceed the window's peak, n_high = n_low / 2, same tau; `full+int8` (no eviction) is "
        "the INT8-only reference. That bound is loose (the gated cache rarely grows to n_low), so the "
        "`@gated peak` rows instead take the largest n_high whose simulated GATED run (full-KV confidences) "
        "peaks at or below the window's peak; their actual peak is reported.",
        "",
        "| row | policy | params | PPL | gap closed | peak KV MB | mean KV MB | peak / window | mean / window | "
        "matched on | mean kept tokens / layer | confident steps | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap = ""
        if window and full and r["label"] not in ("full",) and window["ppl"] != full["ppl"]:
            gap = f"{(window['ppl'] - r['ppl']) / (window['ppl'] - full['ppl']):.0%}"
        peak_ratio = f"{r['peak_kv_bytes'] / window['peak_kv_bytes']:.3f}" if window else ""
        mean_ratio = f"{r['mean_kv_bytes'] / window['mean_kv_bytes']:.3f}" if window else ""
        params = ", ".join([f"{k}={v}" for k, v in r["params"].items()] + (["kv_int8"] if r["kv_int8"] else []))
        lines.append(
            f"| {r['label']} | `{r['policy']}` | {params} | {r['ppl']:.3f} | {gap} | {r['peak_kv_bytes'] / 1e6:.2f} | "
            f"{r['mean_kv_bytes'] / 1e6:.2f} | {peak_ratio} | {mean_ratio} | {r['matched']} | "
            f"{r['mean_kept_tokens']:.0f} | {'-' if r['confident_fraction'] is None else format(r['confident_fraction'], '.2f')} | "
            f"{r['seconds']:.0f} |")
    if record.get("calibration"):
        lines += ["", f"Gate calibration (simulated on a one-layer store, x{layers} layers):", ""]
        for name, cal in record["calibration"].items():
            lines.append(f"- {name}: {json.dumps(cal)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    from confkv.data import corpus_tokens  # noqa: PLC0415
    from confkv.eval.quality.ppl import streaming_ppl  # noqa: PLC0415
    from confkv.models import load_model  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", default="pydoc-topics")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", default="results/policies_512")
    parser.add_argument("--only", nargs="*", default=None, help="row labels to run")
    parser.add_argument("--resume", action="store_true", help="keep finished rows of an existing JSON")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 is fastest on a shared 2-core machine: no oversubscription)")
    parser.add_argument("--render-only", action="store_true", help="rewrite OUT.md from OUT.json (no row is run)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out.with_suffix(".json"), out.with_suffix(".md")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record: dict[str, Any] = {"model": args.model, "corpus": args.corpus, "tokens": args.tokens,
                              "window": args.window, "commit": commit, "rows": [], "calibration": {}}
    if (args.resume or args.render_only) and json_path.exists():
        record = json.loads(json_path.read_text())  # keeps the commit its rows ran at
        for r in record["rows"]:
            r.setdefault("commit", record["commit"])
    done = {r["label"] for r in record["rows"]}
    fp, int8 = StoreConfig(), StoreConfig(kv_int8=True)

    model, tokenizer = load_model(record["model"])
    config = model.config
    num_layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    parameter = next(model.parameters())
    record.setdefault("command", run_command(record, args.out))
    record.setdefault("description", f"Model `{record['model']}` ({type(model).__name__}, {num_layers} layers, "
                                     f"{str(parameter.dtype).removeprefix('torch.')} on {parameter.device.type})")
    record.setdefault("layers", num_layers)
    record.setdefault("int8_fp_window", int8.fp_window)
    if args.render_only:
        json_path.write_text(json.dumps(record, indent=1) + "\n")
        md_path.write_text(render(record))
        print(render(record), end="")
        return
    ids = corpus_tokens(tokenizer, record["corpus"], record["tokens"])
    n = record["window"]

    def row(label: str) -> dict[str, Any] | None:
        return next((r for r in record["rows"] if r["label"] == label), None)

    def run(label: str, policy: str, params: dict[str, Any], store: StoreConfig, matched: str) -> None:
        if label in done or (args.only is not None and label not in args.only):
            return
        print(f"== {label}: {policy} {params} kv_int8={store.kv_int8}", flush=True)
        result = streaming_ppl(model, ids, policy, store=store, progress=False, **params)
        trace = result.trace
        gate = make_policy(policy, **params)
        gated = gate.min_budget() != gate.max_budget()  # confkv-fixed has a gate field but ignores it
        tau = getattr(getattr(gate, "gate", None), "tau", None) if gated else None
        confs = trace.confidences()
        confident = sum(c >= tau for c in confs) / len(confs) if tau is not None else None
        entry = {"label": label, "policy": policy, "params": params, "kv_int8": store.kv_int8,
                 "ppl": result.ppl, "peak_kv_bytes": trace.peak_kv_bytes(), "mean_kv_bytes": trace.mean_kv_bytes(),
                 "mean_kept_tokens": sum(trace.kept_tokens()) / len(trace), "confident_fraction": confident,
                 "matched": matched, "seconds": result.seconds,
                 "per_layer_kept_last_step": trace.steps[-1].kept[:, 0].tolist(), "commit": commit}
        if policy == "full":
            entry["confidences"] = [round(c, 5) for c in confs]
        record["rows"].append(entry)
        commits = list(dict.fromkeys(r.get("commit", record["commit"]) for r in record["rows"]))
        record["commit"] = commits[0] if len(commits) == 1 else f"{commits[0]}..{commits[-1]}"
        done.add(label)
        json_path.write_text(json.dumps(record, indent=1) + "\n")
        md_path.write_text(render(record))
        print(f"   ppl {result.ppl:.3f}  peak {entry['peak_kv_bytes'] / 1e6:.2f} MB  mean {entry['mean_kv_bytes'] / 1e6:.2f} MB"
              f"  {result.seconds:.0f}s", flush=True)

    run("full", "full", {}, fp, "-")
    run("window", "window", {"budget": n}, fp, "reference")
    for name in ("streaming", "h2o", "scissorhands", "tova", "random", "confkv-fixed"):
        run(name, name, {"budget": n}, fp, "peak & mean")

    confidences = row("full")["confidences"] if row("full") else None
    window = row("window")
    if confidences is None or window is None:
        return
    # INT8 cannot be matched on the mean over 2,048 tokens: keeping every token (INT8 beyond the
    # FP window) already averages less than the window's mean, so INT8 rows are matched on peak.
    for label, store, target, match in (("fp", fp, window["mean_kv_bytes"], "mean"),
                                        ("int8-peak", int8, window["peak_kv_bytes"], "peak"),
                                        ("int8-gated-peak", int8, window["peak_kv_bytes"], "gated-peak")):
        if label not in record["calibration"]:
            high = 4 * n if store.kv_int8 else 2 * n
            record["calibration"][label] = calibrate_gate(confidences, target, num_layers, kv_heads,
                                                          head_dim, store, low=n // 4, high=high, match=match)
            json_path.write_text(json.dumps(record, indent=1) + "\n")
            print(f"calibrated {label}: {record['calibration'][label]}", flush=True)
    gate_fp = {k: record["calibration"]["fp"][k] for k in ("tau", "n_high", "n_low")}
    gate_int8 = {k: record["calibration"]["int8-peak"][k] for k in ("tau", "n_high", "n_low")}
    run("confkv", "confkv", gate_fp, fp, "mean")
    run("confkv-l", "confkv-l", gate_fp, fp, "mean (same gate as confkv)")
    run("full+int8", "full", {}, int8, "- (no eviction)")
    run("confkv+int8", "confkv", gate_int8, int8, "peak (worst case n_low)")
    floor_int8 = int8.fp_window + 4 + 1  # the FP window and the sinks are never evicted
    run("confkv-l+int8", "confkv-l", {**gate_int8, "min_layer_budget": floor_int8}, int8,
        "peak (same gate as confkv+int8)")
    # the worst-case bound leaves memory unused (the cache rarely grows to n_low): also match the
    # peak the gate actually reaches on this text
    gate_int8_gated = {k: record["calibration"]["int8-gated-peak"][k] for k in ("tau", "n_high", "n_low")}
    run("confkv+int8 @gated peak", "confkv", gate_int8_gated, int8, "peak (simulated gated run)")
    run("confkv-l+int8 @gated peak", "confkv-l", {**gate_int8_gated, "min_layer_budget": floor_int8}, int8,
        "peak (same gate as confkv+int8 @gated peak)")


if __name__ == "__main__":
    main()
