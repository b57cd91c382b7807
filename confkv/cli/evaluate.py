"""``confkv niah``, ``confkv probe``, ``confkv sweep``, ``confkv report``: thin CLI over :mod:`confkv.eval`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from confkv.cli.common import (MEMORY_HELP, MODEL_HELP, floats, ints, memory_fraction, memory_fractions,  # noqa: F401
                               parse_params, removed_flags, set_threads, strs, write_json)

def add_eval_subcommands(sub: Any, add_common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register the evaluation subcommands on ``sub`` (an argparse subparsers object)."""
    from confkv.eval.ray.grid import add_ray_arguments

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="smollm2", help=MODEL_HELP)
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
        p.add_argument("--no-progress", action="store_true",
                       help="no progress output (default: a bar on a terminal, a few plain lines otherwise)")

    probe = sub.add_parser("probe", help="confidence vs KL shift from evicting the most recent tokens")
    model_args(probe)
    probe.add_argument("--corpus", default="pydoc-topics")
    probe.add_argument("--tokens", type=int, default=2048)
    probe.add_argument("--offset", type=int, default=0)
    probe.add_argument("--k", type=ints, default=[32], help="tokens evicted before the current one, e.g. 8,32,128")
    probe.add_argument("--start", type=int, default=None, help="first probed step (default max(64, 2*max(k)))")
    probe.add_argument("--stride", type=int, default=1, help="probe every s-th step")
    probe.add_argument("--block", type=int, default=256, help="tokens per forward block")
    probe.add_argument("--n-boot", type=int, default=2000)
    probe.add_argument("--block-len", type=int, default=1, help="moving-block bootstrap block length (1 = iid)")
    probe.add_argument("--keep-recent", action="store_true",
                       help="the other reading: keep only --sinks first tokens and the k most recent ones "
                            "(drop everything older), as a recall gate decides; k = R, e.g. 64,128,256")
    probe.add_argument("--sinks", type=int, default=4, help="first tokens kept with --keep-recent")
    probe.add_argument("--out-dir", type=Path, default=Path("results/probe"))

    niah = sub.add_parser("niah", help="needle-in-a-haystack grid (query-aware and streaming protocols)")
    model_args(niah)
    niah.add_argument("--policies", type=strs, default=["full", "streaming", "confkv"],
                      help="comma-separated policy names; add +int8 for an INT8 store (e.g. confkv+int8), "
                           "+slack<N> for evict_slack=N (e.g. tiered+slack64)")
    niah.add_argument("--protocols", type=strs, default=["query-aware", "streaming"])
    niah.add_argument("--lengths", type=ints, default=[1024, 2048])
    niah.add_argument("--depths", type=floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    niah.add_argument("--trials", type=int, default=1)
    niah.add_argument("--first-trial", type=int, default=0,
                      help="run trials FIRST..FIRST+TRIALS-1 (split a grid over processes; same --out-dir)")
    niah.add_argument("--haystack", default="pydoc-topics")
    niah.add_argument("--needle", default=None, help="needle template with {answer}")
    niah.add_argument("--question", default=None, help="question template")
    niah.add_argument("--answer", default=None, help="fixed answer (default: a passkey per trial)")
    niah.add_argument("--memory", type=memory_fraction, default=0.25,
                      help="memory target (default 0.25): " + MEMORY_HELP + "; so of each length's own bytes. "
                           "Query-aware: the prompt is prefilled without eviction, then brought to this fraction "
                           "of its bytes in one step")
    removed_flags(niah, ("--budget-fraction", "--budget-of", "--budget-tokens"),
                  "give --memory F: each cache holds F of the full cache's bytes at every step (e.g. --memory 0.25)")
    niah.add_argument("--max-new-tokens", type=int, default=10)
    niah.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    niah.add_argument("--batch", type=int, default=0, help="sequences per batch (0: all of one length)")
    niah.add_argument("--int8", action="store_true", help="INT8 store for every policy (or add '+int8' to one)")
    niah.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="model dtype (bfloat16: faster prefill on CPUs with AMX/AVX512-BF16)")
    niah.add_argument("--collect-only", action="store_true",
                      help="run nothing: write niah.json/csv/heatmap from the records in <out-dir>/niah.jsonl")
    niah.add_argument("--replot", action="store_true",
                      help="run nothing, load no model: redraw <out-dir>/niah_heatmap.png from <out-dir>/niah.json")
    niah.add_argument("--fresh", action="store_true",
                      help="ignore the records already in <out-dir>/niah.jsonl (default: resume from them)")
    niah.add_argument("--param", action="append", metavar="[POLICY:]KEY=VALUE",
                       help="extra policy parameter, repeatable; POLICY: gives it to that policy only "
                            "(e.g. confkv-r:budget=256)")
    niah.add_argument("--out-dir", type=Path, default=Path("results/niah"))
    add_ray_arguments(niah)

    sweep = sub.add_parser("sweep", help="policies x memory targets (x INT8) on streaming perplexity, resumable")
    model_args(sweep)
    sweep.add_argument("--policies", type=strs,
                       default=["full", "window", "streaming", "confkv", "confkv-fixed", "h2o", "tova",
                                "scissorhands", "random", "confkv-l"])
    sweep.add_argument("--memory", type=memory_fractions, default=[0.25, 0.125],
                       help="memory targets, e.g. 0.25,0.125 (the default): " + MEMORY_HELP + "; full runs once")
    removed_flags(sweep, ("--reference-windows", "--match", "--confidence-trace", "--ratio"),
                  "give --memory F1,F2: every policy runs with the cache holding each fraction of the full cache's "
                  "bytes at every step (e.g. --memory 0.25,0.125)")
    sweep.add_argument("--int8", choices=("off", "on", "both"), default="off")
    sweep.add_argument("--corpus", default="pydoc-topics")
    sweep.add_argument("--tokens", type=int, default=2048)
    sweep.add_argument("--offset", type=int, default=0)
    sweep.add_argument("--fp-window", type=int, default=128)
    sweep.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="model dtype (rows record it when it is not float32)")
    sweep.add_argument("--param", action="append", metavar="POLICY:KEY=VALUE",
                       help="extra parameter for one policy or preset (or '*'), e.g. confkv:tau=0.6, "
                            "tiered:ladder=[8,4] (a storage field of a preset)")
    sweep.add_argument("--out", type=Path, default=Path("results/sweep/ppl.jsonl"))
    sweep.add_argument("--traces-dir", type=Path, default=None, help="also save each run's trace JSON here")
    sweep.add_argument("--dry-run", action="store_true", help="print the planned runs only (no model is loaded)")
    add_ray_arguments(sweep)

    from confkv.cli.agent import add_agent_subcommand

    add_agent_subcommand(sub, model_args, strs, floats)

    report = sub.add_parser("report", help="Markdown (+ HTML) page from a results folder")
    report.add_argument("results", type=Path, nargs="?", default=Path("results"))
    report.add_argument("--out", type=Path, default=None, help="default <results>/REPORT.md")
    report.add_argument("--html", action="store_true")


