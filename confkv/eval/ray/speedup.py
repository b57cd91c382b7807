"""The same NIAH subset in process and on a local N-worker Ray: wall times, ratio, identical records?

Runs two ``confkv niah`` commands one after the other (never at the same time), each in a
fresh folder under ``--out-dir``:

    in process  confkv niah <grid> --threads T                         (T = --inprocess-threads)
    on Ray      confkv niah <grid> --ray --ray-workers N                (one torch thread per worker)

and reports, for each, the wall time of the whole command (Python start, model load, Ray
start and the actors' model loads included) and the grid time ``niah.json`` records
(``seconds``: after the driver's model load; on Ray it includes the Ray start and the
workers' model loads), their ratios, and whether the two
``niah.jsonl`` hold the same records apart from the timing field ``seconds_per_seq``.
Writes ``<out-dir>/README.md`` (the table and the exact commands) and ``<out-dir>/speedup.json``.

The lead's measurement (SmolLM2-135M, streaming protocol, 2 lengths x 3 depths x 2 trials
x 3 policies = 36 generations, one sample per unit)::

    OMP_NUM_THREADS=1 .venv/bin/python -m confkv.eval.ray.speedup --out-dir results/ray

A quick check of the script itself on a tiny random model (seconds, no measurement)::

    .venv/bin/python -m confkv.eval.ray.speedup --model tiny-llama --lengths 120,160 --depths 0,1 --trials 1 \\
        --out-dir /tmp/ray_speedup_check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from confkv.eval.jsonl import load_rows
from confkv.eval.niah.records import record_key

#: the folder that holds this ``confkv`` package: the two commands run the same code
ROOT = Path(__file__).resolve().parents[2]

#: the only record field that may differ between the two runs (wall-clock time per sequence)
TIMING_FIELDS = ("seconds_per_seq",)


def niah_command(args: argparse.Namespace, out_dir: Path) -> list[str]:
    """The ``confkv niah`` command line of the grid, writing into ``out_dir``."""
    return [sys.executable, "-m", "confkv.cli", "niah", "--model", args.model, "--lengths", args.lengths,
            "--depths", args.depths, "--trials", str(args.trials), "--policies", args.policies,
            "--protocols", args.protocols, "--batch", str(args.batch), "--fresh", "--no-progress",
            "--out-dir", str(out_dir)]


def timed_run(command: list[str]) -> float:
    """Run ``command`` (output shown), return its wall time in seconds; a failure stops the script."""
    print("$ " + shlex.join(command), flush=True)
    start = time.perf_counter()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"ray_speedup: the command failed (exit {done.returncode}): {shlex.join(command)}")
    return seconds


def timed_parallel(commands: list[list[str]]) -> float:
    """Run ``commands`` at the same time (plain processes, no Ray), return the wall time until the last ends."""
    for command in commands:
        print("$ " + shlex.join(command) + " &", flush=True)
    start = time.perf_counter()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    running = [subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
               for command in commands]
    codes = [process.wait() for process in running]
    seconds = time.perf_counter() - start
    if any(codes):
        raise SystemExit(f"ray_speedup: a parallel half failed (exit codes {codes})")
    return seconds


def busy_seconds(path: Path) -> float:
    """Sum of ``seconds_per_seq`` over a ``niah.jsonl``: the compute time of its sequences (one at a time per process)."""
    return sum(row["seconds_per_seq"] for row in load_rows(path))


def compare(a: Path, b: Path) -> dict:
    """Records of two ``niah.jsonl`` by key, without the timing fields: counts and differing keys."""
    def by_key(path: Path) -> dict:
        out = {}
        for row in load_rows(path):
            out[record_key(row)] = json.dumps({k: v for k, v in row.items() if k not in TIMING_FIELDS},
                                              sort_keys=True)
        return out

    left, right = by_key(a), by_key(b)
    differing = sorted(str(k) for k in left.keys() | right.keys() if left.get(k) != right.get(k))
    return {"records_in_process": len(left), "records_ray": len(right), "identical": not differing and bool(left),
            "differing": differing[:10]}


def contention_lines(result: dict, workers: int) -> list[str]:
    """What running several models at once costs on this machine, from the records (and the two-process run)."""
    alone, together = result["busy_seconds_in_process"], result["busy_seconds_ray"]
    slowdown = together / alone
    lines = [f"Each sequence's own compute time (`seconds_per_seq`, summed): {alone:.1f} s one at a time, "
             f"{together:.1f} s with {workers} running at once: each ran {slowdown - 1:+.0%} slower side by side "
             f"(shared memory bandwidth and caches), so no {workers}-way split of this grid can beat "
             f"{workers / slowdown:.2f}x here; Ray reached {result['wall_ratio'] / (workers / slowdown):.0%} of that."]
    if result.get("wall_seconds_two_processes"):
        two = result["wall_seconds_two_processes"]
        lines.append(f"The same grid as two plain processes at once (half the trials each, no Ray): {two:.1f} s, "
                     f"{result['wall_seconds_in_process'] / two:.2f}x the in-process wall time; Ray's "
                     f"{result['wall_seconds_ray']:.1f} s is {result['wall_seconds_ray'] / two:.2f}x that.")
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--depths", default="0,0.5,1")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--policies", default="full,streaming,tova")
    parser.add_argument("--protocols", default="streaming")
    parser.add_argument("--batch", type=int, default=1,
                        help="samples per unit (1: many small units, so N workers stay busy to the end)")
    parser.add_argument("--workers", type=int, default=2, help="Ray workers (one torch thread each)")
    parser.add_argument("--inprocess-threads", type=int, default=1,
                        help="torch threads of the in-process run (1: the same per-process work as one worker)")
    parser.add_argument("--out-dir", type=Path, default=Path("results/ray"))
    parser.add_argument("--two-process", action="store_true",
                        help="also run the grid as two plain processes at once (half the trials each, no Ray): "
                             "what this machine gives any 2-way split, the ceiling for the Ray ratio")
    args = parser.parse_args()
    if args.two_process and (args.workers != 2 or args.trials % 2):
        parser.error("--two-process needs --workers 2 and an even --trials (the halves split the trials)")

    local_dir, ray_dir = args.out_dir / "in_process", args.out_dir / "ray"
    in_process = niah_command(args, local_dir) + ["--threads", str(args.inprocess_threads)]
    on_ray = niah_command(args, ray_dir) + ["--ray", "--ray-workers", str(args.workers)]
    load_before = os.getloadavg()
    wall_local = timed_run(in_process)
    wall_ray = timed_run(on_ray)
    wall_two, halves = None, []
    if args.two_process:
        half = args.trials // 2
        for index in range(2):
            command = niah_command(args, args.out_dir / f"two_process_{index}") + ["--threads", "1"]
            command[command.index("--trials") + 1] = str(half)
            halves.append(command + ["--first-trial", str(index * half)])
        wall_two = timed_parallel(halves)
    grid_local = json.loads((local_dir / "niah.json").read_text())["seconds"]
    grid_ray = json.loads((ray_dir / "niah.json").read_text())["seconds"]
    same = compare(local_dir / "niah.jsonl", ray_dir / "niah.jsonl")
    result = {"wall_seconds_in_process": wall_local, "wall_seconds_ray": wall_ray,
              "wall_ratio": wall_local / wall_ray, "grid_seconds_in_process": grid_local,
              "grid_seconds_ray": grid_ray, "grid_ratio": grid_local / grid_ray, **same,
              "workers": args.workers, "inprocess_threads": args.inprocess_threads,
              "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
              "busy_seconds_in_process": busy_seconds(local_dir / "niah.jsonl"),
              "busy_seconds_ray": busy_seconds(ray_dir / "niah.jsonl"),
              "wall_seconds_two_processes": wall_two,
              "load_average_before": load_before, "machine": platform.platform(),
              "commands": [shlex.join(["python", *command[1:]]) for command in (in_process, on_ray, *halves)],
              "script": "python -m confkv.eval.ray.speedup " + shlex.join(sys.argv[1:])}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "speedup.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# NIAH subset: in process vs a local {args.workers}-worker Ray",
        "",
        f"Produced by `{result['script']}` (OMP_NUM_THREADS=1; {result['cores']} cores; load average before "
        f"{load_before[0]:.2f}). The two commands it ran, one after the other:",
        "",
        "    " + result["commands"][0],
        "    " + result["commands"][1],
        *(["", "and, with `--two-process`, these two at the same time:", "",
           *("    " + command for command in result["commands"][2:])] if halves else []),
        "",
        "| | in process | Ray | ratio |",
        "|---|---:|---:|---:|",
        f"| wall time of the command (s) | {wall_local:.1f} | {wall_ray:.1f} | {result['wall_ratio']:.2f}x |",
        f"| grid time, `seconds` in niah.json (s) | {grid_local:.1f} | {grid_ray:.1f} | {result['grid_ratio']:.2f}x |",
        "",
        *contention_lines(result, args.workers),
        f"Records: {same['records_in_process']} in process, {same['records_ray']} on Ray; identical apart from "
        f"`seconds_per_seq`: **{'yes' if same['identical'] else 'NO'}**"
        + ("" if same["identical"] else f" (differing keys, first 10: {same['differing']})"),
        "",
        "The wall time includes Python start and the driver's model load; the grid time starts after that "
        "load and, on Ray, includes starting Ray and each worker's own model load.",
    ]
    text = "\n".join(lines) + "\n"
    (args.out_dir / "README.md").write_text(text)
    print(text)
    return 0 if same["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
