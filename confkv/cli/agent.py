"""``confkv agent``: the agent workload grid (thin CLI over :mod:`confkv.eval.agent.grid`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_agent_subcommand(sub: Any, model_args: Any, strs: Any, floats: Any) -> None:
    from confkv.cli.common import MEMORY_HELP, memory_fractions, removed_flags

    agent = sub.add_parser("agent", help="agent tasks on a text web, teacher-forced and closed loop (resumable)")
    model_args(agent)
    agent.add_argument("--policies", type=strs, default=None,
                       help="comma-separated policy names, '+int8' for an INT8 store (default: full,window,"
                            "streaming,h2o,tova,confkv,confkv+int8)")
    agent.add_argument("--protocols", type=strs, default=["teacher-forced", "closed-loop"])
    agent.add_argument("--memory", type=memory_fractions, default=[0.36, 0.25],
                       help="memory targets, e.g. 0.36,0.25 (the default): " + MEMORY_HELP + "; records keep "
                            "compression = 1 / memory")
    removed_flags(agent, ("--compressions",), "give --memory 1/C for a compression C: each cache holds that fraction "
                                              "of the full cache's bytes at every step (--compressions 2.8,4 is "
                                              "--memory 0.36,0.25)")
    agent.add_argument("--tasks", type=strs, default=[], help="task ids or template names (default: all 56)")
    agent.add_argument("--limit", type=int, default=None, help="only the first N selected tasks")
    agent.add_argument("--seed", type=int, default=0, help="world seed")
    agent.add_argument("--chunk", type=int, default=128, help="prefill chunk (tokens)")
    agent.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="model dtype (bfloat16 for the 1.5B model: half the memory, faster on CPU)")
    agent.add_argument("--max-new-tokens", type=int, default=24, help="tokens per generated action")
    agent.add_argument("--max-steps", type=int, default=None, help="cap on steps per episode")
    agent.add_argument("--param", action="append", metavar="[POLICY:]KEY=VALUE",
                       help="extra policy parameter, repeatable; POLICY: gives it to that policy only "
                            "(e.g. confkv-r:budget=256)")
    agent.add_argument("--fresh", action="store_true", help="move <out-dir>/agent.jsonl aside first")
    agent.add_argument("--collect-only", action="store_true", help="run nothing: summarize the records on disk")
    agent.add_argument("--out-dir", type=Path, default=Path("results/agent"))
    from confkv.eval.ray.grid import add_ray_arguments

    add_ray_arguments(agent)


def run_agent(args: argparse.Namespace) -> int:
    from confkv.eval.agent.grid import DEFAULT_POLICIES, AgentConfig, run_agent_grid, summarize, summary_lines
    from confkv.cli.common import parse_params, set_threads, write_json
    from confkv.eval.ray.grid import ModelSpec, ray_options
    from confkv.outputs import check_writable

    check_writable(args.out_dir, folder=True, what="--out-dir")
    set_threads(args)
    config = AgentConfig(policies=tuple(args.policies or DEFAULT_POLICIES), protocols=tuple(args.protocols),
                         memory=tuple(args.memory), tasks=tuple(args.tasks), limit=args.limit,
                         seed=args.seed, chunk=args.chunk, max_new_tokens=args.max_new_tokens,
                         max_steps=args.max_steps, extra_params=parse_params(args.param), dtype=args.dtype)
    path = args.out_dir / "agent.jsonl"
    if args.fresh and path.exists():
        path.replace(path.with_suffix(".jsonl.old"))
        print(f"--fresh: moved the previous records to {path.with_suffix('.jsonl.old')}", file=sys.stderr)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    spec = ModelSpec(args.model, args.dtype)
    model, tokenizer = spec()
    try:
        records = run_agent_grid(model, tokenizer, config, path, model_name=args.model,
                                 progress=not args.no_progress, compute=not args.collect_only,
                                 ray=ray_options(args), loader=spec)
    except KeyboardInterrupt:
        print(f"interrupted (Ctrl-C): the finished episodes are in {path}; rerun the same command to resume.",
              file=sys.stderr)
        return 130
    rows = summarize(records)
    write_json(args.out_dir / "agent_summary.json", {"model": args.model, "config": vars(config), "summary": rows})
    for line in summary_lines(rows):
        print(line)
    from confkv.eval.agent.report import write_agent_report

    written = write_agent_report(rows, records, args.out_dir, command=args.command_line)
    print(f"wrote {path}, {args.out_dir / 'agent_summary.json'}, " + ", ".join(str(p) for p in written))
    return 0


__all__ = ["add_agent_subcommand", "run_agent"]