def run_probe(args: argparse.Namespace) -> int:
    import csv

    from confkv.data import corpus_tokens
    from confkv.eval.quality.probe import plot_probe, probe_confidence_kl
    from confkv.models import load_model
    from confkv.outputs import check_writable

    check_writable(args.out_dir, folder=True, what="--out-dir")
    set_threads(args)
    model, tokenizer = load_model(args.model)
    ids = corpus_tokens(tokenizer, args.corpus, args.tokens, offset=args.offset)
    results = probe_confidence_kl(model, ids, k=args.k, start=args.start, stride=args.stride, block=args.block,
                                  n_boot=args.n_boot, block_len=args.block_len, progress=not args.no_progress,
                                  keep_recent=args.keep_recent, sinks=args.sinks)
    out = args.out_dir
    meta = {"model": args.model, "corpus": args.corpus, "tokens": args.tokens, "offset": args.offset,
            "stride": args.stride, "mode": "keep-recent" if args.keep_recent else "drop-recent",
            "sinks": args.sinks if args.keep_recent else 0}
    write_json(out / "probe.json", {"meta": meta, "results": [r.to_dict() for r in results]})
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "probe.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["k", "step", "confidence", "kl", "nll_full", "nll_evict", "confidence_evict"])
        for r in results:
            for row in zip(r.positions.tolist(), r.confidence.tolist(), r.kl.tolist(), r.nll_full.tolist(),
                           r.nll_evict.tolist(), r.confidence_evict.tolist()):
                writer.writerow([r.k, *row])
    plot_probe(results, out / "probe.png", title=f"{args.model} on {args.corpus} ({args.tokens} tokens)")
    for r in results:
        s = r.summary()
        print(f"k={r.k:4d}  steps {s['steps']}  r={s['pearson_r']:+.3f} CI95 [{s['pearson_ci95'][0]:+.3f}, "
              f"{s['pearson_ci95'][1]:+.3f}]  r(logKL)={s['pearson_r_log_kl']:+.3f}  rho={s['spearman_rho']:+.3f}  "
              f"mean KL {s['mean_kl']:.4f}  ppl full {s['ppl_full']:.2f} evict {s['ppl_evict']:.2f}  "
              f"{s['seconds']:.0f}s")
        for i, q in enumerate(s["kl_by_confidence_quintile"], 1):
            print(f"    confidence quintile {i} (c {q['confidence_min']:.2f}-{q['confidence_max']:.2f}): "
                  f"median KL {q['median_kl']:.4f}  mean KL {q['mean_kl']:.4f}  ({q['steps']} steps)")
    print(f"wrote {out / 'probe.json'}, {out / 'probe.csv'}, {out / 'probe.png'}")
    return 0


