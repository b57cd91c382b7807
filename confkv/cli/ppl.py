"""``confkv ppl``: streaming perplexity of one policy, printed and optionally saved."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from confkv.config import StoreConfig
from confkv.display import budgets_text
from confkv.cli.textplot import sparkline


def run_ppl(args: argparse.Namespace, params: dict[str, Any], store: StoreConfig) -> int:
    from confkv.eval.quality.ppl import PplUnit, RunInterrupted, run_ppl_unit
    from confkv.eval.ray.grid import ModelSpec, WorkUnit, ray_options, run_units
    from confkv.outputs import check_writable
    from confkv.policies import make_policy
    from confkv.store import check_store_fits

    # fail fast, before loading or computing anything: output paths, then the policy's parameters
    if args.out:
        check_writable(args.out, what="--out")
    if args.plot:
        check_writable(args.plot, what="--plot")
    from confkv.presets import resolve

    spec = resolve(args.policy, **params)
    from confkv.tiers.storage import store_for

    store_run = store_for(store, spec.storage)  # what the cache runs with (the storage's slack, an INT8 hot tier)
    check_store_fits(spec.policy, store_run)
    ray = ray_options(args)
    unit = PplUnit(corpus=args.corpus, tokens=args.tokens, offset=args.offset, policy=args.policy, params=params,
                   store=store, progress=not args.no_progress and ray is None)
    if ray is not None:  # the run on one Ray worker (a cluster's node); this process loads no model
        results: list[Any] = []
        run_units([WorkUnit(unit.key, unit)], run_ppl_unit, ModelSpec(args.model, args.dtype), ray,
                  lambda _, rows: results.extend(rows), progress=not args.no_progress, desc="ppl")
        result = results[0]
    else:
        model, tokenizer = ModelSpec(args.model, args.dtype)()
        try:
            result = run_ppl_unit(model, tokenizer, unit)[0]
        except RunInterrupted as interrupt:
            from confkv.data import corpus_tokens

            result = interrupt.partial
            total = corpus_tokens(tokenizer, args.corpus, args.tokens, offset=args.offset).shape[1] - 1
            print(f"interrupted (Ctrl-C) after {result.tokens} of {total} tokens", file=sys.stderr)
            if not result.tokens:
                return 130
    summary = result.summary()
    summary.update({"model": args.model, "corpus": args.corpus, "kv_int8": store_run.kv_int8,
                    "fp_window": store_run.fp_window, "int8_from": store_run.int8_from, "dtype": args.dtype})
    from confkv.presets import DEFAULT_PRESET, preset_signature

    signature = preset_signature(args.policy or DEFAULT_PRESET)  # a preset's defaults, so tables tell runs of two apart
    if signature is not None:
        summary["preset"] = signature
    trace = result.trace
    kept = trace.kept_tokens(0)
    conf = trace.confidences(0)
    budgets = [float(s.budget[0]) for s in trace.steps]
    target = f"  memory target {spec.target}" if spec.target is not None else ""
    print(f"policy {args.policy or 'tiered (default preset)'} {params}  int8={store_run.kv_int8}{target}")
    print(f"tokens {summary['tokens']}  ppl {summary['ppl']:.3f}  peak KV {summary['peak_kv_bytes'] / 1e6:.2f} MB  "
          f"mean KV {summary['mean_kv_bytes'] / 1e6:.2f} MB  {summary['tokens_per_second']:.1f} tok/s")
    print(f"confidence  {sparkline(conf, low=0.0, high=1.0)}")
    print(f"kept tokens {sparkline(kept)}  ({min(kept):.0f}..{max(kept):.0f})")
    switches = sum(1 for a, b in zip(budgets, budgets[1:]) if a != b)
    print(f"budget switches: {switches}; budgets used: {budgets_text(budgets)}")
    print(f"kept tokens, steps 1000-1039: {[int(k) for k in kept[1000:1040]]}" if len(kept) > 1040 else "")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")  # write then rename: never a half-written JSON
        tmp.write_text(json.dumps({"summary": summary, "interrupted": result.interrupted, "trace": trace.to_dict(),
                                   "nll": result.nll.tolist()}))
        tmp.replace(args.out)
        print(f"wrote {args.out}{' (partial: interrupted)' if result.interrupted else ''}")
    if args.plot:
        from confkv.eval.report.plots import plot_trace

        plot_trace(trace, args.plot, title=f"{args.policy or 'tiered'} on {args.corpus}")
        print(f"wrote {args.plot}")
    return 130 if result.interrupted else 0
