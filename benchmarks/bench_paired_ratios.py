"""Each row's decode step against a baseline row of the same `confkv bench` run, paired round by round.

`confkv bench` times its rows interleaved: round after round, each row takes ``--steps`` timed steps in turn
(``times_ms`` in its bench.json, in that order). Its table gives each row's median over all its steps, and a ratio of
two medians carries whatever the machine did between the rows' steps; on this project's shared 2-core machines the
rows' medians move by about 10% from run to run (results/lowbit/README.md, "Outlier corrections from one list a
page"). Here each round's mean step of a row is divided by the baseline row's mean step in the same round, and the
median of those ratios is printed beside the ratio of medians, with their spread (no model run); with ``--pooled``,
then each row's rounds of all the files together (the same context), as one median::

    .venv/bin/python benchmarks/bench_paired_ratios.py --baseline kivi-4@bf16 RUN/bench.json [more bench.json ...]
"""

from __future__ import annotations

import argparse
import json
import statistics


def paired_ratios(row: list[float], baseline: list[float], steps: int) -> list[float]:
    """Per round, the row's mean step over the baseline's (both ``steps`` steps a round, in round order)."""
    if len(row) != len(baseline) or len(row) % steps:
        raise ValueError(f"the rows hold {len(row)} and {len(baseline)} steps: not the same whole rounds of {steps}")
    return [statistics.mean(row[i:i + steps]) / statistics.mean(baseline[i:i + steps])
            for i in range(0, len(row), steps)]


def pooled_median(rounds: dict[tuple[str, str], list[float]]) -> dict[tuple[str, str], tuple[float, int]]:
    """(context, row) -> the median of its rounds' ratios gathered over runs, and how many rounds."""
    return {key: (statistics.median(ratios), len(ratios)) for key, ratios in rounds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="bench.json files of `confkv bench`")
    parser.add_argument("--baseline", required=True, help="the row to divide by, as the bench names it (e.g. kivi-4@bf16)")
    parser.add_argument("--pooled", action="store_true", help="also each row's rounds of all the files, one median")
    args = parser.parse_args()
    rounds: dict[tuple[str, str], list[float]] = {}
    for path in args.files:
        run = json.load(open(path))
        for context, rows in run["latency"].items():
            if args.baseline not in rows:
                raise SystemExit(f"{path}: no row {args.baseline!r} at context {context}; rows: "
                                 + ", ".join(k for k in rows if not k.startswith("_")))
            base = rows[args.baseline]
            for name, row in rows.items():
                if name.startswith("_") or name == args.baseline:
                    continue
                ratios = paired_ratios(row["times_ms"], base["times_ms"], run["steps"])
                rounds.setdefault((context, name), []).extend(ratios)
                print(f"{path} ctx {context} {name}: ratio of medians {row['median_ms'] / base['median_ms']:.3f}, "
                      f"median of {len(ratios)} rounds' ratios {statistics.median(ratios):.3f} "
                      f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")
    if args.pooled:
        for (context, name), (median, count) in pooled_median(rounds).items():
            print(f"pooled ctx {context} {name}: median of {count} rounds' ratios over {len(args.files)} runs "
                  f"{median:.3f}")


if __name__ == "__main__":
    main()