def _replot_niah(out_dir: Path) -> int:
    """``confkv niah --replot``: the heatmap again from ``niah.json`` (after a change to the plot)."""
    from confkv.errors import ConfKVError
    from confkv.eval.niah import plot_niah

    source = out_dir / "niah.json"
    try:
        data = json.loads(source.read_text())
    except (OSError, ValueError) as error:
        raise ConfKVError(f"--replot needs {source} (written by a finished `confkv niah` run): {error}") from error
    print(f"wrote {plot_niah(data, out_dir / 'niah_heatmap.png')}")
    return 0


def run_niah(args: argparse.Namespace) -> int:
    from confkv.eval.niah import NiahConfig, plot_niah, run_niah_grid, write_niah
    from confkv.eval.ray.grid import ModelSpec, ray_options
    from confkv.outputs import check_writable

    if args.replot:
        return _replot_niah(args.out_dir)
    check_writable(args.out_dir, folder=True, what="--out-dir")
    ray = ray_options(args)
    set_threads(args)
    spec = ModelSpec(args.model, args.dtype)
    if ray is not None and not args.collect_only:  # Ray and the workers' model loads start while this one loads
        from confkv.eval.niah.runner import run_niah_unit
        from confkv.eval.ray.grid import prestart

        prestart(ray, spec, run_niah_unit)
    model, tokenizer = spec()
    config = NiahConfig(lengths=tuple(args.lengths), depths=tuple(args.depths), trials=args.trials,
                        first_trial=args.first_trial,
                        policies=tuple(args.policies), protocols=tuple(args.protocols), haystack=args.haystack,
                        needle_template=args.needle, question_template=args.question, answer=args.answer,
                        max_new_tokens=args.max_new_tokens, chunk=args.chunk, batch=args.batch,
                        kv_int8=args.int8, extra_params=parse_params(args.param), dtype=args.dtype,
                        memory=args.memory)
    resume = args.out_dir / "niah.jsonl"
    if args.fresh and resume.exists():
        resume.replace(resume.with_suffix(".jsonl.old"))
        print(f"--fresh: moved the previous records to {resume.with_suffix('.jsonl.old')}", file=sys.stderr)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = run_niah_grid(model, tokenizer, config, progress=not args.no_progress, model_name=args.model,
                               resume_path=resume, compute=not args.collect_only, ray=ray, loader=spec)
    except KeyboardInterrupt:
        print(f"interrupted (Ctrl-C): the finished batches are in {resume}; rerun the same command to resume.",
              file=sys.stderr)
        return 130
    finally:
        if ray is not None:
            from confkv.eval.ray.grid import release_prestarted

            release_prestarted()
    paths = write_niah(result, args.out_dir)
    paths.append(plot_niah(result, args.out_dir / "niah_heatmap.png"))
    for line in result.summary_lines():
        print(line)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def run_sweep_cmd(args: argparse.Namespace) -> int:
    from confkv.config import StoreConfig
    from confkv.eval.ray.grid import ray_options
    from confkv.eval.quality.sweep import SweepConfig, plan_sweep, run_sweep
    from confkv.outputs import check_writable

    if not args.dry_run:
        check_writable(args.out, what="--out")
        if args.traces_dir is not None:
            check_writable(args.traces_dir, folder=True, what="--traces-dir")
    set_threads(args)
    per_policy: dict[str, dict[str, Any]] = {}
    for item in args.param or []:
        who, _, kv = item.partition(":")
        if not kv:
            raise SystemExit(f"--param expects POLICY:KEY=VALUE, got {item!r}")
        per_policy.setdefault(who, {}).update(parse_params([kv]))
    int8 = {"off": (False,), "on": (True,), "both": (False, True)}[args.int8]
    config = SweepConfig(policies=tuple(args.policies), memory=tuple(args.memory), int8=int8, corpus=args.corpus,
                         tokens=args.tokens, offset=args.offset, model=args.model,
                         store=StoreConfig(fp_window=args.fp_window), policy_params=per_policy, dtype=args.dtype)
    if args.dry_run:
        for run in plan_sweep(config):
            print(json.dumps(run.key_dict()), "full: no target" if run.memory is None else f"memory {run.memory:g}")
        return 0
    try:
        rows = run_sweep(config, args.out, progress=not args.no_progress, traces_dir=args.traces_dir,
                         ray=ray_options(args))
    except KeyboardInterrupt:
        from confkv.eval.quality.sweep import load_rows

        print(f"interrupted (Ctrl-C): {len(load_rows(args.out))} complete rows in {args.out}; the run in progress "
              "was not written. Rerun the same command to resume.", file=sys.stderr)
        return 130
    print(f"{len(rows)} rows in {args.out}")
    for row in rows:
        memory = "full" if row.get("memory") is None else f"{row['memory']:g}"
        print(f"{row['policy']:14s} int8={row['kv_int8']!s:5s} memory={memory:6s}  "
              f"params={json.dumps(row['params'])}  ppl {row['ppl']:.3f}  peak {row['peak_kv_bytes'] / 1e6:.2f} MB  "
              f"mean {row['mean_kv_bytes'] / 1e6:.2f} MB")
    return 0


def run_report(args: argparse.Namespace) -> int:
    from confkv.eval.report.page import build_report
    from confkv.outputs import check_writable

    check_writable(args.out or args.results / "REPORT.md", what="--out")
    path = build_report(args.results, out=args.out, html=args.html)
    print(f"wrote {path}")
    return 0


def run_agent_cmd(args: argparse.Namespace) -> int:
    from confkv.cli.agent import run_agent

    return run_agent(args)


COMMANDS = {"probe": run_probe, "niah": run_niah, "sweep": run_sweep_cmd, "report": run_report,
            "agent": run_agent_cmd}
