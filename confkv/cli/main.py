"""The ``confkv`` command.

Subcommands:
    demo   CONF-KV next to the full cache on the bundled SmolLM2: text, traces, speed.
    ppl    token-by-token streaming perplexity of one policy, with the memory trace.
    niah   needle-in-a-haystack grid, query-aware and streaming protocols.
    agent  agent tasks on a deterministic text web, teacher-forced and closed loop (resumable JSONL).
    probe  confidence vs the KL shift caused by evicting the most recent tokens.
    sweep  policies x memory targets (x INT8) on streaming perplexity (resumable JSONL).
    report one Markdown/HTML page from a results folder.
    bench  per-step decode latency vs context, batched throughput, step breakdown, bandwidth floor.
    ruler  RULER's synthetic tasks (generated offline) x policies x memory targets: table + plot.
    serve  an OpenAI-compatible server; each request may state its KV memory (docs/SERVING.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from confkv.errors import ConfKVError


def _policy_params(args: argparse.Namespace) -> dict[str, Any]:
    """Policy parameters given as ``--param key=value`` (values parsed as JSON when possible)."""
    from confkv.cli.common import parse_params

    params = parse_params(args.param)
    for name in ("memory", "max_kv_bytes"):
        if getattr(args, name, None) is not None:
            params[name] = getattr(args, name)
    return params


def _slack(text: str) -> int | float:
    """``--evict-slack``: a number of tokens (``64``) or a share of the tokens kept by rank (``0.125``)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither a number of tokens (64) nor a share (0.125)") from None


def _store_config(args: argparse.Namespace):
    from confkv.config import StoreConfig

    return StoreConfig(kv_int8=args.int8, fp_window=args.fp_window, prefill_chunk=args.chunk,
                       evict_slack=getattr(args, "evict_slack", 0))


