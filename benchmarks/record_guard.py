"""Record (or re-record) the degradation guard's reference: ``results/reference/guard.json``.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/record_guard.py                 # tiny cases only
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/record_guard.py --cases tiny-fp tiny-int8 smollm2

Only the cases named are re-recorded; the others are kept as they are in the file. Re-record
only after a change whose effect on quality is intended and understood, and say so in the
commit. The exact command, versions and date are stored with each case.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["tiny-fp", "tiny-int8"])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "reference" / "guard.json")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    from confkv.eval.guard import CASES, TINY_MODEL, case_ids, load_case_model, run_case

    data = json.loads(args.out.read_text()) if args.out.exists() else {"cases": {}}
    command = (f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} .venv/bin/python "
               f"benchmarks/record_guard.py {' '.join(sys.argv[1:])}").strip()
    for name in args.cases:
        case = CASES[name]
        model, tokenizer = load_case_model(case)
        ids = case_ids(tokenizer)
        started = time.perf_counter()
        measured = run_case(case, model, ids)
        entry = {"model": case.model, "policy": case.policy, "params": case.params, "store": case.store,
                 "rel_tol": case.rel_tol, **measured, "seconds": round(time.perf_counter() - started, 1),
                 "corpus": "pydoc-topics (first 512 tokens)", "ids": " ".join(map(str, ids[0].tolist())),
                 "command": command, "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                              "python": platform.python_version()}}
        if case.model == "tiny-llama":
            entry["tiny_model"] = TINY_MODEL
        data["cases"][name] = entry
        print(f"{name:10s} ppl {measured['ppl']:.6f}  full-KV ppl {measured['ppl_full_kv']:.6f}  "
              f"peak KV {measured['peak_kv_bytes']}  mean kept {measured['mean_kept_tokens']:.1f}  "
              f"switches {measured['budget_switches']}  {entry['seconds']}s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data["regenerate"] = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/record_guard.py --cases <names>"
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
