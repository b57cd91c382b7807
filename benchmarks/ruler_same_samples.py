"""RULER scores of several runs on the same samples of each task (a like-for-like table).

``confkv ruler``'s own table averages whatever samples a cell has, so two rows may average different samples
(a grid stopped part-way, a cell resumed further). This keeps only the sample indices given, which every row
must have, and prints one markdown row per (records file, policy, memory) with the mean score per task and the
average over the tasks::

    python benchmarks/ruler_same_samples.py results/qwen/ruler/ruler.jsonl results/qwen/ruler_unread/ruler.jsonl \\
        --samples 0 1 2 --policies full tiered --length 4096
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def same_sample_rows(paths: list[Path], samples: list[int], policies: list[str] | None = None,
                     length: int | None = None,
                     fractions: list[float] | None = None) -> tuple[list[str], list[tuple[str, list[float], float]]]:
    """(tasks, [(row label, mean score per task x 100, average over tasks)]); a row missing a sample is refused.
    ``fractions``: keep only these KV fractions (the memory targets; full KV is 1)."""
    scores: dict[tuple[str, str, float], dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    tasks: list[str] = []
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if (policies and r["policy"] not in policies) or (length and r["length"] != length):
                continue
            if fractions and not any(abs(float(r["kv_fraction"]) - f) < 1e-9 for f in fractions):
                continue
            if r["task"] not in tasks:
                tasks.append(r["task"])
            scores[(path.parent.name, r["policy"], float(r["kv_fraction"]))][r["task"]][r["index"]] = r["score"]
    rows = []
    for (folder, policy, fraction), by_task in scores.items():
        means = []
        for task in tasks:
            missing = [i for i in samples if i not in by_task[task]]
            if missing:
                raise SystemExit(f"{folder} {policy} {fraction:g}: task {task} lacks samples {missing}; "
                                 "run them or leave those indices out")
            means.append(100 * sum(by_task[task][i] for i in samples) / len(samples))
        rows.append((f"{folder}: {policy} at {fraction:g}", means, sum(means) / len(means)))
    return tasks, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", type=Path, help="ruler.jsonl files")
    parser.add_argument("--samples", nargs="+", type=int, required=True, help="sample indices every row must have")
    parser.add_argument("--policies", nargs="*", default=None)
    parser.add_argument("--length", type=int, default=None)
    parser.add_argument("--fractions", nargs="*", type=float, default=None,
                        help="KV fractions to keep (the memory targets; full KV is 1)")
    args = parser.parse_args(argv)
    tasks, rows = same_sample_rows(args.records, args.samples, args.policies, args.length, args.fractions)
    print("| run | " + " | ".join(tasks) + " | avg |")
    print("|---|" + "---:|" * (len(tasks) + 1))
    for label, means, average in rows:
        print(f"| {label} | " + " | ".join(f"{m:.1f}" for m in means) + f" | {average:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
