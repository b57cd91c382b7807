"""``confkv ruler``: thin CLI over :mod:`confkv.eval.ruler.grid` (offline RULER tasks x policies x memory targets)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _csv(kind: type) -> Any:
    return lambda text: [kind(x) for x in str(text).replace(" ", "").split(",") if x]


def add_ruler_subcommand(sub: Any) -> None:
    from confkv.cli.common import MEMORY_HELP, MODEL_HELP, memory_fractions, removed_flags
    from confkv.eval.ruler.tasks import DEFAULT_TASKS, TASKS

    p = sub.add_parser("ruler", help="offline RULER tasks x policies x memory targets (resumable; table + plot)")
    p.add_argument("--model", default="smollm2", help=MODEL_HELP + "; 'tiny-<arch>': a tiny random test model")
    p.add_argument("--tasks", type=_csv(str), default=list(DEFAULT_TASKS), help=f"comma-separated, from: {', '.join(TASKS)}")
    p.add_argument("--lengths", type=_csv(int), default=[4096], help="context lengths (prompt + answer tokens)")
    p.add_argument("--policies", type=_csv(str), default=["full", "streaming", "tova", "confkv"],
                   help="comma-separated policy names; add +int8 for an INT8 store (e.g. confkv+int8)")
    p.add_argument("--memory", "--kv-fractions", dest="memory", type=memory_fractions, default=[0.25, 0.5],
                   help="memory targets, e.g. 0.25,0.125 (default 0.25,0.5): " + MEMORY_HELP + ". Query-aware: the "
                        "prompt is prefilled without eviction, then brought to the fraction of its bytes in one "
                        "step. --kv-fractions is an alias of --memory (the same targets; it no longer matches "
                        "budgets offline)")
    p.add_argument("--samples", type=int, default=3, help="samples per task and length")
    p.add_argument("--first-sample", type=int, default=0, help="sample indices FIRST..FIRST+SAMPLES-1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--protocol", choices=("streaming", "query-aware"), default="streaming")
    p.add_argument("--query-window", type=int, default=64, help="query-aware: last prompt tokens fed as their own chunk")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    p.add_argument("--batch", type=int, default=1, help="samples per batch (left-padded)")
    p.add_argument("--fp-window", type=int, default=128)
    removed_flags(p, ("--ratio",), "under a memory target the hot budget comes from the target; give a gated "
                                   "policy's n_high / n_low with --param if you want them")
    p.add_argument("--param", action="append", metavar="[POLICY:]KEY=VALUE",
                       help="extra policy parameter, repeatable; POLICY: gives it to that policy only "
                            "(e.g. confkv-r:budget=256)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress output (default: a bar on a terminal, a few plain lines otherwise)")
    p.add_argument("--collect-only", action="store_true", help="run nothing: table + plot from <out-dir>/ruler.jsonl")
    p.add_argument("--fresh", action="store_true", help="ignore the records already in <out-dir>/ruler.jsonl")
    p.add_argument("--out-dir", type=Path, default=Path("results/ruler"))
    from confkv.eval.ray.grid import add_ray_arguments

    add_ray_arguments(p)


def run_ruler(args: argparse.Namespace) -> int:
    from confkv.cli.common import parse_params
    from confkv.eval.ruler.grid import RulerConfig, RulerRecord, run_key, run_ruler_grid, write_ruler
    from confkv.eval.jsonl import load_rows

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = RulerConfig(tasks=tuple(args.tasks), lengths=tuple(args.lengths), policies=tuple(args.policies),
                         memory=tuple(args.memory),
                         samples=args.samples, first_sample=args.first_sample,
                         seed=args.seed, protocol=args.protocol, chunk=args.chunk, query_window=args.query_window,
                         batch=args.batch, fp_window=args.fp_window,
                         extra_params=parse_params(args.param), dtype=args.dtype)
    jsonl = args.out_dir / "ruler.jsonl"
    if args.fresh and jsonl.exists():
        jsonl.unlink()
    command = "confkv " + " ".join(sys.argv[1:])
    if args.collect_only:
        run = run_key(config, args.model)
        records = [RulerRecord(**r) for r in load_rows(jsonl) if r.get("run") == run]
        if not records:
            from confkv.errors import ConfKVError

            raise ConfKVError(f"--collect-only: {jsonl} has no records of this run (model {args.model}, --dtype "
                              f"{args.dtype}, --param, --protocol, --chunk, --seed and --fp-window must be "
                              f"those of the run that wrote them)")
    else:
        from confkv.eval.ray.grid import ModelSpec, ray_options

        ray = ray_options(args)
        spec = ModelSpec(args.model, args.dtype)  # tiny-<arch>: a tiny random test model
        model, tokenizer = spec()
        records = run_ruler_grid(model, tokenizer, config, model_name=args.model, resume_path=jsonl,
                                 progress=not args.no_progress, ray=ray, loader=spec)
    for path in write_ruler(records, args.out_dir, config.tasks, command):
        print(f"wrote {path}")
    print((args.out_dir / "ruler.md").read_text())
    return 0


__all__ = ["add_ruler_subcommand", "run_ruler"]