def _add_common(parser: argparse.ArgumentParser) -> None:
    from confkv.cli.common import MODEL_HELP

    parser.add_argument("--model", default="smollm2", help=MODEL_HELP)
    parser.add_argument("--policy", default=None,
                        help="policy or preset name (see `confkv policies`); default: the preset 'tiered' at --memory "
                             "0.25 (the paper's CONF-KV: --policy confkv)")
    parser.add_argument("--memory", type=float, default=None,
                        help="memory target: this fraction (0, 1] of the full cache's bytes, held at every step")
    parser.add_argument("--max-kv-bytes", type=int, default=None, help="memory target: an absolute cap in bytes")
    parser.add_argument("--param", action="append", metavar="KEY=VALUE",
                        help="policy parameter, repeatable (e.g. --param n_high=128 --param tau=0.6)")
    parser.add_argument("--int8", action="store_true", help="store tokens older than the FP window in INT8")
    parser.add_argument("--fp-window", type=int, default=128, help="recent tokens kept in full precision (W)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    parser.add_argument("--evict-slack", type=_slack, default=0,
                        help="opt-in: evict down to budget - SLACK when over budget (compaction once per SLACK steps); "
                             "a float in [0, 1) is a share of the tokens kept by rank (e.g. 0.125)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="confkv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="CONF-KV next to the full cache on the bundled model")
    _add_common(demo)
    demo.add_argument("--prompt", default=None)
    demo.add_argument("--max-new-tokens", type=int, default=160)
    demo.set_defaults(param=None)

    ppl = sub.add_parser("ppl", help="streaming perplexity of one policy")
    _add_common(ppl)
    ppl.add_argument("--corpus", default="pydoc-topics", help="built-in corpus name, a text file, or hf:<dataset>")
    ppl.add_argument("--tokens", type=int, default=2048)
    ppl.add_argument("--offset", type=int, default=0)
    ppl.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype")
    ppl.add_argument("--out", type=Path, default=None, help="write the summary and trace as JSON here")
    ppl.add_argument("--plot", type=Path, default=None, help="write the kept-tokens / KV-bytes / confidence plot here")
    ppl.add_argument("--no-progress", action="store_true",
                     help="no progress output (default: a bar on a terminal, a few plain lines otherwise)")
    from confkv.eval.ray.grid import add_ray_arguments

    add_ray_arguments(ppl)

    sub.add_parser("policies", help="list the registered policies and their parameters")

    bench = sub.add_parser("bench", help="decode latency / throughput benchmark against transformers' caches")
    bench.add_argument("--model", default="smollm2")
    bench.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    bench.add_argument("--budget", type=int, default=1024, help="budget of the evicting configurations")
    bench.add_argument("--slack", type=int, default=64, help="evict_slack of the '+slack' configurations (0: none)")
    bench.add_argument("--preset-slack", type=_slack, nargs="*", default=[],
                       help="more tiered@<percent>+slack<S>-lean rows: S tokens or a share of the tokens kept by rank (0.125)")
    bench.add_argument("--steps", type=int, default=4, help="timed decode steps per configuration per repeat")
    bench.add_argument("--repeats", type=int, default=3, help="interleaved repeats (A, B, C, A, B, C, ...)")
    bench.add_argument("--warmup", type=int, default=2, help="untimed decode steps per configuration first")
    bench.add_argument("--chunk", type=int, default=1024, help="prefill chunk")
    bench.add_argument("--batches", type=int, nargs="*", default=[1, 4, 8], help="throughput batch sizes")
    bench.add_argument("--batch-steps", type=int, default=3, help="timed steps per configuration per batch size")
    bench.add_argument("--breakdown-steps", type=int, default=8)
    bench.add_argument("--configs", nargs="*", default=None, help="subset of configuration names")
    bench.add_argument("--memory", type=float, nargs="+", default=[0.25],
                       help="memory targets of the preset rows tiered@<percent> (fractions of the full cache's bytes)")
    bench.add_argument("--formats", nargs="*", default=[],
                       help="page formats of extra preset rows tiered[<format>]@<percent> (e.g. kivi+hadamard)")
    bench.add_argument("--kivi", nargs="*", default=[],
                       help="extra KIVI rows kivi-<spec>, spec BITS[/VALUE_BITS][:FORMAT] (e.g. 4 or "
                            "4/2:hadamard+outliers+clip): every older token in low-bit pages, read natively")
    bench.add_argument("--out", type=Path, default=Path("results/bench"))
    bench.add_argument("--threads", type=int, default=2,
                       help="torch CPU threads, and llama.cpp's n_threads for its row (default 2)")
    bench.add_argument("--dtype", nargs="+", default=["float32"],
                       choices=["float32", "bfloat16", "bfloat16-w8", "bfloat16-w8a8", "bfloat16-w4a8"],
                       help="model dtype(s): the whole grid runs once per dtype, rows labelled (e.g. confkv@bf16); "
                            "bfloat16-w8: bfloat16 with weight-only INT8 linear layers; bfloat16-w8a8: also int8 "
                            "activation blocks of 32 (integer products); bfloat16-w4a8: 4-bit weight blocks of 32 "
                            "with a float16 scale and minimum each, int8 activation blocks")
    bench.add_argument("--quality-tokens", type=int, default=2048,
                       help="perplexity check per dtype on the text's first N tokens, ratio to float32 (0: skip)")
    bench.add_argument("--llamacpp-kv", nargs="+", default=["f16", "q8_0", "q4_0"], choices=["f16", "q8_0", "q4_0"],
                       help="llama.cpp's KV cache types, a row each (q8_0 / q4_0 with flash attention; "
                            "default: all three); with --quality-tokens each also gets its perplexity")
    bench.add_argument("--llamacpp-fill", choices=["native", "f16"], default="native",
                       help="how the q8_0 / q4_0 rows reach each context: native (llama.cpp's own prefill with "
                            "that cache, flash attention; hours at 32K on 2 threads) or f16 (a float16 prefill, "
                            "its cache converted to the row's block format and loaded; the timed steps are the same)")
    bench.add_argument("--no-llamacpp", action="store_true",
                       help="leave out the llama.cpp peer row (it runs when llama_cpp is installed: "
                            'pip install "confkv[llamacpp]")')

    from confkv.cli.evaluate import COMMANDS as EVAL_COMMANDS, add_eval_subcommands

    add_eval_subcommands(sub, _add_common)
    from confkv.cli.ruler import add_ruler_subcommand, run_ruler

    add_ruler_subcommand(sub)
    from confkv.cli.serve import register as register_serve

    register_serve(sub)

    args = parser.parse_args(argv)
    # the command line as given, for outputs that print the command that wrote them
    args.command_line = "confkv " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        if getattr(args, "threads", None):
            import torch

            torch.set_num_threads(args.threads)
        if args.command == "policies":
            from confkv.policies import POLICIES
            from confkv.policies.registry import policy_parameters

            for name in sorted(POLICIES):
                defaults = ", ".join(f"{k}={v}" for k, v in policy_parameters(name).items())
                print(f"{name:14s} {defaults}")
            return 0
        if args.command == "bench":
            from confkv.eval.bench import run as bench_mod
            from confkv.eval.bench.output import write_outputs

            lines: list[str] = []
            def log(line: str) -> None:
                print(line, flush=True)
                lines.append(line)
            log("command: confkv " + " ".join(argv if argv is not None else sys.argv[1:]))
            result = bench_mod.run_bench(
                model_name=args.model, contexts=args.contexts, budget=args.budget, slack=args.slack,
                steps=args.steps, repeats=args.repeats, warmup=args.warmup, chunk=args.chunk,
                batches=args.batches, batch_steps=args.batch_steps, breakdown_steps=args.breakdown_steps,
                configs=args.configs, dtypes=args.dtype, quality_tokens=args.quality_tokens,
                llamacpp=not args.no_llamacpp, log=log, memory=tuple(args.memory), formats=tuple(args.formats),
                llamacpp_kv=tuple(args.llamacpp_kv), kivi=tuple(args.kivi),
                preset_slacks=tuple(args.preset_slack), llamacpp_fill=args.llamacpp_fill)
            log(f"peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB; load {result['load']}")
            write_outputs(result, args.out, "\n".join(lines) + "\n")
            return 0
        if args.command == "demo":
            from confkv.cli.demo import run_demo

            return run_demo(args.model, args.prompt, args.max_new_tokens, store=_store_config(args))
        if args.command == "ppl":
            from confkv.cli.ppl import run_ppl

            return run_ppl(args, _policy_params(args), _store_config(args))
        if args.command == "ruler":
            return run_ruler(args)
        if getattr(args, "run", None) is not None:
            return args.run(args)
        if args.command in EVAL_COMMANDS:
            return EVAL_COMMANDS[args.command](args)
    except ConfKVError as error:
        print(f"confkv: error: {error}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
